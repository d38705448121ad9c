"""Size arithmetic of legacy-exported (TorchScript, ``dynamo=False``) models keeps the dynamic batch
through import, quantize and export (issue 12 part 5, the EfficientViT case).

timm's ``efficientvit_m0`` (LocalWindowAttention) pads its feature map to a multiple of the window
with ``pad_b = (ws - H % ws) % ws``; the legacy exporter writes that as ``Shape -> Gather -> Mod ->
Sub -> Mod -> Unsqueeze -> Concat -> Pad``. A 0-d size that reached a torch-mode op went through
``np.ascontiguousarray``, which returns 0-d arrays as 1-d: the size became shape ``(1,)``, its
``Unsqueeze`` ``(1, 1)``, and the ``Concat`` of the pad amounts failed at any batch (reproduced with
timm 1.0.31 at commit 606d6eb^, where ``Mod`` had no numpy form). The same happens today to any
size passing an op without a numpy form (``Sqrt`` below, ``Not`` of legacy floor division before
it got one). The window replica also pads through a ``Pad`` whose ``constant_value`` input is left
empty, which failed (``float(None)``) whenever the pad was not zero.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import TensorProto, helper, numpy_helper
from torch import nn

import quantbridge as qb
from quantbridge.onnx.importer._registry import as_tensor
from quantbridge.onnx.importer._symbolic import DynamicDimensionWarning


class _WindowAttention(nn.Module):
    """timm ``efficientvit_msra.LocalWindowAttention``'s shape logic around a 1x1 conv standing
    in for the cascaded attention: pad to whole windows, partition, attend, reverse, crop."""

    def __init__(self, channels: int = 8, window: int = 3):
        super().__init__()
        self.window = window
        self.stem = nn.Conv2d(3, channels, 3, 2, 1)
        self.attn = nn.Conv2d(channels, channels, 1)

    def forward(self, x):
        x = self.stem(x)
        B, C, H, W = x.shape
        ws = self.window
        x = x.permute(0, 2, 3, 1)
        pad_b = (ws - H % ws) % ws
        pad_r = (ws - W % ws) % ws
        x = F.pad(x, (0, 0, 0, pad_r, 0, pad_b))
        pH, pW = H + pad_b, W + pad_r
        nH, nW = pH // ws, pW // ws
        x = x.view(B, nH, ws, nW, ws, C).transpose(2, 3)
        x = x.reshape(B * nH * nW, ws, ws, C).permute(0, 3, 1, 2)
        x = self.attn(x).relu()
        x = x.permute(0, 2, 3, 1).view(B, nH, nW, ws, ws, C)
        x = x.transpose(2, 3).reshape(B, pH, pW, C)
        return x[:, :H, :W].contiguous().permute(0, 3, 1, 2)


class _FloorDivResize(nn.Module):
    """Sizes halved with ``torch.div(h, 2, rounding_mode="floor")`` (legacy: ``Div, Mod, Less,
    Xor, Not, And, Where``) and ``//``, read by ``interpolate``: ``Not`` ran in torch, the
    sizes became tensors, then ``(1, 1)`` after their Unsqueeze."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, 2, 1)

    def forward(self, x):
        y = self.stem(x)
        h, w = y.shape[2], y.shape[3]
        z = F.interpolate(y, size=(torch.div(h, 2, rounding_mode="floor"), w // 2))
        return F.interpolate(z, size=(h, w)) + y


class _LinearAttention(nn.Module):
    """timm ``efficientvit_mit.LiteMLA``'s shapes: ``reshape(B, -1, 3 * C, H * W)``, ``v`` padded
    with ones (``F.pad(v, (0, 1), value=1)``), the ratio of the last column."""

    def __init__(self, channels: int = 8):
        super().__init__()
        self.channels = channels
        self.stem = nn.Conv2d(3, channels, 3, 2, 1)
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)

    def forward(self, x):
        x = self.stem(x)
        B, _, H, W = x.shape
        qkv = self.qkv(x).reshape(B, -1, 3 * self.channels, H * W).transpose(-1, -2)
        q, k, v = qkv.chunk(3, dim=-1)
        v = F.pad(v, (0, 1), mode="constant", value=1.0)
        out = q.relu() @ (k.relu().transpose(-1, -2) @ v)
        out = out[..., :-1] / (out[..., -1:] + 1e-15)
        return out.transpose(-1, -2).reshape(B, -1, H, W)


def _legacy_export(model: nn.Module, path: str, size: int) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the TorchScript exporter's deprecation notice
        torch.onnx.export(model, (torch.randn(2, 3, size, size),), path, dynamo=False,
                          opset_version=17, input_names=["x"],
                          dynamic_axes={"x": {0: "batch"}})  # fmt: skip


@pytest.mark.parametrize(
    "make, ops",
    [(_WindowAttention, {"Mod", "Pad"}), (_FloorDivResize, {"Not", "Where", "Resize"})],
    ids=["efficientvit_m_window", "floor_div_resize"],
)
def test_legacy_size_arithmetic_keeps_the_dynamic_batch(tmp_path, make, ops):
    torch.manual_seed(0)
    model = make().eval()
    path = str(tmp_path / "float.onnx")
    _legacy_export(model, path, 28)  # 14x14 features: the 3x3 windows need a pad of 1
    assert ops <= {n.op_type for n in onnx.load(path).graph.node}  # the pattern is exported
    with warnings.catch_warnings(record=True) as caught:  # recorded: the import check
        warnings.simplefilter("always")  # catches every error, a warning raised as one too
        imported = qb.import_onnx(path)
    assert not [w for w in caught if issubclass(w.category, DynamicDimensionWarning)]
    with warnings.catch_warnings():
        warnings.simplefilter("error", DynamicDimensionWarning)  # nothing pins the batch
        rng = torch.Generator().manual_seed(1)
        calib = [torch.randn(2, 3, 28, 28, generator=rng) for _ in range(2)]
        qmodel = qb.quantize(imported, calib, recipe="native")
    out = str(tmp_path / "int8.onnx")
    qb.export(qmodel, out, example_inputs=calib[0])
    session, step = _node_by_node(out)
    for batch in (1, 2):
        x = torch.randn(batch, 3, 28, 28, generator=rng)
        with torch.no_grad():
            # same float32 ops in the same order as the model
            torch.testing.assert_close(imported(x), model(x), rtol=0, atol=1e-6)
            expected = qmodel(x).numpy()
        got = session.run(None, {"x": x.numpy()})[0]
        assert got.shape == expected.shape == (batch, 8, 14, 14)
        # the same codes, but for a code flipped where torch's and ORT's float32 conv sums
        # straddle a rounding boundary (measured: 0 or 1 element of 1568-3136, one step)
        codes = np.abs(got - expected) / step
        assert codes.max() <= 1.0 + 1e-3 and np.mean(codes > 0.5) < 0.01


class _BatchCentred(nn.Module):
    """A feature map minus its batch mean, ``y.sum(0) / y.shape[0]``: a size read as a tensor."""

    def __init__(self):
        super().__init__()
        self.stem = nn.Conv2d(3, 8, 3, 2, 1)

    def forward(self, x):
        y = self.stem(x)
        return y - y.sum(0, keepdim=True) / y.shape[0]


def test_a_size_read_as_a_tensor_exports(tmp_path):
    """``Div(y, Cast(Shape(y)[0]))`` makes the symbolic batch a tensor (``torch.tensor`` of a
    SymInt: an in-place ``detach_`` in the captured graph). The one-trace export's verifier
    refused that graph with SpecViolationError instead of tracing again."""
    torch.manual_seed(0)
    model = _BatchCentred().eval()
    path = str(tmp_path / "centred.onnx")
    _legacy_export(model, path, 16)
    rng = torch.Generator().manual_seed(1)
    calib = [torch.randn(2, 3, 16, 16, generator=rng) for _ in range(2)]
    qmodel = qb.quantize(qb.import_onnx(path), calib, recipe="native")
    out = str(tmp_path / "centred.int8.onnx")
    qb.export(qmodel, out, example_inputs=calib[0])
    session, step = _node_by_node(out)
    for batch in (1, 3):
        x = torch.randn(batch, 3, 16, 16, generator=rng)
        with torch.no_grad():
            expected = qmodel(x).numpy()
        got = session.run(None, {"x": x.numpy()})[0]
        assert got.shape == expected.shape == (batch, 8, 8, 8)
        codes = np.abs(got - expected) / step  # as above: at most a flipped code at a tie
        assert codes.max() <= 1.0 + 1e-3 and np.mean(codes > 0.5) < 0.01


def _node_by_node(path: str) -> tuple[ort.InferenceSession, float]:
    """ONNX Runtime on ``path`` node by node (the file's QDQ arithmetic, exactly), and the step
    of its output's grid."""
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])
    return session, _output_step(onnx.load(path))


