"""Graph helpers the PTQ methods share: read and replace the weight and bias of a captured
conv / linear node, and run the captured graph: batch by batch recording chosen nodes' values
(``record``), or every batch at once node by node (``Lockstep``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from .._heap import release_free_memory
from .._ops import TRANSPOSED_CONV_OPS, WEIGHTED_OPS
from .._passes import _owner, _unwrap

aten = torch.ops.aten

# weighted ops the methods rescale: weight (out, in / groups, ...), output channels on axis 0
PLAIN_WEIGHTED = frozenset(op for op in WEIGHTED_OPS if op not in TRANSPOSED_CONV_OPS)
CONV_OPS = frozenset(PLAIN_WEIGHTED - {aten.linear.default})


def attr_node(node) -> torch.fx.Node | None:
    """The ``get_attr`` node behind an argument (through placed quantizers), else None."""
    node = _unwrap(node)
    return node if isinstance(node, torch.fx.Node) and node.op == "get_attr" else None


def get_tensor(gm: nn.Module, node: torch.fx.Node) -> torch.Tensor:
    owner, attr = _owner(gm, node.target)
    return getattr(owner, attr)


def set_tensor(gm: nn.Module, node: torch.fx.Node, value: torch.Tensor) -> None:
    """Replace the parameter (or buffer) read by ``node`` with ``value`` in its dtype."""
    owner, attr = _owner(gm, node.target)
    old = getattr(owner, attr)
    value = value.detach().to(old.dtype)
    if isinstance(old, nn.Parameter):
        setattr(owner, attr, nn.Parameter(value, requires_grad=old.requires_grad))
    else:
        owner.register_buffer(attr, value)


def weight_and_bias(gm: nn.Module, node: torch.fx.Node):
    """(weight get_attr, bias get_attr or None) of a conv / linear, or None when the weight is
    not a plain parameter of the captured module."""
    if node.op != "call_function" or node.target not in PLAIN_WEIGHTED:
        return None
    w = attr_node(node.args[1])
    if w is None:
        return None
    b = attr_node(node.args[2]) if len(node.args) > 2 and node.args[2] is not None else None
    if len(node.args) > 2 and node.args[2] is not None and b is None:
        return None
    return w, b


def conv_geometry(node: torch.fx.Node, dims: int) -> tuple[tuple[int, ...], ...]:
    """(stride, padding, dilation) of an ``aten.conv*d`` node, ``dims`` ints each (aten's
    defaults 1, 0, 1 where an argument is absent; a one-element list broadcasts)."""
    args = list(node.args) + [None] * 7
    return tuple(_per_dim(v, d, dims) for v, d in zip(args[3:6], (1, 0, 1), strict=True))


def _per_dim(value, default: int, dims: int) -> tuple[int, ...]:
    if value is None:
        return (default,) * dims
    value = list(value) if isinstance(value, (list, tuple)) else [value]
    return tuple(int(v) for v in (value * dims if len(value) == 1 else value))


def groups_of(node: torch.fx.Node) -> int:
    if node.target in CONV_OPS:
        return int(node.args[6]) if len(node.args) > 6 else int(node.kwargs.get("groups", 1))
    return 1


def record(
    gm: torch.fx.GraphModule,
    batches: Iterable[tuple[tuple, dict]],
    watched: set[torch.fx.Node],
    on_value: Callable[[torch.fx.Node, torch.Tensor], None],
    on_args: Callable[[torch.fx.Node, tuple], None] | None = None,
) -> None:
    """Run every batch through ``gm``, one at a time; ``on_value(node, value)`` for each watched
    node's output, ``on_args(node, args)`` with its evaluated arguments (before it runs)."""

    def before(node, step):
        if node in watched and on_args is not None:
            on_args(node, step.args(node)[0])

    def after(node, values, step):
        if node in watched:
            on_value(node, values[0])

    for batch in batches:
        Lockstep(gm, [batch]).run(after, before)


