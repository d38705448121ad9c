"""C99 for the ``conv`` step (``kernels._linear`` states the pipeline), registered in the C
emitter's table: the same int32 sums as the numpy executor, laid out so that gcc -O3
vectorizes them on any target (SSE2 ``pmaddwd`` at plain -O3 on x86-64, AVX2 with -mavx2).

The emitted function works in four stages:

1. the input, centered (``q_x - z_x``, int16) and zero padded, is copied once to NHWC
   (``{k}_xp``), so the channels of one pixel are contiguous; the padding border is never
   written and stays 0 (static storage), which is what a padded code ``z_x`` centers to;
2. for each output row (and group), its patches are copied to ``{k}_p[ow][i][j][c]``: one
   contiguous run of K = KH*KW*Cg centered codes per output pixel, followed by zeros up to
   ``KP`` (K rounded up to ``LANES``), so the sums have no remainder loop;
3. a block of ``OB`` output channels by ``PB`` pixels is summed at a time: ``OB * PB``
   independent dot products over the same ``KP`` codes (weights ``{k}_w[o][i][j][c]``,
   centered, zero padded alike), each one a vectorized int16 x int16 -> int32 reduction;
   the block shares its loads, which is where the speed comes from. The sums of the row
   go to ``{k}_acc[o][ow]``;
4. ``+ bias`` and ``qb_requantize`` along each output channel's row, its multiplier and shift
   loaded once (inside the block loop, the requantization spilled registers and took a quarter
   of the time).

The order of the additions differs from numpy's, the sums do not: integers below 2**31
(the lowering's accumulator bound), so every order gives the same int32.
"""

from __future__ import annotations

import numpy as np

from ._c import VECTORIZED, _Ctx, _layer_requant_consts, _register, _requant

LANES = 16  # int16 lanes of a 256-bit vector: KP = K rounded up to this
# Block shape, measured (user cycles, perf stat) on a conv stack in ResNet-18-style sizes, this
# AVX2 CPU: 8 x 1 took 140 M cycles at -O3 -march=native where 4 x 2 took 161 M (-O3: alike)
OB_CHOICES = (8, 4, 2, 1)  # output channels per block: the largest that divides C_out / group
PB = 1  # output pixels per block


def _block(n: int, choices: tuple[int, ...]) -> int:
    """The largest block size in ``choices`` that divides ``n``."""
    return next(b for b in choices if n % b == 0)


VECTORIZED.add("conv")  # -DQB_X86_CLONES: an AVX2 clone of each conv step (emitter PRELUDE)


