"""Normalisation of a quantized ONNX graph: a float graph plus the file's quantization record.

A quantized file (QDQ, QOperator or a mix) holds integer tensors. The normalised graph holds, for
every integer tensor ``t`` of the file, a float tensor of the same name carrying the dequantized
values ``scale * (t - zero_point)``; where the file produces integers, a ``Site`` node (domain
``quantbridge.import``) marks the float value that is quantized onto a grid. The import runs the
float graph with the float importer and makes every ``Site`` a quantizer of the ``QuantModel``
holding the file's scale and zero point (``_qmodel``). This module owns the pass, its helpers and
the rule registry keyed by op type; the rules live in ``_qdq`` (Cases 1-4), here (Case 5),
``_qoperator`` (Case 6) and ``_dynamic`` (Case 7). What the rewrite does, per case:

* Case 1 - ``QuantizeLinear(x) -> y``: ``Site(x) -> y``, a new grid with the Q's parameters.
  A Q of a constant (a float weight followed by Q) is computed now: an integer constant.
* Case 2 - ``DequantizeLinear(y) -> x'`` of an integer constant (weights, int32 biases): a float
  constant ``x'`` of the dequantized values, recorded (``QuantRecord.weights`` / ``biases``) with
  the integers, so the quantizers of the layer reproduce them exactly.
* Case 3 - ``DequantizeLinear(y) -> x'`` of a run-time integer tensor: ``Identity(y) -> x'``,
  after checking that the DQ reads ``y`` with the parameters ``y`` was written with (a DQ whose
  scale differs from its Q's is refused: the file is inconsistent, no engine agrees on it).
* Case 4 - ``Q -> Clip -> DQ`` (narrow and sub-8-bit ranges): the Clip's integer bounds narrow the
  grid of the Q (one quantizer with the narrow scheme), or make a new grid when ``y`` has other
  readers.
* Case 1 takes per-channel activations too (NNCF quantizes a depthwise conv's input per
  channel): a per-channel ``Quantizer``; Case 5 then moves them only through
  ``_KEEPS_CHANNELS``.
* Case 5 - data movement on integer tensors (``MaxPool``, ``Reshape``, ``Transpose``, ``Resize``,
  ``Slice``, ...: ``DATA_MOVEMENT``): the float op, then a ``Site`` on the input's grid (the same
  quantizer, not observing), as placement does for a torch model. A constant ``Pad`` value is an
  integer code in the file and is dequantized.
* Case 5b - ``Gather`` of an integer constant (ONNX Runtime's quantized embedding table,
  ``Gather(int8 table, ids) -> DequantizeLinear`` or read by a QOperator op): the grid is the
  reader's; when it reads, the table is dequantized with it, gathered in float, and a ``Site``
  on that grid follows.
* Case 6 - QOperator ops: unfolded by the rules in ``_qoperator`` into dequantized operands ->
  float op -> ``Site``.
* Case 7 - dynamic quantization (``_dynamic``): ``DynamicQuantizeLinear`` becomes a
  ``DynamicSite`` (quantized with each call's range), the integer op and the Cast / Mul that
  rescale its int32 result become one float op on the dequantized operands.

Anything else reading an integer tensor, and ops no rule and no float handler knows, are refused
together: one ``ValueError`` listing every unsupported op type of the file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...numerics import dequantize
from ._qparams import FileQParams, onnx_type_of, read_qparams
from ._registry import lookup

SITE_DOMAIN = "quantbridge.import"
# data movement that keeps every channel where it is (a per-channel activation grid carries over)
_KEEPS_CHANNELS = frozenset({"Identity", "MaxPool", "Resize", "Upsample"})
_INTEGER_CODES = (np.int8, np.uint8, np.int16, np.uint16)  # element types of quantized tensors
SITE_OP = "Site"
_DEFAULT_DOMAINS = ("", "ai.onnx")

# ops that move integers without arithmetic: the output lies on the input's grid (Case 5)
DATA_MOVEMENT = frozenset({
    "Identity", "Reshape", "Flatten", "Squeeze", "Unsqueeze", "Transpose", "Slice", "Gather",
    "Split", "Concat", "MaxPool", "Resize", "Upsample", "DepthToSpace", "SpaceToDepth",
    "Expand", "Tile", "Pad",
})  # fmt: skip


@dataclass
class Site:
    """One grid of the file: its parameters and the ONNX tensor first quantized onto it."""

    grid: int
    qparams: FileQParams
    tensor: str


@dataclass
class QuantRecord:
    """What the file quantizes, keyed by names of the normalised float graph."""

    sites: dict[int, Site] = field(default_factory=dict)
    tensor_grid: dict[str, int] = field(default_factory=dict)  # integer tensor -> grid
    dequantized: dict[str, int] = field(default_factory=dict)  # a DQ's float output -> grid
    weights: dict[str, tuple[FileQParams, np.ndarray]] = field(default_factory=dict)
    biases: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)  # scale, int32


Rule = Callable[["Normaliser", onnx.NodeProto], None]
RULES: dict[str, Rule] = {}
QUANTIZED_OPS: set[str] = set()  # ops whose presence makes a file quantized


def rule(*op_types: str, quantized: bool = True) -> Callable[[Rule], Rule]:
    """Register the rewrite of ``op_types`` (any domain) into float ops and ``Site`` nodes;
    ``quantized=False`` for ops that are float unless they read integers (Clip)."""

    def decorate(fn: Rule) -> Rule:
        for op in op_types:
            assert op not in RULES, f"rule for {op} registered twice"
            RULES[op] = fn
            if quantized:
                QUANTIZED_OPS.add(op)
        return fn

    return decorate


def is_quantized(proto: onnx.ModelProto) -> bool:
    return any(n.op_type in QUANTIZED_OPS for n in proto.graph.node)


class Normaliser:
    """The rewrite of one quantized graph (see the module docstring); rules call its helpers."""

    def __init__(self, proto: onnx.ModelProto, ranks: dict[str, int]):
        self.proto, self.ranks = proto, ranks
        g = proto.graph
        self.opset = next(
            (o.version for o in proto.opset_import if o.domain in _DEFAULT_DOMAINS), 1
        )
        self.consts = {i.name: numpy_helper.to_array(i) for i in g.initializer}
        self.input_types = {
            i.name: i.type.tensor_type.elem_type for i in g.input if i.name not in self.consts
        }
        self.readers: dict[str, int] = {}
        self.users: dict[str, list[onnx.NodeProto]] = {}
        self.producer: dict[str, onnx.NodeProto] = {}
        for node in g.node:
            for i in node.input:
                self.readers[i] = self.readers.get(i, 0) + 1
                self.users.setdefault(i, []).append(node)
            for o in node.output:
                self.producer[o] = node
        for o in g.output:
            self.readers[o.name] = self.readers.get(o.name, 0) + 1
        self.nodes: list[onnx.NodeProto] = []
        self.new_consts: dict[str, np.ndarray] = {}
        self.record = QuantRecord()
        self.unsupported: dict[str, str] = {}  # op type -> first node
        self._dequantized: dict[tuple, str] = {}
        self.const_types: dict[str, int] = {}  # integer constants computed here (Q of a weight)
        self.const_bounds: dict[str, tuple[int, int]] = {}  # integer constant -> Clip (Case 4b)
        self.dynamic: dict[str, tuple[str, str]] = {}  # DynamicQuantizeLinear y -> (scale, zp)
        self.absorbed: set[str] = set()  # outputs of nodes a rule rewrote with an earlier node
        self.pending: dict[str, onnx.NodeProto] = {}  # Gather of an integer table (Case 5b)

    # -- helpers for the rules ------------------------------------------------------------------
    @staticmethod
    def where(node: onnx.NodeProto) -> str:
        return f"ONNX node {node.name or node.output[0]!r} (op {node.op_type})"

    @staticmethod
    def attrs(node: onnx.NodeProto) -> dict:
        return {a.name: helper.get_attribute_value(a) for a in node.attribute}

    def const(self, name: str) -> np.ndarray | None:
        return self.consts.get(name) if name else None

    def qparams(
        self, node: onnx.NodeProto, x: str, s: int, z: int | None, axis: int | None = None,
        output_type: int | None = None, block_size: int | None = None,
    ) -> FileQParams:  # fmt: skip
        """Parameters of operand ``x`` given by inputs ``s`` / ``z`` of ``node``."""
        inputs = list(node.input)
        scale = inputs[s] if s < len(inputs) else ""
        zero_point = inputs[z] if z is not None and z < len(inputs) else ""
        return self.qparams_named(node, x, scale, zero_point, axis, output_type, block_size)

    def qparams_named(
        self, node: onnx.NodeProto, x: str, scale: str, zero_point: str, axis: int | None = None,
        output_type: int | None = None, block_size: int | None = None,
    ) -> FileQParams:  # fmt: skip
        """Parameters of operand ``x`` of ``node`` held by constants ``scale`` / ``zero_point``."""
        scale_value = self.const(scale)
        zero_value = self.const(zero_point)
        if zero_point and zero_value is None:
            raise ValueError(
                f"{self.where(node)}: zero point {zero_point!r} is computed at run time; "
                "quantbridge imports constant zero points only"
            )
        if not zero_point and output_type is None and x in self.consts:
            # no zero point: 0 of the codes' own type (a DequantizeLinear's T is its input's;
            # an int8 weight's DQ without one is int8, not the uint8 of a missing Q zero point)
            output_type = self.const_types.get(x) or onnx_type_of(self.consts[x])
        rank = self.consts[x].ndim if x in self.consts else self.ranks.get(x)
        where = f"{self.where(node)} operand {x!r}"
        return read_qparams(where, scale_value, zero_value, axis, rank, output_type, block_size)

    def emit(self, op_type: str, inputs, outputs, name: str = "", domain: str = "", **attrs):
        self.nodes.append(
            helper.make_node(
                op_type, list(inputs), list(outputs), name=name, domain=domain, **attrs
            )
        )

    def add_const(self, name: str, value: np.ndarray) -> str:
        self.consts[name] = value
        self.new_consts[name] = value
        return name

    def site(self, raw: str, out: str, qp: FileQParams, tensor: str, grid: int | None = None):
        """``Site(raw) -> out`` on a new grid with ``qp`` (or on the existing ``grid``)."""
        observe = 1
        if grid is None:
            grid = len(self.record.sites)
            self.record.sites[grid] = Site(grid, qp, tensor)
        else:
            observe = 0
        self.record.tensor_grid[out] = grid
        self.emit(SITE_OP, [raw], [out], name=f"site_{out}", domain=SITE_DOMAIN, grid=grid,
                  observe=observe)  # fmt: skip

    def grid(self, name: str) -> Site | None:
        g = self.record.tensor_grid.get(name)
        return None if g is None else self.record.sites[g]

    def read(self, node: onnx.NodeProto, x: str, qp: FileQParams) -> str:
        """The float tensor for integer operand ``x`` of ``node`` read with ``qp``: a dequantized
        constant (recorded with its integers), or ``x`` itself once its grid is checked."""
        if x in self.pending:
            self._gather_table(node, x, qp)
        if x in self.consts:
            return self._dequantize_constant(node, x, qp)
        site = self.grid(x)
        if site is None:
            if x in self.input_types:
                raise ValueError(
                    f"{self.where(node)}: graph input {x!r} holds integers; quantbridge imports "
                    "quantized models whose inputs are float (quantize them in the graph with a "
                    "QuantizeLinear)"
                )
            raise ValueError(
                f"{self.where(node)}: operand {x!r} is read as integers but no QuantizeLinear or "
                "quantized op produces it"
            )
        if not site.qparams.same_grid(qp):
            theirs = site.qparams
            raise ValueError(
                f"{self.where(node)} reads {x!r} with scale {_short(qp.scale)} and zero point "
                f"{_short(qp.zero_point)}, but {theirs.where} wrote it with scale "
                f"{_short(theirs.scale)} and zero point {_short(theirs.zero_point)}. A tensor "
                "must be read with the parameters it was quantized with: fix the "
                "DequantizeLinear's (or the op's) scale and zero point to match"
            )
        return x

    def _gather_table(self, node: onnx.NodeProto, x: str, qp: FileQParams) -> None:
        """Case 5b: ``x`` = ``Gather(table, indices)`` of an integer constant, read by ``node``
        with ``qp``: the table dequantized with ``qp`` (recorded with its integers), gathered in
        float, then a ``Site`` on a new grid with ``qp`` (the values lie on it already)."""
        gather = self.pending.pop(x)
        if qp.axis is not None:
            raise ValueError(
                f"{self.where(node)} reads {x!r}, rows of the integer table {gather.input[0]!r} "
                f"gathered by {self.where(gather)}, with per-channel parameters; quantbridge "
                "imports a gathered integer table on one (per-tensor) scale: quantize the "
                "embedding per tensor"
            )
        table = self._dequantize_constant(gather, gather.input[0], qp)
        raw = f"{x}_qb_float"
        self.emit("Gather", [table, *gather.input[1:]], [raw], name=gather.name,
                  **self.attrs(gather))  # fmt: skip
        self.site(raw, x, qp, x)

    def _integer_table(self, node: onnx.NodeProto) -> bool:
        """``node`` gathers rows of an integer constant (ONNX Runtime's quantized embedding:
        ``Gather(int8 table, ids) -> DequantizeLinear``, or read by a quantized op)."""
        if node.op_type != "Gather" or node.domain not in _DEFAULT_DOMAINS:
            return False
        table = self.consts.get(node.input[0])
        return table is not None and (
            node.input[0] in self.const_types or table.dtype in _INTEGER_CODES
        )

    def _dequantize_constant(self, node: onnx.NodeProto, x: str, qp: FileQParams) -> str:
        codes = self.consts[x]
        kind = self.const_types.get(x) or onnx_type_of(codes)
        if kind != qp.onnx_type:
            raise ValueError(
                f"{self.where(node)}: constant {x!r} has element type {codes.dtype} but its zero "
                f"point is {onnx.TensorProto.DataType.Name(qp.onnx_type)}; they must be equal"
            )
        key = (x, qp.scale.tobytes(), qp.zero_point.tobytes(), qp.axis, qp.block_size)
        if key not in self._dequantized:
            codes = codes.astype(np.int64)
            try:
                values = dequantize(codes, qp.scale, qp.zero_point.astype(np.float32), qp.axis,
                                    qp.block_size)  # fmt: skip
            except ValueError as e:  # blocked parameters of the wrong shape
                raise ValueError(f"{self.where(node)} constant {x!r}: {e}") from None
            name = x if node.op_type != "DequantizeLinear" else node.output[0]
            name = self._fresh(f"{name}_dequantized" if name == x else name)
            self.add_const(name, np.asarray(values, dtype=np.float32))
            self.record.weights[name] = (qp, codes)
            self._dequantized[key] = name
        return self._dequantized[key]

    def dequantize_bias(
        self, node: onnx.NodeProto, b: str, scale: np.ndarray, name: str | None = None
    ) -> str:
        """A float constant for int32 bias ``b`` with ``scale`` (input scale x weight scale)."""
        codes = self.consts.get(b)
        if codes is None or codes.dtype != np.int32:
            raise ValueError(
                f"{self.where(node)}: bias {b!r} must be an int32 constant, got "
                f"{'a run-time tensor' if codes is None else codes.dtype}"
            )
        scale = np.asarray(scale, dtype=np.float32)
        name = name or self._fresh(f"{b}_dequantized")
        values = codes.astype(np.float64) * np.broadcast_to(scale, codes.shape)
        self.add_const(name, values.astype(np.float32))
        self.record.biases[name] = (scale, codes)
        return name

    def _fresh(self, name: str) -> str:
        base, i = name, 1
        while name in self.consts:
            i += 1
            name = f"{base}_{i}"
        return name

    def refuse(self, node: onnx.NodeProto) -> None:
        key = node.op_type if node.domain in _DEFAULT_DOMAINS else f"{node.domain}.{node.op_type}"
        self.unsupported.setdefault(key, node.name or node.output[0])

    # -- the pass -------------------------------------------------------------------------------
    def run(self) -> tuple[onnx.ModelProto, QuantRecord]:
        for node in self.proto.graph.node:
            if node.output and all(o in self.absorbed for o in node.output if o):
                continue
            if node.op_type == "Constant" and node.domain in _DEFAULT_DOMAINS:
                self.add_const(node.output[0], _constant(node))
            elif node.op_type in RULES:
                RULES[node.op_type](self, node)
            else:
                self.default(node)
        self.nodes += self.pending.values()  # graph outputs: the integers, as in the file
        if self.unsupported:
            listed = ", ".join(f"{op} (e.g. node {n!r})" for op, n in self.unsupported.items())
            raise ValueError(
                f"quantbridge.import_onnx cannot import this quantized model: unsupported ops "
                f"{listed}. Quantized ops it imports: {', '.join(sorted(RULES))}; data movement "
                f"on integer tensors: {', '.join(sorted(DATA_MOVEMENT))}. Re-quantize the model "
                "without them (keep those ops in float), or import the fp32 model and quantize it "
                "with quantbridge.quantize"
            )
        return self._model(), self.record

    def default(self, node: onnx.NodeProto) -> None:
        """A node no rule rewrites: data movement on integers, a float op, or unsupported."""
        if self._integer_table(node):  # Case 5b: its reader gives the grid
            self.pending[node.output[0]] = node
            return
        for i in node.input:  # a gathered integer table read as integers by a float op
            if i in self.pending:
                self.nodes.append(self.pending.pop(i))
        if any(self.grid(i) for i in node.input if i):
            self._integer_data_movement(node)  # Case 5
        elif any(i in self.dynamic for i in node.input if i):
            self.refuse(node)  # dynamic integers read by something else than a rule
        elif node.domain not in _DEFAULT_DOMAINS or lookup(node.op_type, self.opset) is None:
            self.refuse(node)
        else:
            self.nodes.append(node)

    def _integer_data_movement(self, node: onnx.NodeProto) -> None:
        site = self.grid(node.input[0]) if node.input else None
        if node.op_type not in DATA_MOVEMENT or site is None or node.domain not in _DEFAULT_DOMAINS:
            self.refuse(node)
            return
        if site.qparams.axis is not None and node.op_type not in _KEEPS_CHANNELS:
            raise ValueError(
                f"{self.where(node)} moves the integers of {node.input[0]!r}, quantized per "
                f"channel along axis {site.qparams.axis}; quantbridge imports per-channel "
                f"activations read by {', '.join(sorted(_KEEPS_CHANNELS))} or dequantized "
                "directly: dequantize before this op, or quantize that tensor per tensor"
            )
        inputs = list(node.input)
        data = inputs if node.op_type == "Concat" else inputs[:1]
        for x in data:
            self.read(node, x, site.qparams)
        if node.op_type == "Pad" and self.attrs(node).get("mode", b"constant") in (
            b"constant",
            "constant",
        ):
            qp = site.qparams
            code = self.consts.get(inputs[2]) if len(inputs) > 2 and inputs[2] else None
            code = np.zeros((), np.int64) if code is None else code.astype(np.int64)
            value = dequantize(code, qp.scale, qp.zero_point.astype(np.float32))
            inputs += [""] * (3 - len(inputs))
            inputs[2] = self.add_const(
                self._fresh(f"{node.output[0]}_pad_value"), np.asarray(value, np.float32)
            )
        carried = list(node.output) if node.op_type == "Split" else node.output[:1]
        outputs = [f"{o}_qb_float" if o in carried else o for o in node.output]
        self.nodes.append(
            helper.make_node(node.op_type, inputs, outputs, name=node.name, **self.attrs(node))
        )
        for o in carried:
            self.site(f"{o}_qb_float", o, site.qparams, o, grid=site.grid)

    def _model(self) -> onnx.ModelProto:
        g = self.proto.graph
        inits = [numpy_helper.from_array(_storable(v), k) for k, v in self.consts.items()]
        graph = helper.make_graph(
            self.nodes, g.name or "quantized", [i for i in g.input if i.name not in self.consts],
            list(g.output), inits,
        )  # fmt: skip
        opsets = [helper.make_opsetid("", self.opset), helper.make_opsetid(SITE_DOMAIN, 1)]
        return helper.make_model(graph, opset_imports=opsets, ir_version=self.proto.ir_version)


def _short(values: np.ndarray) -> str:
    """At most four values, each as its shortest repr (float32 scales as written: 0.06)."""
    flat = values.reshape(-1)
    shown = ", ".join(str(v) for v in flat[:4])  # numpy's shortest repr of each float32
    return shown if values.ndim == 0 else f"[{shown}{', ...' if flat.size > 4 else ''}]"


def _constant(node: onnx.NodeProto) -> np.ndarray:
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if "value" in attrs:
        return numpy_helper.to_array(attrs["value"])
    for key, dtype in (("value_float", np.float32), ("value_floats", np.float32),
                       ("value_int", np.int64), ("value_ints", np.int64)):  # fmt: skip
        if key in attrs:
            return np.asarray(attrs[key], dtype=dtype)
    raise ValueError(f"Constant node {node.name!r}: {sorted(attrs)} constants are not supported")


def _storable(value: np.ndarray) -> np.ndarray:
    """int4 / uint4 codes (ml_dtypes) as int8 / uint8: the float graph never reads them."""
    kind = str(value.dtype)
    if kind in ("int4", "uint4"):
        return value.astype(np.int8 if kind == "int4" else np.uint8)
    return value


def normalise(proto: onnx.ModelProto, ranks: dict[str, int]) -> tuple[onnx.ModelProto, QuantRecord]:
    """The float graph with ``Site`` nodes and the record of the file's quantization."""
    return Normaliser(proto, ranks).run()
