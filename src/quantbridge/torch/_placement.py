"""Placement: insert quantizers into the captured graph as the recipe and the op tables say.

Walks the graph once in topological order and asks ``_ops.op_role`` for each node:

1. WEIGHTED (conv, linear): quantize the activation input, the weight (per channel along the
   op's output-channel axis), the bias (int32, scale = input scale x weight scale) and the output
   (not a value read only as a graph output when ``recipe.quantize_outputs`` is False).
2. ARITHMETIC (add, mul, matmul, bmm, cat): quantize every floating input (constants excepted,
   see below) and the output; MoE experts ``W[ids]`` read by bmm: a weight quantizer on ``W``
   (``_experts``). ``recipe.align_concat_inputs`` / ``align_add_inputs``: the inputs of ``cat``
   / ``add`` share one quantizer with its output. Divisors stay float, and so do ops feeding
   divisors only (``_ops.DIVISOR_INPUTS``). ``recipe.quantize_constants``: the constant operand
   of an add / mul between quantized values gets a ``ConstantQuantizer`` (an int initializer).
3. DATA_MOVEMENT (max-pool, reshape, permute, ...): the output lies on the input's grid, so the
   *same* quantizer is applied again with ``observe=False`` (a no-op in value that gives the
   exported graph its DQ -> op -> Q pattern with identical parameters).
   IDENTITY_IN_EVAL (dropout): the output counts as on the input's grid, but no quantizer is
   applied after it (nor after data movement following it): in QAT, train-mode dropout scales
   the kept values by ``1 / (1 - p)``, and the input's grid would clip them.
4. FOLDABLE_ACTIVATION (relu, relu6, clamp): an output quantizer moves past them, so the clamp is
   absorbed by the quantization range (one quantizer after ``conv -> relu``, none between).
5. FAN-OUT: a float value (a SiLU's output) read by a quantized op and by others is quantized
   once, for every reader (``_fanout``): squeeze-excite's pool reads the codes its multiply reads.

``recipe.activation_scope="weighted_inputs"`` changes the roles (``_scope.scoped_role``): only
weighted ops' inputs and matmul operands are quantized, no output, everything else float.

Placement is data: the walk (``plan_placement``) changes nothing; it returns a
``PlacementPlan`` - the quantizers to create (with their ``QuantPoint`` records), which quantizer
each value's grid is (``grid``: every consumer reads it quantized; ``reads``: one consumer does),
the graph edits in order, and which quantizers were merged into which - and one step,
``_record.apply_plan``, applies it to the graph. Inputs already on a grid are not quantized twice.

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

The result is recorded as plain data (``QuantPoint``, in ``_record`` with the graph edits): which
user module and tensor each quantizer serves, so export and debug tools use the record, not names.
"""

from __future__ import annotations

import torch
from torch import nn

from ..recipe import Recipe, TensorRecipe
from ._fanout import fan_out_readers
from ._nodes import constant_values, is_float_tensor, module_of
from ._ops import (
    ARITHMETIC_OPS,
    CONSTANT_OPERAND_OPS,
    WEIGHTED_OPS,
    Role,
    clamps_negatives,
    is_epilogue,
    keeps_float_output,
    op_role,
    read_only_as_graph_output,
    reads_as_divisor,
    tensor_args,
    unquantized_weighted_reason,
)
from ._place_experts import place_stacked_weights
from ._placement_warnings import warn_placement
from ._record import (
    CONTAINER,
    Edit,
    PlacementPlan,
    QuantizerSpec,
    QuantPoint,
    apply_plan,
    output_quantizers,
    parameter_point,
    quantize_new_bias,
    unique_attr,
)
from ._scope import moved_from, scoped_role