@_register("conv")
def _conv(c: _Ctx, k: str, step) -> str:
    a = step.attrs
    xs, ys = c.shapes[step.inputs[0]], c.shapes[step.output]
    w = np.asarray(a["weight"])
    strides, pads, dil = a["strides"], a["pads"], a["dilations"]
    if w.ndim > 4:
        raise ValueError(
            f"C emitter: conv {step.node!r} is a {w.ndim - 2}-D convolution; the C "
            "emitter writes 1-D and 2-D ones (the numpy and ONNX programs run it)"
        )
    if w.ndim == 3:  # 1-D as 2-D with unit height
        w, xs, ys = w[:, :, None], (*xs[:2], 1, xs[2]), (*ys[:2], 1, ys[2])
        strides, dil, pads = (1, strides[0]), (1, dil[0]), (0, pads[0], 0, pads[1])
    n, ch, h, wd = xs
    o, cg, kh, kw = w.shape
    oh, ow = ys[2], ys[3]
    group = a["group"]
    og = o // group
    hp, wp = h + pads[0] + pads[2], wd + pads[1] + pads[3]
    kdim = kh * kw * cg
    kp = -(-kdim // LANES) * LANES
    owp = -(-ow // PB) * PB  # whole pixel blocks: the last one may hold an unused pixel
    wz = np.asarray(a["w_zero"], np.int64).reshape(-1, 1, 1, 1)
    wc = (w.astype(np.int64) - wz).transpose(0, 2, 3, 1).reshape(o, kdim)  # [O][KH][KW][Cg]
    c.const("int16_t", f"{k}_w", np.pad(wc, ((0, 0), (0, kp - kdim))))
    c.decls.append(f"static int16_t {k}_xp[{n * hp * wp * ch}];")
    c.decls.append(f"static int16_t {k}_p[{owp * kp}];")
    c.decls.append(f"static int32_t {k}_acc[{o * owp}];")
    _layer_requant_consts(c, k, a)
    x, y = c.names[step.inputs[0]], c.names[step.output]
    src = f"{k}_xp + ((n * {hp} + oh * {strides[0]} + i * {dil[0]}) * {wp} + ow * {strides[1]}"
    if dil[1] == 1 and group == 1:  # the KW pixels of a patch row are one contiguous run
        copy = f"""for (int i = 0; i < {kh}; i++)
                    memcpy({k}_p + ow * {kp} + i * {kw * cg}, {src}) * {ch},
                           {kw * cg} * sizeof(int16_t));"""
    else:
        copy = f"""for (int i = 0; i < {kh}; i++) for (int j = 0; j < {kw}; j++)
                    memcpy({k}_p + ow * {kp} + (i * {kw} + j) * {cg},
                           {src} + j * {dil[1]}) * {ch} + g * {cg}, {cg} * sizeof(int16_t));"""
    req = _requant(a, "m", "shift").format(acc=f"{k}_acc[o * {owp} + ow] + {k}_b[o]")
    return f"""    /* 1. centered input, NHWC, zero padding (the border is never written) */
    for (int n = 0; n < {n}; n++) for (int h = 0; h < {h}; h++)
        for (int w = 0; w < {wd}; w++) for (int c = 0; c < {ch}; c++)
            {k}_xp[((n * {hp} + h + {pads[0]}) * {wp} + w + {pads[1]}) * {ch} + c] =
                (int16_t)({x}[((n * {ch} + c) * {h} + h) * {wd} + w] - {a["x_zero"]});
    for (int n = 0; n < {n}; n++) for (int oh = 0; oh < {oh}; oh++) {{
        for (int g = 0; g < {group}; g++) {{
            /* 2. the patches of output row oh: {k}_p[ow][i][j][c], {kdim} codes + zeros to {kp} */
            for (int ow = 0; ow < {ow}; ow++)
                {copy}
{_block_sums(k, _block(og, OB_CHOICES), kp, og, owp)}        }}
        /* 4. + bias, requantize: the row of each output channel */
        for (int o = 0; o < {o}; o++) {{
            const int64_t m = {k}_m[o];
            const int shift = {k}_n[o];
            for (int ow = 0; ow < {ow}; ow++)
                {y}[((n * {o} + o) * {oh} + oh) * {ow} + ow] = ({c.ctype(step.output)}){req};
        }}
    }}
"""


def _plus(var: str, offset: int) -> str:
    """C for ``var + offset``; ``var`` alone at offset 0."""
    return f"{var} + {offset}" if offset else var


def _block_sums(k: str, ob: int, kp: int, og: int, owp: int) -> str:
    """C of stage 3: the sums of group ``g``, ``ob`` output channels x ``PB`` pixels at a time,
    into ``{k}_acc[o][ow]``."""
    pairs = [(i, j) for i in range(ob) for j in range(PB)]
    accs = ", ".join(f"acc{i}{j} = 0" for i, j in pairs)
    sums = "\n".join(f"                    acc{i}{j} += (int32_t)w[{_plus('q', i * kp)}]"
                     f" * p[{_plus('q', j * kp)}];" for i, j in pairs)  # fmt: skip
    stores = "\n".join(f"                out[{i * owp + j}] = acc{i}{j};" for i, j in pairs)
    pixels = "1 pixel" if PB == 1 else f"{PB} pixels"
    return f"""            /* 3. {ob} output channels x {pixels}: {len(pairs)} dot products sharing loads */
            for (int o = g * {og}; o < (g + 1) * {og}; o += {ob})
            for (int ow = 0; ow < {owp}; ow += {PB}) {{
                const int16_t *w = {k}_w + o * {kp}, *p = {k}_p + ow * {kp};  /* row o, pixel ow */
                int32_t *out = {k}_acc + o * {owp} + ow;
                int32_t {accs};
                for (int q = 0; q < {kp}; q++) {{
{sums}
                }}
{stores}
            }}
"""