def _output_step(model: onnx.ModelProto) -> float:
    """The scale of the DequantizeLinear that writes the graph output (through data movement)."""
    producer = {o: n for n in model.graph.node for o in n.output}
    constants = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    node = producer[model.graph.output[0].name]
    while node.op_type != "DequantizeLinear":
        node = producer[node.input[0]]
    return float(constants[node.input[1]])


def test_efficientvit_b_attention_import_names_no_pin(tmp_path):
    """The import-time check ran ``Pad`` (and ``Resize``) through C++ fake kernels that guard
    a symbolic batch to the example's size, so it warned that LiteMLA's ``/Pad`` pins the batch,
    where quantize's trace keeps it symbolic; it now traces as torch.export does."""
    torch.manual_seed(0)
    model = _LinearAttention().eval()
    path = str(tmp_path / "lite_mla.onnx")
    _legacy_export(model, path, 16)
    with warnings.catch_warnings(record=True) as caught:  # recorded: the check catches errors
        warnings.simplefilter("always")
        imported = qb.import_onnx(path)
    assert not [w for w in caught if issubclass(w.category, DynamicDimensionWarning)]
    for batch in (1, 3):
        x = torch.randn(batch, 3, 16, 16)
        with torch.no_grad():
            torch.testing.assert_close(imported(x), model(x), rtol=1e-5, atol=1e-5)


