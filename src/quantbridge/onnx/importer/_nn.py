"""Layer ops of ``import_onnx``: Conv, ConvTranspose, BatchNormalization, Gemm, MatMul,
LayerNormalization as real ``nn.Module`` layers when their weights are constants; instance norm.

Layers (``LayerSpec``): the constant weight becomes the module's ``nn.Parameter``, so the captured
graph has ``aten.conv2d(x, <get_attr weight>)`` / ``aten.linear`` as a hand-written model has, and
quantbridge's placement quantizes it per channel. With a run-time weight the op runs functionally.

* Conv: ``nn.Conv{1,2,3}d``; symmetric ``pads`` are the module's ``padding``; asymmetric pads and
  ``auto_pad=SAME_*`` become an explicit ``F.pad`` before the module (zeros, as ONNX).
* ConvTranspose: ``nn.ConvTranspose{1,2,3}d`` with ``padding = min(begin, end)`` and
  ``output_padding``; asymmetric pads are cropped after it; ``output_shape`` / ``auto_pad`` are
  converted to pads from the input size (ONNX's formula, SAME_UPPER puts the odd pixel last).
* Gemm ``Y = alpha * A' @ B' + beta * C`` with constant ``B``: ``nn.Linear`` with
  ``weight = alpha * B'^T`` and, when ``C`` is a constant of N values (or one), ``bias = beta * C``.
* MatMul ``A @ B`` with a constant 2-D ``B``: ``nn.Linear(K, N, bias=False)`` with ``weight = B^T``.
* BatchNormalization: ``nn.BatchNorm{1,2,3}d`` by the input's rank (inference form;
  ``momentum_torch = 1 - momentum_onnx``).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from ._registry import LayerSpec, OnnxNode, as_tensor, register


def _parameter(array: np.ndarray) -> nn.Parameter:
    return nn.Parameter(torch.from_numpy(np.array(array, dtype=array.dtype, copy=True)))


def _const(node: OnnxNode, consts: dict, i: int) -> np.ndarray | None:
    return consts.get(node.inputs[i]) if i < len(node.inputs) and node.inputs[i] else None


def _has(node: OnnxNode, i: int) -> bool:
    return i < len(node.inputs) and bool(node.inputs[i])


def _with_parameters(module: nn.Module, weight: np.ndarray, bias: np.ndarray | None):
    """``module`` holding ``weight`` (and ``bias``, if any) as its own Parameters."""
    module.weight = _parameter(weight)
    if bias is not None:
        module.bias = _parameter(bias)
    return module


# -- padding -------------------------------------------------------------------------------------
def onnx_pads(node: OnnxNode, x, kernel, strides, dilations) -> list:
    """ONNX pads ``[b_1..b_k, e_1..e_k]`` for the spatial dims of ``x`` (``auto_pad`` applied)."""
    k = len(kernel)
    auto = node.attr("auto_pad", "NOTSET")
    if auto in ("NOTSET", ""):
        return list(node.attr("pads", [0] * 2 * k))
    if auto == "VALID":
        return [0] * 2 * k
    begin, end = [], []
    for i in range(k):
        n = x.shape[2 + i]
        out = -(-n // strides[i])
        total = max((out - 1) * strides[i] + (kernel[i] - 1) * dilations[i] + 1 - n, 0)
        small, big = total // 2, total - total // 2
        begin.append(small if auto == "SAME_UPPER" else big)
        end.append(big if auto == "SAME_UPPER" else small)
    return begin + end


def static_padding(node: OnnxNode, k: int) -> tuple[int, ...] | None:
    """The symmetric padding a torch module can do itself, or None (pad explicitly)."""
    auto = node.attr("auto_pad", "NOTSET")
    if auto == "VALID":
        return (0,) * k
    if auto not in ("NOTSET", ""):
        return None
    pads = list(node.attr("pads", [0] * 2 * k))
    return tuple(pads[:k]) if pads[:k] == pads[k:] else None


def torch_pads(pads: list) -> list:
    """ONNX ``[b_1..b_k, e_1..e_k]`` -> ``F.pad``'s ``[b_k, e_k, ..., b_1, e_1]``."""
    k = len(pads) // 2
    out: list = []
    for i in reversed(range(k)):
        out += [pads[i], pads[k + i]]
    return out


