"""``qb.import_onnx``: real models against ONNX Runtime, the int8 path end to end, and errors.

* PP-OCR (from the ``rapidocr-onnxruntime`` wheel, see ``tests/ppocr_models.py``; opset 11/12): the imported module against ONNX
  Runtime on rendered text (Pillow + DejaVu when available, numpy strokes otherwise; noise is no
  input for a text detector), detector at two image sizes;
* the model-zoo structures of onnx's ``backend/test/data/light`` (opset 9): against their
  reference outputs, and with random weights against ONNX Runtime;
* ``qb.quantize(import_onnx(det), ..., dynamic="all")`` -> ``qb.export`` -> ONNX Runtime;
* the refusals: unsupported op, custom domain, inexact Resize, external data.
"""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper
from ppocr_models import ppocr_dir, skip_reason
from torch import nn

import quantbridge as qb
from quantbridge.torch._ops import WEIGHTED_OPS

PPOCR = ppocr_dir() or Path("/nonexistent")
DET = PPOCR / "ch_PP-OCRv4_det_infer.onnx"
CLS = PPOCR / "ch_ppocr_mobile_v2.0_cls_infer.onnx"
REC = PPOCR / "ch_PP-OCRv4_rec_infer.onnx"
LIGHT = Path(onnx.__file__).parent / "backend" / "test" / "data" / "light"
needs_ppocr = pytest.mark.skipif(not DET.exists(), reason=skip_reason())
SLOW = [
    pytest.mark.slow,
    pytest.mark.skipif(os.environ.get("QB_SKIP_SLOW") == "1", reason="QB_SKIP_SLOW=1"),
]


# -- inputs --------------------------------------------------------------------------------------
def _text_images(seeds, height: int, width: int) -> np.ndarray:
    """``N x 3 x H x W`` float32 normalised as PP-OCR expects, ``(v / 255 - 0.5) / 0.5``: dark
    words on a light page, rendered with Pillow (DejaVu fonts if installed)."""
    images = np.stack([_render(s, height, width) for s in seeds]).astype(np.float32)
    return ((images / 255.0 - 0.5) / 0.5).transpose(0, 3, 1, 2).copy()