class _Planner:
    """The placement walk. Decisions only: every handler records specs and edits in the plan and
    reads the graph as it was captured (nothing is inserted until ``apply_plan``)."""

    def __init__(
        self, gm: torch.fx.GraphModule, recipe: Recipe, separate_concats: frozenset = frozenset()
    ):
        self.gm, self.graph, self.recipe = gm, gm.graph, recipe
        self.separate_concats = separate_concats
        self.plan = PlacementPlan()
        self.names = nn.Module()  # the container's attribute names, as apply_plan will add them
        self.points: dict[str, int] = {}  # attr -> spec, in the container's order
        self.input_spec: dict[torch.fx.Node, int] = {}
        self.weight_spec: dict[torch.fx.Node, int] = {}
        self.constant_spec: dict[torch.fx.Node, int] = {}
        self.seen_modules: set[tuple[str, str]] = set()
        self.scaled_in_training: set[torch.fx.Node] = set()  # see identity_in_eval
        self.constant = constant_values(self.graph)
        # asymmetric output quantizers after a ReLU-like clamp (lower bound >= 0): their zero
        # point is qmin, so engines absorb the clamp - a concat must not merge them (see
        # ``_aligned_inputs``)
        self.nonnegative: set[int] = set()
        # activation scope "weighted_inputs" (``_scope``): no output quantizers, reads keyed by
        # the value a data movement chain starts from
        self.outputs = recipe.activation_scope == "all"

    # -- the plan -------------------------------------------------------------------------------
    def _spec(self, spec: QuantizerSpec) -> int:
        """Add a quantizer to create; its container attribute as ``add_quantizer`` would pick."""
        index = len(self.plan.specs)
        self.plan.specs.append(spec)
        base = spec.point.name
        attr = unique_attr(self.names, base)
        self.names.add_module(attr, nn.Identity())
        spec.point.attr = attr
        self.points[attr] = index
        self.plan.edits.append(Edit("create", index, None))
        return index

    def resolve(self, spec: int | None) -> int | None:
        while spec is not None and spec in self.plan.merged:
            spec = self.plan.merged[spec]
        return spec

    def grid_of(self, consumer: torch.fx.Node, value) -> int | None:
        """The quantizer whose grid ``value`` lies on as ``consumer`` reads it (None: float)."""
        if not isinstance(value, torch.fx.Node):
            return None
        spec = self.plan.grid.get(value, self.plan.reads.get((consumer, value)))
        return self.resolve(spec)

    def _activation(self, value: torch.fx.Node, recipe: TensorRecipe, module: str, producer):
        name = f"{module}/{producer.name}" if module else producer.name
        point = QuantPoint(
            "", name, "activation", module, value.name, recipe.scheme.to_dict(), recipe.method
        )
        return self._spec(QuantizerSpec(point, "activation", recipe))

    def _read(self, consumer: torch.fx.Node, value: torch.fx.Node, spec: int) -> None:
        self.plan.edits.append(Edit("consumer", spec, value, consumer))
        self.plan.reads[(consumer, value)] = spec

    def _everywhere(self, value: torch.fx.Node, spec: int, observe: bool = True) -> None:
        self.plan.edits.append(Edit("all", spec, value, observe=observe))
        self.plan.grid[value] = spec

    # -- quantizing values ----------------------------------------------------------------------
    def quantize_input(
        self, consumer: torch.fx.Node, value, recipe: TensorRecipe, constant_too: bool = False
    ) -> None:
        """Quantize ``value`` where ``consumer`` reads it (one quantizer per value); a value of
        no input stays float unless ``constant_too`` (a computed weight)."""
        if not is_float_tensor(value) or self.grid_of(consumer, value) is not None:
            return
        # probabilities stay float (P @ V); a conv / linear (EfficientFormerV2) reads them int8
        softmax_kept = keeps_float_output(value) and op_role(consumer) is not Role.WEIGHTED
        if (softmax_kept and self.outputs) or (value in self.constant and not constant_too):
            return
        key = value if self.outputs else moved_from(value)  # one quantizer per tensor
        if key not in self.input_spec:
            module = "input" if key.op == "placeholder" else module_of(key)[0]
            self.input_spec[key] = self._activation(key, recipe, module, key)
        self._read(consumer, value, self.input_spec[key])

    def quantize_output(self, node: torch.fx.Node, recipe: TensorRecipe) -> int | None:
        if node in self.constant or not self.outputs:
            return None
        last = node
        while len(last.users) == 1:
            (user,) = last.users
            if not is_epilogue(user, last):
                break
            last = user
        if not is_float_tensor(last):
            return None
        if not self.recipe.quantize_outputs and read_only_as_graph_output(last):
            return None
        divisors = {u for u in last.users if reads_as_divisor(u, last)}  # they read it float
        if divisors and len(divisors) == len(last.users):
            return None
        spec = self._activation(last, recipe, module_of(node)[0], node)
        if divisors:  # the other readers read it quantized
            for user in [u for u in last.users if u not in divisors]:
                self._read(user, last, spec)
        else:
            self._everywhere(last, spec)
        if last is not node and not recipe.scheme.symmetric and clamps_negatives(node, last):
            self.nonnegative.add(spec)
        return spec

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
        if w not in self.weight_spec:
            point = parameter_point(w, "weight", wr.scheme.to_dict(), wr.method)
            spec = QuantizerSpec(point, "weight", wr, axis=axis, source=w.target)
            self.weight_spec[w] = self._spec(spec)
        self._read(node, w, self.weight_spec[w])
        b = node.args[i_b] if len(node.args) > i_b else None
        x_spec = self.grid_of(node, node.args[i_x])
        if self._is_bias_vector(b) and x_spec is not None:
            point = parameter_point(b, "bias", {"bits": 32, "signed": True}, "derived")
            spec = QuantizerSpec(point, "bias", None, source=b.target)
            spec.bias_of = (x_spec, self.weight_spec[w])
            self._read(node, b, self._spec(spec))
        if not self._read_by_skipped_only(node):
            self.quantize_output(node, ar)

    def _read_by_skipped_only(self, node: torch.fx.Node) -> bool:
        """Every reader of ``node`` is an op a recipe rule leaves float: its output stays float
        too (measured on MiniLM: the FFN output linears' outputs carry BERT's outlier channels
        into float residual adds; one uint8 scale there costs 0.045 of mean cosine)."""
        users = list(node.users)
        return bool(users) and all(self._left_float(u, node) for u in users)

    def _left_float(self, user: torch.fx.Node, value: torch.fx.Node) -> bool:
        if user.op != "call_function":
            return False
        if self.recipe.for_module(*module_of(user))[0]:
            return True
        # a dropout / reshape between (BERT: dense -> dropout -> residual add) passes it on
        passes_on = op_role(user) in (Role.IDENTITY_IN_EVAL, Role.DATA_MOVEMENT)
        return passes_on and user.args[0] is value and self._read_by_skipped_only(user)

    def _is_bias_vector(self, node) -> bool:
        """A 1-D float parameter: a bias the int32 quantizer can take (addmm's may be a matrix)."""
        if not (isinstance(node, torch.fx.Node) and node.op == "get_attr"):
            return False
        value = node.meta.get("val")
        if value is None:  # made by a pass (a bias BN folding created)
            value = getattr(self.gm.get_submodule(node.target.rpartition(".")[0]),
                            node.target.rpartition(".")[2], None)  # fmt: skip
        return isinstance(value, torch.Tensor) and value.is_floating_point() and value.ndim == 1

    def arithmetic(self, node: torch.fx.Node, ar: TensorRecipe, wr: TensorRecipe) -> None:
        floats = [v for _, v in tensor_args(node) if is_float_tensor(v)]
        weights = place_stacked_weights(self, node, wr)  # MoE experts' [E, O, K] (``_experts``)
        inputs = [v for v in floats if v not in self.constant and v not in weights]
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
                if shared is not None:
                    self._everywhere(node, shared, observe=False)
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
        if not live or not all(self.grid_of(node, a) is not None for a in live):
            return  # an input left float: the op stays float in the engine anyway
        module = module_of(node)[0]
        for i, a in args:
            if isinstance(a, (int, float)) and not isinstance(a, bool):
                if torch.isfinite(torch.tensor(float(a))):
                    name = f"{module}/{node.name}_constant" if module else f"{node.name}_constant"
                    scheme = ar.scheme.to_dict()
                    point = QuantPoint("", name, "constant", module, node.name, scheme, "constant")
                    spec = self._spec(QuantizerSpec(point, "constant", ar, value=float(a)))
                    self.plan.edits.append(Edit("scalar", spec, None, node, index=i))
            elif isinstance(a, torch.fx.Node) and a.op == "get_attr" and self._is_buffer(a):
                if a not in self.constant_spec:  # one quantizer per buffer, named by it
                    point = parameter_point(a, "constant", ar.scheme.to_dict(), "constant")
                    spec = QuantizerSpec(point, "constant", ar, source=a.target)
                    self.constant_spec[a] = self._spec(spec)
                self.plan.edits.append(Edit("arg", self.constant_spec[a], a, node, index=i))

    def _is_buffer(self, node: torch.fx.Node) -> bool:
        try:
            value = self.gm.get_buffer(node.target)
        except AttributeError:
            return False  # a parameter (trains) or a plain attribute
        return value.is_floating_point() and bool(torch.isfinite(value).all())

    def _aligned_inputs(self, node: torch.fx.Node, inputs: list, ar: TensorRecipe) -> int | None:
        """One quantizer for all inputs: merge the inputs' quantizers into the first; return it
        (None when no input is on a grid)."""
        for v in inputs:
            self.quantize_input(node, v, ar)
        on_grid = [(v, self.grid_of(node, v)) for v in node.all_input_nodes]
        on_grid = [(v, s) for v, s in on_grid if s is not None]
        if not on_grid:
            return None
        free = [s for _, s in on_grid if s not in self.nonnegative]
        keep = free[0] if free else on_grid[0][1]
        for v, other in on_grid:
            if other == keep:
                continue
            if other in self.nonnegative and free:
                self._requantize(node, v, keep)  # the ReLU-ended producer keeps its grid
                continue
            same = self.plan.specs[other].recipe.scheme == self.plan.specs[keep].recipe.scheme
            if same:
                self._merge(other, keep)
        return keep

    def _requantize(self, consumer: torch.fx.Node, value: torch.fx.Node, spec: int) -> None:
        """``consumer`` reads ``value`` (already on its own grid) re-quantized by ``spec``."""
        self.plan.edits.append(Edit("requantize", spec, value, consumer))
        self.plan.reads[(consumer, value)] = spec

    def _merge(self, old: int, new: int) -> None:
        """``old`` shares ``new``'s quantizer from now on: its calls and bias scales use ``new``,
        and it is never created (its attribute name is free again)."""
        self.plan.merged[old] = new
        self.plan.edits.append(Edit("merge", old, None, index=new))
        attr = self.plan.specs[old].point.attr
        delattr(self.names, attr)
        del self.points[attr]

    def data_movement(self, node: torch.fx.Node) -> None:
        src = node.args[0] if node.args else None
        spec = self.grid_of(node, src)
        if spec is not None and is_float_tensor(node):
            if src in self.scaled_in_training:  # after dropout: on the grid only in eval mode
                self.identity_in_eval(node)
            else:
                self._everywhere(node, spec, observe=False)

    def identity_in_eval(self, node: torch.fx.Node) -> None:
        """Dropout (and data movement after it): the output is on the input's grid in eval mode,
        so consumers do not quantize it again, but no quantizer runs after it (in training the
        values are scaled by ``1 / (1 - p)`` and a re-quantization would clip them)."""
        src = node.args[0] if node.args else None
        spec = self.grid_of(node, src)
        if spec is not None and is_float_tensor(node):
            self.plan.grid[node] = spec
            self.scaled_in_training.add(node)

    def float_reads_of_inputs(self) -> None:
        """Float ops read a graph input on a layer's grid of it, unless skipped (attention.md)."""
        for value, spec in self.input_spec.items():
            for user in list(value.users) if value.op == "placeholder" else ():
                self.seen_modules.add(module_of(user))
                if (op_role(user) is Role.FLOAT and (user, value) not in self.plan.reads
                        and not self.recipe.for_module(*module_of(user))[0]):  # fmt: skip
                    self._read(user, value, spec)

    def fan_out(self, node: torch.fx.Node) -> None:
        """One quantizer before ``node``'s fan-out to quantized and float readers (``_fanout``)."""
        skip = not self.outputs or node.op != "call_function" or node in self.constant
        if skip or node in self.plan.grid or not is_float_tensor(node) or keeps_float_output(node):
            return
        kept, first = fan_out_readers(node, self.recipe)
        if kept:
            ar = self.recipe.for_module(*module_of(first))[2]
            spec = self.input_spec[node] = self._activation(node, ar, module_of(node)[0], node)
            if len(kept) == len(node.users):
                self._everywhere(node, spec)
            else:  # the others (a skipped layer, the graph output) read it float
                for user in kept:
                    self._read(user, node, spec)

    # -- driver ---------------------------------------------------------------------------------
    def step(self, node: torch.fx.Node, left_float: list) -> None:
        role = scoped_role(node, self.recipe.activation_scope)
        reason = unquantized_weighted_reason(node, self.constant)
        module, module_type = module_of(node)
        if reason and not self.recipe.for_module(module, module_type)[0]:
            left_float.append((module or node.name, reason))
        if role in (Role.FLOAT, Role.FOLDABLE_ACTIVATION):
            return
        self.seen_modules.add((module, module_type))
        skip, wr, ar = self.recipe.for_module(module, module_type)
        if skip:
            return
        if role is Role.WEIGHTED:
            self.weighted(node, wr, ar)
        elif role is Role.ARITHMETIC:
            self.arithmetic(node, ar, wr)
        elif role is Role.DATA_MOVEMENT:
            self.data_movement(node)
        elif role is Role.IDENTITY_IN_EVAL:
            self.identity_in_eval(node)

    def run(self) -> PlacementPlan:
        left_float = []  # (layer, reason): weighted ops no rule skips that stay float
        for node in list(self.graph.nodes):
            self.step(node, left_float)
            self.fan_out(node)
        if self.outputs:
            self.float_reads_of_inputs()
        warn_placement(self.recipe, left_float, self.seen_modules, self.graph)
        self.plan.order = list(self.points.values())
        return self.plan


def plan_placement(
    gm: torch.fx.GraphModule, recipe: Recipe, separate_concats: frozenset = frozenset()
) -> PlacementPlan:
    """Where quantizers go in ``gm`` and which values share them, as data (``gm`` unchanged).
    ``separate_concats``: fx names of concats kept float on separately quantized inputs."""
    return _Planner(gm, recipe, frozenset(separate_concats)).run()


def place_quantizers(
    gm: torch.fx.GraphModule, recipe: Recipe, separate_concats: frozenset = frozenset()
) -> list[QuantPoint]:
    """Insert quantizers into ``gm`` in place; return the record of what was placed."""
    return apply_plan(gm, plan_placement(gm, recipe, separate_concats))


__all__ = [
    "CONTAINER",
    "PlacementPlan",
    "QuantPoint",
    "constant_values",
    "module_of",
    "output_quantizers",
    "place_quantizers",
    "plan_placement",
    "quantize_new_bias",
]
