"""Op-type tables for placement: which captured aten ops get which quantization treatment.

Rules are data (named property sets), not if/elif chains. Placement asks one question per node:
``op_role(node) -> Role``. The roles:

* ``WEIGHTED`` - ops with a weight and an optional bias (conv, linear, addmm). Activation input, weight
  (per-channel along ``WEIGHT_AXIS``), int32 bias (scale = input scale x weight scale) and output.
* ``ARITHMETIC`` - ops between activations (add, mul, matmul, bmm, cat): inputs, output quantized.
* ``DATA_MOVEMENT`` - ops that commute with quantization (max-pool, reshape, permute, slicing, zero
  or copying padding ...):
  ``quantize(f(x)) == f(quantize(x))`` with the same parameters, so the output reuses the input's
  quantizer and no new range is observed.
* ``IDENTITY_IN_EVAL`` - dropout: the identity in eval mode (so its output lies on its input's
  grid and needs no quantizer of its own), but in training it multiplies the kept values by
  ``1 / (1 - p)``, which leave the input's range: re-quantizing them on the input's grid would
  clip them and zero their gradients in QAT. Placement records the input's grid for the output
  and applies no quantizer after it.
* ``FOLDABLE_ACTIVATION`` - clamps (relu, relu6/hardtanh, clamp) that a following quantizer's range
  absorbs: the producer's output quantizer moves after them.
* anything else runs in float (softmax, layer_norm, gelu, ...): quantized inputs are dequantized
  before it, its output is float until a consumer quantizes it. Arithmetic that only feeds a
  softmax (scores + attention mask) stays float too (``feeds_float_input_only``).
"""

from __future__ import annotations

import enum
import re

import torch

from ._experts import stacked_reads
from ._nodes import is_float_tensor

aten = torch.ops.aten


class Role(enum.Enum):
    WEIGHTED = "weighted"
    ARITHMETIC = "arithmetic"
    DATA_MOVEMENT = "data_movement"
    IDENTITY_IN_EVAL = "identity_in_eval"
    FOLDABLE_ACTIVATION = "foldable_activation"
    FLOAT = "float"


# op -> (index of activation input, index of weight, index of bias, weight channel axis)
WEIGHTED_OPS: dict[object, tuple[int, int, int, int]] = {
    aten.conv1d.default: (0, 1, 2, 0),
    aten.conv2d.default: (0, 1, 2, 0),
    aten.conv3d.default: (0, 1, 2, 0),
    aten.linear.default: (0, 1, 2, 0),
    # transposed convolutions: weight (in, out / groups, k...), output channels along axis 1;
    # only groups == 1 (see ``op_role``): with groups the axis-1 scales would not be per output
    # channel, and the int32 bias needs one scale per output channel
    aten.conv_transpose1d.default: (0, 1, 2, 1),
    aten.conv_transpose2d.input: (0, 1, 2, 1),
    aten.conv_transpose3d.input: (0, 1, 2, 1),
    # ``bias + x @ w`` with w (in, out): GPT-2's Conv1D (``torch.addmm``), output channels along
    # the weight's last axis; baddbmm the same per batch, w (batch, in, out). Only with the
    # default ``beta = alpha = 1`` (see ``op_role``)
    aten.addmm.default: (1, 2, 0, 1),
    aten.baddbmm.default: (1, 2, 0, 2),
}
# scaled sums whose "weight" depends on an input (Bloom's ``baddbmm(alibi, q, k^T, alpha=...)``):
# products of activations, not layers left float (no placement warning)
SCALED_SUM_OPS = {aten.addmm.default, aten.baddbmm.default}
TRANSPOSED_CONV_OPS = {
    aten.conv_transpose1d.default,
    aten.conv_transpose2d.input,
    aten.conv_transpose3d.input,
}

# Functional ops between activations. Value: which positional args hold tensors to quantize
# ("list0" means arg 0 is a list of tensors, as for cat).
ARITHMETIC_OPS: dict[object, tuple[int, ...] | str] = {
    aten.add.Tensor: (0, 1),
    aten.mul.Tensor: (0, 1),
    aten.matmul.default: (0, 1),
    aten.bmm.default: (0, 1),
    aten.mm.default: (0, 1),
    aten.cat.default: "list0",
}

# ARITHMETIC ops whose constant operand (a Python scalar, a buffer) is quantized too, when the
# recipe's ``quantize_constants`` is on: ONNX Runtime fuses DQ(a), DQ(b) -> Add/Mul -> Q into
# QLinearAdd / QLinearMul only when both inputs are DequantizeLinear (``x * 0.1666 + 0.5`` of a
# hard-sigmoid otherwise stays float). matmul / bmm / mm with a constant are left float here, and
# cat shares its grid with its inputs instead.
CONSTANT_OPERAND_OPS: frozenset = frozenset({aten.add.Tensor, aten.mul.Tensor})