class Lockstep:
    """``batches`` ((args, kwargs) calls) through ``gm`` together, node by node: each node runs on
    every batch before the next node does, and a value is freed once no later node reads it, so
    what is held is one value per live edge per batch. A pass can then change a parameter after
    the node that reads it ran on every batch, and run that node again (``rerun``) before the
    rest of the graph sees it."""

    def __init__(self, gm: torch.fx.GraphModule, batches: Iterable[tuple[tuple, dict]]):
        self.gm = gm
        self.runs = []
        for args, kwargs in batches:
            run = torch.fx.Interpreter(gm)  # one environment per batch (its ``env``)
            run.env = {}
            run.args_iter = iter(gm.graph.process_inputs(*tree_flatten((args, kwargs))[0]))
            self.runs.append(run)

    def args(self, node: torch.fx.Node) -> list[tuple]:
        """``node``'s evaluated positional arguments, one tuple per batch."""
        return [run.fetch_args_kwargs_from_env(node)[0] for run in self.runs]

    def rerun(self, nodes: Iterable[torch.fx.Node]) -> list:
        """Run ``nodes`` (in order; their inputs still held) again on every batch; the last
        one's new values. A node's previous values are released before it runs again (one
        value per batch held, not two, unless the caller still holds the old ones)."""
        values: list = []
        for node in nodes:
            for run in self.runs:
                run.env.pop(node, None)
            values = [run.run_node(node) for run in self.runs]
            for run, value in zip(self.runs, values, strict=True):
                run.env[node] = value
        return values

    def run(
        self,
        after: Callable[[torch.fx.Node, list, Lockstep], None],
        before: Callable[[torch.fx.Node, Lockstep], None] | None = None,
        constants_late: bool = False,
    ) -> int:
        """Every node in graph order: ``before(node, self)``, the node on every batch, then
        ``after(node, values, self)`` (one value per batch; its inputs are freed only after
        that). Returns the peak bytes of the tensors held: a parameter read is not counted, a
        view counts as a copy (an upper bound). ``constants_late``: the nodes that read no
        input (a weight's quantizer: placement puts them all first) run just before their
        first reader instead (``late_constants``), so their values are not all held from the
        start (the same values: each node still runs after its inputs)."""
        if not self.runs:
            return 0
        order = late_constants(self.gm.graph) if constants_late else list(self.gm.graph.nodes)
        last_uses = last_readers(order)
        sizes: dict = {}
        held = peak = 0
        with torch.no_grad():
            for node in order:
                if before is not None:
                    before(node, self)
                values = self.rerun([node])
                if node.op != "get_attr":
                    sizes[node] = sum(_nbytes(v) for v in values)
                    held += sizes[node]
                    peak = max(peak, held)
                after(node, values, self)
                for dead in last_uses.get(node, ()):
                    for run in self.runs:
                        del run.env[dead]
                    held -= sizes.pop(dead, 0)
        return peak

    def sweep(
        self,
        layers: set[torch.fx.Node],
        measure: Callable[[torch.fx.Node, int, object], None],
        correct: Callable[[torch.fx.Node], Iterable[torch.fx.Node]],
        pack: Callable[[torch.fx.Node, object], Callable[[], object] | None] | None = None,
    ) -> None:
        """The walk of ``run`` with ``after`` rerunning each of ``layers`` after a correction,
        holding less: the graph (``late_constants`` order) is cut at ``layers``, and each
        stretch between two of them runs a batch at a time; the layer then runs on each batch
        in turn, ``measure(layer, i, value)`` seeing batch ``i``'s output, which is not kept;
        ``correct(layer)`` (every batch measured) may change parameters and returns the
        constant nodes to evaluate again (a bias and its quantizer); the layer runs again, on
        each batch, as the first node of the next stretch. Held: between stretches, one value
        per live edge per batch; within a stretch, one batch's other values besides (``run``
        held every batch's values at every node: a stem conv's output and its activation's for
        all images). A node that reads no input (a parameter, its quantizer) runs once, its
        value shared by every batch (``run`` ran it per batch: a copy each). ``pack(node,
        value)``: a value held from one stretch to a later one is kept as what ``pack`` turned
        it into (a callable that gives the value back, or None: kept as it is), and given back
        for the batch's stretch that reads it. Every node sees the same values as in ``run``
        (where ``pack`` gives back the same values)."""
        constant = constant_nodes(self.gm.graph)
        order = late_constants(self.gm.graph)
        last_uses = last_readers(order)
        packed: list[dict] = [{} for _ in self.runs]  # per batch: node -> _Packed (or None)
        largest = [0]  # bytes of the largest value the batch's stretch made

        def evaluate(node):  # once for every batch: the same value
            value = self.runs[0].run_node(node)
            for run in self.runs:
                run.env[node] = value
                for dead in last_uses.get(node, ()):
                    run.env.pop(dead, None)

        def step(i, node, keep=True):
            run = self.runs[i]
            for arg in node.all_input_nodes:
                if isinstance(run.env.get(arg), _Packed):
                    run.env[arg] = run.env[arg].rebuild()
            value = run.run_node(node)
            largest[0] = max(largest[0], _nbytes(value))
            if not keep:
                return value
            run.env[node] = value
            for dead in last_uses.get(node, ()):
                run.env.pop(dead, None)
                packed[i].pop(dead, None)
            return None

        def hold(i):  # the end of batch i's stretch: what it still holds, packed
            env = self.runs[i].env
            if pack is not None and largest[0] >= TRIM_BYTES:
                release_free_memory()  # what the stretch freed (``_heap``)
            largest[0] = 0
            for node, value in env.items():
                if pack is None or node in constant or isinstance(value, _Packed):
                    continue
                if node not in packed[i]:
                    rebuild = pack(node, value)
                    packed[i][node] = _Packed(rebuild) if rebuild is not None else None
                if packed[i][node] is not None:
                    env[node] = packed[i][node]

        def advance(stretch):
            for i in range(len(self.runs)):
                for node in stretch:
                    if node not in constant:
                        step(i, node)
                    elif i == 0:
                        evaluate(node)
                hold(i)

        stretch: list[torch.fx.Node] = []
        with torch.no_grad():
            for node in order:
                if node not in layers:
                    stretch.append(node)
                    continue
                advance(stretch)
                for i in range(len(self.runs)):
                    measure(node, i, step(i, node, keep=False))
                    hold(i)
                for again in correct(node):
                    evaluate(again)
                stretch = [node]
            advance(stretch)


