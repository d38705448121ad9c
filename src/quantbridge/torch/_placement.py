"""Placement: insert quantizers into the captured graph as the recipe and the op tables say.

Walks the graph once in topological order and asks ``_ops.op_role`` for each node:

1. WEIGHTED (conv, linear): quantize the activation input, the weight (per channel along the
   op's output-channel axis), the bias (int32, scale = input scale x weight scale) and the output.
2. ARITHMETIC (add, mul, matmul, bmm, cat): quantize every floating input (constants excepted,
   see below) and the output. With ``recipe.align_concat_inputs`` the inputs of ``cat`` share one
   quantizer with its output (the concat then only moves integers); with
   ``recipe.align_add_inputs`` the same for ``add`` inputs. With ``recipe.quantize_constants``
   the constant operand of an add / mul between quantized values (a Python scalar, a buffer)
   gets a ``ConstantQuantizer``: an integer initializer in the export, so engines fuse the op.
3. DATA_MOVEMENT (max-pool, reshape, permute, ...): the output lies on the input's grid, so the
   *same* quantizer is applied again with ``observe=False`` (a no-op in value that gives the
   exported graph its DQ -> op -> Q pattern with identical parameters).
   IDENTITY_IN_EVAL (dropout): the output counts as on the input's grid, but no quantizer is
   applied after it (nor after data movement following it): in QAT, train-mode dropout scales
   the kept values by ``1 / (1 - p)``, and the input's grid would clip them.
4. FOLDABLE_ACTIVATION (relu, relu6, clamp): an output quantizer moves past them, so the clamp is
   absorbed by the quantization range (one quantizer after ``conv -> relu``, none between).

"Quantized" is tracked per value: ``self.grid[node]`` is the quantizer whose grid ``node``'s
output lies on. Inputs already on a grid are not quantized twice.

Values that depend on no graph input (``constant_values``: computed only from parameters,
buffers and literals, such as BERT's position-embedding lookup ``embedding(weight,
position_ids)``) get no activation quantizer: they are the same on every run, so there is nothing
to observe, and engines fold them - OpenVINO constant-folds a Q/DQ pair on such a value and then
fails to compile the model (MiniLM: "[AddTransformation] ... index < m_inputs.size()"). An op
with such an input quantizes its other inputs and its output as usual; a ``cat`` with one does
not share its inputs' quantizer with its output (the float constant would be clipped to a grid
observed without it). The weight slot of a WEIGHTED op is the exception: a parameter gets its
weight quantizer, and a weight computed from parameters (``w.t()``, a parametrization) keeps the
activation-style quantizer it had, so the op still runs on int8 weights.

A concat listed in ``separate_concats`` (inputs whose ranges are too far apart for one scale, see
``_ranges``) quantizes each input on its own grid and stays float, output included.

The result is recorded as plain data (``QuantPoint``, in ``_record`` with the graph edits that
put one quantizer in place) - which user module and tensor each quantizer serves - so export and
debug tools use the record, not name guessing.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ..recipe import Recipe, TensorRecipe
from ._capture import user_stacklevel
from ._fakequant import BiasQuantizer, ConstantQuantizer, Quantizer, WeightQuantizer
from ._ops import (
    ARITHMETIC_OPS,
    CONSTANT_OPERAND_OPS,
    WEIGHTED_OPS,
    Role,
    is_epilogue,
    keeps_float_output,
    op_role,
    tensor_args,
)
from ._record import (
    CONTAINER,
    QuantPoint,
    add_bias_quantizer,
    add_quantizer,
    insert_call,
    output_quantizers,
    parameter_point,
    quantize_new_bias,
)


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


def _is_float_tensor(node) -> bool:
    if not isinstance(node, torch.fx.Node):
        return False
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


class _Placer:
    def __init__(
        self, gm: torch.fx.GraphModule, recipe: Recipe, separate_concats: frozenset = frozenset()
    ):
        self.gm, self.graph, self.recipe = gm, gm.graph, recipe
        self.separate_concats = separate_concats
        self.container = nn.Module()
        gm.add_submodule(CONTAINER, self.container)
        self.grid: dict[torch.fx.Node, Quantizer] = {}
        self.points: dict[str, QuantPoint] = {}
        self.input_fq: dict[torch.fx.Node, torch.fx.Node] = {}
        self.weight_fq: dict[torch.fx.Node, torch.fx.Node] = {}
        self.constant_fq: dict[torch.fx.Node, torch.fx.Node] = {}
        self.biases: list[BiasQuantizer] = []
        self.seen_modules: set[tuple[str, str]] = set()
        self.scaled_in_training: set[torch.fx.Node] = set()  # see identity_in_eval
        self.constant = constant_values(self.graph)  # of the graph before any insertion

    # -- module bookkeeping ---------------------------------------------------------------------
    def _add(self, module: nn.Module, point: QuantPoint) -> str:
        target = add_quantizer(self.container, module, point)
        self.points[point.attr] = point
        return target

    def _call(self, target: str, value: torch.fx.Node, observe: bool = True) -> torch.fx.Node:
        return insert_call(self.graph, target, value, observe)

    def _new_activation(
        self, value: torch.fx.Node, recipe: TensorRecipe, module: str, producer: torch.fx.Node
    ) -> tuple[Quantizer, str]:
        name = f"{module}/{producer.name}" if module else producer.name
        q = Quantizer(name, recipe, "activation")
        point = QuantPoint(
            "", name, "activation", module, value.name, recipe.scheme.to_dict(), recipe.method
        )
        return q, self._add(q, point)

    # -- quantizing values ----------------------------------------------------------------------
    def quantize_input(
        self, consumer: torch.fx.Node, value, recipe: TensorRecipe, constant_too: bool = False
    ) -> None:
        """Quantize ``value`` where ``consumer`` reads it (one quantizer per value). A value that
        depends on no input stays float unless ``constant_too`` (a computed weight)."""
        if not _is_float_tensor(value) or value in self.grid or keeps_float_output(value):
            return
        if value in self.constant and not constant_too:
            return
        if value not in self.input_fq:
            module = "input" if value.op == "placeholder" else module_of(value)[0]
            q, target = self._new_activation(value, recipe, module, value)
            fq = self._call(target, value)
            self.grid[fq] = q
            self.input_fq[value] = fq
        consumer.replace_input_with(value, self.input_fq[value])

    def quantize_output(self, node: torch.fx.Node, recipe: TensorRecipe) -> Quantizer | None:
        if node in self.constant:
            return None
        last = node
        while len(last.users) == 1:
            (user,) = last.users
            if not is_epilogue(user, last):
                break
            last = user
        if not _is_float_tensor(last):
            return None
        q, target = self._new_activation(last, recipe, module_of(node)[0], node)
        fq = self._call(target, last)
        last.replace_all_uses_with(fq, delete_user_cb=lambda u: u is not fq)
        self.grid[fq] = q
        return q

    # -- per role -------------------------------------------------------------------------------
    def weighted(self, node: torch.fx.Node, wr: TensorRecipe, ar: TensorRecipe) -> None:
        i_x, i_w, i_b, axis = WEIGHTED_OPS[node.target]
        self.quantize_input(node, node.args[i_x], ar)
        w = node.args[i_w]
        if not (isinstance(w, torch.fx.Node) and w.op == "get_attr"):
            # computed weight: quantized like an activation, even when it is constant
            self.quantize_input(node, w, ar, constant_too=True)
            self.quantize_output(node, ar)
            return
        if w not in self.weight_fq:
            wq = WeightQuantizer(w.target, wr, axis)
            wq.weight_name = w.target
            point = parameter_point(w, "weight", wr.scheme.to_dict(), wr.method)
            self.weight_fq[w] = self._call(self._add(wq, point), w)
        node.replace_input_with(w, self.weight_fq[w])
        bq = self.quantize_bias(node)
        if bq is not None:
            self.biases.append(bq)
        self.quantize_output(node, ar)

    def quantize_bias(self, node: torch.fx.Node) -> BiasQuantizer | None:
        """int32 bias quantizer for a WEIGHTED op whose input and weight are quantized."""
        x_q = self.grid.get(node.args[WEIGHTED_OPS[node.target][0]])
        placed = add_bias_quantizer(self.gm, node, x_q)
        if placed is None:
            return None
        bq, point = placed
        self.points[point.attr] = point
        return bq

    def arithmetic(self, node: torch.fx.Node, ar: TensorRecipe) -> None:
        floats = [v for _, v in tensor_args(node) if _is_float_tensor(v)]
        inputs = [v for v in floats if v not in self.constant]  # constants stay float
        if node.name in self.separate_concats:
            for v in inputs:  # each on its own grid; one output scale would wipe out the small
                self.quantize_input(node, v, ar)
            return
        align = (node.target is torch.ops.aten.cat.default and self.recipe.align_concat_inputs) or (
            node.target is torch.ops.aten.add.Tensor and self.recipe.align_add_inputs
        )
        if align and len(inputs) > 1:
            shared = self._aligned_inputs(node, inputs, ar)
            # a float constant among the inputs would be clipped to a grid observed without it
            if node.target is torch.ops.aten.cat.default and len(inputs) == len(floats):
                self._share(node, shared)
                return
        else:
            for v in inputs:
                self.quantize_input(node, v, ar)
        if self.quantize_output(node, ar) is not None and self.recipe.quantize_constants:
            self.quantize_constants(node, ar)

    def quantize_constants(self, node: torch.fx.Node, ar: TensorRecipe) -> None:
        """Put the constant operands of ``node`` (Python scalars, buffers) on their own grid, by
        a ``ConstantQuantizer`` (see there), when ``node`` is an add / mul (CONSTANT_OPERAND_OPS)
        whose other inputs and output are quantized: an integer initializer -> DequantizeLinear,
        not a runtime Q/DQ pair, so the rule for ``constant_values`` is kept. Parameters (they
        train) and constants computed by ops stay float."""
        if node.target not in CONSTANT_OPERAND_OPS or node.kwargs.get("alpha", 1) != 1:
            return
        positions = ARITHMETIC_OPS[node.target]
        args = [(i, node.args[i]) for i in positions if i < len(node.args)]
        live = [a for _, a in args if isinstance(a, torch.fx.Node) and a not in self.constant]
        if not live or not all(a in self.grid for a in live):
            return  # an input left float: the op stays float in the engine anyway
        module = module_of(node)[0]
        for i, a in args:
            if isinstance(a, (int, float)) and not isinstance(a, bool):
                fq = self._scalar(node, float(a), ar, module)
            elif isinstance(a, torch.fx.Node) and a.op == "get_attr" and self._is_buffer(a):
                fq = self._buffer(a, ar, module)
            else:
                continue
            if fq is not None:
                args_ = list(node.args)
                args_[i] = fq
                node.args = tuple(args_)

    def _is_buffer(self, node: torch.fx.Node) -> bool:
        try:
            value = self.gm.get_buffer(node.target)
        except AttributeError:
            return False  # a parameter (trains) or a plain attribute
        return value.is_floating_point() and bool(torch.isfinite(value).all())

    def _scalar(
        self, node: torch.fx.Node, c: float, ar: TensorRecipe, module: str
    ) -> torch.fx.Node | None:
        if not torch.isfinite(torch.tensor(c)):
            return None
        name = f"{module}/{node.name}_constant" if module else f"{node.name}_constant"
        q = ConstantQuantizer(name, ar, torch.tensor(c, dtype=torch.float32), own=True)
        point = QuantPoint("", name, "constant", module, node.name, ar.scheme.to_dict(), "constant")
        target = self._add(q, point)
        q.constant_name = f"{target}.value"
        with self.graph.inserting_before(node):
            value = self.graph.get_attr(q.constant_name)
            value.meta["val"] = q.value
            fq = self.graph.call_module(target, (value,))
        fq.meta["val"] = q.value
        fq.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
        self.grid[fq] = q
        return fq

    def _buffer(self, buffer: torch.fx.Node, ar: TensorRecipe, module: str) -> torch.fx.Node:
        """One quantizer per buffer (like a weight), named by the buffer."""
        if buffer not in self.constant_fq:
            q = ConstantQuantizer(buffer.target, ar, self.gm.get_buffer(buffer.target))
            q.constant_name = buffer.target
            point = parameter_point(buffer, "constant", ar.scheme.to_dict(), "constant")
            fq = self._call(self._add(q, point), buffer)
            self.grid[fq] = q
            self.constant_fq[buffer] = fq
        return self.constant_fq[buffer]

    def _aligned_inputs(
        self, node: torch.fx.Node, inputs: list, ar: TensorRecipe
    ) -> Quantizer | None:
        """One quantizer for all inputs: merge existing input quantizers into the first; return
        it (None when no input is on a grid)."""
        for v in inputs:
            self.quantize_input(node, v, ar)
        qs = [self.grid[v] for v in node.all_input_nodes if v in self.grid]
        if not qs:
            return None
        keep = qs[0]
        for other in qs[1:]:
            if other is not keep and other.scheme == keep.scheme:
                self._merge(other, keep)
        return keep

    def _merge(self, old: Quantizer, new: Quantizer) -> None:
        new_target = next(
            f"{CONTAINER}.{a}" for a, m in self.container.named_children() if m is new
        )
        for n in self.graph.nodes:
            if n.op == "call_module" and n.target.startswith(CONTAINER + "."):
                if self.gm.get_submodule(n.target) is old:
                    n.target = new_target
        for k, v in list(self.grid.items()):
            if v is old:
                self.grid[k] = new
        for bq in self.biases:
            if bq.input_quantizer is old:
                bq.use_input_quantizer(new)
        attr = next(a for a, m in self.container.named_children() if m is old)
        delattr(self.container, attr)
        del self.points[attr]

    def data_movement(self, node: torch.fx.Node) -> None:
        src = node.args[0] if node.args else None
        if isinstance(src, torch.fx.Node) and src in self.grid and _is_float_tensor(node):
            if src in self.scaled_in_training:  # after dropout: on the grid only in eval mode
                self.identity_in_eval(node)
            else:
                self._share(node, self.grid[src])

    def identity_in_eval(self, node: torch.fx.Node) -> None:
        """Dropout (and data movement after it): the output is on the input's grid in eval mode,
        so consumers do not quantize it again, but no quantizer runs after it (in training the
        values are scaled by ``1 / (1 - p)`` and a re-quantization would clip them)."""
        src = node.args[0] if node.args else None
        if isinstance(src, torch.fx.Node) and src in self.grid and _is_float_tensor(node):
            self.grid[node] = self.grid[src]
            self.scaled_in_training.add(node)

    def _share(self, node: torch.fx.Node, q: Quantizer | None) -> None:
        if q is None:
            return
        target = next(f"{CONTAINER}.{a}" for a, m in self.container.named_children() if m is q)
        fq = self._call(target, node, observe=False)
        node.replace_all_uses_with(fq, delete_user_cb=lambda u: u is not fq)
        self.grid[fq] = q

    # -- driver ---------------------------------------------------------------------------------
    def run(self) -> list[QuantPoint]:
        for node in list(self.graph.nodes):
            role = op_role(node)
            if role in (Role.FLOAT, Role.FOLDABLE_ACTIVATION):
                continue
            module, module_type = module_of(node)
            self.seen_modules.add((module, module_type))
            skip, wr, ar = self.recipe.for_module(module, module_type)
            if skip:
                continue
            if role is Role.WEIGHTED:
                self.weighted(node, wr, ar)
            elif role is Role.ARITHMETIC:
                self.arithmetic(node, ar)
            elif role is Role.DATA_MOVEMENT:
                self.data_movement(node)
            elif role is Role.IDENTITY_IN_EVAL:
                self.identity_in_eval(node)
        for rule in self.recipe.unmatched_rules(sorted(self.seen_modules)):
            warnings.warn(
                f"recipe rule {rule.describe()} matches no layer of the model; known layers "
                f"include {sorted(m for m, _ in self.seen_modules if m)[:8]}",
                stacklevel=user_stacklevel(),
            )
        self.graph.lint()
        self.gm.recompile()
        return list(self.points.values())


def place_quantizers(
    gm: torch.fx.GraphModule, recipe: Recipe, separate_concats: frozenset = frozenset()
) -> list[QuantPoint]:
    """Insert quantizers into ``gm`` in place; return the record of what was placed.
    ``separate_concats``: fx names of concats kept float on separately quantized inputs."""
    return _Placer(gm, recipe, frozenset(separate_concats)).run()


__all__ = [
    "CONTAINER",
    "QuantPoint",
    "constant_values",
    "module_of",
    "output_quantizers",
    "place_quantizers",
    "quantize_new_bias",
]
