"""``openvino_layout``: a QDQ model re-laid for OpenVINO's CPU plugin (Q/DQ pairs only where
OpenVINO runs an int8 kernel).

Our QDQ export quantizes every op's output, the layout ONNX Runtime wants: it fuses
``DQ -> Add/Mul -> Q`` into QLinearAdd / QLinearMul. OpenVINO's low-precision transformations
(LPT) work the other way round: each Conv / MatMul runs in int8 and the element-wise ops after it
run in float, fused into the kernel's post-ops where they form a chain. A Q/DQ pair on an
element-wise op's output becomes a stand-alone float FakeQuantize layer, and the next float op
dequantizes again (Convert u8 -> f32, Subtract zero point). Measured on the PP-OCRv4 detector
(1x3x480x480, OpenVINO 2026.4, AMD EPYC AVX2 without VNNI, 2 threads; ``python -m
bench.ov_layout``, load 12-14): our QDQ file ran 88 float FakeQuantize layers and 47 Converts,
0.64x OpenVINO's own float speed; in this layout 1.22x, NNCF's INT8 (OpenVINO IR) 1.23x
(``docs/openvino.md``).

The pass removes every activation ``QuantizeLinear -> DequantizeLinear`` pair none of whose
DequantizeLinear readers is in ``KEEP``; those readers then read the QuantizeLinear's float input.
``KEEP``:

* ``Conv``, ``ConvTranspose``, ``MatMul``, ``Gemm``: the inputs OpenVINO quantizes, also when
  read through data movement (``INTEGER_DATA_MOVEMENT``: ``DQ -> Reshape -> Transpose -> MatMul``).
  Weights are untouched: their DequantizeLinear reads an initializer, and is read by a kept op.
* ``ReduceMean``, ``GlobalAveragePool``: a squeeze-excitation mean that reads an int8 Conv's float
  output directly makes OpenVINO 2026.4 compute that Conv wrongly (the detector's RSE layers,
  ``x + x * se(x)``: SQNR 0 dB against ONNX Runtime node by node; NNCF's ONNX export of the
  detector fails the same way in OpenVINO, its OpenVINO-IR export does not). Keeping the mean's
  input quantized keeps the Conv's output on the ``Conv -> Q`` pattern OpenVINO handles.

Second, a constant on an integer grid (``DequantizeLinear`` of an initializer, our export's
``quantize_constants``: the ``3`` and ``6`` of a hard-swish, a learnable affine's scale and bias)
that no ``KEEP`` op reads becomes the float initializer it dequantizes to, bit for bit.
OpenVINO's pattern fusions (HSwish, scale-shift into the convolution's post-ops) match constant
nodes, and a DequantizeLinear sub-graph hides them: with the constants left as DQ the detector ran
stand-alone Clamp / Power layers (33 + 62 ms of 303 ms per inference) and reached 1.14x float;
with them float (here, or quantizing with ``quantize_constants=False``) 1.28x (NNCF 1.32x, same
run). Folding them only skips a dequantization the engine would do: the values are the same.

A removed pair's clamp stays where it may be the only one: ONNX Runtime's quantizer deletes a
Relu / Clip(0, 6) and lets the next QuantizeLinear's range clamp instead, so a pair whose grid
starts at 0 (zero point at the integer minimum) after an op that is not already non-negative
(``NON_NEGATIVE``) becomes ``Clip(x, 0, top of the grid)``. Without it ONNX Runtime's QDQ file of
the detector lost its hard-swish clamps (SQNR against float -2 dB).

A pair stays as it is where removing it would not be a pure rounding removal: a QuantizeLinear of
a constant, one read by anything but a DequantizeLinear, a DequantizeLinear that is a graph output,
or a DequantizeLinear with other parameters than its QuantizeLinear. The result computes the same
function with fewer roundings (the detector in OpenVINO: SQNR against float 10.8 -> 19.1 dB).
"""

from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import numpy_helper

from ...numerics import dequantize
from .._graph_index import GraphIndex
from .._load import parse_onnx
from ._normalize import INTEGER_DATA_MOVEMENT

