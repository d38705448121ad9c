"""Values that depend on no model input (parameters, buffers, literals) get no activation quantizer.

Regression for MiniLM: BERT's position-embedding lookup ``embedding(weight, position_ids)`` had a
Q/DQ pair; OpenVINO constant-folds it and then fails to compile the model ("[AddTransformation]
... Check 'index < m_inputs.size()' failed"). Such a value is the same on every run, so there is
nothing to observe either; it stays float and the op reading it quantizes its other inputs.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import quantbridge as qb
from quantbridge.torch._fakequant import BiasQuantizer, Quantizer, WeightQuantizer
from quantbridge.torch._nodes import constant_values
from quantbridge.torch._placement import CONTAINER

HAS_OPENVINO = importlib.util.find_spec("openvino") is not None
aten = torch.ops.aten


class PositionEmbedding(nn.Module):
    """``fc(x + pos(pos_ids))`` with ``pos_ids`` a buffer, as in BERT's embeddings."""

    def __init__(self, seq: int = 16, dim: int = 8):
        super().__init__()
        self.pos = nn.Embedding(seq, dim)
        self.register_buffer("pos_ids", torch.arange(seq)[None], persistent=False)
        self.fc = nn.Linear(dim, 4)

    def forward(self, x):
        return self.fc(x + self.pos(self.pos_ids))


class MovedConstant(nn.Module):
    """A constant through reshape, slice and transpose before a mul and an add."""

    def __init__(self, seq: int = 16, dim: int = 8):
        super().__init__()
        self.table = nn.Parameter(torch.randn(dim * seq * 2))
        self.gain = nn.Parameter(torch.rand(dim) + 0.5)
        self.fc = nn.Linear(dim, 4)

    def forward(self, x):
        pos = self.table.reshape(-1, x.shape[2], 2)[..., 0][: x.shape[1]]  # (seq, dim)
        pos = pos.t().contiguous().t()
        return self.fc((x * self.gain) + pos)


class ClassToken(nn.Module):
    """``fc(cat([cls, x]))`` with ``cls`` a parameter expanded to the batch, as in ViT."""

    def __init__(self, dim: int = 8):
        super().__init__()
        self.cls = nn.Parameter(torch.randn(1, 1, dim) * 4)  # a wider range than x
        self.fc = nn.Linear(dim, 4)

    def forward(self, x):
        return self.fc(torch.cat([self.cls.expand(x.shape[0], -1, -1), x], dim=1))


def _batches(n: int = 4, batch: int = 8) -> list[torch.Tensor]:
    return [torch.randn(batch, 16, 8) for _ in range(n)]


def _quantizer_inputs(qm) -> dict[str, torch.fx.Node]:
    """Name of each activation quantizer's call site -> the value it quantizes."""
    return {
        n.name: n.args[0]
        for n in qm.graph.nodes
        if n.op == "call_module"
        and n.target.startswith(CONTAINER + ".")
        and type(qm.get_submodule(n.target)) is Quantizer
    }


def _constant_tensors(model: onnx.ModelProto) -> set[str]:
    """ONNX tensors computed only from initializers and Constant nodes."""
    graph = model.graph
    const = {i.name for i in graph.initializer}
    for node in graph.node:  # topological order
        if all(i in const for i in node.input if i):
            const.update(node.output)
    return const


def _quantize_linear_on_constants(model: onnx.ModelProto) -> list[str]:
    const = _constant_tensors(model)
    return [
        n.name for n in model.graph.node if n.op_type == "QuantizeLinear" and n.input[0] in const
    ]


def _lsb_error(qm, y_engine: np.ndarray, y_torch: torch.Tensor) -> np.ndarray:
    out_q = qm.output_quantizer()
    return np.abs(y_engine - y_torch.numpy()) / out_q.scale.item()


