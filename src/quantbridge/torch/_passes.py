"""Graph passes on the captured GraphModule that prepare it for quantizer placement.

* ``out_of_place`` - replace in-place aten ops (``out += identity`` is ``aten.add_``, an
  ``nn.ReLU(inplace=True)`` is ``aten.relu_``) by their functional twins, so the op tables, keyed by
  functional ops, see every op. Found from the op's schema (the first argument is written, a
  functional overload of the same name without ``_`` takes the same arguments), not from a list.
  Cases (numbered as in the code):

  1. the mutated value is a fresh result (not a graph input, parameter, buffer or view) of the
     same dtype as the other tensor arguments: the op becomes its twin, and readers of the
     mutated value after the op read the twin's result (what functionalization does);
  2. otherwise (a view or an input is mutated, a view of the value is read later, dtypes differ):
     the op is left as captured (it then runs in float, as any op outside the tables).
* ``own_parameters`` - give the captured module its own copies of parameters and buffers, so
  passes that rewrite weights never touch the user's float model. BN folding never writes a
  tensor (it makes new ones), so ``quantize`` folds first and copies only what the capture
  shares with the user's model afterwards (``tensor_storages``): one copy of the weights less.
* ``fold_batchnorm`` - fold an inference-mode ``batch_norm`` into the conv/linear before it:

  .. math::
     k = \\gamma / \\sqrt{\\sigma^2 + \\epsilon},\\quad W' = W \\cdot k,\\quad
     b' = (b - \\mu) \\cdot k + \\beta

  (``k`` broadcast along the weight's output-channel axis: 0, or 1 for transposed convs). Applied only when the conv's output
  feeds nothing but the batch norm, and the batch norm is not in training mode. The float result
  is unchanged up to float32 rounding; quantization then sees the folded weight, as the deployed
  engine does.
* ``written_inputs`` - the in-place ops that write a graph input (``x.mul_(2)`` in forward):
  capture refuses them, since quantize runs each calibration batch more than once.
* ``set_graph_training`` - flip the ``training`` argument of the captured batch-norm and dropout
  ops (``QuantModel.train`` calls it, so the graph follows the module's mode).
"""

from __future__ import annotations

import torch
from torch import nn

from ._ops import TRANSPOSED_CONV_OPS, WEIGHTED_OPS

aten = torch.ops.aten

# weighted ops whose output channels are the output's last dimension (BN normalises dim 1)
_CHANNELS_LAST_OPS = frozenset({aten.linear.default, aten.addmm.default, aten.baddbmm.default})


def finish(gm: torch.fx.GraphModule, changed: int, dead_code: bool = True) -> int:
    """The end of a graph pass: when it ``changed`` anything, drop dead nodes (unless a pass keeps
    them), check the graph and regenerate its code. Returns ``changed``."""
    if changed:
        if dead_code:
            gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    return changed


def functional_twin(target) -> object | None:
    """The functional overload of in-place aten op ``target`` (``add_.Tensor`` -> ``add.Tensor``),
    or None when ``target`` is not an in-place aten op whose only written argument is the first
    and whose twin takes the same arguments."""
    schema = getattr(target, "_schema", None)
    if schema is None or not schema.name.startswith("aten::") or not schema.name.endswith("_"):
        return None
    args = schema.arguments
    written = [a for a in args if a.alias_info is not None and a.alias_info.is_write]
    if not args or len(written) != 1 or written[0] is not args[0]:
        return None
    packet = getattr(aten, schema.name[len("aten::") : -1], None)
    twin = getattr(packet, schema.overload_name or "default", None)
    twin_schema = getattr(twin, "_schema", None)
    if twin_schema is None or twin_schema.is_mutable:
        return None
    if [a.name for a in twin_schema.arguments] != [a.name for a in args]:
        return None
    return twin


def _aliases(node: torch.fx.Node) -> bool:
    """``node``'s result may share storage with an input (a view, an in-place op, getitem)."""
    if node.op != "call_function":
        return True  # a graph input, parameter or buffer: not a fresh value
    schema = getattr(node.target, "_schema", None)
    return schema is None or any(r.alias_info is not None for r in schema.returns)