def geometry(node: OnnxNode, kernel) -> tuple[list[int], list[int]]:
    k = len(kernel)
    return list(node.attr("strides", [1] * k)), list(node.attr("dilations", [1] * k))


# -- Conv ----------------------------------------------------------------------------------------
_CONV = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}
_CONV_T = {1: nn.ConvTranspose1d, 2: nn.ConvTranspose2d, 3: nn.ConvTranspose3d}


def _conv_operands(node: OnnxNode, consts: dict):
    """``(w, b, k, strides, dilations, group)`` of a Conv or ConvTranspose whose weight (and
    bias, if given) are constants of a rank torch has a module for; None otherwise."""
    w, b = _const(node, consts, 1), _const(node, consts, 2)
    if w is None or (_has(node, 2) and b is None) or w.ndim - 2 not in _CONV:
        return None
    strides, dilations = geometry(node, w.shape[2:])
    return w, b, w.ndim - 2, strides, dilations, node.attr("group", 1)


def _build_conv(node: OnnxNode, consts: dict):
    operands = _conv_operands(node, consts)
    if operands is None:
        return None
    w, b, k, strides, dilations, group = operands
    padding = static_padding(node, k)
    module = nn.utils.skip_init(
        _CONV[k],
        w.shape[1] * group,
        w.shape[0],
        tuple(w.shape[2:]),
        stride=tuple(strides),
        padding=padding if padding is not None else 0,
        dilation=tuple(dilations),
        groups=group,
        bias=b is not None,
    )
    return _with_parameters(module, w, b), (1, 2)


def _call_conv(node: OnnxNode, module: nn.Module, x):
    if static_padding(node, len(module.kernel_size)) is None:
        pads = onnx_pads(node, x, module.kernel_size, module.stride, module.dilation)
        x = F.pad(x, torch_pads(pads))
    return module(x)


@register("Conv", layer=LayerSpec(_build_conv, _call_conv))
def _conv(node, x, w, b=None):
    w = as_tensor(w)
    k = w.ndim - 2
    strides, dilations = geometry(node, w.shape[2:])
    x = F.pad(x, torch_pads(onnx_pads(node, x, w.shape[2:], strides, dilations)))
    conv = (F.conv1d, F.conv2d, F.conv3d)[k - 1]
    return conv(x, w, as_tensor(b), strides, 0, dilations, node.attr("group", 1))


# -- ConvTranspose -------------------------------------------------------------------------------
def _transpose_pads(node: OnnxNode, x, w_shape) -> tuple[list, list]:
    """(pads, output_padding) of a ConvTranspose for input ``x`` (ONNX's formulas)."""
    kernel = list(w_shape[2:])
    k = len(kernel)
    strides, dilations = geometry(node, kernel)
    out_pad = list(node.attr("output_padding", [0] * k))
    shape = node.attr("output_shape")
    auto = node.attr("auto_pad", "NOTSET")
    if shape is None and auto in ("NOTSET", "", "VALID"):
        pads = [0] * 2 * k if auto == "VALID" else list(node.attr("pads", [0] * 2 * k))
        return pads, out_pad
    shape = list(shape)[-k:] if shape is not None else None
    begin, end = [], []
    for i in range(k):
        n = x.shape[2 + i]
        target = shape[i] if shape is not None else n * strides[i]
        total = strides[i] * (n - 1) + out_pad[i] + (kernel[i] - 1) * dilations[i] + 1 - target
        if isinstance(total, int) and total < 0:
            raise ValueError(
                f"{node.where()}: output_shape {shape} is larger than the transposed "
                "convolution's full output; use output_padding instead"
            )
        small, big = total // 2, total - total // 2  # ONNX: SAME_UPPER puts the odd pixel last
        upper = auto == "SAME_UPPER" or (shape is None and auto != "SAME_LOWER")
        begin.append(small if upper else big)
        end.append(big if upper else small)
    return begin + end, out_pad


