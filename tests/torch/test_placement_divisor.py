"""A divisor stays float (``torch._ops.DIVISOR_INPUTS``): MIT EfficientViT's LiteMLA divides
``out[..., :-1] / (out[..., -1:] + eps)``. With the ``+ eps`` quantized (step ~0.36) the eps was
lost, denominators rounded to 0, 0 / 0 gave NaN, and fake-quant and ONNX Runtime turned that NaN
into codes 131 LSB apart (in an imported replica; quantizing the torch module itself failed in
calibration on the NaN). Checked on the torch module and on its ONNX file imported."""

from __future__ import annotations

import io

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import quantbridge as qb
from quantbridge.onnx import to_onnx
from quantbridge.torch._ops import Role, feeds_divisor_only, op_role

aten = torch.ops.aten


class LiteMLA(nn.Module):
    """MIT EfficientViT's ReLU linear attention (``relu_linear_att``), one small block: the
    padded row of ones in ``v`` makes the last row of ``out`` the normaliser."""

    def __init__(self, dim: int = 16, head_dim: int = 8, eps: float = 1e-15):
        super().__init__()
        self.head_dim, self.eps = head_dim, eps
        self.qkv = nn.Conv2d(dim, 3 * dim, 1)
        self.proj = nn.Conv2d(dim, dim, 1)

    def forward(self, x):
        b, _, h, w = x.shape
        d = self.head_dim
        qkv = self.qkv(x).reshape(b, -1, 3 * d, h * w)
        q, k, v = qkv[:, :, :d], qkv[:, :, d : 2 * d], qkv[:, :, 2 * d :]
        q, k = F.relu(q), F.relu(k)
        v = F.pad(v, (0, 0, 0, 1), mode="constant", value=1)
        out = torch.matmul(torch.matmul(v, k.transpose(-1, -2)), q)
        out = out[:, :, :-1] / (out[:, :, -1:] + self.eps)
        return self.proj(out.reshape(b, -1, h, w))


def _data():
    g = torch.Generator().manual_seed(0)
    calib = [torch.randn(2, 16, 8, 8, generator=g) for _ in range(4)]
    return calib, torch.randn(2, 16, 8, 8, generator=g)


def _float_model():
    torch.manual_seed(0)
    return LiteMLA().eval()


def _imported(model, x):
    buffer = io.BytesIO()
    torch.onnx.export(model, (x,), buffer, dynamo=False, opset_version=17, input_names=["x"])
    return qb.import_onnx(buffer.getvalue(), check_dynamic=False)


def _torch_div(qmodel, x) -> tuple[torch.fx.Node, np.ndarray]:
    """The Div node of the quantized graph and its output, by running the graph node by node."""
    div = next(n for n in qmodel.graph.nodes if n.target is aten.div.Tensor)
    seen = {}

    class Capture(torch.fx.Interpreter):
        def run_node(self, n):
            value = super().run_node(n)
            if n is div:
                seen["div"] = value
            return value

    with torch.no_grad():
        Capture(qmodel).run(x)
    return div, seen["div"].numpy()


def _quantized_upstream(node: torch.fx.Node, stop) -> list[str]:
    """Quantizer calls between ``node`` and the first op ``stop`` accepts, walking inputs."""
    found, stack = [], [node]
    while stack:
        n = stack.pop()
        if n.op == "call_module" and n.target.startswith("_quantbridge"):
            found.append(n.target)
        if n.op == "call_function" and stop(n):
            continue
        stack.extend(n.all_input_nodes)
    return found


def _onnx_div(qmodel, x):
    """ONNX Runtime (graph optimizations off: the node-by-node QDQ reference) on the export:
    the Div's output, and the op types between its divisor and the MatMul that produced it."""
    proto = to_onnx(qmodel, x)
    graph = proto.graph
    div = next(n for n in graph.node if n.op_type == "Div")
    producer = {o: n for n in graph.node for o in n.output}
    chain, tensor = [], div.input[1]
    while tensor in producer and producer[tensor].op_type != "MatMul":
        chain.append(producer[tensor].op_type)
        tensor = producer[tensor].input[0]
    graph.output.append(onnx.helper.make_tensor_value_info(div.output[0], 1, None))
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(
        proto.SerializeToString(), options, providers=["CPUExecutionProvider"]
    )
    (value,) = session.run([div.output[0]], {graph.input[0].name: x.numpy()})
    return value, chain