def _ort(path, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def _openvino(path, x: np.ndarray) -> np.ndarray:
    import openvino

    return openvino.Core().compile_model(str(path), "CPU")({0: x})[0]


# -- placement ---------------------------------------------------------------------------------
def test_position_embedding_stays_float_its_add_and_linear_are_quantized():
    qm = qb.quantize(PositionEmbedding(), _batches(), recipe="native")
    kinds = [p.kind for p in qm.qb_points]
    # x, the add's output (= fc's input) and fc's output; fc's weight and int32 bias
    assert sorted(kinds) == ["activation"] * 3 + ["bias", "weight"]
    assert not any("pos" in p.name and p.kind == "activation" for p in qm.qb_points)
    (add,) = [n for n in qm.graph.nodes if n.target is aten.add.Tensor]
    x_in, pos_in = add.args
    assert x_in.op == "call_module"  # the input x is quantized
    assert pos_in.target is aten.embedding.default  # the lookup stays float
    assert all(v.target is not aten.embedding.default for v in _quantizer_inputs(qm).values())
    (q_add,) = add.users
    assert q_add.op == "call_module" and q_add.kwargs == {}  # an observed output quantizer
    quantizers = qm.quantizers().values()
    assert sum(isinstance(q, WeightQuantizer) for q in quantizers) == 1
    assert sum(isinstance(q, BiasQuantizer) for q in quantizers) == 1


def _constant_targets(model: nn.Module, x: torch.Tensor, dynamic: str = "batch") -> dict:
    """aten op -> whether its (first) node is in ``constant_values``, on the captured graph."""
    from quantbridge.torch._capture import capture

    gm = capture(model, (x,), {}, dynamic)
    const = constant_values(gm.graph)
    out: dict = {}
    for n in gm.graph.nodes:
        if n.op in ("call_function", "get_attr"):
            out.setdefault(n.target, n in const)
    return out


class _Noise(nn.Module):
    def forward(self, x):
        return x + torch.randn(8)


def test_constant_values_are_those_no_input_reaches():
    x = torch.randn(2, 16, 8)
    pe = _constant_targets(PositionEmbedding(), x)
    assert pe["pos.weight"] and pe["pos_ids"] and pe["fc.weight"] and pe["fc.bias"]
    assert pe[aten.embedding.default]  # the lookup of a buffer in a parameter
    assert not pe[aten.add.Tensor] and not pe[aten.linear.default]
    moved = _constant_targets(MovedConstant(), x)
    assert moved[aten.reshape.default] and moved[aten.select.int] and moved[aten.t.default]
    # the batch size is an input: expand(cls, [batch, ...]) depends on x unless shapes are static
    assert not _constant_targets(ClassToken(), x, "batch")[aten.expand.default]
    assert _constant_targets(ClassToken(), x, "none")[aten.expand.default]
    # random values are not constants (and dropout, tagged alike, becomes random under QAT)
    assert not _constant_targets(_Noise(), x)[aten.randn.default]


def test_constant_through_data_movement_gets_no_quantizer_and_no_shared_one():
    torch.manual_seed(0)
    qm = qb.quantize(MovedConstant(), _batches(), recipe="native")
    # activation quantizers: x, x * gain, the add, fc's output - none on the table's path
    quantized = {v.name for v in _quantizer_inputs(qm).values()}
    assert len(quantized) == 4, quantized
    for n in qm.graph.nodes:
        if n.target in (aten.reshape.default, aten.view.default, aten.t.default):
            assert all(u.op != "call_module" for u in n.users), f"{n.name} got a quantizer"
    (mul,) = [n for n in qm.graph.nodes if n.target is aten.mul.Tensor]
    assert mul.args[0].op == "call_module" and mul.args[1].op == "get_attr"  # gain stays float


@pytest.mark.parametrize("dynamic", ["none", "batch"])
def test_cat_is_not_aligned_with_a_constant_input(dynamic):
    torch.manual_seed(0)
    m = ClassToken().eval()
    qm = qb.quantize(m, _batches(), dynamic=dynamic, recipe="native")
    (cat,) = [n for n in qm.graph.nodes if n.target is aten.cat.default]
    (q_out,) = cat.users
    cls_in, x_in = cat.args[0]
    out_q = qm.get_submodule(q_out.target)
    x_q = qm.get_submodule(x_in.target)
    if dynamic == "none":
        # the expanded cls token is a constant: float, and the output is observed on its own
        # (sharing x's quantizer would clip cls, whose range is 4x wider)
        assert cls_in.op == "call_function" and q_out.kwargs == {}
        assert out_q is not x_q
    else:
        # expanded to the batch size of x, the token depends on an input: aligned as before
        assert qm.get_submodule(cls_in.target) is x_q is out_q
        assert q_out.kwargs == {"observe": False}
    x = torch.randn(8, 16, 8)
    with torch.no_grad():
        y, y_ref = qm(x), m(x)
    cos = torch.nn.functional.cosine_similarity(y.flatten(), y_ref.flatten(), dim=0)
    assert cos > 0.999, cos


def test_qat_places_the_same_quantizers_and_trains_the_constant_path():
    torch.manual_seed(0)
    m = PositionEmbedding()
    qm = qb.prepare_qat(m, "native", _batches())
    assert sorted(p.kind for p in qm.qb_points) == ["activation"] * 3 + ["bias", "weight"]
    assert all(v.target is not aten.embedding.default for v in _quantizer_inputs(qm).values())
    loss = qm(torch.randn(8, 16, 8)).square().mean()
    loss.backward()
    grad = qm.get_parameter("pos.weight").grad
    assert grad is not None and grad.abs().sum() > 0


# -- export and engines ------------------------------------------------------------------------
@pytest.fixture(scope="module", params=["position_embedding", "moved_constant", "class_token"])
def exported(request, tmp_path_factory):
    torch.manual_seed(0)
    model, dynamic = {
        "position_embedding": (PositionEmbedding(), "batch"),
        "moved_constant": (MovedConstant(), "batch"),
        "class_token": (ClassToken(), "none"),
    }[request.param]
    qm = qb.quantize(model.eval(), _batches(), dynamic=dynamic, recipe="native")
    path = tmp_path_factory.mktemp("constants") / f"{request.param}.onnx"
    x = torch.randn(8 if dynamic == "none" else 64, 16, 8)
    onnx_model = qb.export(qm, path, x[:8], dynamic=dynamic)
    with torch.no_grad():
        y = qm(x)
    return request.param, qm, path, onnx_model, x, y


def test_export_has_no_quantize_linear_on_constants(exported):
    _, _, _, model, _, _ = exported
    assert _quantize_linear_on_constants(model) == []
    assert sum(n.op_type == "QuantizeLinear" for n in model.graph.node) >= 3


def test_onnxruntime_agrees_within_one_lsb(exported):
    _, qm, path, _, x, y = exported
    err = _lsb_error(qm, _ort(path, x.numpy()), y)
    assert err.max() <= 1.0 + 1e-3, err.max()


@pytest.mark.skipif(not HAS_OPENVINO, reason="openvino not installed (the 'bench' extra)")
def test_openvino_compiles_and_runs(exported, request):
    name, qm, path, _, x, y = exported
    if name == "class_token":
        # not about constants: OpenVINO 2026.4 fails the same way on ``linear(cat([a, b]))`` with
        # two model inputs ("[MatMulTransformation] ... cannot be broadcasted"), and did so
        # before this change with the class token quantized
        request.applymarker(
            pytest.mark.xfail(raises=RuntimeError, strict=True, reason="OpenVINO cat -> linear")
        )
    y_ov = _openvino(path, x.numpy())
    err = _lsb_error(qm, y_ov, y)
    assert err.max() <= 1.0 + 1e-3, err.max()
