"""What ``qb.fold`` does to real graphs: op counts before and after, ops left in QDQ form, and
agreement of the folded model with the QDQ model run by ONNX Runtime (default optimizations).

    python bench/fold_study.py zoo                       # quantbridge exports of the zoo models
    python bench/fold_study.py light squeezenet resnet50 # ORT quantize_static of onnx's model-zoo
                                                         # graph structures (random weights)

The ``light`` models (onnx's ``backend/test/data/light``) store every weight as
``ConstantOfShape(0.02)``; they get random weights here, opset 13, ``quant_pre_process`` and
``quantize_static`` (QDQ, uint8 activations, int8 per-channel weights). A trailing Softmax is
dropped so that the compared outputs are logits (a random-weight softmax rounds to 0).
"""

from __future__ import annotations

import collections
import logging
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
from onnx import numpy_helper

import quantbridge as qb

LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"


def _session(model: onnx.ModelProto):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.log_severity_level = 3
    return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])


def report(name: str, qdq: onnx.ModelProto, feeds: dict) -> None:
    folded = qb.fold(qdq)
    before = collections.Counter(n.op_type for n in qdq.graph.node)
    after = collections.Counter(n.op_type for n in folded.graph.node)
    left = collections.Counter(label.split()[0] for label in qb.onnx.inspect_model(folded).qdq_ops)
    dq = next(n for n in qdq.graph.node if n.output[0] == qdq.graph.output[0].name)
    scale = next(i for i in qdq.graph.initializer if i.name == dq.input[1])
    y_qdq, y_fold = _session(qdq).run(None, feeds)[0], _session(folded).run(None, feeds)[0]
    err = np.abs(y_qdq - y_fold) / float(numpy_helper.to_array(scale))
    print(f"{name}: Q/DQ {before['QuantizeLinear']}/{before['DequantizeLinear']} -> "
          f"{after['QuantizeLinear']}/{after['DequantizeLinear']}")  # fmt: skip
    print(f"  before: {dict(sorted(before.items()))}")
    print(f"  after:  {dict(sorted(after.items()))}")
    print(f"  left in QDQ form: {dict(left) or 'none'}")
    print(f"  vs ORT QDQ: {err.size} outputs, {np.mean(err < 1e-3):.2%} identical, "
          f"max {err.max():.2f} LSB", flush=True)  # fmt: skip


def zoo() -> None:
    import torch

    from quantbridge.zoo import DigitsCNN, TinyTransformer, mobilenetv2_style, resnet18_style

    rng = np.random.default_rng(1)
    image = {"x": rng.standard_normal((64, 3, 32, 32)).astype(np.float32)}
    cases = {
        "resnet18_style(10, 8)": (resnet18_style(10, 8), torch.randn(8, 3, 32, 32), image),
        "mobilenetv2_style(10, 0.35)": (mobilenetv2_style(10, 0.35), torch.randn(8, 3, 32, 32), image),
        "DigitsCNN": (DigitsCNN().eval(), torch.randn(8, 1, 8, 8),
                      {"x": rng.standard_normal((256, 1, 8, 8)).astype(np.float32)}),
        "TinyTransformer": (TinyTransformer(num_classes=8), torch.randint(0, 100, (8, 16)),
                            {"tokens": rng.integers(0, 100, (64, 16))}),
    }  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for name, (model, calib, feeds) in cases.items():
            qdq = qb.export(qb.quantize(model, [calib]), Path(tmp) / "m.onnx", calib[:2])
            report(name, qdq, feeds)


def _materialize(model: onnx.ModelProto, rng) -> onnx.ModelProto:
    """Random initializers for the light models' ConstantOfShape weights (module docstring)."""
    inits = {i.name: i for i in model.graph.initializer}
    users = {t: (n.op_type, k) for n in model.graph.node for k, t in enumerate(n.input)}
    keep = []
    for n in model.graph.node:
        if n.op_type != "ConstantOfShape":
            keep.append(n)
            continue
        shape = numpy_helper.to_array(inits[n.input[0]]).astype(int)
        if users.get(n.output[0], ("", 0)) in (
            ("BatchNormalization", 1),
            ("BatchNormalization", 4),
        ):
            value = rng.uniform(0.5, 1.5, shape)  # scale and variance: positive
        elif len(shape) >= 2:
            value = rng.standard_normal(shape) * np.sqrt(2.0 / max(1, int(np.prod(shape[1:]))))
        else:
            value = rng.standard_normal(shape) * 0.1
        model.graph.initializer.append(
            numpy_helper.from_array(value.astype(np.float32), n.output[0])
        )
    if keep[-1].op_type == "Softmax":
        model.graph.output[0].name = keep.pop().input[0]
    del model.graph.node[:]
    model.graph.node.extend(keep)
    model.ir_version = max(model.ir_version, 8)
    return onnx.version_converter.convert_version(model, 13)


def light(names: list[str]) -> None:
    from onnxruntime.quantization import (
        CalibrationDataReader,
        QuantFormat,
        QuantType,
        quant_pre_process,
        quantize_static,
    )

    class Reader(CalibrationDataReader):
        def __init__(self, feeds):
            self._it = iter(feeds)

        def get_next(self):
            return next(self._it, None)

    logging.getLogger().setLevel(logging.ERROR)
    for name in names:
        rng = np.random.default_rng(0)
        model = _materialize(onnx.load(LIGHT / f"light_{name}.onnx"), rng)
        x = next(
            i for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}
        )
        shape = [d.dim_value or 1 for d in x.type.tensor_type.shape.dim]
        calib = [{x.name: rng.random(shape, np.float32)} for _ in range(2)]
        with tempfile.TemporaryDirectory() as tmp:
            raw, pre, q = (str(Path(tmp) / f) for f in ("raw.onnx", "pre.onnx", "qdq.onnx"))
            onnx.save(model, raw)
            quant_pre_process(raw, pre)
            quantize_static(pre, q, Reader(calib), quant_format=QuantFormat.QDQ,
                            activation_type=QuantType.QUInt8, weight_type=QuantType.QInt8,
                            per_channel=True)  # fmt: skip
            report(f"light_{name}", onnx.load(q), {x.name: rng.random(shape, np.float32)})


if __name__ == "__main__":
    if sys.argv[1:2] == ["zoo"]:
        zoo()
    elif sys.argv[1:2] == ["light"] and sys.argv[2:]:
        light(sys.argv[2:])
    else:
        sys.exit(__doc__)