KEEP = frozenset({"Conv", "ConvTranspose", "MatMul", "Gemm", "ReduceMean", "GlobalAveragePool"})
# ops whose output a grid starting at 0 clamps no further at 0 (module docstring)
NON_NEGATIVE = frozenset({"Relu", "Clip", "Sigmoid", "HardSigmoid", "Softmax"})


def openvino_layout(
    src: str | os.PathLike | onnx.ModelProto,
    dst: str | os.PathLike | None = None,
    keep: frozenset[str] = KEEP,
) -> onnx.ModelProto:
    """The QDQ model ``src`` (path or ``ModelProto``) with the activation Q/DQ pairs OpenVINO
    cannot fuse removed and the quantized constants of element-wise ops dequantized (module
    docstring); written to ``dst`` if given. ``src`` is not changed.
    Raises ``ValueError`` for a model without QuantizeLinear/DequantizeLinear pairs."""
    model = _load(src)
    out = onnx.ModelProto()
    out.CopyFrom(model)
    graph = out.graph
    index = GraphIndex(
        list(graph.node), {t.name: t for t in graph.initializer}, (o.name for o in graph.output)
    )
    consts, readers, outputs = index.constants, index.consumers, index.outputs
    pairs = [q for q in graph.node if q.op_type == "QuantizeLinear"]
    if not pairs:
        raise ValueError(
            "openvino_layout: the model has no QuantizeLinear nodes (a float model?); export a "
            "quantized model first (qb.export, quantbridge quantize)"
        )
    producer = index.producer  # a removed pair's new Clip is added to it below
    opset = next((o.version for o in out.opset_import if o.domain in ("", "ai.onnx")), 0)
    rename: dict[str, str] = {}
    gone: set[int] = set()
    clips: dict[int, tuple[onnx.NodeProto, list[onnx.TensorProto]]] = {}
    for q in pairs:
        dqs = readers.get(q.output[0], [])
        if not _removable(q, dqs, consts, outputs, readers, keep):
            continue
        gone.add(id(q))
        value = q.input[0]
        while value in rename:  # read through pairs removed before this one
            value = rename[value]
        source = producer.get(value)
        if source is None or source.op_type not in NON_NEGATIVE:
            top = _zero_based_top(q, consts)
            if top is not None:
                dtype = numpy_helper.to_array(consts[q.input[1]]).dtype
                clips[id(q)] = _clip(q, top, opset, dtype)
                value = clips[id(q)][0].output[0]
                producer[value] = clips[id(q)][0]
        for dq in dqs:
            gone.add(id(dq))
            rename[dq.output[0]] = value
    folded = []
    for dq in graph.node:
        if _constant_dq(dq, consts, outputs, readers, keep):
            gone.add(id(dq))
            folded.append(numpy_helper.from_array(_dequantize(dq, consts), dq.output[0]))
    nodes = [clips[id(n)][0] if id(n) in clips else n for n in graph.node]
    nodes = [n for n in nodes if id(n) not in gone]
    folded += [t for _, inits in clips.values() for t in inits]
    for n in nodes:
        for i, t in enumerate(n.input):
            while t in rename:  # chained pairs: Q -> DQ -> Q -> DQ
                t = rename[t]
            n.input[i] = t
    read = {t for n in nodes for t in n.input} | outputs
    nodes = [n for n in nodes if n.op_type != "Constant" or n.output[0] in read]
    del graph.node[:]
    graph.node.extend(nodes)
    read = {t for n in nodes for t in n.input} | outputs
    live = [t for t in [*graph.initializer, *folded] if t.name in read]
    del graph.initializer[:]
    graph.initializer.extend(live)
    kept = {t for n in nodes for t in n.output}
    values = [v for v in graph.value_info if v.name in kept]
    del graph.value_info[:]
    graph.value_info.extend(values)
    if dst is not None:
        onnx.save(out, os.fspath(dst))
    return out


# ops OpenVINO's front end drops when their constant operand is the identity (0 or 1)
_IDENTITY_WITH = {"Add": 0.0, "Sub": 0.0, "Mul": 1.0, "Div": 1.0}


