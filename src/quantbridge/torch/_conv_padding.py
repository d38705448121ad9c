"""``explicit_conv_padding``: convolutions written with a string padding (``padding="same"`` or
``"valid"``) as the integer-padding convolutions they compute, so that the op tables see them.

``nn.Conv2d(..., padding="same")`` is captured as ``aten.conv2d.padding``, an overload of its
own that ``_ops.WEIGHTED_OPS`` (keyed by ``aten.conv2d.default``) does not hold: such a conv got
no quantizer at all and ran in float, without a word (Hugging Face EfficientNet: 36 of its 58
convs, every one but the depthwise convs behind a ``ZeroPad2d``). Each such conv of the
captured graph becomes, as torch's own ``_convolution_mode`` computes it:

* ``"valid"``: ``conv(x, w, b, stride, 0, dilation, groups)``;
* ``"same"`` (stride 1, torch refuses others): per spatial dimension ``s = dilation * (k - 1)``,
  left padding ``s // 2``, right padding ``s - s // 2``. Symmetric everywhere:
  ``conv(x, ..., padding=[s // 2 ...])``; otherwise (an even kernel) the extra column is padded
  first, ``conv(constant_pad_nd(x, [0, 1, ...]), ..., padding=[s // 2 ...])``, the same values.

The conv node is rewritten in place (its name, ``nn_module_stack`` and fake value stay), so the
user's layer names are unchanged.
"""

from __future__ import annotations

import contextlib

import torch
from torch._guards import detect_fake_mode

from ._nodes import weight_of
from ._passes import finish

aten = torch.ops.aten
_TWINS = {
    aten.conv1d.padding: aten.conv1d.default,
    aten.conv2d.padding: aten.conv2d.default,
    aten.conv3d.padding: aten.conv3d.default,
}


def explicit_conv_padding(gm: torch.fx.GraphModule) -> int:
    """Rewrite every string-padding conv of ``gm`` with integer padding; the count."""
    done = 0
    for node in list(gm.graph.nodes):
        if node.op == "call_function" and node.target in _TWINS and _rewrite(gm, node):
            done += 1
    return finish(gm, done)


def _weight_shape(gm: torch.fx.GraphModule, w) -> tuple | None:
    val = w.meta.get("val") if isinstance(w, torch.fx.Node) else None
    if isinstance(val, torch.Tensor):
        return tuple(val.shape)
    if isinstance(w, torch.fx.Node) and w.op == "get_attr":
        return tuple(weight_of(gm, w.target).shape)
    return None


def _rewrite(gm: torch.fx.GraphModule, node: torch.fx.Node) -> bool:
    names = ("input", "weight", "bias", "stride", "padding", "dilation", "groups")
    a = {"bias": None, "stride": 1, "padding": "valid", "dilation": 1, "groups": 1}
    a.update(zip(names, node.args, strict=False))
    a.update(node.kwargs)
    shape = _weight_shape(gm, a["weight"])
    if shape is None or a["padding"] not in ("same", "valid"):
        return False
    kernel = shape[2:]
    nd = len(kernel)
    dilation = [a["dilation"]] * nd if isinstance(a["dilation"], int) else list(a["dilation"])
    stride = [a["stride"]] * nd if isinstance(a["stride"], int) else list(a["stride"])
    x = a["input"]
    if a["padding"] == "valid":
        left = [0] * nd
    else:
        spans = [d * (k - 1) for d, k in zip(dilation, kernel, strict=True)]
        left = [s // 2 for s in spans]
        extra = [s - s // 2 - s // 2 for s in spans]
        if any(extra):  # F.pad's order: last dimension first, (before, after) each
            pads = [p for e in reversed(extra) for p in (0, e)]
            with gm.graph.inserting_before(node):
                x = gm.graph.call_function(aten.constant_pad_nd.default, (x, pads, 0.0))
            x_val = a["input"].meta.get("val")
            if isinstance(x_val, torch.Tensor):
                with detect_fake_mode([x_val]) or contextlib.nullcontext():
                    x.meta["val"] = aten.constant_pad_nd.default(x_val, pads, 0.0)
            for key in ("nn_module_stack", "stack_trace", "source_fn_stack"):
                if key in node.meta:
                    x.meta[key] = node.meta[key]
    node.target = _TWINS[node.target]
    node.args = (x, a["weight"], a["bias"], stride, left, dilation, a["groups"])
    node.kwargs = {}
    return True
