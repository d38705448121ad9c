"""Which folded layers this machine's ONNX Runtime will not compute exactly.

On x86 without VNNI, ONNX Runtime adds uint8 x int8 products pairwise in int16 with saturation
(``quantbridge._platform``; int8 activations run as uint8 + 128). A QOperator layer whose int8
weight codes go beyond ``safe_weight_bound()`` then computes other values than its QDQ form
evaluated node by node: on the import sweep's AVX2 machine, ORT's per-channel u8s8 files of a
MiniLM-style model folded to 54 output steps off, MobileNetV2-style to 3. ``qb.export`` warns
for the models it writes; ``fold`` warns for the files it folds, whoever wrote them.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from ..._platform import SaturationWarning, safe_weight_bound, u8s8_saturates

__all__ = ["SaturationWarning", "saturating_layers", "saturation_message"]

# QOperator layers: (activation input, weight input) positions
_WEIGHTED = {"QLinearConv": (0, 3), "QLinearMatMul": (0, 3), "QGemm": (0, 3)}


def saturating_layers(model: onnx.ModelProto) -> list[str]:
    """Names of the layers of ``model`` with 8-bit activations and int8 weight codes beyond
    ``safe_weight_bound()``, on a CPU where that saturates (empty elsewhere)."""
    if not u8s8_saturates():
        return []
    inits = {i.name: i for i in model.graph.initializer}
    bound = safe_weight_bound()
    found = []
    for node in model.graph.node:
        slots = _WEIGHTED.get(node.op_type)
        if slots is None or len(node.input) <= slots[1]:
            continue
        w = inits.get(node.input[slots[1]])
        if w is None or w.data_type != onnx.TensorProto.INT8:
            continue
        if int(np.abs(numpy_helper.to_array(w).astype(np.int16)).max(initial=0)) > bound:
            found.append(node.name or node.output[0])
    return found


def saturation_message(layers: list[str]) -> str:
    return (
        f"this CPU has no VNNI: ONNX Runtime adds uint8 x int8 products pairwise in int16 with "
        f"saturation here, and the int8 weights of {len(layers)} folded layer(s) (first: "
        f"{layers[0]!r}) use codes beyond +-{safe_weight_bound()}, so ONNX Runtime's results for "
        "the folded model on this machine will differ from the file's QDQ arithmetic. The folded "
        "model is right for CPUs with VNNI; to run it exactly here, quantize the weights to 7 bits "
        "(ONNX Runtime: quantize_static(reduce_range=True); quantbridge: recipe='int8_avx2')"
    )
