"""Transfer learning on an imported INT8 file (issue 9, "what a user can do"): a QOperator file
written by ONNX Runtime's ``quantize_static`` is imported, its head is replaced by a layer with
another output size (``qmodel.<head> = nn.Linear(64, 5)``, or a 1x1 conv head of a fully
convolutional net), trained a few QAT steps, exported, and run in ONNX Runtime.

Agreement: torch against ONNX Runtime with graph optimisations off on the exported file (the
node-by-node float simulation of the QDQ file) within 1 step of the output quantizer on every
element; 1 step allows float accumulation order (MLAS vs torch's conv / matmul) to move a value
across a rounding boundary. The optimised session is not used: its u8s8 kernels saturate on this
CPU (no VNNI) with ORT's full-range int8 weights.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from test_import_quantized import _batches, float_file, ort_static, run_ort

import quantbridge as qb
from quantbridge import zoo


class _FullyConv(torch.nn.Module):
    """conv - relu - conv - relu - 1x1 conv head - global average pool: a head that is a conv."""

    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.ReLU(),
            torch.nn.Conv2d(8, 16, 3, padding=1), torch.nn.ReLU(),
        )  # fmt: skip
        self.head, self.pool = torch.nn.Conv2d(16, 10, 1), torch.nn.AdaptiveAvgPool2d(1)

    def forward(self, x):
        return torch.flatten(self.pool(self.head(self.body(x))), 1)


def _digits() -> torch.nn.Module:
    torch.manual_seed(0)
    return zoo._randomize_bn(zoo.DigitsCNN()).eval()


CASES = {
    # model, the head's layer in the import (named after ORT's node), its replacement
    "linear": (_digits, "fc2_Gemm_quant", lambda: torch.nn.Linear(64, 5)),
    "conv": (_FullyConv, "head_Conv_quant", lambda: torch.nn.Conv2d(16, 5, 1)),
}


def _imported(tmp_path, case: str) -> qb.QuantModel:
    make = CASES[case][0]
    src = float_file(make(), torch.randn(2, 1, 8, 8), tmp_path / "float.onnx")
    path = ort_static(src, tmp_path / "q.onnx", _batches((1, 8, 8), 3, 1), "QOperator", True)
    assert any(n.op_type.startswith("QLinear") for n in onnx.load(path).graph.node)
    return qb.import_onnx(path)


@pytest.mark.parametrize("case", sorted(CASES))
def test_new_head_of_another_size_trains_exports_and_matches_ort(case, tmp_path):
    qmodel = _imported(tmp_path, case)
    _, layer, new_head = CASES[case]
    out_q = qmodel.output_quantizer(0)
    file_scale = out_q.scale.clone()
    torch.manual_seed(1)
    setattr(qmodel, layer, new_head())
    rng = np.random.default_rng(2)
    x = torch.from_numpy(rng.standard_normal((32, 1, 8, 8)).astype(np.float32))
    y = torch.from_numpy(rng.integers(0, 5, 32))
    qmodel.train()
    opt = torch.optim.SGD(qmodel.parameters(), lr=0.05, momentum=0.9)
    losses = []
    for _ in range(15):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(qmodel(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    # the new head learns through fake quantization (measured, 15 steps: linear 1.611 -> 1.556,
    # conv 1.610 -> 1.570; slow because the output grid starts at the new head's first-batch range,
    # small at initialisation, and widens by the moving average's 1% a step, clipping the logits)
    assert losses[-1] < losses[0] - 0.02, losses
    qmodel.eval()
    wq = qmodel.quantizers()[f"{layer}.weight"]
    assert wq.scale.shape == (5,)  # per-channel parameters of the new head's 5 channels
    assert not torch.equal(out_q.scale, file_scale)  # the output grid followed the new head
    with torch.no_grad():
        got = qmodel(x).numpy()
    assert got.shape == (32, 5)
    out = tmp_path / "finetuned.onnx"
    qb.export(qmodel, out, example_inputs=x[:2])
    ort_out = run_ort(str(out), x.numpy(), optimize=False)
    steps = np.abs(got - ort_out) / float(out_q.scale)
    assert steps.max() <= 1.0 + 1e-3, steps.max()
    # qb.save / qb.load into a fresh import given the same new head: bit-identical
    qb.save(qmodel, tmp_path / "m.qb")
    fresh = _imported(tmp_path, case)
    setattr(fresh, layer, new_head())
    with torch.no_grad():
        assert torch.equal(qb.load(tmp_path / "m.qb", fresh)(x), torch.from_numpy(got))
    weights = {i.name: i for i in onnx.load(str(out)).graph.initializer}
    head_w = [w for name, w in weights.items() if layer in name and len(w.dims) >= 2]
    assert head_w and head_w[0].dims[0] == 5, [(n, w.dims) for n, w in weights.items()]


def test_head_with_another_input_size_is_refused(tmp_path):
    qmodel = _imported(tmp_path, "linear")
    qmodel.fc2_Gemm_quant = torch.nn.Linear(32, 5)
    with pytest.raises(ValueError, match=r"'fc2_Gemm_quant'.*weight shape \[5, 32\].*\[10, 64\]"):
        qmodel(torch.randn(2, 1, 8, 8))


def test_conv_head_with_another_stride_is_refused(tmp_path):
    qmodel = _imported(tmp_path, "conv")
    qmodel.head_Conv_quant = torch.nn.Conv2d(16, 5, 1, stride=2)
    with pytest.raises(ValueError, match=r"'head_Conv_quant'.*stride=\(2, 2\).*stride=\[1, 1\]"):
        qmodel(torch.randn(2, 1, 8, 8))


def test_head_without_the_bias_the_graph_adds_is_refused(tmp_path):
    qmodel = _imported(tmp_path, "linear")
    qmodel.fc2_Gemm_quant = torch.nn.Linear(64, 5, bias=False)
    with pytest.raises(ValueError, match=r"'fc2_Gemm_quant'.*without a bias.*bias=True"):
        qb.export(qmodel, tmp_path / "m.onnx", example_inputs=torch.randn(2, 1, 8, 8))
