"""How the float ONNX file is prepared for the ONNX peers, so that each runs at its best.

Found on the PP-OCR line models (opset 11/12, weights in ``Constant`` nodes; issue 14):

* **Per-channel weights need opset 13.** ``DequantizeLinear``'s ``axis`` attribute exists from
  opset 13 on. On an opset-12 file NNCF quantizes every weight per-tensor (scale of shape ``()``)
  and ONNX Runtime's ``quantize_static(per_channel=True)`` writes an ``axis`` that ONNX Runtime
  then refuses to load ("Unrecognized attribute: axis for operator DequantizeLinear"). Per-tensor
  int8 weights read 0% of the recognizer's lines: one layer (``p2o.Conv.28``, 480x480 1x1,
  largest weight 22.5, median channel maximum 0.62, i.e. ~3 steps of a per-tensor grid) is
  enough. ``upgrade_opset`` converts the file with ``onnx.version_converter`` (the float function
  is unchanged).
* **Weights in Constant nodes are not weights to a quantizer.** ONNX Runtime's, NNCF's and
  ModelOpt's quantizers read weights from initializers; a weight in a ``Constant`` node is
  calibrated and quantized like an activation (per-tensor, at run time).
  ``constants_to_initializers`` moves the ``Constant`` weights into the initializer list (same
  names, same values). ONNX Runtime's ``quant_pre_process`` does the same through its
  optimizer where its shape inference runs; ``PRE_PROCESS_OPTIONS`` lists its documented
  fallbacks (``tools.pre_process`` tries them in order).

quantbridge's own rows quantize the original file (``qb.quantize_onnx`` reads both forms).
"""

from __future__ import annotations

from pathlib import Path

PER_CHANNEL_OPSET = 13  # DequantizeLinear's axis attribute: opset >= 13
WEIGHT_READERS = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})  # weight 1, bias 2

# quant_pre_process's documented options, tried in order until one runs: its full symbolic shape
# inference, then with conflicting symbolic dimensions merged (PP-OCRv4 rec: "Incomplete symbolic
# shape inference" without), then without symbolic shape inference (MiniLM: its Expand of the
# attention mask fails in it; PP-OCR cls: a Concat of shapes on axis 1)
PRE_PROCESS_OPTIONS: tuple[dict, ...] = ({}, {"auto_merge": True}, {"skip_symbolic_shape": True})


def default_opset(model) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def constants_to_initializers(model) -> int:
    """Move the tensor-valued ``Constant`` nodes of the main graph that are weights (read only as
    the weight or bias input of a Conv / ConvTranspose / Gemm / MatMul) into initializers, in
    place; returns how many moved. Other constants stay nodes: NNCF 3.4's ONNX pre-pass fails on
    a Cast of an initializer (``AttributeError: type``, PP-OCR's shape arithmetic)."""
    readers: dict[str, list[tuple[str, int]]] = {}
    for node in model.graph.node:
        for slot, name in enumerate(node.input):
            readers.setdefault(name, []).append((node.op_type, slot))
    outputs = {o.name for o in model.graph.output}

    def is_weight(name: str) -> bool:
        uses = readers.get(name, [])
        return (
            bool(uses)
            and name not in outputs
            and all(op in WEIGHT_READERS and slot in (1, 2) for op, slot in uses)
        )

    moved, keep = 0, []
    for node in model.graph.node:
        attrs = [a.name for a in node.attribute]
        if (
            node.op_type == "Constant"
            and node.domain in ("", "ai.onnx")
            and attrs == ["value"]
            and is_weight(node.output[0])
        ):
            tensor = node.attribute[0].t
            tensor.name = node.output[0]
            model.graph.initializer.append(tensor)
            moved += 1
        else:
            keep.append(node)
    if moved:
        del model.graph.node[:]
        model.graph.node.extend(keep)
    return moved


def upgrade_opset(model, target: int = PER_CHANNEL_OPSET):
    """``model`` at opset ``target`` or higher (``onnx.version_converter``), and the old opset."""
    import onnx

    old = default_opset(model)
    if old >= target:
        return model, old
    return onnx.version_converter.convert_version(model, target), old


def prepare(src: Path, dst: Path) -> dict:
    """Write ``src`` at ``dst`` with its Constant weights as initializers and opset >= 13; returns
    what changed (``{"constants_moved": n, "opset": "12 -> 13"}``, empty when nothing did)."""
    import onnx

    model = onnx.load(str(src))
    notes: dict = {}
    moved = constants_to_initializers(model)
    if moved:
        notes["constants_moved"] = moved
    model, old = upgrade_opset(model)
    if default_opset(model) != old:
        notes["opset"] = f"{old} -> {default_opset(model)}"
    onnx.save(model, str(dst))
    return notes


def needs_prepare(src: Path) -> bool:
    """Whether ``prepare`` would change ``src`` (Constant weights, or an opset below 13)."""
    import onnx

    model = onnx.load(str(src), load_external_data=False)
    return constants_to_initializers(model) > 0 or default_opset(model) < PER_CHANNEL_OPSET
