"""Portable C99 source for an ``IntegerProgram``: static arrays, no malloc, no float.

``emit_c(program, directory, input_shapes)`` writes ``qb_model.h`` and ``qb_model.c``. Every
tensor is a static array of its code type, every step a static function with its dimensions
as literals (one registry entry per kernel op, ``C_STEPS``), every requantization the same
``qb_requantize`` as ``numerics.requantize`` (int64 product, one rounding, ties to even). Sums
run in int32 (the lowering bounded them below 2**31) over centered int16 operands laid out so
that the innermost loop is contiguous (gcc -O3 vectorizes it; Conv's blocked sums are in
``_c_conv``). ``qb_run`` runs the steps from a table. Data movement that is not a
plain copy (Transpose, Slice, Resize, broadcasting) is a gather through an index map computed
here by running the numpy kernel on ``arange``, so it matches the executor by construction.

Entry point: ``void qb_run(const in_t *in0, ..., out_t *out0, ...)`` on integer codes; the
header gives each boundary's scale and zero point for the caller's (float) side (an output
that is a weighted layer's int32 accumulator: its scales, per channel along ``QB_OUTi_AXIS``).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import numpy as np

from ..kernels import KERNELS
from ..kernels._movement import INDEX_MAPPED

CTYPES = {"int8": "int8_t", "uint8": "uint8_t", "int16": "int16_t", "uint16": "uint16_t",
          "int32": "int32_t", "int64": "int64_t"}  # fmt: skip

PRELUDE = r"""#include <stdint.h>
#include <string.h>
#include "qb_model.h"

/* Optional, gcc on x86-64 Linux (ifunc): -DQB_X86_CLONES builds each QB_VECTORIZED step twice,
   for AVX2 and for baseline x86-64, and the CPU picks one at load time, so the binary still runs
   on any x86-64 with AVX2 speed where there is AVX2. Without it: plain C99. */
#ifdef QB_X86_CLONES
#define QB_VECTORIZED __attribute__((target_clones("avx2", "default")))
#else
#define QB_VECTORIZED
#endif

/* floor(p / 2**n), n >= 1, without >> of a negative value (implementation-defined in C99) */
static inline int64_t qb_floor_shift(int64_t p, int n) { return p >= 0 ? p >> n : ~(~p >> n); }

