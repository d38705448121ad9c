"""The fold pass's view of one ONNX graph: producers, consumers, constants, shapes, the parameters
of QuantizeLinear / DequantizeLinear nodes, and the ``Rewrite`` a fold handler returns.

Handlers read a ``GraphView`` and return a ``Rewrite`` (nodes to remove, nodes and initializers to
add); they never mutate the graph. ``GraphView.apply`` makes the next view from a rewrite.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from .._graph_index import GraphIndex

MS_DOMAIN = "com.microsoft"  # where ONNX Runtime defines QLinearAdd, QGemm, QLinearConcat, ...


@dataclass(frozen=True)
class QParams:
    """Scale and zero point of a Q/DQ node: the tensor names (reused as QOperator inputs), their
    values, the quantization axis (None per tensor) and the integer element type."""

    scale: str
    zero_point: str
    scale_value: np.ndarray
    zero_point_value: np.ndarray
    axis: int | None
    dtype: int

    @property
    def per_tensor(self) -> bool:
        return self.scale_value.size == 1 and self.zero_point_value.size == 1

    def same_as(self, other: QParams) -> bool:
        """The same quantization grid (values, not names)."""
        return (
            self.dtype == other.dtype
            and self.per_tensor == other.per_tensor
            and (self.per_tensor or self.axis == other.axis)
            and np.array_equal(self.scale_value.ravel(), other.scale_value.ravel())
            and np.array_equal(self.zero_point_value.ravel(), other.zero_point_value.ravel())
        )

    def describe(self) -> str:
        s, z = self.scale_value.ravel(), self.zero_point_value.ravel()
        if self.per_tensor:
            return f"scale {s[0]:.9g}, zero point {int(z[0])}"
        return f"{s.size} scales along axis {self.axis}"


@dataclass
class Rewrite:
    """What one fold does: ``remove`` these nodes, ``add`` these, plus new ``initializers``."""

    remove: list[onnx.NodeProto]
    add: list[onnx.NodeProto]
    initializers: list[TensorProto] = field(default_factory=list)


class GraphView(GraphIndex):
    """Read-only facts about ``nodes`` in a graph (rebuilt after every applied rewrite)."""

    def __init__(
        self,
        nodes: list[onnx.NodeProto],
        initializers: dict[str, TensorProto],
        graph: onnx.GraphProto,
        shapes: dict[str, tuple],
        opset: int,
        names: set[str],
    ):
        super().__init__(nodes, initializers, (o.name for o in graph.output))
        self.initializers, self.graph = initializers, graph
        self.shapes, self.opset, self._names = shapes, opset, names
        self._file_names: set[str] | None = None

    @property
    def file_names(self) -> set[str]:
        """Every tensor name of the file the view started from (not those the fold made)."""
        if self._file_names is None:
            g = self.graph
            self._file_names = {t for n in g.node for t in itertools.chain(n.input, n.output)}
            self._file_names |= {i.name for i in g.initializer} | {i.name for i in g.input}
        return self._file_names

    @classmethod
    def of(cls, model: onnx.ModelProto) -> GraphView:
        g = model.graph
        try:
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph
        except Exception:  # unknown domains or broken shapes: fold without shapes
            inferred = g
        shapes = {}
        for v in itertools.chain(inferred.input, inferred.output, inferred.value_info):
            t = v.type.tensor_type
            if v.type.HasField("tensor_type") and t.HasField("shape"):
                shapes[v.name] = tuple(
                    d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim
                )
        opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
        names = {t for n in g.node for t in itertools.chain(n.input, n.output)}
        names |= {i.name for i in g.initializer} | {i.name for i in g.input}
        names |= {n.name for n in g.node}
        inits = {i.name: i for i in g.initializer}
        return cls(
            [onnx.NodeProto.FromString(n.SerializeToString()) for n in g.node],
            inits,
            g,
            shapes,
            opset,
            names,
        )

    def apply(self, rewrite: Rewrite) -> GraphView:
        gone = {id(n) for n in rewrite.remove}
        nodes = [n for n in self.nodes if id(n) not in gone] + list(rewrite.add)
        inits = dict(self.initializers)
        inits.update({t.name: t for t in rewrite.initializers})
        view = GraphView(nodes, inits, self.graph, self.shapes, self.opset, self._names)
        view._file_names = self._file_names
        return view

    # -- names and constants ------------------------------------------------------------------
    def fresh(self, base: str) -> str:
        """A tensor or node name not used anywhere in the graph yet."""
        for k in itertools.count():
            name = f"{base}_qb{k}" if k else f"{base}_qb"
            if name not in self._names:
                self._names.add(name)
                return name
        raise AssertionError("unreachable")

    def constant(self, base: str, value: np.ndarray) -> TensorProto:
        return numpy_helper.from_array(np.asarray(value), self.fresh(base))

    def rank(self, tensor: str) -> int | None:
        shape = self.shapes.get(tensor)
        return None if shape is None else len(shape)

    # -- structure ----------------------------------------------------------------------------
    def produced_by(self, tensor: str, op_type: str) -> onnx.NodeProto | None:
        n = self.producer.get(tensor)
        return n if n is not None and n.op_type == op_type else None

    def sole_consumer(self, tensor: str) -> onnx.NodeProto | None:
        """The one node reading ``tensor`` (once), or None: several readers, or a graph output."""
        users = self.consumers.get(tensor, [])
        if len(users) != 1 or tensor in self.outputs:
            return None
        return users[0] if list(users[0].input).count(tensor) == 1 else None

    def qparams(self, node: onnx.NodeProto) -> QParams | None:
        """Parameters of a QuantizeLinear / DequantizeLinear, or None if they are not constants
        or the integer type cannot be told."""
        scale = self.array(node.input[1])
        if scale is None or any(a.name == "block_size" and a.i for a in node.attribute):
            return None  # blocked (group-wise): no integer operator takes per-block scales
        has_zp = len(node.input) > 2 and node.input[2]
        zp = self.array(node.input[2]) if has_zp else None
        if has_zp and zp is None:
            return None
        dtype = self.constants[node.input[2]].data_type if has_zp else self._type_without_zp(node)
        if dtype is None:
            return None
        zp_name = node.input[2] if has_zp else ""
        if zp is None:
            zp = np.zeros(scale.shape, helper.tensor_dtype_to_np_dtype(dtype))
        axis = None
        if scale.size > 1:
            axis = next((a.i for a in node.attribute if a.name == "axis"), 1)
        return QParams(node.input[1], zp_name, scale, zp, axis, dtype)

    def _type_without_zp(self, node: onnx.NodeProto) -> int | None:
        if node.op_type == "QuantizeLinear":
            attr = next((a.i for a in node.attribute if a.name == "output_dtype"), 0)
            return attr or TensorProto.UINT8
        data = self.constants.get(node.input[0])
        return None if data is None else data.data_type

    def scalar(self, name: str, value: np.ndarray, made: list[TensorProto]) -> str:
        """``name`` if its one value is stored as a scalar, else the name of a scalar copy: one
        made by an earlier rewrite (in the view's or ``made``'s initializers) or a new one,
        appended to ``made``."""
        value = np.asarray(value)
        if value.ndim == 0:
            return name
        scalar = value.reshape(())
        base = f"{name}_scalar"
        for t in itertools.chain(made, self.initializers.values()):
            if t.name.startswith(base) and not t.dims and t.name not in self.file_names:
                array = numpy_helper.to_array(t)
                if array.dtype == scalar.dtype and array == scalar:
                    return t.name
        made.append(self.constant(base, scalar))
        return made[-1].name

    def with_zero_point(self, params: QParams) -> tuple[QParams, list[TensorProto]]:
        """``params`` with a zero-point tensor name (QOperator inputs need one)."""
        if params.zero_point:
            return params, []
        zp = self.constant(f"{params.scale}_zero_point", params.zero_point_value)
        return QParams(
            params.scale,
            zp.name,
            params.scale_value,
            params.zero_point_value,
            params.axis,
            params.dtype,
        ), [zp]


def node(op_type: str, inputs: Iterable[str], outputs: Iterable[str], name: str, **attrs):
    """A NodeProto; ``domain`` goes to com.microsoft for ONNX Runtime's contrib ops."""
    domain = attrs.pop("domain", "")
    return helper.make_node(op_type, list(inputs), list(outputs), name=name, domain=domain, **attrs)


def attributes(n: onnx.NodeProto, drop: Iterable[str] = ()) -> dict:
    """A node's attributes as keyword arguments for ``helper.make_node``."""
    skip = set(drop)
    return {a.name: helper.get_attribute_value(a) for a in n.attribute if a.name not in skip}


def attribute(n: onnx.NodeProto, name: str, default=None):
    for a in n.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def label(n: onnx.NodeProto) -> str:
    return f"{n.op_type} {n.name!r}" if n.name else f"{n.op_type} (output {n.output[0]!r})"
