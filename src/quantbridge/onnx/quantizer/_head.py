"""The output head: weighted layers whose results reach a graph output through float ops only.

A text detector ends ``ConvTranspose -> Sigmoid`` (a probability map thresholded at 0.3), a
recognizer or classifier ``MatMul -> Softmax``: the last weighted layer's output goes through ops
that run in float anyway to the graph output, so quantizing it buys no integer kernel downstream
and puts its rounding straight into the decision. ``quantize_onnx`` keeps these layers in float
by recipe rules (``Rule(pattern=<layer>, skip=True)``, recorded in the file's recipe) unless
asked not to (``float_head=False``, ``--int8-head``); their inputs stay quantized by the layers
before them. Measured on the PP-OCRv4 recognizer (64 rendered lines, minmax) it did not help:
87.5% read exactly with an int8 head, 82.8% with the float head (the misreads are upstream).
"""

from __future__ import annotations

import onnx

from ...recipe import Rule

WEIGHTED = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
# ops between the head and the output that run in float and move or squash values
FLOAT_TAIL = frozenset(
    {"Sigmoid", "Softmax", "LogSoftmax", "Identity", "Reshape", "Transpose", "Flatten",
     "Squeeze", "Unsqueeze", "Cast"}
)  # fmt: skip
# elementwise ops that are tail ops when their other operand is a constant (a Paddle bias Add)
CONSTANT_OPERAND = frozenset({"Add", "Sub", "Mul", "Div"})


def head_layers(model: onnx.ModelProto) -> list[str]:
    """ONNX names of the weighted nodes whose every path to a graph output passes only through
    ``FLOAT_TAIL`` ops and constant-operand arithmetic (a layer whose output is itself a graph
    output keeps its output quantizer, as ``qb.quantize`` gives it)."""
    graph = model.graph
    outputs = {o.name for o in graph.output}
    consumers: dict[str, list[onnx.NodeProto]] = {}
    for node in graph.node:
        for t in node.input:
            consumers.setdefault(t, []).append(node)
    constants = {i.name for i in graph.initializer}
    constants |= {n.output[0] for n in graph.node if n.op_type == "Constant"}
    tail_memo: dict[str, bool] = {}

    def float_tail_op(node: onnx.NodeProto, tensor: str) -> bool:
        if node.op_type in FLOAT_TAIL:
            return True
        others = [t for t in node.input if t != tensor]
        return node.op_type in CONSTANT_OPERAND and all(t in constants for t in others)

    def tail(tensor: str) -> bool:
        """Every use of ``tensor`` is a FLOAT_TAIL op whose outputs are tails or outputs."""
        if tensor not in tail_memo:
            tail_memo[tensor] = False  # cycles cannot occur; guards re-entry
            users = consumers.get(tensor, [])
            tail_memo[tensor] = (
                bool(users)
                and all(
                    float_tail_op(u, tensor) and all(o in outputs or tail(o) for o in u.output)
                    for u in users
                )
                and (tensor not in outputs)
            )
        return tail_memo[tensor]

    return [n.name for n in graph.node if n.op_type in WEIGHTED and n.output and tail(n.output[0])]


def head_rules(model: onnx.ModelProto, onnx_names: dict[str, str]) -> list[Rule]:
    """Skip rules for the imported module's layers (``OnnxModule.onnx_names``: attribute ->
    ONNX node name) that are ``head_layers``."""
    heads = set(head_layers(model))
    return [Rule(pattern=attr, skip=True) for attr, name in onnx_names.items() if name in heads]
