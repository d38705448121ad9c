"""``import_onnx`` of quantized files written by ONNX Runtime's quantizer: QDQ and QOperator,
per-tensor and per-channel, u8/s8 and s8/s8, on the zoo CNNs and a transformer block.

Agreement (part 2a of issue 9), in steps of the output's quantizer:

* against ONNX Runtime with graph optimisations off on the same QDQ file (every op as written:
  DequantizeLinear -> float op -> QuantizeLinear, the float simulation the file specifies): within
  1 step on every element. Measured: 0 steps on every element of every case here; the 1-step
  allowance is for float accumulation order (MLAS vs torch's conv), which can move a value across
  a rounding boundary;
* against ONNX Runtime's deployed integer kernels (optimisations on): a shallow network within 1
  step on >= 99.9% of elements. Deep random-weight networks are chaotic here (a requantization tie
  broken differently flips one code, and it grows layer after layer, see DESIGN.md): ORT's own
  optimised session differs from its unoptimised one by as much as the import does, so those use
  the mean-step criterion of ``test_import.py`` and are compared with ORT-vs-ORT.
"""

from __future__ import annotations

import logging
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnxruntime.quantization import (
    CalibrationDataReader,
    QuantFormat,
    QuantType,
    quantize_dynamic,
    quantize_static,
)

import quantbridge as qb
from quantbridge import zoo

logging.getLogger().setLevel(logging.ERROR)  # ORT's "consider pre-processing" advice

TYPES = {"u8s8": (QuantType.QUInt8, QuantType.QInt8), "s8s8": (QuantType.QInt8, QuantType.QInt8)}


def float_file(model: torch.nn.Module, example: torch.Tensor, path, opset: int = 17) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model.eval(), (example,), str(path), dynamo=False, opset_version=opset,
            input_names=["x"], output_names=["y"], dynamic_axes={"x": {0: "b"}, "y": {0: "b"}},
        )  # fmt: skip
    return str(path)


class _Reader(CalibrationDataReader):
    def __init__(self, batches: list[np.ndarray]):
        self._it = iter([{"x": b} for b in batches])

    def get_next(self):
        return next(self._it, None)


def ort_static(
    src: str, dst, batches, fmt: str, per_channel: bool, types: str = "u8s8", reduce_range=False
) -> str:
    act, weight = TYPES[types]
    quantize_static(
        src, str(dst), _Reader(batches), quant_format=getattr(QuantFormat, fmt),
        per_channel=per_channel, activation_type=act, weight_type=weight,
        reduce_range=reduce_range,
    )  # fmt: skip
    return str(dst)


def ort_dynamic(src: str, dst, per_channel: bool = False, reduce_range: bool = True) -> str:
    quantize_dynamic(
        src, str(dst), per_channel=per_channel, weight_type=QuantType.QInt8,
        reduce_range=reduce_range,
    )  # fmt: skip
    return str(dst)


def run_ort(path: str, x: np.ndarray, optimize: bool) -> np.ndarray:
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def _steps(a: np.ndarray, b: np.ndarray, path: str) -> np.ndarray:
    return np.abs(a - b) / _output_step(path)


def _output_step(path: str) -> float:
    """The scale of the DequantizeLinear that writes the graph's output."""
    model = onnx.load(path)
    consts = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    (last,) = [n for n in model.graph.node if n.output[0] == model.graph.output[0].name]
    assert last.op_type == "DequantizeLinear", last.op_type
    return float(consts[last.input[1]])


def _digits() -> torch.nn.Module:
    torch.manual_seed(0)
    return zoo._randomize_bn(zoo.DigitsCNN()).eval()


def _block() -> torch.nn.Module:
    torch.manual_seed(0)
    return zoo.EncoderBlock(dim=32, heads=4, ff=64).eval()


MODELS = {
    "digits": (_digits, (1, 8, 8)),
    "resnet18": (lambda: zoo.resnet18_style(num_classes=10, width=8), (3, 32, 32)),
    "mobilenetv2": (lambda: zoo.mobilenetv2_style(num_classes=10, width=0.25), (3, 32, 32)),
    "block": (_block, (6, 32)),
}


def _batches(shape, n: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal((4, *shape)).astype(np.float32) for _ in range(n)]