def written_inputs(gm: torch.fx.GraphModule) -> list[tuple[str, torch.fx.Node]]:
    """(input name, op) of each in-place op that writes a graph input, directly or through a
    view."""
    written = []
    for node in gm.graph.nodes:
        schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
        first = schema.arguments[0].alias_info if schema is not None and schema.arguments else None
        if first is None or not first.is_write or not node.args:
            continue
        source = node.args[0]
        while isinstance(source, torch.fx.Node) and _view_of_first(source):
            source = source.args[0]
        if isinstance(source, torch.fx.Node) and source.op == "placeholder":
            written.append((str(source.target), node))
    return written


def _view_of_first(node: torch.fx.Node) -> bool:
    """``node`` reads its first argument's storage: a view op, or the quantizer on an input
    (a placed graph reads the user's tensor through it where quantization is off)."""
    if not node.args:
        return False
    if node.op == "call_module":
        return str(node.target).startswith("_quantbridge")
    schema = getattr(node.target, "_schema", None) if node.op == "call_function" else None
    return schema is not None and any(r.alias_info is not None for r in schema.returns)


def _same_dtype(node: torch.fx.Node) -> bool:
    dtypes = {
        a.meta["val"].dtype
        for a in node.all_input_nodes
        if isinstance(a.meta.get("val"), torch.Tensor) and a.meta["val"].ndim > 0
    }
    return len(dtypes) <= 1


def out_of_place(gm: torch.fx.GraphModule) -> int:
    """Replace in-place aten ops by their functional twins where that keeps the program's
    meaning (see the module docstring). Returns how many were replaced."""
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    replaced = 0
    for node in list(gm.graph.nodes):
        twin = functional_twin(node.target) if node.op == "call_function" else None
        if twin is None:
            continue
        mutated = node.args[0] if node.args else None
        if not isinstance(mutated, torch.fx.Node) or _aliases(mutated) or not _same_dtype(node):
            continue  # Case 2: an input, a parameter or a view is written
        others = [u for u in mutated.users if u is not node]
        if any(_aliases(u) and u.op == "call_function" for u in others):
            continue  # Case 2: a view of the value may be read after the write
        node.target = twin  # Case 1
        for user in others:
            if order[user] > order[node]:  # readers after the write saw the written value
                user.replace_input_with(mutated, node)
        replaced += 1
    return finish(gm, replaced, dead_code=False)


def own_parameters(gm: torch.fx.GraphModule, shared: set[int] | None = None) -> None:
    """Replace every parameter and buffer of ``gm`` by a copy, or only those whose storage is
    in ``shared`` (``tensor_storages`` taken before passes that create new tensors: a folded
    weight is ``gm``'s own already, and copying it would only add a copy of the model)."""
    copies: dict[int, torch.Tensor] = {}  # by id: tied weights (one Parameter) stay tied
    for name, p in list(gm.named_parameters(remove_duplicate=False)):
        if shared is None or _storage(p) in shared:
            owner, attr = _owner(gm, name)
            if id(p) not in copies:
                copies[id(p)] = nn.Parameter(p.detach().clone(), requires_grad=p.requires_grad)
            setattr(owner, attr, copies[id(p)])
    for name, b in list(gm.named_buffers(remove_duplicate=False)):
        if shared is None or _storage(b) in shared:
            owner, attr = _owner(gm, name)
            if id(b) not in copies:
                copies[id(b)] = b.detach().clone()
            owner.register_buffer(attr, copies[id(b)])


def tensor_storages(gm: nn.Module) -> set[int]:
    """The storages of ``gm``'s parameters and buffers (those it may share with the user's model)."""
    return {_storage(t) for t in (*gm.parameters(), *gm.buffers())}


def _storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _owner(gm: nn.Module, fqn: str) -> tuple[nn.Module, str]:
    prefix, _, attr = fqn.rpartition(".")
    return (gm.get_submodule(prefix) if prefix else gm), attr


def _unwrap(node):
    """The get_attr behind a quantizer call (QAT graphs quantize weights before the conv)."""
    while (
        isinstance(node, torch.fx.Node)
        and node.op == "call_module"
        and str(node.target).startswith("_quantbridge.")
    ):
        node = node.args[0]
    return node


def _param(gm: nn.Module, node) -> torch.Tensor | None:
    node = _unwrap(node)
    if not isinstance(node, torch.fx.Node):
        return None
    if node.op != "get_attr":
        raise _NotFoldable
    owner, attr = _owner(gm, node.target)
    return getattr(owner, attr)


class _NotFoldable(Exception):
    pass


