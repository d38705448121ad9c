"""Graph outputs whose channels span very different ranges: the layer writing them stays float.

The concat trap (``quantbridge.torch._ranges``) has a second form: one layer writes the whole
output, some channels in pixels and others in probabilities (a YOLO-style head conv, a
regression + score Gemm). One per-tensor scale on that output is set by the large channels and
wipes out the small ones, and no later op can separate them again. ``quantize_onnx`` runs the
imported float model on the first calibration batch; a graph output written directly by a
weighted node (Conv, ConvTranspose, Gemm, MatMul) whose per-channel absolute maximum has a
largest / median ratio of at least ``RANGE_RATIO`` (the concat rule's 16: the median channel
would keep 16 levels or fewer) makes that node part of the float head (a recipe skip rule, as
``_head``). The node then has float weights and output and ``inspect`` lists it under float
ops; its input stays quantized by the layers before it. Channels: axis 1 for convolutions, the
last axis for Gemm / MatMul.
"""

from __future__ import annotations

import onnx
import torch

from ...recipe import Rule
from ...torch._outliers import channel_ratio
from ...torch._ranges import RANGE_RATIO

CHANNELS_FIRST = frozenset({"Conv", "ConvTranspose"})
CHANNELS_LAST = frozenset({"Gemm", "MatMul"})


def mixed_range_outputs(
    model: onnx.ModelProto, values: list[torch.Tensor], ratio: float = RANGE_RATIO
) -> dict[str, float]:
    """ONNX name of each weighted node writing a graph output whose channels are ``ratio`` or
    more apart -> that ratio; ``values`` are the graph outputs of the float model, in order."""
    writer = {o: n for n in model.graph.node for o in n.output}
    found = {}
    for out, value in zip(model.graph.output, values, strict=False):
        node = writer.get(out.name)
        if node is None or not isinstance(value, torch.Tensor) or value.ndim < 2:
            continue
        if node.op_type in CHANNELS_FIRST:
            r = channel_ratio(value.movedim(1, -1))
        elif node.op_type in CHANNELS_LAST:
            r = channel_ratio(value)
        else:
            continue
        if r >= ratio:
            found[node.name] = r
    return found


def output_rules(model: onnx.ModelProto, module, batch: tuple) -> list[Rule]:
    """Skip rules for the imported ``module``'s layers that ``mixed_range_outputs`` names."""
    with torch.no_grad():
        values = module(*batch)
    values = list(values) if isinstance(values, (tuple, list)) else [values]
    found = mixed_range_outputs(model, values)
    return [Rule(pattern=a, skip=True) for a, name in module.onnx_names.items() if name in found]
