"""Keep near-identity scalar constants through onnxscript's optimizer.

The optimizer torch's ONNX export runs (onnxscript 0.7, ``rewriter/rules/common/_no_op.py``)
replaces ``x + c`` and ``x - c`` by ``x`` when ``math.isclose(c, 0, abs_tol=1e-8)``, and ``x * c``
and ``x / c`` when ``math.isclose(c, 1, rel_tol=1e-5)``. That is not the identity: MIT
EfficientViT's LiteMLA divides by ``out[..., -1:] + 1e-15``; without the eps a row of zeros gives
``0 / 0 = NaN`` in ONNX Runtime where torch gives 0 (``tests/torch/test_placement_divisor.py``).

Those rules match scalar constants only. ``keep_tiny_constants`` turns each such operand into a
one-element vector before the optimizer runs: the same values by broadcasting, since the other
operand has rank >= 1 (an operand of unknown or zero rank is left as it is).
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

# op -> the constant the optimizer's no-op rule takes it for (with its tolerances below)
_IDENTITY_CONSTANT: dict[str, float] = {"Add": 0.0, "Sub": 0.0, "Mul": 1.0, "Div": 1.0}
_REL_TOL, _ABS_TOL = 1e-5, 1e-8  # onnxscript's ``Constant`` pattern defaults


def _scalar(value) -> np.ndarray | None:
    """The value's constant as a 0-d array (an initializer, or a ``Constant`` node's output)."""
    tensor = value.const_value
    producer = value.producer()
    if tensor is None and producer is not None and producer.op_type == "Constant":
        attribute = producer.attributes.get("value")
        tensor = attribute.value if attribute is not None else None
    if tensor is None:
        return None
    array = tensor.numpy()
    return array if array.ndim == 0 and array.dtype.kind == "f" else None


def _taken_for_identity(op_type: str, c: float) -> bool:
    identity = _IDENTITY_CONSTANT[op_type]
    close = math.isclose(c, identity, rel_tol=_REL_TOL, abs_tol=_ABS_TOL)
    return close and c != identity


def keep_tiny_constants(model) -> int:
    """Rewrite, in the ``onnx_ir`` model's main graph, each scalar constant operand of
    Add / Sub / Mul / Div that onnxscript would take for the identity (see the module docstring)
    as a one-element initializer. Returns how many operands were rewritten."""
    graph, count = model.graph, 0
    for node in list(graph):
        if node.domain not in ("", "ai.onnx") or node.op_type not in _IDENTITY_CONSTANT:
            continue
        for i, value in enumerate(node.inputs):
            other = node.inputs[1 - i] if len(node.inputs) == 2 else None
            array = _scalar(value) if value is not None else None
            if array is None or other is None or other.shape is None or len(other.shape) == 0:
                continue
            if not _taken_for_identity(node.op_type, float(array)):
                continue
            kept = ir.tensor(array.reshape(1), name=f"qb_kept_constant_{count}")
            replacement = ir.Value(
                name=kept.name,
                shape=ir.Shape([1]),
                type=ir.TensorType(kept.dtype),
                const_value=kept,
            )
            graph.register_initializer(replacement)
            node.replace_input_with(i, replacement)
            count += 1
    return count
