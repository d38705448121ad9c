"""The report ``inspect_model`` returns: graph inputs/outputs, weights, and the whole report with
its text (``format``) and dict (``to_dict``) forms. Plain data; the analysis is in ``_inspect``."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass(frozen=True)
class TensorInfo:
    """A graph input or output: name, element type, shape (ints, symbolic names, None unknown)."""

    name: str
    dtype: str
    shape: tuple[int | str | None, ...] | None

    def describe(self) -> str:
        if self.shape is None:
            return f"{self.name}: {self.dtype}"
        dims = ", ".join("?" if d is None else str(d) for d in self.shape)
        return f"{self.name}: {self.dtype}[{dims}]"


@dataclass(frozen=True)
class WeightInfo:
    """One weight initializer feeding a Conv/Gemm/MatMul (float or QOperator) weight input."""

    node: str
    op_type: str
    name: str
    dtype: str
    shape: tuple[int, ...]
    is_float: bool
    bits: int  # float: the type's width; integers: bits the stored values need (or Clip's range)
    granularity: str  # "per-tensor", "per-channel(axis=0)", "float"
    value_range: tuple[float, float] | None  # min, max of the stored values
    bias_dtype: str | None = None

    def describe(self) -> str:
        lo_hi = ""
        if self.value_range is not None and not self.is_float:
            lo_hi = f" values [{self.value_range[0]:g}, {self.value_range[1]:g}]"
        bias = f", bias {self.bias_dtype}" if self.bias_dtype else ""
        shape = "x".join(str(d) for d in self.shape)
        return (
            f"{self.name} ({self.op_type} {self.node!r}): {self.dtype}[{shape}] {self.bits}-bit"
            f"{lo_hi}, {self.granularity}{bias}"
        )


@dataclass
class InspectReport:
    """What ``inspect_model`` found; ``format()`` for people, ``to_dict()`` for machines."""

    path: str | None
    size_bytes: int
    ir_version: int
    opsets: dict[str, int]
    producer: str
    form: str  # "float", "QDQ", "QOperator", "QDQ+QOperator"
    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    op_counts: dict[str, int]
    int8_ops: dict[str, int]
    float_ops: dict[str, int]
    float_nodes: list[str]
    quantize_nodes: int
    dequantize_nodes: int
    qdq_pairs: int
    activation_quantizers: dict[str, int]  # "uint8 [0, 255] 8-bit" -> count
    weights: list[WeightInfo] = field(default_factory=list)
    qdq_ops: list[str] = field(default_factory=list)  # ops a DQ feeds or a Q reads
    concats: list[str] = field(default_factory=list)  # Concats with inputs on separate scales
    float16: bool = False  # float16 weights / scales / compute (ModelOpt's default mode)

    @property
    def float_weights(self) -> list[WeightInfo]:
        return [w for w in self.weights if w.is_float]

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["float_weights"] = [w.name for w in self.float_weights]
        d["scheme"] = self.scheme
        return d

    @property
    def scheme(self) -> str | None:
        """``W8A8``, ``W4A8``, ...: the widest integer weight and activation grids, or None when
        the model holds no integer weights."""
        bits = [w.bits for w in self.weights if not w.is_float]
        if not bits:
            return None
        acts = [int(k.rsplit(" ", 1)[1].split("-")[0]) for k in self.activation_quantizers]
        return f"W{max(bits)}A{max(acts)}" if acts else f"W{max(bits)}"

    def format(self, verbose: bool = False) -> str:
        """The report for people: a summary; ``verbose`` adds one line per weight."""
        opsets = ", ".join(f"{d or 'ai.onnx'} {v}" for d, v in sorted(self.opsets.items()))
        lines = [
            f"model:     {self.path or '<ModelProto>'} ({_human_bytes(self.size_bytes)})",
            f"form:      {self.form}" + (f", scheme {self.scheme}" if self.scheme else ""),
            f"producer:  {self.producer or '?'}; IR version {self.ir_version}; opsets: {opsets}",
            "inputs:    " + "; ".join(t.describe() for t in self.inputs),
            "outputs:   " + "; ".join(t.describe() for t in self.outputs),
            "op counts: " + _counts(self.op_counts),
            "int8 ops:  " + (_counts(self.int8_ops) or "none"),
            "float ops: " + (_counts(self.float_ops) or "none"),
        ]
        if self.float16:
            lines.insert(3, "float16:   the graph computes in float16 (float16 weights, scales or "
                         "Casts); import_onnx, fold and lower read it as float32, grids kept exactly")  # fmt: skip
        if self.float_nodes:
            lines.append("           " + _names(self.float_nodes))
        if self.form == "QDQ+QOperator" and self.qdq_ops:
            lines.append(f"QDQ form:  {len(self.qdq_ops)} ops not folded: {_names(self.qdq_ops)}")
        lines.append(
            f"Q/DQ:      {self.quantize_nodes} QuantizeLinear, {self.dequantize_nodes} "
            f"DequantizeLinear, {self.qdq_pairs} Q->DQ pairs"
        )
        if self.activation_quantizers:
            schemes = sorted(self.activation_quantizers.items(), key=lambda kv: -kv[1])
            lines.append("activations: " + ", ".join(f"{n} x {k}" for k, n in schemes))
        if self.concats:
            lines.append("concats on separate scales (ranges too far apart for one scale):")
            lines += [f"  {c}" for c in self.concats]
        lines.append(f"weights:   {len(self.weights)}" + _weight_summary(self.weights))
        if any(not w.is_float and w.dtype == "int8" and w.bits == 7 for w in self.weights):
            lines.append(
                "           7-bit: int8 weights with values within [-64, 63], exact in ONNX Runtime "
                "and OpenVINO on AVX2 CPUs without VNNI, whose u8 x s8 kernels add pairs of "
                "products in int16 with saturation (quantbridge's default recipe; "
                "recipe='int8' uses all 8 bits)"
            )
        if verbose:
            lines += [f"  {w.describe()}" for w in self.weights]
        floats = self.float_weights
        lines.append("float weights: " + (", ".join(w.name for w in floats) if floats else "none"))
        return "\n".join(lines)


def _names(labels: list[str], shown: int = 12) -> str:
    text = ", ".join(labels[:shown])
    return text + (f", ... ({len(labels) - shown} more)" if len(labels) > shown else "")


def _weight_summary(weights: list[WeightInfo]) -> str:
    """``: 60 x int8 8-bit per-channel(axis=0), 4 x float32 (float)`` - weights grouped by form."""
    groups = Counter(
        f"{w.dtype} {w.bits}-bit {w.granularity}" if not w.is_float else f"{w.dtype} (float)"
        for w in weights
    )
    biases = Counter(w.bias_dtype for w in weights if w.bias_dtype)
    text = ", ".join(f"{n} x {k}" for k, n in groups.most_common())
    if biases:
        text += "; biases " + ", ".join(f"{n} x {k}" for k, n in biases.most_common())
    return f" ({text}; --verbose lists each)" if text else ""


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


def _human_bytes(n: int) -> str:
    return (
        f"{n} B"
        if n < 1024
        else f"{n / 1024:.1f} KiB"
        if n < 1 << 20
        else f"{n / (1 << 20):.1f} MiB"
    )