def fold_batchnorm(gm: torch.fx.GraphModule, on_fold=None) -> int:
    """Fold every eligible conv/linear -> batch_norm pair. Returns how many were folded.

    ``on_fold(conv_node, k)`` is called after each fold with the per-channel factor ``k``
    (float64), so quantizers of the weight can follow (QAT folds after training started).
    """
    folded = 0
    for bn in list(gm.graph.nodes):
        if bn.op != "call_function" or bn.target is not aten.batch_norm.default:
            continue
        producer = bn.args[0]
        if (
            not isinstance(producer, torch.fx.Node)
            or producer.target not in WEIGHTED_OPS
            or len(producer.users) != 1
            or bn.args[5]  # training=True: statistics still move (QAT folds later)
        ):
            continue
        try:
            k = _fold_one(gm, producer, bn)
        except _NotFoldable:
            continue
        if on_fold is not None:
            on_fold(producer, k)
        folded += 1
    return finish(gm, folded)


def _fold_one(gm: torch.fx.GraphModule, conv, bn) -> torch.Tensor:
    gamma, beta, mean, var = (_param(gm, a) for a in bn.args[1:5])
    eps = float(bn.args[7])
    _, i_w, i_b, axis = WEIGHTED_OPS[conv.target]  # axis: the weight's output-channel axis
    if conv.target in _CHANNELS_LAST_OPS and _out_ndim(conv) != 2:
        raise _NotFoldable  # linear / addmm on 3-D: BN's dim 1 is not their output channel
    w_node = _unwrap(conv.args[i_w])
    w = _param(gm, w_node)
    if w is None or mean is None or var is None:
        raise _NotFoldable
    b_node = _unwrap(conv.args[i_b]) if len(conv.args) > i_b else None
    if b_node is None and i_b != 2:
        raise _NotFoldable  # a bias slot that is not the third argument is never empty
    b = _param(gm, b_node)
    with torch.no_grad():
        k = torch.rsqrt(var.double() + eps)
        if gamma is not None:
            k = k * gamma.double()
        if conv.target in TRANSPOSED_CONV_OPS and len(conv.args) > 6 and conv.args[6] != 1:
            raise _NotFoldable  # grouped transposed conv: out channels are not one weight axis
        shape = [1] * w.ndim
        shape[axis] = -1
        new_w = (w * k.reshape(shape)).to(w.dtype)  # float64 product (promotion)
        b0 = b.double() if b is not None else torch.zeros_like(mean, dtype=torch.float64)
        new_b = (b0 - mean.double()) * k + (beta.double() if beta is not None else 0.0)
    owner, attr = _owner(gm, w_node.target)
    setattr(owner, attr, nn.Parameter(new_w, requires_grad=w.requires_grad))
    if b is not None:
        b_owner, b_attr = _owner(gm, b_node.target)
        setattr(b_owner, b_attr, nn.Parameter(new_b.to(w.dtype), requires_grad=b.requires_grad))
    else:
        prefix = w_node.target.rpartition(".")[0]
        owner.register_parameter("bias", nn.Parameter(new_b.to(w.dtype)))
        with gm.graph.inserting_after(w_node):
            b_node = gm.graph.get_attr(f"{prefix}.bias" if prefix else "bias")
        args = list(conv.args) + [None] * (3 - len(conv.args))
        args[2] = b_node
        conv.args = tuple(args)
    bn.replace_all_uses_with(conv)
    gm.graph.erase_node(bn)
    return k


def _out_ndim(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    return val.ndim if isinstance(val, torch.Tensor) else -1


def set_graph_training(gm: torch.fx.GraphModule, bn: bool, dropout: bool) -> None:
    """Flip the ``training`` argument of batch_norm and dropout nodes of the captured graph.

    A batch_norm without running statistics is left as it is: it normalizes by the statistics
    of its input in every mode (weight standardization, ``F.batch_norm(w, None, None,
    training=True)`` in timm's StdConv2d and HF BiT), and torch refuses it with
    ``training=False`` ("running_mean must be defined in evaluation mode")."""
    changed = False
    for node in gm.graph.nodes:
        if node.op != "call_function":
            continue
        if (
            node.target is aten.batch_norm.default
            and node.args[3] is not None
            and node.args[5] != bn
        ):
            node.args = node.args[:5] + (bn,) + node.args[6:]
            changed = True
        elif node.target is aten.dropout.default and len(node.args) > 2 and node.args[2] != dropout:
            node.args = node.args[:2] + (dropout,) + node.args[3:]
            changed = True
    if changed:
        gm.recompile()
