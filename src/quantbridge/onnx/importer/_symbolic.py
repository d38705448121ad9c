"""Dynamic dimensions of an imported float model: which input dimensions the ONNX file declares
dynamic, and the watch that names the node that specialises one of them.

A file declares a dimension dynamic with a ``dim_param`` (``"batch"``) or with no ``dim_value``.
``OnnxModule`` computes shapes on python sizes (``SymInt`` under ``torch.export``), so shape
arithmetic normally stays symbolic. Where an op cannot (numpy asked for a concrete size, a guard
on the size), torch's ``ShapeEnv`` replaces the dimension's symbol by the example's size and the
captured model silently runs at that size only. ``SymbolicWatch`` checks the shape environment
after every step of the first trace and warns, naming the ONNX node, its op, the input and the
dimension, so a specialisation is never silent.

``check_at_import`` runs that watch once inside ``import_onnx``, on fake tensors (no data, no
``torch.export``): each declared-dynamic dimension is a fresh symbol (example sizes from
``example_inputs``, else 2 for the first dimension and 64 + i for the others), so the warning
comes at import, before any quantization. It runs under torch's python dispatcher, as
torch.export's trace does: composite ops then take their python decompositions, which keep a
symbolic batch, where the C++ kernels of ``constant_pad_nd`` and ``upsample_*`` guard it to the
example's size (that named pins quantize never makes: EfficientViT-B's ``Pad``, PP-OCRv4 det's
``p2o.Resize.0``). Where the fake run cannot finish (an example size
the graph rejects, a data-dependent op) nothing is said there; the trace in ``quantize`` still
watches.

Elementwise ops stand in for themselves there (``STAND_INS``): a unary op's output is its input
(same shape, dtype and strides; it has no size logic that could pin a dimension), as is that of
batch / layer normalisation and softmax (their parameters span a static axis: a file declaring
that axis dynamic is left to quantize's trace), and an Add / Sub / Mul / Div of two float
operands is the operand of their broadcast shape, or an empty fake of it
(``torch.broadcast_shapes`` makes the guards broadcasting makes, so those pins are still named).
On symbolic shapes torch runs these ops through its Python references, each step recomputing
strides on large sympy expressions (``clamp``: 0.23 s a call under load). ``python -m
bench.import_check`` (load 11, one process, alternating, round 0 / 1): PP-OCRv4 det check 57.7 /
18.9 s -> 3.0 / 3.0 s, rec 62.5 / 43.2 s -> 24.1 / 10.8 s, the same warnings (plain import 0.6-2.3
s there).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import onnx
import torch
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv, StatelessSymbolicContext

from ._registry import operand


class DynamicDimensionWarning(UserWarning):
    """A dimension the ONNX file declares dynamic was specialised while tracing the model."""


def declared_dynamic(graph: onnx.GraphProto, names: list[str]) -> dict[str, dict[int, str]]:
    """``{input name: {dimension: label}}`` for the dimensions of ``names`` that the file leaves
    free (label: the ``dim_param``, or ``"?"`` for an unnamed dimension)."""
    out: dict[str, dict[int, str]] = {}
    for value in graph.input:
        if value.name not in names or not value.type.tensor_type.HasField("shape"):
            continue
        dims = {
            i: d.dim_param or "?"
            for i, d in enumerate(value.type.tensor_type.shape.dim)
            if not d.HasField("dim_value")
        }
        if dims:
            out[value.name] = dims
    return out


class SymbolicWatch:
    """Symbols of the declared-dynamic input dimensions of one trace; ``check(node)`` warns once
    per dimension that the steps so far have pinned to a number."""

    def __init__(self, values: dict[str, Any], declared: dict[str, dict[int, str]]):
        self.symbols: dict[Any, tuple[str, int, str]] = {}
        self.env = None
        for name, dims in declared.items():
            x = values.get(name)
            if not isinstance(x, torch.Tensor):
                continue
            for dim, label in dims.items():
                size = x.shape[dim] if dim < x.ndim else None
                if isinstance(size, torch.SymInt) and size.node.expr.is_symbol:
                    self.env = size.node.shape_env
                    self.symbols[size.node.expr] = (name, dim, label)
        self.seen = self._count()

    def _count(self) -> int:
        return len(getattr(self.env, "replacements", ())) if self.env is not None else 0

    @property
    def active(self) -> bool:
        return bool(self.symbols)

    def check(self, node) -> None:
        count = self._count()
        if count == self.seen:
            return
        self.seen = count
        for symbol, (name, dim, label) in list(self.symbols.items()):
            value = self.env.replacements.get(symbol)
            if value is None or not value.is_number:
                continue
            del self.symbols[symbol]
            warnings.warn(
                f"import_onnx: {node.where()} specialises dimension {dim} of input {name!r}, "
                f"which the ONNX file declares dynamic ({label!r}), to {value}: the captured "
                "model runs at that size only. Quantize with dynamic='none' to accept the fixed "
                "size, or report the node's op so its import keeps the size symbolic",
                DynamicDimensionWarning,
                stacklevel=4,
            )


def check_at_import(module, proto: onnx.ModelProto, examples: dict[str, Any] | None) -> None:
    """Run ``module`` once on fake inputs whose declared-dynamic dimensions are symbols; the
    ``SymbolicWatch`` inside ``module.run`` warns for each one a node pins to a number."""
    declared = module.dynamic_dims
    if not declared:
        return
    mode = FakeTensorMode(shape_env=ShapeEnv(duck_shape=False), allow_non_fake_inputs=True)
    examples = examples or {}
    try:  # best effort: quantize's trace still watches where this cannot run
        inputs = {}
        for value in proto.graph.input:
            if value.name in module.input_names:
                dims = declared.get(value.name, {})
                inputs[value.name] = _fake_input(mode, value, dims, examples.get(value.name))
        if any(x is None for x in inputs.values()):
            return
        # the python dispatcher runs composite ops through their python decompositions, as
        # torch.export's trace does; without it the C++ kernels of constant_pad_nd and
        # upsample_* guard a symbolic batch to the example's size (Eq(s0, 2)), and the check
        # named pins that quantize never makes (EfficientViT's F.pad, every Resize)
        with mode, enable_python_dispatcher(), torch.no_grad():
            module.run(inputs, stand_ins=STAND_INS)
    except Warning:  # our warning under an "error" filter (-W error, pytest): let it out
        raise
    except Exception:  # noqa: BLE001 - an example size the graph rejects, a data-dependent op
        return


def _fake_input(mode: FakeTensorMode, value: onnx.ValueInfoProto, dynamic: dict, example):
    """A fake tensor for one graph input (None where its shape or type is unknown)."""
    t = value.type.tensor_type
    if not t.HasField("shape") or not t.elem_type:
        return None
    sizes = []
    for i, d in enumerate(t.shape.dim):
        if isinstance(example, torch.Tensor) and example.ndim == len(t.shape.dim):
            sizes.append(int(example.shape[i]))
        elif d.dim_value > 0:  # Paddle writes -1 for a free dimension
            sizes.append(d.dim_value)
        else:
            sizes.append(2 if i == 0 else 64 + i)  # distinct, never 0 or 1 (specialised)
    dtype = torch.from_numpy(np.zeros(0, onnx.helper.tensor_dtype_to_np_dtype(t.elem_type))).dtype
    kinds = [DimDynamic.DYNAMIC if i in dynamic else DimDynamic.STATIC for i in range(len(sizes))]
    context = StatelessSymbolicContext(dynamic_sizes=kinds)
    return mode.from_tensor(torch.zeros(sizes, dtype=dtype), symbolic_context=context)


def _same(node, x, *rest):
    """A unary op (or one whose other inputs are scalar bounds): the output is ``x``'s fake."""
    return x if isinstance(x, torch.Tensor) and x.is_floating_point() else None


