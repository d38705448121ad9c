"""``inline_autocast_off``: a ``torch.autocast(..., enabled=False)`` region of the captured graph
written back into the graph, so that its ops are placed like any other.

``torch.export`` keeps a ``with torch.autocast(device_type, enabled=False):`` block of
``forward`` as one ``higher_order.wrap_with_autocast`` call of a sub-GraphModule. The placement
walk does not look into sub-modules, so every op of the block stayed float, with no warning:
timm's EfficientViT (MIT) computes its whole linear attention (``k^T @ v``, ``q @ kv``, the
normalising division) in such a block, 8 of 60 matmuls of ``efficientvit_b0`` left float.
A float32 model is captured outside any autocast, so a region that turns autocast *off*
computes exactly what its ops compute inline: its nodes are copied into the parent graph
(metadata, ``nn_module_stack`` included) and the call is removed.

Left as captured: ``enabled=True`` regions (they compute in half precision, which inline ops
would not); they stay float, as before.
"""

from __future__ import annotations

import operator

import torch

from ._passes import finish

_WRAP_WITH_AUTOCAST = getattr(torch.ops.higher_order, "wrap_with_autocast", None)


def inline_autocast_off(gm: torch.fx.GraphModule) -> int:
    """Inline every ``wrap_with_autocast(..., enabled=False, ...)`` region of ``gm``; the count."""
    done = 0
    found = True
    while found:  # a nested region comes up with its block: inline it on the next round
        found = [n for n in gm.graph.nodes if _is_autocast_off(n)]
        for node in found:
            _inline(gm, node)
        done += len(found)
    return finish(gm, done)


def _is_autocast_off(node: torch.fx.Node) -> bool:
    # args: (device_type, dtype, enabled, cache_enabled, submodule, *operands)
    return (
        _WRAP_WITH_AUTOCAST is not None
        and node.op == "call_function"
        and node.target is _WRAP_WITH_AUTOCAST
        and len(node.args) >= 5
        and node.args[2] is False
        and isinstance(node.args[4], torch.fx.Node)
        and node.args[4].op == "get_attr"
        and all(u.op == "call_function" and u.target is operator.getitem for u in node.users)
    )


def _inline(gm: torch.fx.GraphModule, node: torch.fx.Node) -> None:
    sub = getattr(gm, node.args[4].target)
    operands = node.args[5:]
    env: dict[torch.fx.Node, object] = {}
    placeholders = [n for n in sub.graph.nodes if n.op == "placeholder"]
    env.update(zip(placeholders, operands, strict=True))
    outputs: tuple = ()
    with gm.graph.inserting_before(node):
        for n in sub.graph.nodes:
            if n.op == "placeholder":
                continue
            if n.op == "output":
                outputs = tuple(torch.fx.map_arg(n.args[0], lambda a: env[a]))
                continue
            if n.op == "get_attr":  # a constant or nested region of the block: move it up
                name = _free_name(gm, n.target)
                setattr(gm, name, getattr(sub, n.target))
                env[n] = gm.graph.get_attr(name)
                env[n].meta = dict(n.meta)
                continue
            env[n] = gm.graph.node_copy(n, lambda a: env[a])
    for user in list(node.users):  # the region's results, read through getitem
        user.replace_all_uses_with(outputs[user.args[1]])
        gm.graph.erase_node(user)
    region = node.args[4]
    gm.graph.erase_node(node)
    if not region.users and not any(
        n.op == "get_attr" and n.target == region.target and n is not region for n in gm.graph.nodes
    ):
        gm.graph.erase_node(region)
        delattr(gm, region.target)  # the block's module is gone from the model too


def _free_name(gm: torch.fx.GraphModule, target: str) -> str:
    name, i = target.replace(".", "_"), 0
    while hasattr(gm, name):
        i += 1
        name = f"{target.replace('.', '_')}_{i}"
    return name