def openvino_crash_site(src: str | os.PathLike | onnx.ModelProto) -> str | None:
    """The name of a ``Concat`` on which OpenVINO 2026.4's ``compile_model`` (CPU) dies with a
    segmentation fault, or None.

    The pattern (bisected from HF DeiT / AST / YOLOS / DPT / TimeSformer exports, random init):
    ``Concat -> QuantizeLinear -> DequantizeLinear -> QuantizeLinear``, the second
    QuantizeLinear reading the DequantizeLinear directly, through ``Identity``, or through an
    ``Add`` / ``Sub`` of an all-zero constant or a ``Mul`` / ``Div`` by an all-one constant (which
    OpenVINO removes first: ViT's ``cat([cls, patches]) + position_embeddings`` with the zero
    position embeddings of an untrained model). Its scale and zero point do not matter. It crashes
    when OpenVINO reads the file (``compile_model(path)``); compiled from bytes
    (``convert_model``, as ``to_engine`` does) the few-node pattern survives, the DeiT file with
    ``compare``'s extra outputs does not, which is why ``compare`` compiles in a child process.
    The ``openvino_layout`` of such a file removes the inner pair and compiles."""
    model = _load(src)
    graph = model.graph
    index = GraphIndex(
        list(graph.node), {t.name: t for t in graph.initializer}, (o.name for o in graph.output)
    )
    consts, readers, producer = index.constants, index.consumers, index.producer
    for q in graph.node:
        if q.op_type != "QuantizeLinear":
            continue
        source = producer.get(q.input[0])
        if source is None or source.op_type != "Concat":
            continue
        for dq in readers.get(q.output[0], []):
            if dq.op_type == "DequantizeLinear" and _reaches_quantize(
                dq.output[0], readers, consts
            ):
                return source.name or source.output[0]
    return None


def _reaches_quantize(tensor: str, readers: dict, consts: dict, depth: int = 0) -> bool:
    """Whether a QuantizeLinear reads ``tensor`` directly or through ops that are identities."""
    for r in readers.get(tensor, []):
        if r.op_type == "QuantizeLinear" and r.input[0] == tensor:
            return True
        if depth > 4:
            continue
        if r.op_type == "Identity" or (
            r.op_type in _IDENTITY_WITH and _identity_operand(r, tensor, consts)
        ):
            if _reaches_quantize(r.output[0], readers, consts, depth + 1):
                return True
    return False


def _identity_operand(node: onnx.NodeProto, tensor: str, consts: dict) -> bool:
    """Whether ``node`` (Add / Sub / Mul / Div) applied to ``tensor`` is the identity: its other
    operand a constant of 0 (Add, Sub) or 1 (Mul, Div), ``tensor`` first where order matters."""
    if len(node.input) != 2 or tensor not in node.input:
        return False
    other = node.input[1] if node.input[0] == tensor else node.input[0]
    if other not in consts or (node.op_type in ("Sub", "Div") and node.input[0] != tensor):
        return False
    value = numpy_helper.to_array(consts[other])
    return value.size > 0 and bool(np.all(value == _IDENTITY_WITH[node.op_type]))


def _zero_based_top(q: onnx.NodeProto, consts: dict[str, onnx.TensorProto]) -> float | None:
    """The top of ``q``'s grid when the grid starts at 0 (zero point at the integer minimum; no
    zero point: uint8 0), else None."""
    scale = numpy_helper.to_array(consts[q.input[1]])
    has_zp = len(q.input) > 2 and q.input[2]
    zp = numpy_helper.to_array(consts[q.input[2]]) if has_zp else np.zeros((), np.uint8)
    if scale.size != 1 or zp.size != 1 or not np.issubdtype(zp.dtype, np.integer):
        return None
    info = np.iinfo(zp.dtype)
    if int(zp) != info.min:
        return None
    return float(scale.reshape(())) * (info.max - info.min)


def _clip(q: onnx.NodeProto, top: float, opset: int, dtype: np.dtype):
    """``Clip(x, 0, top)`` in place of ``q``'s pair, with its bound initializers (``dtype``: the
    activation's float type, which is the scale's)."""
    base = q.name or q.output[0]
    out = f"{base}_openvino_clip"
    if opset < 11:
        return onnx.helper.make_node("Clip", [q.input[0]], [out], min=0.0, max=top, name=out), []
    lo = numpy_helper.from_array(np.array(0.0, dtype), f"{out}_min")
    hi = numpy_helper.from_array(np.array(top, dtype), f"{out}_max")
    node = onnx.helper.make_node("Clip", [q.input[0], lo.name, hi.name], [out], name=out)
    return node, [lo, hi]


