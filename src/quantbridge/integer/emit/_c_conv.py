"""C99 for the ``conv`` step (``kernels._linear`` states the pipeline), registered in the C
emitter's table: the same int32 sums as the numpy executor, laid out so that gcc -O3
vectorizes them on any target (SSE2 ``pmaddwd`` at plain -O3 on x86-64, AVX2 with -mavx2).

The emitted function works in three stages:

1. the input, centered (``q_x - z_x``, int16) and zero padded, is copied once to NHWC
   (``{k}_xp``), so the channels of one pixel are contiguous; the padding border is never
   written and stays 0 (static storage), which is what a padded code ``z_x`` centers to;
2. for each output row (and group), its patches are copied to ``{k}_p[ow][i][j][c]``: one
   contiguous run of K = KH*KW*Cg centered codes per output pixel, followed by zeros up to
   ``KP`` (K rounded up to ``LANES``), so the sums have no remainder loop;
3. a block of ``OB`` output channels by ``PB`` pixels is summed at a time: ``OB * PB``
   independent dot products over the same ``KP`` codes (weights ``{k}_w[o][i][j][c]``,
   centered, zero padded alike), each one a vectorized int16 x int16 -> int32 reduction;
   the block shares its loads, which is where the speed comes from. Then ``+ bias``,
   ``qb_requantize`` per output channel, as everywhere in the program.

The order of the additions differs from numpy's, the sums do not: integers below 2**31
(the lowering's accumulator bound), so every order gives the same int32.
"""

from __future__ import annotations

import numpy as np

from ._c import _Ctx, _layer_requant_consts, _register, _requant

LANES = 16  # int16 lanes of a 256-bit vector: KP = K rounded up to this
OB_CHOICES = (4, 2, 1)  # output channels per block: the largest that divides C_out / group
PB = 2  # output pixels per block


def _block(n: int, choices: tuple[int, ...]) -> int:
    """The largest block size in ``choices`` that divides ``n``."""
    return next(b for b in choices if n % b == 0)


@_register("conv")
def _conv(c: _Ctx, k: str, step) -> str:
    a = step.attrs
    xs, ys = c.shapes[step.inputs[0]], c.shapes[step.output]
    w = np.asarray(a["weight"])
    strides, pads, dil = a["strides"], a["pads"], a["dilations"]
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
    ob = _block(og, OB_CHOICES)
    wz = np.asarray(a["w_zero"], np.int64).reshape(-1, 1, 1, 1)
    wc = (w.astype(np.int64) - wz).transpose(0, 2, 3, 1).reshape(o, kdim)  # [O][KH][KW][Cg]
    c.const("int16_t", f"{k}_w", np.pad(wc, ((0, 0), (0, kp - kdim))))
    c.decls.append(f"static int16_t {k}_xp[{n * hp * wp * ch}];")
    c.decls.append(f"static int16_t {k}_p[{-(-ow // PB) * PB * kp}];")  # whole pixel blocks
    _layer_requant_consts(c, k, a)
    x = c.names[step.inputs[0]]
    src = f"{k}_xp + ((n * {hp} + oh * {strides[0]} + i * {dil[0]}) * {wp} + ow * {strides[1]}"
    if dil[1] == 1 and group == 1:  # the KW pixels of a patch row are one contiguous run
        copy = f"""for (int i = 0; i < {kh}; i++)
                memcpy({k}_p + ow * {kp} + i * {kw * cg}, {src}) * {ch},
                       {kw * cg} * sizeof(int16_t));"""
    else:
        copy = f"""for (int i = 0; i < {kh}; i++) for (int j = 0; j < {kw}; j++)
                memcpy({k}_p + ow * {kp} + (i * {kw} + j) * {cg},
                       {src} + j * {dil[1]}) * {ch} + g * {cg}, {cg} * sizeof(int16_t));"""
    return f"""    /* 1. centered input, NHWC, zero padding (the border is never written) */
    for (int n = 0; n < {n}; n++) for (int c = 0; c < {ch}; c++)
        for (int h = 0; h < {h}; h++) for (int w = 0; w < {wd}; w++)
            {k}_xp[((n * {hp} + h + {pads[0]}) * {wp} + w + {pads[1]}) * {ch} + c] =
                (int16_t)({x}[((n * {ch} + c) * {h} + h) * {wd} + w] - {a["x_zero"]});
    for (int n = 0; n < {n}; n++) for (int oh = 0; oh < {oh}; oh++)
    for (int g = 0; g < {group}; g++) {{
        /* 2. the patches of output row oh: {k}_p[ow][i][j][c], {kdim} codes + zeros to {kp} */
        for (int ow = 0; ow < {ow}; ow++)
            {copy}
{_block_sums(c, k, step, ob, kp, og, (n, o, oh, ow))}    }}
"""


def _block_sums(c: _Ctx, k: str, step, ob: int, kp: int, og: int, dims) -> str:
    """C of stage 3: ``ob`` output channels x ``PB`` pixels of row ``oh``, summed over ``kp``."""
    a, y = step.attrs, c.names[step.output]
    _, o, oh, ow = dims
    pairs = [(i, j) for i in range(ob) for j in range(PB)]
    accs = ", ".join(f"acc{i}{j} = 0" for i, j in pairs)
    sums = "\n".join(f"                acc{i}{j} += (int32_t)w[{i * kp} + q] * p[{j * kp} + q];"
                     for i, j in pairs)  # fmt: skip
    stores = []
    for i, j in pairs:
        req = _requant(a, f"{k}_m[o + {i}]", f"{k}_n[o + {i}]")
        req = req.format(acc=f"acc{i}{j} + {k}_b[o + {i}]")
        guard = f"if (ow + {j} < {ow}) " if j and ow % PB else ""  # the last block's extra pixel
        stores.append(f"            {guard}{y}[((n * {o} + o + {i}) * {oh} + oh) * {ow} + ow + {j}]"
                      f" = ({c.ctype(step.output)}){req};")  # fmt: skip
    store_lines = "\n".join(stores)
    return f"""        /* 3. {ob} output channels x {PB} pixels: {len(pairs)} dot products sharing their loads */
        for (int o = g * {og}; o < (g + 1) * {og}; o += {ob})
        for (int ow = 0; ow < {ow}; ow += {PB}) {{
            const int16_t *w = {k}_w + o * {kp}, *p = {k}_p + ow * {kp};  /* row o, pixel ow */
            int32_t {accs};
            for (int q = 0; q < {kp}; q++) {{
{sums}
            }}
{store_lines}
        }}
"""