def _build_conv_transpose(node: OnnxNode, consts: dict):
    operands = _conv_operands(node, consts)
    if operands is None:
        return None
    w, b, k, strides, dilations, group = operands
    static = node.attr("output_shape") is None and node.attr("auto_pad", "NOTSET") in (
        "NOTSET",
        "",
        "VALID",
    )
    pads, out_pad = _transpose_pads(node, None, w.shape) if static else ([0] * 2 * k, [0] * k)
    module = nn.utils.skip_init(
        _CONV_T[k],
        w.shape[0],
        w.shape[1] * group,
        tuple(w.shape[2:]),
        stride=tuple(strides),
        padding=tuple(min(pads[i], pads[k + i]) for i in range(k)),
        output_padding=tuple(out_pad),
        groups=group,
        bias=b is not None,
        dilation=tuple(dilations),
    )
    return _with_parameters(module, w, b), (1, 2)


def _crop(node: OnnxNode, y, pads: list, done: tuple):
    """Remove what the module's symmetric ``padding`` (``done``) did not."""
    k = len(pads) // 2
    index = [slice(None)] * 2
    for i in range(k):
        b, e = pads[i] - done[i], pads[k + i] - done[i]
        if b < 0 or e < 0:
            raise ValueError(
                f"{node.where()}: output_shape larger than the full transposed convolution is not supported"
            )
        index.append(slice(b, y.shape[2 + i] - e))
    return y[tuple(index)]


def _call_conv_transpose(node: OnnxNode, module: nn.Module, x):
    pads, _ = _transpose_pads(node, x, (0, 0, *module.kernel_size))
    y = module(x)
    if any(p != module.padding[i % len(module.padding)] for i, p in enumerate(pads)):
        y = _crop(node, y, pads, module.padding)
    return y


@register("ConvTranspose", layer=LayerSpec(_build_conv_transpose, _call_conv_transpose))
def _conv_transpose(node, x, w, b=None):
    w = as_tensor(w)
    k = w.ndim - 2
    strides, dilations = geometry(node, w.shape[2:])
    pads, out_pad = _transpose_pads(node, x, w.shape)
    fn = (F.conv_transpose1d, F.conv_transpose2d, F.conv_transpose3d)[k - 1]
    y = fn(x, w, as_tensor(b), strides, 0, out_pad, node.attr("group", 1), dilations)
    return _crop(node, y, pads, (0,) * k)


# -- Gemm / MatMul -------------------------------------------------------------------------------
def _linear(weight: np.ndarray, bias: np.ndarray | None) -> nn.Linear:
    module = nn.utils.skip_init(nn.Linear, weight.shape[1], weight.shape[0], bias=bias is not None)
    return _with_parameters(module, weight, bias)


def _build_gemm(node: OnnxNode, consts: dict):
    b = _const(node, consts, 1)
    if b is None or b.ndim != 2 or _const(node, consts, 0) is not None:
        return None
    alpha, beta = node.attr("alpha", 1.0), node.attr("beta", 1.0)
    weight = (b if node.attr("transB", 0) else b.T) * np.asarray(alpha, dtype=b.dtype)
    c = _const(node, consts, 2)
    bias = None
    if (
        c is not None
        and c.size in (1, weight.shape[0])
        and c.ndim <= 2
        and c.shape[:-1] in ((), (1,))
    ):
        bias = np.broadcast_to(c.reshape(-1) * np.asarray(beta, dtype=c.dtype), (weight.shape[0],))
    return _linear(weight, bias), (1, 2) if bias is not None else (1,)


def _call_gemm(node: OnnxNode, module: nn.Module, a, c=None):
    if node.attr("transA", 0):
        a = a.t()
    y = module(a)
    if c is not None:
        y = y + node.attr("beta", 1.0) * as_tensor(c)
    return y


@register("Gemm", layer=LayerSpec(_build_gemm, _call_gemm))
def _gemm(node, a, b, c=None):
    a, b = as_tensor(a), as_tensor(b)
    a = a.t() if node.attr("transA", 0) else a
    b = b.t() if node.attr("transB", 0) else b
    y = a @ b
    if node.attr("alpha", 1.0) != 1.0:
        y = y * node.attr("alpha")
    if c is not None:
        y = y + node.attr("beta", 1.0) * as_tensor(c)
    return y