def _read_by(tensor: str, readers: dict[str, list[onnx.NodeProto]], keep: frozenset[str]) -> bool:
    """Whether an op in ``keep`` reads ``tensor``, directly or through data movement."""
    for r in readers.get(tensor, []):
        if r.op_type in keep:
            return True
        if r.op_type in INTEGER_DATA_MOVEMENT and any(_read_by(t, readers, keep) for t in r.output):
            return True
    return False


def _removable(
    q: onnx.NodeProto,
    dqs: list[onnx.NodeProto],
    consts: dict[str, onnx.TensorProto],
    outputs: set[str],
    readers: dict[str, list[onnx.NodeProto]],
    keep: frozenset[str],
) -> bool:
    """Whether ``q`` and its DequantizeLinear readers ``dqs`` are a plain rounding of an activation
    that no reader in ``keep`` needs (module docstring)."""
    if q.input[0] in consts or not dqs or q.output[0] in outputs:
        return False
    for dq in dqs:
        if dq.op_type != "DequantizeLinear" or dq.output[0] in outputs:
            return False
        if not _same_params(q, dq, consts):
            return False
        if _read_by(dq.output[0], readers, keep):
            return False
    return True


def _constant_dq(
    dq: onnx.NodeProto,
    consts: dict[str, onnx.TensorProto],
    outputs: set[str],
    readers: dict[str, list[onnx.NodeProto]],
    keep: frozenset[str],
) -> bool:
    """A DequantizeLinear of constants (data, scale, zero point) that only non-``keep`` ops read."""
    if dq.op_type != "DequantizeLinear" or dq.output[0] in outputs:
        return False
    if any(a.name == "block_size" and a.i for a in dq.attribute):
        return False  # blocked quantization: left to the engine
    if not all(t in consts for t in dq.input if t):
        return False
    return bool(readers.get(dq.output[0])) and not _read_by(dq.output[0], readers, keep)


def _dequantize(dq: onnx.NodeProto, consts: dict[str, onnx.TensorProto]) -> np.ndarray:
    """The float32 value the constant DequantizeLinear ``dq`` computes (per tensor or along its
    ``axis``, default 1): ``numerics.dequantize``, DequantizeLinear's arithmetic."""
    x = numpy_helper.to_array(consts[dq.input[0]])
    scale = numpy_helper.to_array(consts[dq.input[1]])
    has_zp = len(dq.input) > 2 and dq.input[2]
    zp = numpy_helper.to_array(consts[dq.input[2]]) if has_zp else np.zeros((), x.dtype)
    axis = None
    if scale.size > 1:
        axis = next((a.i for a in dq.attribute if a.name == "axis"), 1) % x.ndim
    return np.asarray(dequantize(x, scale, zp, axis), dtype=np.float32)


def _same_params(q: onnx.NodeProto, dq: onnx.NodeProto, consts: dict) -> bool:
    def values(n: onnx.NodeProto) -> list:
        names = list(n.input[1:3])
        if any(t and t not in consts for t in names):
            return []
        return [numpy_helper.to_array(consts[t]) if t else None for t in names]

    a, b = values(q), values(dq)
    if not a or len(a) != len(b):
        return False
    return all(
        (x is None and y is None) or (x is not None and y is not None and np.array_equal(x, y))
        for x, y in zip(a, b, strict=True)
    )


def _load(src: str | os.PathLike | onnx.ModelProto) -> onnx.ModelProto:
    if isinstance(src, onnx.ModelProto):
        return src
    if not isinstance(src, (str, os.PathLike)):
        raise TypeError(
            f"openvino_layout expects a path or an onnx.ModelProto, got {type(src).__name__}"
        )
    if not os.path.isfile(src):
        raise FileNotFoundError(f"{os.fspath(src)}: no such file")
    return parse_onnx(lambda: onnx.load(os.fspath(src)), repr(os.fspath(src)))