# Ops whose output sits on the input's quantization grid (commute with quantization).
DATA_MOVEMENT_OPS: frozenset = frozenset(
    {
        aten.max_pool1d.default,
        aten.max_pool2d.default,
        aten.max_pool3d.default,
        aten.adaptive_max_pool2d.default,
        aten.reshape.default,
        aten.view.default,
        aten.flatten.using_ints,
        aten.permute.default,
        aten.transpose.int,
        aten.squeeze.dim,
        aten.squeeze.dims,
        aten.squeeze.default,
        aten.unsqueeze.default,
        aten.slice.Tensor,
        aten.select.int,
        aten.contiguous.default,
        aten.expand.default,
        aten.clone.default,
        aten.pixel_shuffle.default,
        aten.t.default,
    }
)

# Padding: op -> function(node) telling whether it only copies values or writes zeros. Reflect,
# replicate and circular padding copy elements; a constant 0 lies on every affine grid
# (``dequantize(zero_point) == 0`` exactly), so zero padding commutes with quantization as MaxPool
# does and its output shares the input's grid (ONNX Runtime then pads the int8 codes, no
# requantization). A non-zero constant is in general off the grid: such a pad stays FLOAT.
PAD_OPS: dict[object, object] = {
    aten.pad.default: lambda n: (
        _arg(n, 2, n.kwargs.get("mode", "constant")) != "constant"
        or _arg(n, 3, n.kwargs.get("value")) in (None, 0.0)
    ),
    aten.constant_pad_nd.default: lambda n: _arg(n, 2, n.kwargs.get("value", 0.0)) == 0.0,
}
# node.meta key: this pad keeps a grid of its own, as every pad had before zero padding moved
# (``prepare(pads_on_grid=False)``: ``load`` of a checkpoint saved before)
PAD_OWN_GRID = "qb_pad_own_grid"

# Ops that are the identity in eval mode but rescale values in training (see IDENTITY_IN_EVAL).
IDENTITY_IN_EVAL_OPS: frozenset = frozenset({aten.dropout.default})

# Clamps a following quantizer absorbs: op -> function(node) giving the (lo, hi) it clamps to.
FOLDABLE_ACTIVATIONS: dict[object, object] = {
    # (in-place forms such as relu_ are made functional at capture: ``_passes.out_of_place``)
    aten.relu.default: lambda n: (0.0, None),
    aten.hardtanh.default: lambda n: (_arg(n, 1, -1.0), _arg(n, 2, 1.0)),
    aten.clamp.default: lambda n: (_arg(n, 1, None), _arg(n, 2, None)),
}

# Ops whose outputs stay float even where a consumer quantizes its inputs. ONNX Runtime fuses
# DequantizeLinear -> Softmax -> QuantizeLinear into QLinearSoftmax, a lookup-table kernel that is
# off by one code on many elements; a 2-block encoder then ends 3 LSB away from the QDQ semantics
# on ~47% of its outputs (measured, ORT 1.32). Float softmax keeps the engine exact.
KEEP_FLOAT_OUTPUT_OPS: frozenset = frozenset(
    {aten.softmax.int, aten._softmax.default, aten._safe_softmax.default}
)

# Ops whose inputs stay float: they run in float anyway, and their input is often masked scores -
# an additive attention mask holds finfo(float32).min, and a quantized `scores + mask` would get a
# range of [-3.4e38, 10] in which every real score rounds to 0 (MiniLM with eager attention: cosine
# 0.44 vs float; 0.992 when the add stays float).
FLOAT_INPUT_OPS: frozenset = KEEP_FLOAT_OUTPUT_OPS


def _uses_end_in(node: torch.fx.Node, ends, passes) -> bool:
    """Every use of ``node``, followed through the ops ``passes(user, value)`` accepts, is one that
    ``ends(user, value)`` accepts (a use outside any call, or a value with no use, is neither).
    One walk over the ops downstream, stopping at the first use that is neither."""
    seen, stack = {node}, [node]
    while stack:
        value = stack.pop()
        users = list(value.users)
        if not users:
            return False
        for user in users:
            if user.op != "call_function":
                return False
            if ends(user, value):
                continue
            if not passes(user, value):
                return False
            if user not in seen:
                seen.add(user)
                stack.append(user)
    return True