def _build_matmul(node: OnnxNode, consts: dict):
    b = _const(node, consts, 1)
    if b is None or b.ndim != 2 or _const(node, consts, 0) is not None:
        return None
    return _linear(b.T, None), (1,)


@register("MatMul", layer=LayerSpec(_build_matmul, lambda node, module, a: module(a)))
def _matmul(node, a, b):
    return torch.matmul(as_tensor(a), as_tensor(b))


# -- normalization -------------------------------------------------------------------------------
class BatchNormAnyRank(nn.modules.batchnorm._BatchNorm):
    """A batch norm for inputs whose rank shape inference did not tell."""

    def _check_input_dim(self, input):
        if input.dim() < 2:
            raise ValueError(f"expected an input of rank >= 2, got {input.dim()}")


_BATCH_NORM = {2: nn.BatchNorm1d, 3: nn.BatchNorm1d, 4: nn.BatchNorm2d, 5: nn.BatchNorm3d}


def _check_batch_norm(node: OnnxNode) -> None:
    if node.attr("training_mode", 0) or node.attr("spatial", 1) != 1:
        raise ValueError(
            f"{node.where()}: training_mode=1 or spatial=0 batch norms are not supported; export "
            "the model in inference mode"
        )
    if any(node.outputs[1:]):
        raise ValueError(f"{node.where()}: the running-statistics outputs are not supported")


def _build_batch_norm(node: OnnxNode, consts: dict):
    params = [_const(node, consts, i) for i in (1, 2, 3, 4)]
    if any(p is None for p in params) or _const(node, consts, 0) is not None:
        return None
    scale, bias, mean, var = params
    cls = _BATCH_NORM.get(node.ranks[0] if node.ranks else None, BatchNormAnyRank)
    momentum = 1.0 - node.attr("momentum", 0.9)
    module = cls(scale.shape[0], eps=node.attr("epsilon", 1e-5), momentum=momentum)
    _with_parameters(module, scale, bias)
    module.running_mean = torch.from_numpy(np.array(mean, copy=True))
    module.running_var = torch.from_numpy(np.array(var, copy=True))
    return module.eval(), (1, 2, 3, 4)


@register(
    "BatchNormalization",
    layer=LayerSpec(_build_batch_norm, lambda node, module, x: module(x)),
    check=_check_batch_norm,
)
def _batch_norm(node, x, scale, bias, mean, var):
    args = [as_tensor(v) for v in (mean, var, scale, bias)]
    return F.batch_norm(
        x, args[0], args[1], args[2], args[3], False, 0.0, node.attr("epsilon", 1e-5)
    )


@register("InstanceNormalization", since=6)
def _instance_norm(node, x, scale, bias):
    return F.instance_norm(
        x, weight=as_tensor(scale), bias=as_tensor(bias), eps=node.attr("epsilon", 1e-5)
    )


def _build_layer_norm(node: OnnxNode, consts: dict):
    scale, bias = _const(node, consts, 1), _const(node, consts, 2)
    last = node.attr("axis", -1) in (-1, (node.ranks[0] or 0) - 1)
    if scale is None or (_has(node, 2) and bias is None) or not last or scale.ndim != 1:
        return None
    module = nn.LayerNorm(scale.shape[0], eps=node.attr("epsilon", 1e-5), bias=bias is not None)
    return _with_parameters(module, scale, bias), (1, 2)


def _check_layer_norm(node: OnnxNode) -> None:
    if any(node.outputs[1:]):
        raise ValueError(f"{node.where()}: the Mean / InvStdDev outputs are not supported")


@register(
    "LayerNormalization",
    since=17,
    layer=LayerSpec(_build_layer_norm, lambda node, module, x: module(x)),
    check=_check_layer_norm,
)
def _layer_norm(node, x, scale, bias=None):
    axis = node.attr("axis", -1)
    axis = axis + node.rank(0, x) if axis < 0 else axis
    return F.layer_norm(
        x, x.shape[axis:], as_tensor(scale), as_tensor(bias), node.attr("epsilon", 1e-5)
    )
