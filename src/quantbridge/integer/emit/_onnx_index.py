"""Integer ONNX for the integer / bool steps of ``kernels._index`` (masks, ids, table lookups),
registered in the ONNX emitter's table. Bools travel as uint8 0 / 1 between steps (the program's
type for them) and are cast to ONNX bool around Not / And / Or / Xor / Where."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from ._onnx import I64, _Graph, _register

BOOL, U8 = TensorProto.BOOL, TensorProto.UINT8


def _out_type(g: _Graph, step) -> int:
    return helper.np_dtype_to_tensor_dtype(np.dtype(g.program.tensors[step.output].dtype))


@_register("logic")
def _logic(g: _Graph, step, ins: list[str], out: str) -> None:
    y = g.op(step.attrs["fn"], [g.op("Cast", [x], to=BOOL) for x in ins])
    g.op("Cast", [y], out, to=U8)


@_register("compare")
def _compare(g: _Graph, step, ins: list[str], out: str) -> None:
    g.op("Cast", [g.op(step.attrs["fn"], [g.i64(x) for x in ins])], out, to=U8)


# the types ONNX Runtime's Where has a CPU kernel for (int8 / int16 codes select in int32)
WHERE_TYPES = {U8, TensorProto.INT32, TensorProto.INT64}


@_register("where")
def _where(g: _Graph, step, ins: list[str], out: str) -> None:
    to = _out_type(g, step)
    cond = g.op("Cast", [ins[0]], to=BOOL)
    wide = to if to in WHERE_TYPES else TensorProto.INT32
    y = g.op("Where", [cond, *(g.op("Cast", [x], to=wide) for x in ins[1:])])
    g.op("Cast", [y], out, to=to)


@_register("cast")
def _cast(g: _Graph, step, ins: list[str], out: str) -> None:
    x = g.op("Cast", [ins[0]], to=BOOL) if step.attrs["logical"] else ins[0]
    g.op("Cast", [x], out, to=_out_type(g, step))


@_register("cumsum")
def _cumsum(g: _Graph, step, ins: list[str], out: str) -> None:
    """In int64 (ONNX Runtime's CumSum has no 8- or 16-bit kernels), cast back: the sums wrap
    as the numpy kernel's do in the input dtype (two's complement)."""
    a = step.attrs
    y = g.op("CumSum", [g.i64(ins[0]), g.const(a["axis"])], exclusive=int(a["exclusive"]),
             reverse=int(a["reverse"]))  # fmt: skip
    g.op("Cast", [y], out, to=_out_type(g, step))


@_register("take")
def _take(g: _Graph, step, ins: list[str], out: str) -> None:
    g.op("Gather", [ins[0], g.op("Cast", [ins[1]], to=I64)], out, axis=step.attrs["axis"])


@_register("arith")
def _arith(g: _Graph, step, ins: list[str], out: str) -> None:
    to = _out_type(g, step)
    g.op(step.attrs["fn"], [g.op("Cast", [x], to=to) for x in ins], out)


@_register("arg_extreme")
def _arg_extreme(g: _Graph, step, ins: list[str], out: str) -> None:
    """In int64 (ONNX Runtime's ArgMax has no 16-bit kernel)."""
    a = step.attrs
    g.op(a["fn"], [g.i64(ins[0])], out, axis=a["axis"], keepdims=int(a["keepdims"]),
         select_last_index=int(a["last"]))  # fmt: skip


@_register("int_concat")
def _int_concat(g: _Graph, step, ins: list[str], out: str) -> None:
    to = _out_type(g, step)
    g.op("Concat", [g.op("Cast", [x], to=to) for x in ins], out, axis=step.attrs["axis"])


@_register("take_nd")
def _take_nd(g: _Graph, step, ins: list[str], out: str) -> None:
    """Negative indices made positive first (as the numpy kernel: ``index % dim``)."""
    m = g.shapes[step.inputs[1]][-1]
    dims = g.const(np.asarray(g.shapes[step.inputs[0]][:m], np.int64))
    index = g.op("Mod", [g.op("Cast", [ins[1]], to=I64), dims])
    g.op("GatherND", [ins[0], index], out)