def _same_single(node, x, *rest):
    """A shape-preserving op over a fixed-size axis (normalisation over channels or the last
    axis, softmax): ``x``'s fake, when the node has one output (not a training-mode form)."""
    return _same(node, x) if len([o for o in node.outputs if o]) == 1 else None


def _broadcast(node, a, b):
    """A float binary op: an empty fake of the broadcast shape (None: run the op itself)."""
    a, b = operand(a), operand(b)  # as the op's handler sees them
    tensors = [v for v in (a, b) if isinstance(v, torch.Tensor)]
    if len({v.dtype for v in tensors}) != 1 or not tensors[0].is_floating_point():
        return None  # integer or mixed types: the op's own promotion decides
    if any(isinstance(v, bool) or not isinstance(v, (torch.Tensor, int, float)) for v in (a, b)):
        return None
    shape = tensors[0].shape
    if len(tensors) == 2 and not _same_sizes(shape, tensors[1].shape):
        shape = torch.broadcast_shapes(shape, tensors[1].shape)
    for t in tensors:  # the output is shaped like an input: that input's fake serves
        if _same_sizes(shape, t.shape):
            return t
    return torch.empty(shape, dtype=tensors[0].dtype)


def _same_sizes(a, b) -> bool:
    """The same sizes, symbols compared by expression (no guard added)."""
    key = lambda n: n.node.expr if isinstance(n, torch.SymInt) else n  # noqa: E731
    return len(a) == len(b) and all(key(x) == key(y) for x, y in zip(a, b, strict=True))


# op type -> function(node, *inputs) giving the fake output, or None to run the op itself
STAND_INS: dict[str, Any] = {
    **{op: _same for op in ("Relu", "Clip", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh",
                            "LeakyRelu", "Elu", "Selu", "Gelu", "Mish", "Softplus", "Exp",
                            "Sqrt", "Abs", "Neg", "Erf", "Reciprocal")},
    **{op: _same_single for op in ("BatchNormalization", "LayerNormalization", "Softmax")},
    **{op: _broadcast for op in ("Add", "Sub", "Mul", "Div")},
}  # fmt: skip