def _sqrt_of_size_model() -> onnx.ModelProto:
    """``Reshape(x, [-1, int(sqrt(float(Shape(x)[1])))])``: a size through ``Sqrt``, an op with
    no numpy form, so it runs in torch on a 0-d size."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "one"], ["n"], axis=0),
        helper.make_node("Cast", ["n"], ["nf"], to=TensorProto.FLOAT),
        helper.make_node("Sqrt", ["nf"], ["rf"], name="root"),
        helper.make_node("Cast", ["rf"], ["r"], to=TensorProto.INT64),
        helper.make_node("Unsqueeze", ["r", "zero_axis"], ["r1"], name="root_1d"),
        helper.make_node("Concat", ["minus_one", "r1"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["y"]),
    ]
    consts = {
        "one": np.array(1, np.int64),
        "zero_axis": np.array([0], np.int64),
        "minus_one": np.array([-1], np.int64),
    }
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 16])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        initializer=[numpy_helper.from_array(v, k) for k, v in consts.items()],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_scalar_size_stays_scalar_in_torch():
    assert as_tensor(np.array(7, np.int64)).shape == ()  # was (1,)
    model = _sqrt_of_size_model()
    imported = qb.import_onnx(model, check_dynamic=False)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    for batch in (1, 3):
        x = np.arange(batch * 16, dtype=np.float32).reshape(batch, 16)
        (expected,) = session.run(None, {"x": x})
        assert expected.shape == (batch * 4, 4)
        np.testing.assert_array_equal(imported(torch.from_numpy(x)).numpy(), expected)