@pytest.fixture(scope="module")
def float_files(tmp_path_factory):
    folder = tmp_path_factory.mktemp("float")
    out = {}
    for name, (make, shape) in MODELS.items():
        out[name] = float_file(make(), torch.randn(2, *shape), folder / f"{name}.onnx")
    return out


def _quantized(float_files, tmp_path, name, fmt, per_channel, types):
    shape = MODELS[name][1]
    dst = tmp_path / f"{name}_{fmt}_{int(per_channel)}_{types}.onnx"
    return ort_static(float_files[name], dst, _batches(shape, 3, 1), fmt, per_channel, types)


# every form on the shallow CNN, a spread of forms on the others (the file's test time stays ~1 min)
CASES = [("digits", pc, t) for pc in (False, True) for t in ("u8s8", "s8s8")] + [
    ("resnet18", True, "u8s8"),
    ("resnet18", False, "s8s8"),
    pytest.param("mobilenetv2", True, "u8s8", marks=pytest.mark.slow),  # 18 s on a busy CI core
    ("block", True, "u8s8"),  # a square per-channel MatMul weight: the transposed-axis regression
    ("block", False, "s8s8"),
]


@pytest.mark.parametrize("name,per_channel,types", CASES)
def test_qdq_matches_ort_reference(float_files, tmp_path, name, per_channel, types):
    """The imported QDQ model computes what the file specifies (ORT, optimisations off)."""
    path = _quantized(float_files, tmp_path, name, "QDQ", per_channel, types)
    qmodel = qb.import_onnx(path)
    assert isinstance(qmodel, qb.QuantModel)
    x = _batches(MODELS[name][1], 1, 7)[0]
    with torch.no_grad():
        y = qmodel(torch.from_numpy(x)).numpy()
    d = _steps(y, run_ort(path, x, optimize=False), path)
    assert d.max() <= 1.0 + 1e-3, f"{name}: max {d.max():.2f} steps, {(d > 1e-3).mean():.4f} differ"


QOPERATOR_CASES = [
    ("digits", False, "u8s8"),
    ("digits", True, "s8s8"),
    ("resnet18", True, "s8s8"),
    pytest.param("mobilenetv2", False, "u8s8", marks=pytest.mark.slow),  # depthwise QLinearConv
]


@pytest.mark.parametrize("name,per_channel,types", QOPERATOR_CASES)
def test_qoperator_matches_the_qdq_reference(float_files, tmp_path, name, per_channel, types):
    """ORT writes the same scales in QOperator and QDQ form from the same calibration: the
    imported QOperator model computes what the QDQ file specifies (ORT, optimisations off).
    Measured: 0 steps on every element of every case."""
    qop = _quantized(float_files, tmp_path, name, "QOperator", per_channel, types)
    qdq = _quantized(float_files, tmp_path, name, "QDQ", per_channel, types)
    qmodel = qb.import_onnx(qop)
    assert not any(n.op_type.startswith("QLinear") for n in onnx.load(qdq).graph.node)
    x = np.concatenate(_batches(MODELS[name][1], 2, 7))
    with torch.no_grad():
        y = qmodel(torch.from_numpy(x)).numpy()
    d = _steps(y, run_ort(qdq, x, optimize=False), qdq)
    assert d.max() <= 1.0 + 1e-3, f"{name}: max {d.max():.2f} steps, {(d > 1e-3).mean():.4f} differ"


@pytest.mark.parametrize("name", ["digits", "resnet18"])
def test_ort_integer_kernels_agree_within_one_step(float_files, tmp_path, name):
    """s8/s8 QOperator: ORT's integer kernels agree with the import within 1 step on >= 99.9%
    of output elements. Measured: 0 steps on every element (DigitsCNN, ResNet-18 and MobileNetV2
    layouts, per-tensor and per-channel). (ORT runs s8/s8 *QDQ* files through u8 kernels on x86
    - its QDQS8ToU8 rewrite - and so meets the u8/s8 saturation of the next test.)"""
    path = _quantized(float_files, tmp_path, name, "QOperator", True, "s8s8")
    qdq = _quantized(float_files, tmp_path, name, "QDQ", True, "s8s8")
    qmodel = qb.import_onnx(path)
    x = np.concatenate(_batches(MODELS[name][1], 4, 13))
    with torch.no_grad():
        y = qmodel(torch.from_numpy(x)).numpy()
    d = _steps(y, run_ort(path, x, optimize=True), qdq)
    assert (d <= 1.0 + 1e-3).mean() >= 0.999, f"{(d <= 1.001).mean():.4f} within 1 step"


