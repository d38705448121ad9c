"""Lowering of an Einsum that is a (batched) matrix product: ``batch i j, batch j k -> batch i k``,
either operand possibly with its two last labels swapped (``bhid,bhjd->bhij``: q k^T), the
second possibly without the batch labels (a weight), ``...`` standing for equal batch labels.
The operands are transposed on codes (exact, ``_movement``) and the MatMul lowering does the
rest: the same integer kernel as the MatMul the einsum spells out."""

from __future__ import annotations

import onnx

from ._core import Builder, LoweringError, Value, attrs_of, describe_node, register_lowering
from ._linear import _matmul_qdq
from ._movement import moved


def _labels(b: Builder, node: onnx.NodeProto) -> tuple[list[str], str]:
    """The operands' and the output's labels, ``...`` replaced by upper-case batch labels."""
    equation = attrs_of(node)["equation"]
    equation = (equation.decode() if isinstance(equation, bytes) else equation).replace(" ", "")
    if "->" not in equation:
        raise LoweringError(
            f"{describe_node(node)}: an implicit output ({equation!r}) is not lowered"
        )
    inputs, out = equation.split("->")
    terms = inputs.split(",")
    if "..." in equation:
        ranks = {len(b.shapes.get(n) or ()) - len(t.replace("...", "")) for n, t in
                 zip(node.input, terms, strict=True) if "..." in t}  # fmt: skip
        if len(ranks) != 1 or min(ranks) < 0:
            raise LoweringError(f"{describe_node(node)}: '...' of unknown or differing ranks")
        dots = "ABCDEFGH"[: ranks.pop()]
        terms, out = [t.replace("...", dots) for t in terms], out.replace("...", dots)
    return terms, out


@register_lowering("Einsum")
def _einsum(b: Builder, node: onnx.NodeProto, ins: list[Value | None]) -> list[Value]:
    terms, out = _labels(b, node) if len(ins) == 2 else ([], "")
    refuse = LoweringError(
        f"{describe_node(node)}: equation {attrs_of(node).get('equation')!r} is not a matrix "
        "product (batch i j, batch j k -> batch i k, operands' last two labels in either "
        "order); only those are lowered: write the other contractions as Transpose + MatMul"
    )
    if len(terms) != 2 or len(out) < 2:
        raise refuse
    (ta, tb), batch, i, k = terms, out[:-2], out[-2], out[-1]
    shared = set(ta) & set(tb) - set(out)
    if len(shared) != 1 or len(set(ta + tb + out)) != len(batch) + 3:
        raise refuse
    j = shared.pop()
    if ta[: len(batch)] != batch or tb[: len(tb) - 2] not in ("", batch):
        raise refuse
    operands = []
    for x, term, rows, cols, n in ((ins[0], ta, i, j, 0), (ins[1], tb, j, k, 1)):
        tail = term[len(term) - 2 :]
        if len(term) - 2 not in (0, len(batch)) or set(tail) != {rows, cols}:
            raise refuse
        name = node.input[n]
        if tail == cols + rows:  # swapped: move the codes (exact) into matrix order
            name = f"{node.output[0]}__einsum_operand{n}"
            perm = [*range(len(term) - 2), len(term) - 1, len(term) - 2]
            t = onnx.helper.make_node("Transpose", [node.input[n]], [name], name=name)
            x = moved(b, t, x, "transpose", {"perm": tuple(perm)})
            shape = b.shapes.get(node.input[n])
            if shape is not None:
                b.shapes[name] = tuple(shape[p] for p in perm)
        operands.append((name, x))
    matmul = onnx.helper.make_node("MatMul", [n for n, _ in operands], list(node.output),
                                   name=node.name or node.output[0])  # fmt: skip
    return _matmul_qdq(b, matmul, [x for _, x in operands])