@pytest.mark.parametrize("source", ["torch", "imported"])
def test_litemla_divisor_stays_float_and_ort_agrees(source):
    calib, x = _data()
    model = _float_model()
    if source == "imported":
        model = _imported(model, x)
    qmodel = qb.quantize(model, calib, "native", progress=False)
    div, torch_value = _torch_div(qmodel, x)
    # the divisor reaches back to the matmul with no quantizer on the way; the numerator has one
    is_matmul = lambda n: n.target is aten.matmul.default  # noqa: E731
    assert _quantized_upstream(div.args[1], is_matmul) == []
    assert _quantized_upstream(div.args[0], is_matmul) != []
    ort_value, chain = _onnx_div(qmodel, x)
    assert "DequantizeLinear" not in chain and "QuantizeLinear" not in chain, chain
    assert np.isfinite(torch_value).all() and np.isfinite(ort_value).all()
    # in steps of the quantizer that reads the quotient (after a reshape): both engines divide
    # the same dequantized numerator by the same float divisor, so they differ by float
    # rounding only (1 LSB allows one code of the numerator's matmul flipped by summation order)
    (reader,) = [u for u in next(iter(div.users)).users if u.op == "call_module"]
    step = float(qmodel.get_submodule(reader.target).scale)
    lsb = np.abs(torch_value - ort_value) / step
    assert lsb.max() <= 1.0, lsb.max()
    with torch.no_grad():
        reference, quantized = model(x), qmodel(x)
    sqnr = 10 * torch.log10(reference.pow(2).sum() / (quantized - reference).pow(2).sum())
    # measured 17.9 dB on both paths (the quotient magnifies the numerator's rounding where the
    # normaliser is small); before, calibration of the torch module failed on the NaN
    assert sqnr > 15.0, float(sqnr)


def _captured(fn, *example):
    class Wrap(nn.Module):
        def forward(self, *args):
            return fn(*args)

    return torch.export.export(Wrap(), example).graph


def _node(graph, target, index=0):
    return [n for n in graph.nodes if n.target is target][index]


def test_rmsnorm_variance_plus_eps_stays_float():
    """Llama's RMSNorm ``x * rsqrt(mean(x^2) + eps)``: the ``+ eps`` feeds a divisor only."""
    graph = _captured(
        lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6), torch.randn(2, 8)
    )
    add = _node(graph, aten.add.Tensor)
    assert feeds_divisor_only(add) and op_role(add) is Role.FLOAT
    assert op_role(_node(graph, aten.mul.Tensor)) is Role.ARITHMETIC


def test_value_read_as_divisor_and_as_operand():
    """``a + b`` feeds a matmul and a divisor: only the divisor read stays float."""
    graph = _captured(
        lambda a, b: ((a + b) @ a) / (a + b + 1.0), torch.randn(4, 4), torch.randn(4, 4)
    )
    first, second = _node(graph, aten.add.Tensor, 0), _node(graph, aten.add.Tensor, 1)
    assert op_role(first) is Role.ARITHMETIC and not feeds_divisor_only(first)
    assert op_role(second) is Role.FLOAT


class MixedReaders(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(4, 4, 1)
        self.head = nn.Conv2d(4, 4, 1)

    def forward(self, x):
        y = F.relu(self.conv(x))
        return self.head(y) + x / (y + 1e-6)


def test_conv_output_read_by_a_divisor_and_a_conv():
    """The conv's output quantizer (after its relu) serves the head conv only; the divisor
    ``y + 1e-6`` reads the relu's float output."""
    g = torch.Generator().manual_seed(3)
    calib = [torch.randn(2, 4, 6, 6, generator=g) for _ in range(2)]
    qmodel = qb.quantize(MixedReaders().eval(), calib, "native", progress=False)
    relu = next(n for n in qmodel.graph.nodes if n.target is aten.relu.default)
    readers = {u.op: u for u in relu.users}
    assert set(readers) == {"call_module", "call_function"}, readers
    assert readers["call_function"].target is aten.add.Tensor  # y + 1e-6, float
    (head,) = readers["call_module"].users  # the quantizer's one reader
    assert head.target is aten.conv2d.default
    with torch.no_grad():
        assert torch.isfinite(qmodel(calib[0] * 0)).all()  # y = relu(bias) may hold zeros


class MixedReadersView(MixedReaders):
    def forward(self, x):
        y = F.relu(self.conv(x))
        return self.head(y.view(y.shape[0], 4, 36).view(y.shape)) + x / (y + 1e-6)


def test_data_movement_after_a_value_also_read_by_a_divisor_keeps_its_grid():
    """The conv's output quantizer serves its non-divisor readers per read (no ``plan.grid``
    entry for the value): a view chain after it still lies on that grid, as data movement does
    (the same quantizer again, ``observe=False``), so the head conv reads int8 codes, not float."""
    g = torch.Generator().manual_seed(3)
    calib = [torch.randn(2, 4, 6, 6, generator=g) for _ in range(2)]
    qmodel = qb.quantize(MixedReadersView().eval(), calib, "native", progress=False)
    relu = next(n for n in qmodel.graph.nodes if n.target is aten.relu.default)
    (grid,) = [u for u in relu.users if u.op == "call_module"]
    assert [u.target for u in relu.users if u.op == "call_function"] == [aten.add.Tensor]
    node = grid
    for _ in range(2):  # each view: the same quantizer again, without observing
        (view,) = node.users
        assert view.target is aten.view.default
        (node,) = view.users
        assert node.op == "call_module" and node.target == grid.target
        assert node.kwargs.get("observe") is False
    (head,) = node.users
    assert head.target is aten.conv2d.default
