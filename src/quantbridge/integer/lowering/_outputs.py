"""The program's boundary options: static input shapes and float graph outputs.

* ``with_input_shapes``: a copy of the model whose graph inputs have the given static shapes, so
  that shape inference gives every averaged or reshaped dimension a size (a global average pool
  over a dynamic H x W has no fixed ``1 / (H W)`` rescale in an integer program);
* ``graph_outputs``: the output boundaries. An output that is the dequantized codes of a program
  tensor is dequantized by ``run``. One that the graph computes in float from the codes (a final
  Sigmoid after the last QuantizeLinear) is refused with ``float_outputs="refuse"``; with
  ``float_outputs="dequantize"`` (the default: ``qb.quantize``'s default recipe keeps the
  logits float, see ``quantbridge.recipe``) the program ends at the codes, and the float conversion is a 2**bits-entry float32 table of
  the function (float64, then rounded to float32) applied outside the integer program
  (``Boundary.to_float``; the ONNX and C emitters output the codes). A float output of an
  integer kernel whose real range is bounded by its own constants (a final LayerNormalization:
  ``|y_i| <= |gamma_i| sqrt(N) + |beta_i|``, ``Pending.bound``; nn.TransformerEncoder ends with
  one) or by its input's range (an average pool / mean: a backbone's pooled features, of codes
  or of a bounded float result: Swin's mean of its final layer norm, EfficientNet's of a SiLU) is
  realized inside the program on a symmetric int16 grid of scale ``bound / 32767`` and
  dequantized outside it; ``_core.BOUNDED_BITS`` says why 16 bits. A float output written by a weighted
  layer (Conv, ConvTranspose, Gemm, MatMul with no QuantizeLinear after it: classification
  logits of ``Recipe(quantize_outputs=False)``) ends the program at the layer's int32
  accumulator, bias included (identity requantization: multiplier 1, shift 0), and its float32
  scale ``s_x * s_w[c]``, per tensor or per output channel, is recorded in the ``Boundary``
  (``Boundary.scale``) and applied outside the program; a Relu after the layer clamps the codes
  at 0 (a Clip to other bounds only with one scale for all channels). Data movement between the
  layer and the output (a Linear's output reshaped) moves the accumulator, and per-channel
  scales follow the channel axis where the movement keeps one (``_movement``).
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import numpy as np
import onnx

from .._program import Boundary
from ._core import (
    Builder,
    Elementwise,
    IndexValue,
    LoweringError,
    Pending,
    QValue,
    Value,
    node_name,
    realize_bounded,
)

FLOAT_OUTPUTS = ("refuse", "dequantize")


def with_input_shapes(
    model: onnx.ModelProto, input_shapes: Mapping[str, tuple[int, ...]] | None
) -> onnx.ModelProto:
    """``model``, or a copy whose named graph inputs have the given static shapes."""
    if not input_shapes:
        return model
    inputs = {vi.name: vi for vi in model.graph.input}
    unknown = sorted(set(input_shapes) - set(inputs))
    if unknown:
        raise ValueError(f"input_shapes names {unknown}; the graph's inputs are {sorted(inputs)}")
    model = copy.deepcopy(model)
    for vi in model.graph.input:
        if vi.name not in input_shapes:
            continue
        shape = [int(d) for d in input_shapes[vi.name]]
        dims = vi.type.tensor_type.shape.dim
        if len(dims) != len(shape):
            raise ValueError(
                f"input_shapes[{vi.name!r}] has {len(shape)} dims; the input has {len(dims)}"
            )
        for d, size in zip(dims, shape, strict=True):
            if d.HasField("dim_value") and d.dim_value > 0 and d.dim_value != size:
                raise ValueError(
                    f"input_shapes[{vi.name!r}] = {tuple(shape)} conflicts with the input's "
                    f"static dimension {d.dim_value}"
                )
            d.Clear()
            d.dim_value = size
    return model


def _float_table(v: Elementwise) -> np.ndarray:
    codes = np.arange(v.source.qmin, v.source.qmax + 1, dtype=np.int64)
    with np.errstate(all="ignore"):
        real = v.fn((codes - v.source.zero_point) * np.float64(v.source.scale))
    return np.broadcast_to(np.asarray(real, np.float64), codes.shape).astype(np.float32)


def _bounded_output(b: Builder, name: str, v: Pending) -> Boundary:
    """A bounded float result realized on a symmetric int16 grid covering ``[-bound, bound]``
    (narrowed by a Relu / Clip after it), dequantized outside the program."""
    return Boundary(name, realize_bounded(b, name, v), True)


def _accumulator_output(b: Builder, name: str, v: Pending) -> Boundary | None:
    """The layer's int32 accumulator as the program output (module docstring); None when a
    Clip after it is not expressible on the codes (per-channel scales, bounds other than 0)."""
    acc = v.accumulator
    scale = np.asarray(acc.scale, np.float64).reshape(-1).astype(np.float32)
    top = 2**31 - 1
    dtype = np.int32 if acc.bound <= top else np.int64  # accumulator_bits=64 (C refuses it)
    if acc.bound > top:
        top = 2**63 - 1
    uniform = bool(np.all(scale == scale[0]))
    scale = scale[:1] if uniform else scale  # per tensor: one value
    if not uniform and (v.lo not in (-np.inf, 0.0) or v.hi != np.inf):
        return None
    out = b.tensor(name, dtype, float(scale.max()), 0)
    step = np.float64(scale[0])
    lo = -top if v.lo == -np.inf else max(-top, int(np.rint(v.lo / step)))
    hi = top if v.hi == np.inf else min(top, int(np.rint(v.hi / step)))
    acc.write(b, out, lo, max(lo, hi))
    return Boundary(name, out, True, scale=scale, axis=acc.axis)


def graph_outputs(
    graph: onnx.GraphProto,
    env: dict[str, Value],
    float_outputs: str = "dequantize",
    builder: Builder | None = None,
) -> list[Boundary]:
    """The output boundaries (module docstring); one LoweringError names every refused output.
    ``builder``: where a bounded float output's steps go (``float_outputs="dequantize"``)."""
    if float_outputs not in FLOAT_OUTPUTS:
        raise ValueError(f"float_outputs must be one of {FLOAT_OUTPUTS}, got {float_outputs!r}")
    outputs, floats = [], []
    producer = {t: n for n in graph.node for t in n.output}
    for vi in graph.output:
        v = env.get(vi.name)
        bounded = isinstance(v, Pending) and v.bound is not None
        weighted = isinstance(v, Pending) and v.accumulator is not None
        if isinstance(v, QValue):
            outputs.append(Boundary(vi.name, v.tensor, not v.integer))
        elif isinstance(v, IndexValue):  # the integers themselves (bools as uint8 0 / 1)
            outputs.append(Boundary(vi.name, v.tensor, False))
        elif isinstance(v, Elementwise) and float_outputs == "dequantize":
            outputs.append(Boundary(vi.name, v.source, True, _float_table(v)))
        elif bounded and float_outputs == "dequantize" and builder is not None:
            outputs.append(_bounded_output(builder, vi.name, v))
        elif (weighted and float_outputs == "dequantize" and builder is not None
              and (acc := _accumulator_output(builder, vi.name, v)) is not None):  # fmt: skip
            outputs.append(acc)
        else:
            node = producer.get(vi.name)
            source = f"{node_name(node)!r}, {node.op_type}" if node else "a graph input"
            fixable = isinstance(v, Elementwise) or bounded or weighted
            floats.append((f"{vi.name!r} (from {source})", fixable and float_outputs == "refuse"))
    if floats:
        names = ", ".join(f for f, _ in floats)
        tail = all(e for _, e in floats)
        raise LoweringError(
            f"graph output{'s' if len(floats) > 1 else ''} {names} "
            f"{'are' if len(floats) > 1 else 'is'} not quantized: computed in float after the "
            "last quantized tensor, which an integer-only program cannot do. Quantize the output: "
            "end the graph with QuantizeLinear -> DequantizeLinear (qb.quantize with "
            "recipe='int8' or any Recipe(quantize_outputs=True) quantizes an output written by a "
            "weighted or arithmetic layer (conv, linear, matmul, add, mul, cat) unless a rule "
            "skips it, not one written by another float op (a norm, a pool, an activation): "
            "quantize that value in the model or the ONNX file; quantize_onnx quantizes a "
            "final Sigmoid/Softmax head with --int8-head)"
            + (
                "; or lower with float_outputs='dequantize' (`--float-outputs dequantize`): "
                "the program then outputs codes (a final layer norm's on an int16 grid of its "
                "range, a weighted layer's int32 accumulator) and their float value (a "
                "function's table, the accumulator's scale) is applied outside it"
                if tail
                else ""
            )
        )
    return outputs