def feeds_float_input_only(node: torch.fx.Node) -> bool:
    """Every use of ``node`` (through data-movement ops) is an input of a FLOAT_INPUT_OPS op."""
    return _uses_end_in(
        node,
        ends=lambda user, value: user.target in FLOAT_INPUT_OPS,
        passes=lambda user, value: (
            (user.target in DATA_MOVEMENT_OPS or user.target in IDENTITY_IN_EVAL_OPS)
            and bool(user.args)
            and user.args[0] is value
        ),
    )


# Casts, and the shape checks torch.export leaves before them, that end an index computation.
_CASTS: frozenset = frozenset({aten.to.dtype, aten._to_copy.default, aten.to.dtype_layout})
_CHECKS: frozenset = frozenset({aten._assert_tensor_metadata.default})


def feeds_integer_cast_only(node: torch.fx.Node) -> bool:
    """Every use of ``node`` ends in a cast to an integer or bool dtype, through float ops: the
    value computes indices and stays float. OPT's positions ``(cumsum(mask) * mask - 1).long()``
    on the float mask transformers builds when none is passed: quantized (step 16/255 over
    0..15), position 7 became 6.97 and cast to 6, and every later token took a wrong position
    embedding (random-init OPT, 16 tokens: SQNR vs float 4.4 dB; tokens 7-14 at 1-4 dB)."""
    return _uses_end_in(
        node,
        ends=lambda user, value: (
            user.target in _CHECKS or (user.target in _CASTS and not is_float_tensor(user))
        ),
        passes=lambda user, value: is_float_tensor(user) and user.target not in WEIGHTED_OPS,
    )


# Ops that divide by an input: op -> the divisor's position (x / y, 1 / y, 1 / sqrt(y)). A divisor
# stays float: on an int8 grid a small denominator rounds to 0, and the quotient becomes inf, or
# NaN for 0 / 0 (which fake-quant and ONNX Runtime then map to different codes). Measured on MIT
# EfficientViT's LiteMLA, ``out[..., :-1] / (out[..., -1:] + 1e-15)``: the quantized ``+ eps``
# (step ~0.36) swallowed the eps, 2 of 512 denominators were 0, ORT and torch 131 LSB apart.
DIVISOR_INPUTS: dict[object, int] = {
    aten.div.Tensor: 1,
    aten.div.Tensor_mode: 1,
    aten.reciprocal.default: 0,
    aten.rsqrt.default: 0,
}
# Ops that pass a value on to a divisor unchanged in kind (``(y + eps).sqrt()``, a slice of it):
# when their output feeds divisors only, they stay float and read their inputs float.
_PASSES_DIVISOR_ON: frozenset = (
    DATA_MOVEMENT_OPS
    | IDENTITY_IN_EVAL_OPS
    | frozenset(ARITHMETIC_OPS)
    | frozenset({aten.sqrt.default, aten.abs.default, aten.clamp_min.default})
)


def reads_as_divisor(user: torch.fx.Node, value: torch.fx.Node) -> bool:
    """``user`` reads ``value`` only as a divisor: directly (``DIVISOR_INPUTS``), or as an op of
    ``_PASSES_DIVISOR_ON``, or a clamp, whose output feeds divisors only."""
    if user.op != "call_function":
        return False
    position = DIVISOR_INPUTS.get(user.target)
    if position is not None:
        others = [a for i, a in enumerate(user.args) if i != position]
        return len(user.args) > position and user.args[position] is value and value not in others
    passes = user.target in _PASSES_DIVISOR_ON or user.target in FOLDABLE_ACTIVATIONS
    return passes and feeds_divisor_only(user)


def feeds_divisor_only(node: torch.fx.Node) -> bool:
    """Every use of ``node`` ends as a divisor (see ``DIVISOR_INPUTS``), through ops of
    ``_PASSES_DIVISOR_ON`` and clamps (a dividing op reading it otherwise ends the walk: no)."""
    return _uses_end_in(
        node,
        ends=lambda user, value: user.target in DIVISOR_INPUTS and reads_as_divisor(user, value),
        passes=lambda user, value: (
            user.target not in DIVISOR_INPUTS
            and (user.target in _PASSES_DIVISOR_ON or user.target in FOLDABLE_ACTIVATIONS)
        ),
    )


# Ops whose output is their input's values (in eval): a softmax passed through them stays float.
_PASSES_ON_FLOAT: frozenset = (
    IDENTITY_IN_EVAL_OPS | DATA_MOVEMENT_OPS | frozenset({aten.to.dtype, aten._to_copy.default})
)


