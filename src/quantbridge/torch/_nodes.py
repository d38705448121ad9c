"""Questions about the nodes of a captured graph that placement and its readers ask: which user
module produced a node, which values are constants, which are float tensors."""

from __future__ import annotations

import torch


def module_of(node: torch.fx.Node) -> tuple[str, str]:
    """(module path, module class name) of the innermost user module that produced ``node``."""
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return "", ""
    path, kind = list(stack.values())[-1]
    type_name = kind if isinstance(kind, str) else getattr(kind, "__name__", str(kind))
    return path, type_name.rsplit(".", 1)[-1]


def constant_values(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """Nodes whose value depends on no graph input: parameters, buffers, and ops computing only
    from them and from literals. A dependence on an input's shape (``sym_size`` under dynamic
    shapes) counts as depending on the input; random ops (``randn``, ``dropout``: torch tags them
    ``nondeterministic_seeded``) are sources of run-time values like an input."""
    dependent: set[torch.fx.Node] = set()
    constant: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "output":
            continue
        if node.op == "placeholder" or _is_random(node):
            dependent.add(node)
        elif any(a in dependent for a in node.all_input_nodes):
            dependent.add(node)
        else:
            constant.add(node)
    return constant


def _is_random(node: torch.fx.Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return node.op == "call_function" and torch.Tag.nondeterministic_seeded in tags


def is_float_tensor(node) -> bool:
    """``node`` is a float32 (or float64: a model checked in float64) tensor, the floats that
    quantizers read and write. Half-precision values inside a float32 model stay float: HF
    Falcon's ALiBi slopes ``slopes.bfloat16() * positions`` got a quantizer whose float32 output
    failed torch's own dtype check in the captured graph (and ONNX Runtime has no bfloat16
    QuantizeLinear)."""
    if not isinstance(node, torch.fx.Node):
        return False
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.dtype in (torch.float32, torch.float64)


def weight_of(model: torch.nn.Module, name: str) -> torch.Tensor:
    """The tensor a weight quantizer reads: a parameter, or a buffer used as a weight (timm
    TResNet's anti-aliasing blur: ``F.conv2d(x, self.filt)``, ``filt`` a registered buffer)."""
    try:
        return model.get_parameter(name)
    except AttributeError:
        return model.get_buffer(name)