/* numerics.requantize: clip(z + round_half_even(acc * m / 2**n), lo, hi); |acc * m| < 2**62 */
static inline int32_t qb_requantize(int64_t acc, int64_t m, int n, int32_t z, int32_t lo,
                                    int32_t hi) {
    int64_t p = acc * m, r;
    if (n > 0) {
        int64_t half_minus_one = ((int64_t)1 << (n - 1)) - 1;
        r = qb_floor_shift(p + half_minus_one + (qb_floor_shift(p, n) & 1), n);
    } else {
        r = p * ((int64_t)1 << -n);
    }
    r += z;
    return (int32_t)(r < lo ? lo : (r > hi ? hi : r));
}
"""


def _array(ctype: str, name: str, values: np.ndarray) -> str:
    flat = np.asarray(values).reshape(-1)
    body = ",".join(map(str, flat.tolist())) if flat.size else "0"
    return f"static const {ctype} {name}[{max(flat.size, 1)}] = {{{body}}};"


class _Ctx:
    """What a step generator sees: C names and types of tensors, shapes, a declaration list."""

    def __init__(self, program: Any, shapes: dict[str, tuple[int, ...]]):
        self.program, self.shapes, self.decls = program, shapes, []
        self.names = {t: f"t{i}" for i, t in enumerate(program.tensors)}

    def ctype(self, tensor: str) -> str:
        return CTYPES[np.dtype(self.program.tensors[tensor].dtype).name]

    def size(self, tensor: str) -> int:
        return int(np.prod(self.shapes[tensor], dtype=np.int64))

    def const(self, ctype: str, name: str, values: np.ndarray) -> str:
        self.decls.append(_array(ctype, name, values))
        return name


StepGen = Callable[[_Ctx, str, Any], str]
C_STEPS: dict[str, StepGen] = {}
VECTORIZED: set[str] = set()  # steps whose functions are marked QB_VECTORIZED (see PRELUDE)


def _register(*ops: str) -> Callable[[StepGen], StepGen]:
    def add(fn: StepGen) -> StepGen:
        for op in ops:
            C_STEPS[op] = fn
        return fn

    return add


def _requant(a, m: str, n: str) -> str:
    return f"qb_requantize({{acc}}, {m}, {n}, {a['out_zero']}, {a['qmin']}, {a['qmax']})"


def _layer_requant_consts(c: _Ctx, k: str, a: dict) -> None:
    """A weighted layer's int32 bias and per-output-channel multiplier and shift, as arrays
    ``{k}_b``, ``{k}_m``, ``{k}_n`` (what ``_requant`` reads for channel ``o``)."""
    c.const("int32_t", f"{k}_b", a["bias"])
    c.const("int64_t", f"{k}_m", a["multiplier"])
    c.const("int8_t", f"{k}_n", a["shift"])


@_register("conv_transpose")
def _conv_transpose(c: _Ctx, k: str, step) -> str:
    a = step.attrs
    n, ch, h, wd = c.shapes[step.inputs[0]]
    _, o, oh, ow = c.shapes[step.output]
    w = np.asarray(a["weight"]).astype(np.int64)
    group = a["group"]
    og, kh, kw = w.shape[1], w.shape[2], w.shape[3]
    zero = np.asarray(a["w_zero"], np.int64).reshape(group, 1, og, 1, 1)
    wc = (w.reshape(group, ch // group, og, kh, kw) - zero).reshape(w.shape)
    (sh, sw), (dh, dw), pads = a["strides"], a["dilations"], a["pads"]
    fh, fw = oh + pads[0] + pads[2], ow + pads[1] + pads[3]
    c.decls.append(f"static int32_t {k}_acc[{n * o * fh * fw}];")
    c.const("int32_t", f"{k}_w", wc)
    _layer_requant_consts(c, k, a)
    x, y = c.names[step.inputs[0]], c.names[step.output]
    return f"""    memset({k}_acc, 0, sizeof {k}_acc);
    for (int n = 0; n < {n}; n++) for (int c = 0; c < {ch}; c++)
    for (int h = 0; h < {h}; h++) for (int w = 0; w < {wd}; w++) {{
        const int32_t v = (int32_t){x}[((n * {ch} + c) * {h} + h) * {wd} + w] - {a["x_zero"]};
        const int g = c / {ch // group};
        for (int o = 0; o < {og}; o++) for (int i = 0; i < {kh}; i++) for (int j = 0; j < {kw}; j++)
            {k}_acc[((n * {o} + g * {og} + o) * {fh} + h * {sh} + i * {dh}) * {fw}
                    + w * {sw} + j * {dw}] += v * {k}_w[((c * {og} + o) * {kh} + i) * {kw} + j];
    }}
    for (int n = 0; n < {n}; n++) for (int o = 0; o < {o}; o++)
    for (int h = 0; h < {oh}; h++) for (int w = 0; w < {ow}; w++) {{
        const int32_t acc = {k}_acc[((n * {o} + o) * {fh} + h + {pads[0]}) * {fw} + w + {pads[1]}]
                            + {k}_b[o];
        {y}[((n * {o} + o) * {oh} + h) * {ow} + w] =
            ({c.ctype(step.output)}){_requant(a, f"{k}_m[o]", f"{k}_n[o]").format(acc="acc")};
    }}
"""


@_register("matmul")
def _matmul(c: _Ctx, k: str, step) -> str:
    a = step.attrs
    xs, ys = c.shapes[step.inputs[0]], c.shapes[step.output]
    kdim, ncols = xs[-1], ys[-1]
    x, y = c.names[step.inputs[0]], c.names[step.output]
    c.const("int32_t", f"{k}_b", np.broadcast_to(a["bias"], (ncols,)))
    c.const("int64_t", f"{k}_m", np.broadcast_to(a["multiplier"], (ncols,)))
    c.const("int8_t", f"{k}_n", np.broadcast_to(a["shift"], (ncols,)))
    rows = int(np.prod(xs[:-1]))
    c.decls.append(f"static int16_t {k}_a[{rows * kdim}];")
    if len(step.inputs) == 1:  # constant weight, stored [N][K] centered
        zero = np.asarray(a["b_zero"], np.int64).reshape(1, -1)
        c.const("int16_t", f"{k}_w", (np.asarray(a["weight"]).astype(np.int64) - zero).T)
        batches, per_batch, wsel, prep = 1, rows, f"{k}_w", ""
    else:  # a (B, M, K) @ b (B, K, N): b centered and transposed per batch
        bs = c.shapes[step.inputs[1]]
        if tuple(bs[:-2]) != tuple(xs[:-2]):
            raise ValueError(f"C emitter: matmul {step.node!r} broadcasts batch dimensions")
        batches = int(np.prod(xs[:-2])) if len(xs) > 2 else 1
        per_batch = xs[-2]
        c.decls.append(f"static int16_t {k}_w[{batches * ncols * kdim}];")
        b = c.names[step.inputs[1]]
        wsel = f"{k}_w + bt * {ncols * kdim}"
        prep = f"""    for (int bt = 0; bt < {batches}; bt++) for (int r = 0; r < {kdim}; r++)
        for (int j = 0; j < {ncols}; j++)
            {k}_w[(bt * {ncols} + j) * {kdim} + r] =
                (int16_t)({b}[(bt * {kdim} + r) * {ncols} + j] - {int(a["b_zero"])});
"""
    return f"""    for (int i = 0; i < {rows * kdim}; i++) {k}_a[i] = (int16_t)({x}[i] - {a["a_zero"]});
{prep}    for (int bt = 0; bt < {batches}; bt++) for (int r = 0; r < {per_batch}; r++) {{
        const int16_t *ar = {k}_a + (bt * {per_batch} + r) * {kdim};
        const int16_t *wb = {wsel};
        for (int j = 0; j < {ncols}; j++) {{
            int32_t acc = {k}_b[j];
            const int16_t *wr = wb + j * {kdim};
            for (int q = 0; q < {kdim}; q++) acc += (int32_t)ar[q] * wr[q];
            {y}[(bt * {per_batch} + r) * {ncols} + j] =
                ({c.ctype(step.output)}){_requant(a, f"{k}_m[j]", f"{k}_n[j]").format(acc="acc")};
        }}
    }}
"""


def _broadcast_index(c: _Ctx, k: str, i: int, tensor: str, out_shape) -> str:
    """``x[i]`` or ``x[map[i]]`` for an input broadcast to the output shape."""
    shape = c.shapes[tensor]
    if tuple(shape) == tuple(out_shape):
        return f"{c.names[tensor]}[i]"
    index = np.broadcast_to(np.arange(c.size(tensor)).reshape(shape), out_shape)
    c.const("int32_t", f"{k}_i{i}", index)
    return f"{c.names[tensor]}[{k}_i{i}[i]]"


@_register("rescale_sum", "mul")
def _elementwise(c: _Ctx, k: str, step) -> str:
    a, out = step.attrs, step.output
    xs = [_broadcast_index(c, k, i, t, c.shapes[out]) for i, t in enumerate(step.inputs)]
    if step.op == "mul":
        za, zb = a["zeros"]
        acc, m, n = (
            f"((int64_t){xs[0]} - {za}) * ((int64_t){xs[1]} - {zb})",
            a["multiplier"],
            a["shift"],
        )
    else:
        terms = [f"((int64_t){x} - {z}) * {mm}LL" for x, z, mm in zip(xs, a["zeros"], a["multipliers"], strict=True)]  # fmt: skip
        acc, m, n = " + ".join(terms), 1, a["shift"]
    return f"""    for (int i = 0; i < {c.size(out)}; i++) {{
        const int64_t acc = {acc};
        {c.names[out]}[i] = ({c.ctype(out)}){_requant(a, f"{m}LL", str(n)).format(acc="acc")};
    }}
"""


@_register("concat")
def _concat(c: _Ctx, k: str, step) -> str:
    a, out = step.attrs, step.output
    shape = c.shapes[out]
    axis = a["axis"] % len(shape)
    outer = int(np.prod(shape[:axis]))
    inner = int(np.prod(shape[axis + 1 :]))
    lines, offset = [], 0
    for t, z, m, n in zip(step.inputs, a["zeros"], a["multipliers"], a["shifts"], strict=True):
        chunk = c.shapes[t][axis] * inner
        req = _requant(a, f"{m}LL", str(n)).format(
            acc=f"(int64_t){c.names[t]}[o * {chunk} + j] - {z}"
        )
        lines.append(f"""        for (int j = 0; j < {chunk}; j++)
            {c.names[out]}[o * {shape[axis] * inner} + {offset} + j] = ({c.ctype(out)}){req};""")
        offset += chunk
    body = "\n".join(lines)
    return f"    for (int o = 0; o < {outer}; o++) {{\n{body}\n    }}\n"


@_register("lut")
def _lut(c: _Ctx, k: str, step) -> str:
    x, y = c.names[step.inputs[0]], c.names[step.output]
    c.const(c.ctype(step.output), f"{k}_t", step.attrs["table"])
    return f"""    for (int i = 0; i < {c.size(step.output)}; i++)
        {y}[i] = {k}_t[(int32_t){x}[i] - ({step.attrs["in_qmin"]})];
"""


def _pool_loops(c: _Ctx, step, inner: str, init: str, finish: str) -> str:
    a = step.attrs
    if len(a["kernel"]) != 2:
        raise ValueError(
            f"C emitter: {step.op} {step.node!r} has a {len(a['kernel'])}-D window; "
            "the C emitter writes 2-D ones (the numpy and ONNX programs run it)"
        )
    n, ch, h, w = c.shapes[step.inputs[0]]
    oh, ow = c.shapes[step.output][2:]
    (kh, kw), (sh, sw), (dh, dw), pads = a["kernel"], a["strides"], a["dilations"], a["pads"]
    x = c.names[step.inputs[0]]
    return f"""    for (int n = 0; n < {n}; n++) for (int c = 0; c < {ch}; c++)
    for (int oh = 0; oh < {oh}; oh++) for (int ow = 0; ow < {ow}; ow++) {{
        {init}
        for (int i = 0; i < {kh}; i++) for (int j = 0; j < {kw}; j++) {{
            const int h = oh * {sh} + i * {dh} - {pads[0]}, w = ow * {sw} + j * {dw} - {pads[1]};
            if (h < 0 || h >= {h} || w < 0 || w >= {w}) continue;
            const int32_t v = (int32_t){x}[((n * {ch} + c) * {h} + h) * {w} + w];
            {inner}
        }}
        const int p = oh * {ow} + ow, out = ((n * {ch} + c) * {oh} + oh) * {ow} + ow;
        {finish}
    }}
"""


@_register("maxpool")
def _maxpool(c: _Ctx, k: str, step) -> str:
    lo = int(np.iinfo(c.program.tensors[step.inputs[0]].dtype).min)
    y = f"{c.names[step.output]}[out] = ({c.ctype(step.output)})best; (void)p;"
    return _pool_loops(c, step, "if (v > best) best = v;", f"int32_t best = {lo};", y)


@_register("reduce_max", "reduce_min")
def _reduce_extreme(c: _Ctx, k: str, step) -> str:
    """One output code per row of an index table (the reduced axes moved last, flattened)."""
    shape = c.shapes[step.inputs[0]]
    axes = step.attrs["axes"]
    axes = range(len(shape)) if axes is None else sorted({ax % len(shape) for ax in axes})
    kept = [ax for ax in range(len(shape)) if ax not in axes]
    source = np.arange(c.size(step.inputs[0])).reshape(shape).transpose(*kept, *axes)
    inner = int(np.prod([shape[ax] for ax in axes]))
    c.const("int32_t", f"{k}_i", source)
    x, y = c.names[step.inputs[0]], c.names[step.output]
    better = ">" if step.op == "reduce_max" else "<"
    return f"""    for (int o = 0; o < {c.size(step.output)}; o++) {{
        {c.ctype(step.output)} best = {x}[{k}_i[o * {inner}]];
        for (int i = 1; i < {inner}; i++)
            if ({x}[{k}_i[o * {inner} + i]] {better} best) best = {x}[{k}_i[o * {inner} + i]];
        {y}[o] = best;
    }}
"""


@_register("avgpool")
def _avgpool(c: _Ctx, k: str, step) -> str:
    a = step.attrs
    oh, ow = c.shapes[step.output][2:]
    c.const("int64_t", f"{k}_m", np.broadcast_to(a["multiplier"], (oh, ow)))
    c.const("int8_t", f"{k}_n", np.broadcast_to(a["shift"], (oh, ow)))
    req = _requant(a, f"{k}_m[p]", f"{k}_n[p]").format(acc="acc")
    y = f"{c.names[step.output]}[out] = ({c.ctype(step.output)}){req};"
    return _pool_loops(c, step, f"acc += v - {a['x_zero']};", "int32_t acc = 0;", y)


@_register("reduce_mean")
def _reduce_mean(c: _Ctx, k: str, step) -> str:
    a = step.attrs
    shape = c.shapes[step.inputs[0]]
    axes = sorted(ax % len(shape) for ax in a["axes"])
    if axes != list(range(len(shape) - len(axes), len(shape))):
        raise ValueError(f"C emitter: reduce_mean {step.node!r} over non-trailing axes {axes}")
    inner = int(np.prod([shape[ax] for ax in axes]))
    outer = c.size(step.inputs[0]) // inner
    x, y = c.names[step.inputs[0]], c.names[step.output]
    req = _requant(a, f"{int(a['multiplier'])}LL", str(int(a["shift"]))).format(acc="acc")
    return f"""    for (int o = 0; o < {outer}; o++) {{
        int32_t acc = 0;
        for (int i = 0; i < {inner}; i++) acc += (int32_t){x}[o * {inner} + i] - {a["x_zero"]};
        {y}[o] = ({c.ctype(step.output)}){req};
    }}
"""


@_register("reshape", "flatten", "squeeze", "unsqueeze", "identity")
def _copy(c: _Ctx, k: str, step) -> str:
    x, y = c.names[step.inputs[0]], c.names[step.output]
    return f"    memcpy({y}, {x}, sizeof {y});\n"


@_register("transpose", "slice", "resize_nearest", "gather", *INDEX_MAPPED)
def _gather(c: _Ctx, k: str, step) -> str:
    source = np.arange(c.size(step.inputs[0])).reshape(c.shapes[step.inputs[0]])
    c.const("int32_t", f"{k}_i", KERNELS[step.op](step.attrs, source))
    x, y = c.names[step.inputs[0]], c.names[step.output]
    return f"    for (int i = 0; i < {c.size(step.output)}; i++) {y}[i] = {x}[{k}_i[i]];\n"


@_register("pad")
def _pad(c: _Ctx, k: str, step) -> str:
    """A gather whose padded positions (index -1) write the zero point."""
    source = np.arange(c.size(step.inputs[0])).reshape(c.shapes[step.inputs[0]])
    c.const("int32_t", f"{k}_i", KERNELS["pad"]({**step.attrs, "value": -1}, source))
    x, y, value = c.names[step.inputs[0]], c.names[step.output], step.attrs["value"]
    return (
        f"    for (int i = 0; i < {c.size(step.output)}; i++)\n"
        f"        {y}[i] = {k}_i[i] < 0 ? ({c.ctype(step.output)}){value} : {x}[{k}_i[i]];\n"
    )


def emit_c(program: Any, directory: str | os.PathLike, input_shapes=None) -> list[str]:
    """Write ``qb_model.h`` / ``qb_model.c`` for ``program`` into ``directory``; the paths."""
    directory = os.fspath(directory)
    try:
        os.makedirs(directory, exist_ok=True)
        probe = os.path.join(directory, ".qb_write_test")
        with open(probe, "w"):
            pass
        os.remove(probe)
    except OSError as e:
        raise OSError(f"C output folder {directory!r} is not writable: {e}") from e
    shapes = program.tensor_shapes(input_shapes)
    c = _Ctx(program, shapes)
    for step in program.steps:
        if step.op in ("conv", "conv_transpose", "matmul") and step.attrs["bound"] >= 2**31:
            raise ValueError(f"C emitter: {step.node!r} needs a 64-bit accumulator")
    bodies = []
    for i, step in enumerate(program.steps):
        gen = C_STEPS.get(step.op)
        if gen is None:
            raise ValueError(f"C emitter: no C for step {step.op!r}; known: {sorted(C_STEPS)}")
        mark = "QB_VECTORIZED " if step.op in VECTORIZED else ""
        bodies.append(f"/* {step.op} {step.node} */\n{mark}static void s{i}(void) {{\n"
                      f"{gen(c, f's{i}', step)}}}\n")  # fmt: skip
    tensors = []
    for name, cname in c.names.items():
        if name in program.constants:
            tensors.append(_array(c.ctype(name), cname, program.constants[name]))
        else:
            tensors.append(f"static {c.ctype(name)} {cname}[{max(c.size(name), 1)}]; /* {name} */")
    params, copy_in, copy_out, header = [], [], [], []
    for i, b in enumerate(program.inputs):
        t = b.tensor.name
        params.append(f"const {c.ctype(t)} *in{i}")
        copy_in.append(f"    memcpy({c.names[t]}, in{i}, sizeof {c.names[t]});")
        header.append(_boundary_macros(f"IN{i}", b, shapes[t]))
    for i, b in enumerate(program.outputs):
        t = b.tensor.name
        params.append(f"{c.ctype(t)} *out{i}")
        copy_out.append(f"    memcpy(out{i}, {c.names[t]}, sizeof {c.names[t]});")
        header.append(_boundary_macros(f"OUT{i}", b, shapes[t]))
    signature = f"void qb_run({', '.join(params)})"
    # The steps run from a table rather than as calls: compilers inline a static function called
    # once, and gcc -O3 allocates registers badly in one function holding every loop of the
    # network (the conv sums spilled to the stack: 382 -> 280 ms on a conv stack, -march=native)
    table = ("/* the program: its steps in order */\nstatic void (*const qb_steps[])(void) = {"
             + ", ".join(f"s{i}" for i in range(len(program.steps))) + "};\n")  # fmt: skip
    calls = "    for (size_t i = 0; i < sizeof qb_steps / sizeof *qb_steps; i++) qb_steps[i]();"
    source = "\n".join([PRELUDE, *tensors, *c.decls, *bodies, table,
                        f"{signature} {{", *copy_in, calls, *copy_out, "}", ""])  # fmt: skip
    guard = "#ifndef QB_MODEL_H\n#define QB_MODEL_H\n#include <stdint.h>\n"
    head = guard + "\n".join(header) + f"\n{signature};\n#endif\n"
    paths = [os.path.join(directory, "qb_model.h"), os.path.join(directory, "qb_model.c")]
    for path, text in zip(paths, (head, source), strict=True):
        with open(path, "w") as f:
            f.write(text)
    return paths


def _boundary_macros(prefix: str, b: Any, shape: tuple[int, ...]) -> str:
    t = b.tensor
    if getattr(b, "scale", None) is not None:  # a weighted layer's accumulator (Boundary.scale)
        scales = ", ".join(repr(float(v)) for v in np.asarray(b.scale).reshape(-1))
        return (f"/* {b.name}: {np.dtype(t.dtype).name} accumulator codes; the float output is "
                f"real = scale[c] * q along axis {b.axis} (one value: per tensor), computed "
                "outside this program */\n"
                f"#define QB_{prefix}_SIZE {int(np.prod(shape))}\n"
                f"#define QB_{prefix}_AXIS {b.axis}\n"
                f"#define QB_{prefix}_SCALES {{{scales}}}\n#define QB_{prefix}_ZERO_POINT 0")  # fmt: skip
    return (f"/* {b.name}: {np.dtype(t.dtype).name} codes, real = scale * (q - zero_point) */\n"
            f"#define QB_{prefix}_SIZE {int(np.prod(shape))}\n"
            f"#define QB_{prefix}_SCALE {t.scale!r}\n#define QB_{prefix}_ZERO_POINT {t.zero_point}")  # fmt: skip