class _Packed:
    """A value ``Lockstep.sweep`` holds in another form: ``rebuild()`` gives it back."""

    def __init__(self, rebuild: Callable[[], object]):
        self.rebuild = rebuild


# with ``pack``, a batch's stretch that made a value of this many bytes hands the heap's free
# pages back after it (``_heap``): ResNet-18-style's stem at batch 8 (each call costs ~10 ms:
# at 4 MiB, stage 1 too, 88 calls at 64 images, 1.1 s)
TRIM_BYTES = 16 << 20


def constant_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The parameter reads (``get_attr``) and the module calls on them alone (a weight's or a
    bias's quantizer): the nodes whose value does not depend on the batch."""
    constant: set[torch.fx.Node] = set()
    for node in graph.nodes:
        if node.op == "get_attr" or (
            node.op == "call_module" and all(a in constant for a in node.all_input_nodes)
        ):
            constant.add(node)
    return constant


def late_constants(graph: torch.fx.Graph) -> list[torch.fx.Node]:
    """``graph``'s nodes, with the parameter reads (``get_attr``) and the module calls on them
    alone (a weight's or a bias's quantizer) each moved to just before its first reader that
    is neither, or kept in place when it has none; the rest keep their order. Every node still
    comes after its inputs, but a value's last reader may change: a parameter read by two
    quantizers (a layer called twice, ALBERT's shared layers) whose graph order is the reverse
    of their readers' (``last_readers`` of this order says when to free it). Operator calls
    stay in place (an in-place operator on a parameter must keep its order)."""
    constant = constant_nodes(graph)
    late: set[torch.fx.Node] = set()  # the constants some other node reads, maybe through others
    for node in reversed(graph.nodes):
        if node in constant and any(u not in constant or u in late for u in node.users):
            late.add(node)
    order: list[torch.fx.Node] = []
    placed: set[torch.fx.Node] = set()

    def place(node: torch.fx.Node) -> None:
        for a in node.all_input_nodes:
            if a in late and a not in placed:
                place(a)
        placed.add(node)
        order.append(node)

    for node in graph.nodes:
        if node not in late and node not in placed:
            place(node)
    return order


def last_readers(order: list[torch.fx.Node]) -> dict[torch.fx.Node, list[torch.fx.Node]]:
    """Per node, the values it is the last reader of when the nodes run in ``order`` (what
    ``torch.fx.Interpreter.user_to_last_uses`` gives for the graph's own order)."""
    last: dict[torch.fx.Node, torch.fx.Node] = {}
    for node in order:
        for value in node.all_input_nodes:
            last[value] = node
    readers: dict[torch.fx.Node, list[torch.fx.Node]] = {}
    for value, node in last.items():
        readers.setdefault(node, []).append(value)
    return readers


def _nbytes(value) -> int:
    leaves, _ = tree_flatten(value)
    return sum(t.numel() * t.element_size() for t in leaves if isinstance(t, torch.Tensor))
