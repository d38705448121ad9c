"""What a QDQ file does at each Concat whose inputs lie on different quantization scales.

Joining tensors of very different ranges (box coordinates in pixels and class probabilities) on
one scale wipes out the small-range part, so ``quantize`` keeps such a concat's inputs on their
own scales and the concat in float (``quantbridge.torch._ranges``). ``inspect`` shows where,
read from the file alone: a Concat whose data inputs all come from DequantizeLinear with scales
that differ, and whether its output is quantized again (one output scale: "requantized") or not
("output float").
"""

from __future__ import annotations

import numpy as np


def separate_scale_concats(g) -> list[str]:
    """One line per Concat of ``g`` (the inspector's ``_Graph``) with inputs on different
    scales, e.g. ``Concat 'head': 2 inputs on their own scales (steps 0.0039 to 2.5, 640x
    apart), output float``."""
    lines = []
    for node in g.nodes:
        if node.op_type != "Concat":
            continue
        steps = [_input_step(g, t) for t in node.input if t]
        if len(steps) < 2 or any(s is None for s in steps):
            continue
        lo, hi = min(steps), max(steps)
        if hi <= lo * (1 + 1e-6):
            continue  # one shared scale
        consumers = g.consumers.get(node.output[0], [])
        requantized = (
            bool(consumers)
            and node.output[0] not in g.outputs
            and all(c.op_type == "QuantizeLinear" for c in consumers)
        )
        label = f"Concat {node.name!r}" if node.name else f"Concat -> {node.output[0]!r}"
        lines.append(
            f"{label}: {len(steps)} inputs on their own scales (steps {lo:.3g} to {hi:.3g}, "
            f"{hi / lo:.0f}x apart), {'requantized to one output scale' if requantized else 'output float'}"
        )
    return lines


def _input_step(g, tensor: str) -> float | None:
    """The scalar scale of the DequantizeLinear producing ``tensor`` (None otherwise)."""
    dq = g.producer.get(tensor)
    if dq is None or dq.op_type != "DequantizeLinear":
        return None
    scale = g.array(dq.input[1])
    return float(scale) if scale is not None and np.size(scale) == 1 else None