def _render(seed: int, height: int, width: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    words = "invoice total 42.50 EUR date 2024-11-30 order No. 7731 quantization kernel".split()
    try:
        from PIL import Image, ImageDraw, ImageFont
    except ImportError:
        return _strokes(rng, height, width)
    fonts = sorted(glob.glob("/usr/share/fonts/**/DejaVu*.ttf", recursive=True))
    page = Image.new("RGB", (width, height), tuple(int(v) for v in rng.integers(200, 256, 3)))
    draw = ImageDraw.Draw(page)
    y = int(rng.integers(2, 8))
    while y < height - 12:
        size = int(rng.integers(11, 22))
        font = (
            ImageFont.truetype(fonts[int(rng.integers(len(fonts)))], size)
            if fonts
            else ImageFont.load_default()
        )
        text = " ".join(rng.choice(words, int(rng.integers(1, 4))))
        ink = tuple(int(v) for v in rng.integers(0, 80, 3))
        draw.text((int(rng.integers(0, max(width // 4, 1))), y), text, font=font, fill=ink)
        y += size + int(rng.integers(3, 12))
    return np.asarray(page)


def _strokes(rng, height: int, width: int) -> np.ndarray:
    """Without Pillow: rows of glyph-sized dark strokes (vertical bars and bowls) on a page."""
    page = np.full((height, width, 3), rng.integers(200, 256), np.uint8)
    for top in range(4, height - 14, 18):
        x = int(rng.integers(0, 10))
        while x < width - 8:
            glyph = rng.random((11, 6)) < 0.45
            page[top : top + 11, x : x + 6][glyph] = rng.integers(0, 80)
            x += 7 + (6 if rng.random() < 0.2 else 0)
    return page


def _ort(path_or_model, feeds: dict, threads: int = 2, optimize: bool = True) -> list[np.ndarray]:
    """Outputs of a CPU session; ``optimize=False`` runs the graph node by node (no fusions)."""
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    if not optimize:
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    src = (
        path_or_model.SerializeToString()
        if isinstance(path_or_model, onnx.ModelProto)
        else str(path_or_model)
    )
    return ort.InferenceSession(src, so, providers=["CPUExecutionProvider"]).run(None, feeds)


def _cpu() -> str:
    """The CPU's model name and whether it has VNNI (ORT's int8 kernels differ without it), for
    assertion messages of agreement tests whose statistics depend on the machine."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "cpu unknown"
    model = next(
        (ln.split(":", 1)[1].strip() for ln in info.splitlines() if "model name" in ln), "?"
    )
    vnni = "vnni" if "vnni" in info else "no vnni"
    return f"{model}, {vnni}, {os.cpu_count()} cpus"


def _torch(module, x: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return module(torch.from_numpy(x)).numpy()


# -- PP-OCR vs ONNX Runtime ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def det(ppocr_det):
    return ppocr_det  # conftest: imported once per session


@needs_ppocr
@pytest.mark.parametrize("height,width", [(64, 96), (96, 128)])
def test_det_matches_onnxruntime(det, height, width):
    """Text probabilities in [0, 1]. Tolerance 1e-4: both engines compute 62 convolutions in
    float32 with different summation orders (measured max 1.6e-5 on these images)."""
    x = _text_images([1, 2], height, width)
    expected = _ort(DET, {"x": x})[0]
    got = _torch(det, x)
    assert got.shape == expected.shape == (2, 1, height, width)
    assert (expected > 0.3).mean() > 0.01  # the images do contain text pixels
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-4)


@pytest.fixture(scope="module")
def cls_rec():
    """The classifier and the recognizer imported once for the two tests that only read them
    (``test_imported_model_trains`` imports its own classifier: it trains it)."""
    return qb.import_onnx(CLS), qb.import_onnx(REC)


@needs_ppocr
def test_cls_and_rec_match_onnxruntime(cls_rec):
    """Classifier: 2 probabilities (measured max error 2e-6, tolerance 2e-5). Recognizer: CTC
    probabilities over 6625 characters, two line widths (dynamic width; measured 7e-6, tolerance
    5e-5: LayerNorm-style reductions and attention softmax in float32)."""
    cls, rec = cls_rec
    x = _text_images([3, 4], 48, 192)
    np.testing.assert_allclose(_torch(cls, x), _ort(CLS, {"x": x})[0], rtol=0, atol=2e-5)
    for width in (320, 160):
        x = _text_images([5, 6], 48, width)
        expected = _ort(REC, {"x": x})[0]
        assert expected.shape == (2, width // 8, 6625)
        np.testing.assert_allclose(_torch(rec, x), expected, rtol=0, atol=5e-5)


@needs_ppocr
def test_weights_are_named_submodules(det, cls_rec):
    proto = onnx.load(str(DET))
    count = {op: sum(n.op_type == op for n in proto.graph.node) for op in ("Conv", "ConvTranspose")}
    modules = dict(det.named_children())
    assert sum(isinstance(m, nn.Conv2d) for m in modules.values()) == count["Conv"] == 62
    assert sum(isinstance(m, nn.ConvTranspose2d) for m in modules.values()) == 2
    assert sum(isinstance(m, nn.BatchNorm2d) for m in modules.values()) == 3
    assert isinstance(det.p2o_Conv_0, nn.Conv2d) and det.onnx_names["p2o_Conv_0"] == "p2o.Conv.0"
    assert det.p2o_Conv_1.groups == 16  # depthwise
    assert all(p.requires_grad for p in det.parameters())
    # the Paddle bias pattern Conv -> Add(Reshape(b)) is the conv's own bias (Case 2)
    cls, rec = cls_rec
    assert isinstance(cls.Conv_3, nn.Conv2d) and cls.Conv_3.bias is not None
    # MatMul with a constant weight is nn.Linear; activation @ activation (attention) is not
    proto = onnx.load(str(REC))
    consts = {n.output[0] for n in proto.graph.node if n.op_type == "Constant"}
    weighted = [n for n in proto.graph.node if n.op_type == "MatMul" and n.input[1] in consts]
    linears = [m for m in rec.modules() if isinstance(m, nn.Linear)]
    assert len(linears) == len(weighted) == 9


@needs_ppocr
def test_imported_model_trains():
    """One SGD step moves the classifier's weights and lowers its loss on the batch."""
    cls = qb.import_onnx(CLS).train()
    x = torch.from_numpy(_text_images([7, 8, 9, 10], 48, 192))
    target = torch.tensor([1, 1, 0, 0])
    opt = torch.optim.SGD(cls.parameters(), lr=0.05)
    before = cls.Conv_0.weight.detach().clone()
    losses = []
    for _ in range(3):
        loss = nn.functional.nll_loss(torch.log(cls(x) + 1e-6), target)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert not torch.equal(before, cls.Conv_0.weight)
    assert losses[-1] < losses[0]


# -- onnx model-zoo structures -------------------------------------------------------------------
LIGHT_MODELS = sorted(p.name for p in LIGHT.glob("light_*.onnx"))
SLOW_LIGHT = {"light_vgg19.onnx", "light_bvlc_alexnet.onnx", "light_zfnet512.onnx"}  # > 4 s each


def _light_params():
    return [pytest.param(name, marks=SLOW) if name in SLOW_LIGHT else name for name in LIGHT_MODELS]


def _light_input(model: onnx.ModelProto) -> tuple[str, list[int]]:
    inits = {i.name for i in model.graph.initializer}
    (inp,) = [i for i in model.graph.input if i.name not in inits]
    return inp.name, [
        d.dim_value if d.HasField("dim_value") else 1 for d in inp.type.tensor_type.shape.dim
    ]


@pytest.mark.parametrize("name", _light_params())
def test_model_zoo_reference_output(name):
    """As onnx's backend test runner feeds these models (``arange(n) / n``) against the shipped
    ``*_output_0.pb``; the runner's tolerance (rtol 1e-3, atol 1e-7). Their weights are constants
    from ConstantOfShape, so the outputs are nearly uniform: the random-weight test below is the
    numerical check, this one checks the shipped graphs import and run as the runner expects."""
    model = onnx.load(str(LIGHT / name))
    input_name, shape = _light_input(model)
    x = (np.arange(np.prod(shape)).reshape(shape) / np.prod(shape)).astype(np.float32)
    reference = numpy_helper.to_array(
        onnx.load_tensor(str(LIGHT / name.replace(".onnx", "_output_0.pb")))
    )
    np.testing.assert_allclose(_torch(qb.import_onnx(model), x), reference, rtol=1e-3, atol=1e-7)


def _random_weights(model: onnx.ModelProto, seed: int = 0) -> onnx.ModelProto:
    """The zoo graph with He-scaled random weights (1-D parameters - biases, BN statistics - in
    [0.5, 1.5]) instead of its ConstantOfShape constants, and the logits as output (the final
    Softmax dropped: saturated probabilities would hide differences)."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    shapes = {i.name: numpy_helper.to_array(i) for i in g.initializer}
    rng = np.random.default_rng(seed)
    keep = []
    for node in g.node:
        if node.op_type == "ConstantOfShape" and node.input[0] in shapes:
            shape = tuple(int(d) for d in shapes[node.input[0]])
            if len(shape) == 1:
                value = rng.uniform(0.5, 1.5, shape)
            else:
                value = rng.standard_normal(shape) * np.sqrt(2.0 / np.prod(shape[1:]))
            g.initializer.append(numpy_helper.from_array(value.astype(np.float32), node.output[0]))
        elif node.op_type == "Softmax" and node.output[0] == g.output[0].name:
            g.output[0].name = node.input[0]
        else:
            keep.append(node)
    del g.node[:]
    g.node.extend(keep)
    return out


@pytest.mark.parametrize("name", _light_params())
def test_model_zoo_random_weights_match_onnxruntime(name):
    """Logits against ONNX Runtime on a U(0, 1) image. Tolerance: 1e-5 of the largest logit
    (float32 through up to 121 convolutions with different summation orders; measured <= 5e-7
    relative)."""
    model = _random_weights(onnx.load(str(LIGHT / name)))
    input_name, shape = _light_input(model)
    x = np.random.default_rng(1).random(shape, np.float32)
    expected = _ort(model, {input_name: x})[0]
    got = _torch(qb.import_onnx(model), x)
    assert np.abs(expected).max() > 1e-3
    np.testing.assert_allclose(got, expected, rtol=0, atol=1e-5 * np.abs(expected).max())
    assert got.reshape(-1).argmax() == expected.reshape(-1).argmax()


# -- int8 end to end -----------------------------------------------------------------------------
def _last_activation(qmodel, model: onnx.ModelProto):
    """The last activation quantizer of ``qmodel`` and the ONNX value of its DequantizeLinear
    (found through the export's quantizer record, not by name guessing)."""
    record = json.loads({p.key: p.value for p in model.metadata_props}["quantbridge.quantizers"])
    point = [p for p in qmodel.qb_points if p.kind == "activation"][-1]
    scale = record[point.name]["scale"]
    (dq,) = [
        n for n in model.graph.node if n.op_type == "DequantizeLinear" and n.input[1] == scale
    ][:1]
    return getattr(qmodel._quantbridge, point.attr), dq.output[0]


def _mask_iou(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a > 0.3, b > 0.3
    return float((a & b).sum() / max((a | b).sum(), 1))


@pytest.fixture(scope="module")
def det_int8(ppocr_det_int8):
    return ppocr_det_int8  # conftest: one quantization and export of the detector per session


@needs_ppocr
def test_det_int8_end_to_end(det, det_int8):
    """Import -> quantize (dynamic batch, height and width) -> export -> ONNX Runtime.

    Agreement is measured on the last quantized tensor (the detector's output is a float Sigmoid;
    the tensor before it, the second ConvTranspose's full-resolution output, is the last one
    quantized), in units of that quantizer's step, against two ONNX Runtime sessions:

    * ``reference``: graph optimizations off, so ORT runs DequantizeLinear -> float op ->
      QuantizeLinear node by node: the same arithmetic as our fake-quant model. This is the check
      of the translation.
    * ``fused``: ORT's default session, with QLinearConv/QLinearAdd/QLinearMul kernels that round
      differently (zero point added before rounding, int32 accumulation). This is what users run.

    The 99.9%-within-1-LSB criterion of the zoo-model tests does not hold on this model, for a
    reason of the model, not of the import: its SE blocks average whole feature maps and scale
    every pixel of a channel by the quantized result, and its FPN upsamples the 1/32 map 8x, so
    one rounding tie resolved differently (float32 summation order, which depends on the CPU and
    the thread count, or a fused kernel's rounding) moves whole channels and 8x8 blocks by a
    step, and two transposed convolutions spread it. The fraction of elements within one step is
    therefore not a stable statistic (CI's CPU gave 93.9% where this machine gave 95.4%); the mean
    step difference over four images is. Measured here (1-3 threads, three sets of four images):
    reference mean 0.00-0.36 steps, 99.0-100% within 2 steps; fused mean 0.51-0.65 steps,
    98.5-99.6% within 2 steps, text-mask IoU 0.991-0.995. Negative controls (a 5% error in one
    convolution's weight scale, early or mid network): reference mean 0.83-1.34 steps, 85-98%
    within 2; Resize in linear instead of nearest mode: mean 21-27 steps. The bounds sit between.
    """
    qmodel, path = det_int8
    model = onnx.load(str(path))

    # int8 weights: every Conv reads an int8 initializer through DequantizeLinear
    floats = qb.onnx.float_weights(model)
    assert [f for f in floats if not f.startswith("ConvTranspose")] == []
    if torch.ops.aten.conv_transpose2d.input in WEIGHTED_OPS:
        assert floats == []
    int8 = {i.name for i in model.graph.initializer if i.data_type == TensorProto.INT8}
    dq_int8 = {
        n.output[0]
        for n in model.graph.node
        if n.op_type == "DequantizeLinear" and n.input[0] in int8
    }
    convs = [n for n in model.graph.node if n.op_type == "Conv"]
    assert len(convs) == 62 and all(n.input[1] in dq_int8 for n in convs)

    quantizer, value = _last_activation(qmodel, model)
    captured = []
    hook = quantizer.register_forward_hook(lambda m, i, o: captured.append(o.detach().clone()))
    model.graph.output.append(helper.make_tensor_value_info(value, TensorProto.FLOAT, None))
    x = _text_images([1000, 1001, 1002, 1003], 96, 128)
    with torch.no_grad():
        y_torch = qmodel(torch.from_numpy(x)).numpy()
        y_float = _torch(det, x)
    hook.remove()
    inner_torch = captured[0].numpy()
    assert inner_torch.size >= 4 * 96 * 128  # the pre-sigmoid map (ConvTranspose output), or larger

    def steps(optimize: bool):
        y_ort, inner_ort = _ort(model, {"x": x}, optimize=optimize)
        d = np.abs(inner_ort - inner_torch) / quantizer.scale.item()
        stats = (
            f"mean {d.mean():.3f} steps, {(d <= 2.001).mean():.4f} within 2, "
            f"{(d <= 1.001).mean():.4f} within 1, max {d.max():.0f}; {_cpu()}"
        )
        return d, y_ort, stats

    d, y_ref, stats = steps(optimize=False)
    assert d.mean() <= 0.6 and (d <= 2.0 + 1e-3).mean() >= 0.97, f"reference: {stats}"
    assert _mask_iou(y_torch, y_ref) >= 0.97, f"reference: {stats}"
    d, y_ort, stats = steps(optimize=True)
    assert d.mean() <= 1.0 and (d <= 2.0 + 1e-3).mean() >= 0.95, f"fused: {stats}"
    assert _mask_iou(y_torch, y_ort) >= 0.97, f"fused: {stats}"
    assert _mask_iou(y_float, y_ort) >= 0.75  # int8 still finds the text (measured 0.93)

    # the captured model took other image sizes: dynamic H and W in torch
    small = _text_images([1002], 64, 96)
    with torch.no_grad():
        assert qmodel(torch.from_numpy(small)).shape == (1, 1, 64, 96)


@needs_ppocr
@SLOW[0]
@SLOW[1]
def test_det_int8_export_with_dynamic_image_size(det_int8):
    """``qb.export`` of a model quantized with ``dynamic="all"`` (export's default then):
    one int8 file runs every image size in ONNX Runtime."""
    qmodel, path = det_int8
    dims = onnx.load(str(path)).graph.input[0].type.tensor_type.shape.dim
    free = [bool(d.dim_param) for d in dims]
    assert free == [True, False, True, True], dims  # batch, height and width; 3 channels
    for height, width in ((64, 96), (128, 160)):
        x = _text_images([40], height, width)
        (y_ort,) = _ort(path, {"x": x})
        with torch.no_grad():
            y_torch = qmodel(torch.from_numpy(x)).numpy()
        assert y_ort.shape == (1, 1, height, width)
        assert _mask_iou(y_torch, y_ort) >= 0.95


def test_torch_exported_model_quantizes_like_the_original(tmp_path):
    """import(float ONNX export of a torch model) quantizes like the torch model itself, and its
    int8 export meets the zoo-model ORT criterion (>= 99.9% within 1 LSB of the output
    quantizer, the rest within 2). Measured: float outputs 7e-8 apart, int8 outputs 3e-5 LSB
    apart (the exporter folds BatchNorm itself, in another rounding order), ORT identical."""
    from quantbridge.demo import export_float
    from quantbridge.zoo import resnet18_style

    model = resnet18_style(num_classes=100, width=16).eval()
    export_float(model, str(tmp_path / "r18.float.onnx"), torch.randn(2, 3, 32, 32))
    imported = qb.import_onnx(tmp_path / "r18.float.onnx")
    calib = [torch.randn(8, 3, 32, 32) for _ in range(4)]
    direct = qb.quantize(model, calib, progress=False, recipe="native")
    via_onnx = qb.quantize(imported, calib, progress=False, recipe="native")
    x = torch.randn(32, 3, 32, 32)
    with torch.no_grad():
        np.testing.assert_allclose(imported(x), model(x), rtol=0, atol=1e-5)
        y_direct, y = direct(x).numpy(), via_onnx(x).numpy()
    step = via_onnx.output_quantizer().scale.item()
    assert (np.abs(y - y_direct) / step <= 1.0 + 1e-3).mean() >= 0.999
    exported = qb.export(via_onnx, tmp_path / "r18.int8.onnx", example_inputs=x[:2])
    assert qb.onnx.float_weights(exported) == []
    (y_ort,) = _ort(tmp_path / "r18.int8.onnx", {"x": x.numpy()})
    steps = np.abs(y_ort - y) / step
    assert (steps <= 1.0 + 1e-3).mean() >= 0.999 and steps.max() <= 2.0 + 1e-3


# -- refusals ------------------------------------------------------------------------------------
def _one_node_model(op: str, domain: str = "", opset: int = 13, **attrs) -> onnx.ModelProto:
    node = helper.make_node(op, ["x"], ["y"], name="my.node.7", domain=domain, **attrs)
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
    )
    imports = [helper.make_opsetid("", opset)] + (
        [helper.make_opsetid(domain, 1)] if domain else []
    )
    return helper.make_model(graph, opset_imports=imports)


def test_unsupported_op_names_node_op_opset_and_supported_list():
    model = _one_node_model("Trilu")
    with pytest.raises(ValueError) as err:
        qb.import_onnx(model)
    message = str(err.value)
    assert "ONNX node 'my.node.7' (op Trilu, opset 13)" in message
    assert "not supported by quantbridge.import_onnx" in message
    assert "supported ops: " in message and "Conv" in message and "Resize" in message


def test_custom_domain_is_refused_with_its_domain():
    with pytest.raises(ValueError, match="in domain 'com.microsoft'"):
        qb.import_onnx(_one_node_model("FusedGemm", domain="com.microsoft"))


def test_inexact_resize_is_refused_at_import():
    node = helper.make_node(
        "Resize", ["x", "", "scales"], ["y"], name="up", mode="linear",
        coordinate_transformation_mode="asymmetric",
    )  # fmt: skip
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 1, 4, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(np.array([1, 1, 2, 2], np.float32), "scales")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    with pytest.raises(ValueError, match=r"'up' \(op Resize, opset 13\).*asymmetric.*supported"):
        qb.import_onnx(model)


def test_external_data_needs_the_path(tmp_path):
    w = np.random.default_rng(0).standard_normal((64, 32)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32])],
        initializer=[numpy_helper.from_array(w, "w")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    path = tmp_path / "m.onnx"
    onnx.save_model(
        model, str(path), save_as_external_data=True, location="m.onnx.data", size_threshold=0
    )
    assert os.path.exists(tmp_path / "m.onnx.data")
    without_data = onnx.load(str(path), load_external_data=False)
    with pytest.raises(ValueError, match="external data.*pass the model's file path"):
        qb.import_onnx(without_data)
    module = qb.import_onnx(path)  # from the path, onnx loads the data from the model's folder
    x = np.random.default_rng(1).standard_normal((2, 64)).astype(np.float32)
    np.testing.assert_allclose(_torch(module, x), x @ w, rtol=1e-5, atol=1e-5)
    assert isinstance(module.mm, nn.Linear)


def test_bad_argument_type():
    with pytest.raises(TypeError, match="path, an onnx.ModelProto or its bytes"):
        qb.import_onnx(42)
