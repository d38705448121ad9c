"""The program's boundary options: static input shapes and float graph outputs.

* ``with_input_shapes``: a copy of the model whose graph inputs have the given static shapes, so
  that shape inference gives every averaged or reshaped dimension a size (a global average pool
  over a dynamic H x W has no fixed ``1 / (H W)`` rescale in an integer program);
* ``graph_outputs``: the output boundaries. An output that is the dequantized codes of a program
  tensor is dequantized by ``run``. One that the graph computes in float from the codes (a final
  Sigmoid after the last QuantizeLinear) is refused, unless ``float_outputs="dequantize"``: then
  the program ends at the codes, and the float conversion is a 2**bits-entry float32 table of
  the function (float64, then rounded to float32) applied outside the integer program
  (``Boundary.to_float``; the ONNX and C emitters output the codes). A float output computed by
  a weighted layer (Conv with no QuantizeLinear after it) is refused either way.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping

import numpy as np
import onnx

from .._program import Boundary
from ._core import Elementwise, LoweringError, QValue, Value, node_name

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


def graph_outputs(
    graph: onnx.GraphProto, env: dict[str, Value], float_outputs: str = "refuse"
) -> list[Boundary]:
    """The output boundaries (module docstring); one LoweringError names every refused output."""
    if float_outputs not in FLOAT_OUTPUTS:
        raise ValueError(f"float_outputs must be one of {FLOAT_OUTPUTS}, got {float_outputs!r}")
    outputs, floats = [], []
    producer = {t: n for n in graph.node for t in n.output}
    for vi in graph.output:
        v = env.get(vi.name)
        if isinstance(v, QValue):
            outputs.append(Boundary(vi.name, v.tensor, not v.integer))
        elif isinstance(v, Elementwise) and float_outputs == "dequantize":
            outputs.append(Boundary(vi.name, v.source, True, _float_table(v)))
        else:
            node = producer.get(vi.name)
            source = f"{node_name(node)!r}, {node.op_type}" if node else "a graph input"
            floats.append((f"{vi.name!r} (from {source})", isinstance(v, Elementwise)))
    if floats:
        names = ", ".join(f for f, _ in floats)
        tail = all(e for _, e in floats)
        raise LoweringError(
            f"graph output{'s' if len(floats) > 1 else ''} {names} "
            f"{'are' if len(floats) > 1 else 'is'} not quantized: computed in float after the "
            "last quantized tensor, which an integer-only program cannot do. Quantize the output: "
            "end the graph with QuantizeLinear -> DequantizeLinear (qb.quantize places an output "
            "quantizer unless a recipe rule skips the last layer; quantize_onnx quantizes a "
            "final Sigmoid/Softmax head with --int8-head)"
            + (
                "; or lower with float_outputs='dequantize' (`--float-outputs dequantize`): "
                "the program then outputs the codes and the float function of them is a table "
                "applied outside it"
                if tail
                else ""
            )
        )
    return outputs