def keeps_float_output(node) -> bool:
    """A KEEP_FLOAT_OUTPUT_OPS output, also as a dropout (the identity in eval), a data-movement
    op or a float cast passes it on: BERT's ``softmax -> dropout -> matmul`` and Llama's
    ``softmax -> to(float32) -> dropout -> matmul`` keep the softmax float as ``softmax ->
    matmul`` does (the dropout used to give the probabilities a quantizer)."""
    while (
        isinstance(node, torch.fx.Node)
        and node.op == "call_function"
        and node.target in _PASSES_ON_FLOAT
        and node.args
    ):
        node = node.args[0]
    return (
        isinstance(node, torch.fx.Node)
        and node.op == "call_function"
        and (node.target in KEEP_FLOAT_OUTPUT_OPS)
    )


def read_only_as_graph_output(value: torch.fx.Node) -> bool:
    """``value`` reaches the graph's outputs only, directly or through dropout / data movement
    (``flatten``, ``reshape``): no engine kernel downstream needs it quantized, so with
    ``Recipe(quantize_outputs=False)`` it stays float (see ``recipe.py`` for the measurement)."""
    users = list(value.users)
    return bool(users) and all(
        user.op == "output"
        or (
            user.op == "call_function"
            and user.target in _PASSES_ON_FLOAT
            and user.args[0] is value
            and read_only_as_graph_output(user)
        )
        for user in users
    )


# Ops a producer's output quantizer moves past, like the foldable activations: a batch norm kept
# during QAT is folded into the conv before export, so conv -> bn -> relu has one quantizer.
EPILOGUE_OPS: frozenset = frozenset({aten.batch_norm.default})


def is_epilogue(node: torch.fx.Node, producer: torch.fx.Node) -> bool:
    """``node`` is absorbed into ``producer``'s output quantization (bn, relu, relu6, clamp)."""
    if node.op != "call_function" or not node.args or node.args[0] is not producer:
        return False
    return node.target in FOLDABLE_ACTIVATIONS or node.target in EPILOGUE_OPS


def clamps_negatives(producer: torch.fx.Node, last: torch.fx.Node) -> bool:
    """Some activation of the epilogue chain ``producer -> ... -> last`` clamps at a lower bound
    >= 0 (relu, relu6, clamp(0, ...)): the output holds no negative value."""
    while last is not producer:
        if last.target in FOLDABLE_ACTIVATIONS:
            lo = FOLDABLE_ACTIVATIONS[last.target](last)[0]
            if isinstance(lo, (int, float)) and lo >= 0:
                return True
        last = last.args[0]
    return False


def _arg(node: torch.fx.Node, i: int, default):
    return node.args[i] if len(node.args) > i else default


# ops with a weight that ``op_role`` may still leave FLOAT: placement warns naming them
# (``unquantized_weighted_reason``), since a layer left float without a word is what users hit
_WEIGHTED_OVERLOADS = frozenset(WEIGHTED_OPS) | {
    aten.convolution.default,
    aten._convolution.default,
    aten.conv1d.padding,
    aten.conv2d.padding,
    aten.conv3d.padding,
}
# recurrent layers: no int8 cell here (their gates are float functions of int8 products); the
# whole layer, weights included, runs in float (the exported file holds a float ONNX LSTM/GRU/RNN)
RECURRENT_OPS: frozenset = frozenset(
    getattr(getattr(aten, op), overload)
    for op in ("lstm", "gru", "rnn_tanh", "rnn_relu")
    for overload in ("input", "data")
)
_WEIGHTED_OVERLOADS |= RECURRENT_OPS

# products reading a parameter or buffer (``x @ self.proj``: OpenAI CLIP's projections; einsum):
# no weight to placement, not quantized (CONSTANT_OPERAND_OPS), so the product runs in float
_CONSTANT_PRODUCT_OPS: frozenset = frozenset(
    {aten.matmul.default, aten.mm.default, aten.bmm.default, aten.einsum.default}
)

_TRANSPOSES: frozenset = frozenset({aten.t.default, aten.transpose.int, aten.permute.default})
# how a product reads a parameter: transposed, rows by index (HF MoE, unless ``_experts``
# quantizes it), sliced (a GRU's gate rows)
_VIEWS = _TRANSPOSES | {aten.numpy_T.default, aten.index.Tensor, aten.unsqueeze.default,
                        aten.slice.Tensor, aten.select.int, aten.narrow.default}  # fmt: skip


# torch's names of a recurrent layer's weights (nn.RNNBase: ``weight_ih_l0``, ``weight_hh_l1_reverse``):
# a subclass whose forward computes the cell itself (ONNX's GRU with linear_before_reset=0, import)
_RECURRENT_WEIGHT = re.compile(r"(^|\.)weight_(ih|hh)_l\d+(_reverse)?\b")


