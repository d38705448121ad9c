"""A layer of a ``qb.quantize`` model replaced by one with another output size (``qmodel.fc2 =
nn.Linear(64, 5)``): its quantizers follow the new layer (``torch/_replace.py``), and the export
runs in ONNX Runtime with torch's outputs. The imported-ONNX form of the same is in
``tests/onnx/test_import_new_head.py``.

Agreement: ONNX Runtime with graph optimisations off (node-by-node QDQ) within 1 step of the output
quantizer on every element: float accumulation order may move a value across a rounding boundary.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import torch

import quantbridge as qb
from quantbridge import zoo


def test_quantized_model_gets_a_new_head_of_another_size(tmp_path):
    torch.manual_seed(0)
    model = zoo._randomize_bn(zoo.DigitsCNN()).eval()
    x = torch.randn(16, 1, 8, 8)
    qmodel = qb.quantize(model, [x], "int8", progress=False)
    old_out = qmodel.output_quantizer(0).scale.clone()
    qmodel.fc2 = torch.nn.Linear(64, 5)
    qmodel.train()
    opt = torch.optim.SGD(qmodel.parameters(), lr=0.05)
    for _ in range(3):
        opt.zero_grad()
        torch.nn.functional.cross_entropy(qmodel(x), torch.arange(16) % 5).backward()
        opt.step()
    qmodel.eval()
    assert qmodel.quantizers()["fc2.weight"].scale.shape == (5,)  # per-channel, new head
    out_q = qmodel.output_quantizer(0)
    assert not torch.equal(out_q.scale, old_out)  # the output grid follows the new head
    with torch.no_grad():
        got = qmodel(x).numpy()
    qb.export(qmodel, tmp_path / "m.onnx", example_inputs=x[:2])
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(str(tmp_path / "m.onnx"), so, providers=["CPUExecutionProvider"])
    expected = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    assert got.shape == expected.shape == (16, 5)
    assert (np.abs(got - expected) / float(out_q.scale)).max() <= 1.0 + 1e-3