def test_qoperator_transformer_block_agrees_with_ort_as_ort_agrees_with_itself(
    float_files, tmp_path
):
    """The block's QOperator file (QLinearMatMul, QLinearAdd, QLinearMul, QLinearSoftmax, integer
    Reshape / Transpose / Split / Squeeze) ends in a float LayerNorm, so it has no output grid to
    compare on with the QDQ file: the import is held to ORT-vs-ORT (mean steps of the QDQ file's
    output grid; measured: import vs ORT QOperator 1.01 / 1.16, ORT QDQ vs ORT QOperator 1.05 /
    1.20, per-tensor / per-channel)."""
    qop = _quantized(float_files, tmp_path, "block", "QOperator", True, "u8s8")
    qdq = _quantized(float_files, tmp_path, "block", "QDQ", True, "u8s8")
    x = np.concatenate(_batches(MODELS["block"][1], 2, 7))
    with torch.no_grad():
        y = qb.import_onnx(qop)(torch.from_numpy(x)).numpy()
    engine = run_ort(qop, x, optimize=False)
    ours = _steps(y, engine, qdq)
    ort_qdq = _steps(run_ort(qdq, x, optimize=False), engine, qdq)
    assert ours.mean() <= ort_qdq.mean() + 0.05, (ours.mean(), ort_qdq.mean())


def test_ort_u8s8_kernels_saturate_on_avx2_and_reduce_range_removes_it(float_files, tmp_path):
    """u8/s8 without reduce_range: ORT's x86 kernels without VNNI sum pairs of u8 x s8 products
    in int16 (VPMADDUBSW) and saturate, so ORT's fused session differs from its own unoptimised
    one (measured on this AVX2 machine, DigitsCNN per-channel: a mean of 6.0 steps, 17.5% within
    1 step; the import equals the unoptimised session on every element). The same file quantized
    with reduce_range=True (7-bit weights, no saturation) agrees with the import on every
    element. So the import is held to ORT-vs-ORT here, and to the 99.9% criterion with reduce_range."""
    path = _quantized(float_files, tmp_path, "digits", "QOperator", True, "u8s8")
    x = np.concatenate(_batches((1, 8, 8), 4, 13))
    with torch.no_grad():
        y = qb.import_onnx(path)(torch.from_numpy(x)).numpy()
    fused = run_ort(path, x, optimize=True)
    qdq = _quantized(float_files, tmp_path, "digits", "QDQ", True, "u8s8")
    ours = _steps(y, fused, qdq)
    ort_self = _steps(run_ort(qdq, x, optimize=False), fused, qdq)
    assert ours.mean() <= ort_self.mean() + 0.05, (ours.mean(), ort_self.mean())

    reduced = tmp_path / "reduced.onnx"
    ort_static(float_files["digits"], reduced, _batches((1, 8, 8), 3, 1), "QOperator", True,
               "u8s8", reduce_range=True)  # fmt: skip
    with torch.no_grad():
        y = qb.import_onnx(reduced)(torch.from_numpy(x)).numpy()
    d = _steps(y, run_ort(str(reduced), x, optimize=True), str(reduced))
    assert (d <= 1.0 + 1e-3).mean() >= 0.999, f"{(d <= 1.001).mean():.4f} within 1 step"


# -- dynamic quantization -------------------------------------------------------------------------
@pytest.mark.parametrize(
    "name,per_channel", [("digits", True), ("resnet18", False), ("block", True)]
)
def test_dynamic_matches_ort(float_files, tmp_path, name, per_channel):
    """quantize_dynamic files (DynamicQuantizeLinear + ConvInteger / MatMulInteger + Cast + Mul):
    the import agrees with ORT up to float32 rounding - no output grid here, the result is float:
    ORT rescales the exact int32 sum, the import sums dequantized values in float32. Measured:
    <= 5e-7 of the largest output. reduce_range=True (7-bit weights), as ORT advises on x86:
    without it ORT's AVX2 u8 x s8 kernels saturate their int16 pair sums (DigitsCNN's fc1: 3% of
    the largest output; u8 weights or reduce_range: 3e-7, the import unchanged)."""
    path = ort_dynamic(float_files[name], tmp_path / f"{name}.dyn.onnx", per_channel)
    assert any(n.op_type == "DynamicQuantizeLinear" for n in onnx.load(path).graph.node)
    qmodel = qb.import_onnx(path)
    weights = [q for q in qmodel.quantizers().values() if getattr(q, "kind", "") == "weight"]
    assert weights and all((q.qmin, q.qmax) == (-128, 127) for q in weights)  # the file's int8
    x = np.concatenate(_batches(MODELS[name][1], 2, 7))
    with torch.no_grad():
        y = qmodel(torch.from_numpy(x)).numpy()
    expected = run_ort(path, x, optimize=True)
    assert np.abs(y - expected).max() <= 1e-5 * np.abs(expected).max()