def _constant_operands(node: torch.fx.Node) -> list[torch.fx.Node]:
    """The operands of ``node`` that are a parameter or buffer, or its transpose (``x @ w.T``)."""
    found, stacked = [], {r.param for r in stacked_reads(node)}  # quantized (``_experts``)
    for a in node.args[1] if node.target is aten.einsum.default else node.args[:2]:
        while isinstance(a, torch.fx.Node) and a.op == "call_function" and a.target in _VIEWS:
            a = a.args[0]  # through ``_VIEWS``
        if isinstance(a, torch.fx.Node) and a.op == "get_attr" and a not in stacked:
            found.append(a)
    return found


def unquantized_weighted_reason(node: torch.fx.Node, constant: set | None = None) -> str | None:
    """Why ``node``, an op with a weight that ``op_role`` leaves FLOAT, has no int8 form; None
    when it is not such an op. ``constant``: ``_nodes.constant_values``, see SCALED_SUM_OPS."""
    if node.op != "call_function":
        return None
    if node.target in _CONSTANT_PRODUCT_OPS and _constant_operands(node):
        names = ", ".join(str(a.target) for a in _constant_operands(node))
        if _RECURRENT_WEIGHT.search(names):  # an nn.RNNBase whose forward spells out its cell
            return (
                f"a recurrent layer (its cell in torch ops, reading {names}): quantbridge has "
                "no int8 recurrent cell"
            )
        return (
            f"{node.target.__name__.split('.')[0]} of the parameter {names}, which is not quantized "
            "(write the product as nn.Linear / F.linear to quantize it)"
        )
    if node.target not in _WEIGHTED_OVERLOADS:
        return None
    if op_role(node) is not Role.FLOAT:
        return None
    if node.target in TRANSPOSED_CONV_OPS:
        return "a grouped transposed conv (its per-output-channel weight scales need groups=1)"
    if node.target in SCALED_SUM_OPS:
        if constant is not None and node.args[WEIGHTED_OPS[node.target][1]] not in constant:
            return None  # its "weight" depends on an input: a product of activations, no layer
        return "beta * bias + alpha * x @ w with beta or alpha != 1"
    if node.target in RECURRENT_OPS:
        return f"a recurrent layer ({node.target.__name__}): quantbridge has no int8 recurrent cell"
    return f"{node.target} is in none of quantbridge's op tables"


def op_role(node: torch.fx.Node) -> Role:
    if node.op != "call_function":
        return Role.FLOAT
    target = node.target
    if target in WEIGHTED_OPS:
        if target in TRANSPOSED_CONV_OPS and _arg(node, 6, 1) != 1:
            return Role.FLOAT  # grouped transposed conv: stays float (see WEIGHTED_OPS)
        if target in SCALED_SUM_OPS and any(node.kwargs.get(k, 1) != 1 for k in ("beta", "alpha")):
            return Role.FLOAT  # beta * bias + alpha * x @ w: not a plain weighted op
        return Role.WEIGHTED
    if target in ARITHMETIC_OPS:
        if (
            feeds_float_input_only(node)
            or feeds_divisor_only(node)
            or feeds_integer_cast_only(node)
        ):
            return Role.FLOAT  # masked scores, a divisor (``+ eps``), an index: see their docs
        return Role.ARITHMETIC
    if target in DATA_MOVEMENT_OPS:
        return Role.DATA_MOVEMENT
    if target in PAD_OPS:  # OWN_GRID: as placed before pads moved (an older checkpoint)
        moves = PAD_OPS[target](node) and not node.meta.get(PAD_OWN_GRID)
        return Role.DATA_MOVEMENT if moves else Role.FLOAT
    if target in IDENTITY_IN_EVAL_OPS:
        return Role.IDENTITY_IN_EVAL
    if target in FOLDABLE_ACTIVATIONS:
        return Role.FOLDABLE_ACTIVATION
    return Role.FLOAT


def tensor_args(node: torch.fx.Node) -> list[tuple[object, torch.fx.Node]]:
    """(arg position, input node) for each activation input of an ARITHMETIC op."""
    spec = ARITHMETIC_OPS[node.target]
    if spec == "list0":
        return [((0, i), a) for i, a in enumerate(node.args[0]) if isinstance(a, torch.fx.Node)]
    return [
        (i, node.args[i])
        for i in spec
        if i < len(node.args) and isinstance(node.args[i], torch.fx.Node)
    ]