# -- round trips (part 2b-d) ----------------------------------------------------------------------
def _integer_weights(path) -> list[np.ndarray]:
    """Layer weights and int32 biases: integer constants of >= 2 dims or int32 read by a
    DequantizeLinear. (Tensor constant operands of Add / Mul, which ORT stores as uint8, are
    compared in ``test_import_constant_operand_grids.py``.)"""
    model = onnx.load(str(path))
    consts = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    found = []
    for n in model.graph.node:
        v = consts.get(n.input[0]) if n.op_type == "DequantizeLinear" else None
        if v is not None and v.size > 1 and (v.ndim >= 2 or v.dtype == np.int32):
            found.append(np.asarray(v).astype(np.int64))
    return found


def _activation_qparams(path) -> set[tuple[float, int]]:
    """(scale, zero point) of every QuantizeLinear of a run-time tensor (ORT also writes Q of
    scalar constants, ``x * 0.5``: imported as the float literal, written back in float)."""
    model = onnx.load(str(path))
    consts = {i.name: onnx.numpy_helper.to_array(i) for i in model.graph.initializer}
    consts.update({n.output[0]: None for n in model.graph.node if n.op_type == "Constant"})
    return {
        (float(consts[n.input[1]]), int(consts[n.input[2]]))
        for n in model.graph.node
        if n.op_type == "QuantizeLinear" and n.input[0] not in consts
    }


def _same_arrays(ours: list[np.ndarray], theirs: list[np.ndarray]) -> bool:
    """Every array of ``theirs`` in ``ours`` (transposed allowed: MatMul -> Gemm), one to one."""
    left = list(ours)
    for t in theirs:
        hit = next(
            (i for i, o in enumerate(left) if o.shape == t.shape and np.array_equal(o, t)), None
        )
        if hit is None and t.ndim == 2:
            hit = next(
                (i for i, o in enumerate(left) if o.shape == t.T.shape and np.array_equal(o, t.T)),
                None,
            )
        if hit is None:
            return False
        left.pop(hit)
    return not left


@pytest.mark.parametrize("name", ["digits", pytest.param("block", marks=pytest.mark.slow)])
def test_round_trips(float_files, tmp_path, name):
    """export(import(f)) keeps integer weights, biases (the block's LayerNormalization int32 bias
    included), scales and zero points bit for bit and runs the same in ORT; import(export(m)) and
    qb.load(qb.save(m)) are bit-identical in torch."""
    path = _quantized(float_files, tmp_path, name, "QDQ", True, "u8s8")
    qmodel = qb.import_onnx(path)
    x = _batches(MODELS[name][1], 1, 5)[0]
    out = tmp_path / "again.onnx"
    qb.export(qmodel, out, example_inputs=torch.from_numpy(x))
    assert _same_arrays(_integer_weights(out), _integer_weights(path))
    assert _activation_qparams(out) == _activation_qparams(path)
    d = _steps(run_ort(str(out), x, optimize=False), run_ort(path, x, optimize=False), path)
    assert d.max() <= 1.0 + 1e-3 and (d > 1e-3).mean() <= 0.001, d.max()

    with torch.no_grad():
        y = qmodel(torch.from_numpy(x))
        again = qb.import_onnx(out)
        assert torch.equal(again(torch.from_numpy(x)), y)
        qb.save(qmodel, tmp_path / "m.qb")
        loaded = qb.load(tmp_path / "m.qb", qb.import_onnx(path))
        assert torch.equal(loaded(torch.from_numpy(x)), y)
