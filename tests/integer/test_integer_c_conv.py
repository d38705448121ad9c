"""The C emitter's blocked convolution (``emit._c_conv``) compiled as shipped (gcc -O3, the
vectorized build), bit-exact with the numpy executor on every layout it generates: blocks of
8, 4, 2 and 1 output channels, by 1 pixel (the shipped shape) or 2 (with an odd output width,
the last pixel block half used), asymmetric padding, strides, a dilated grouped patch (copied
pixel by pixel), a 1x1 convolution whose reduction (8 codes) is padded to the vector width, and
a batch of two; and with ``-DQB_X86_CLONES`` (an AVX2 clone of each conv step)."""

from __future__ import annotations

import platform
import sys

import numpy as np
import pytest

import quantbridge as qb
from quantbridge.integer.emit import _c_conv


def _conv(g, x, cin, cout, k, group=1, dtype=np.uint8, **attrs):
    w = g.weight((cout, cin // group, *k))
    y = g.node("Conv", [x, w, g.bias(cout, 0.05 * 0.02)], group=group, **attrs)
    return g.quant(y, 0.25, 0 if dtype == np.int8 else 128, dtype)


X86_LINUX = platform.machine() in ("x86_64", "AMD64") and sys.platform.startswith("linux")
BUILDS = [
    ("-O3", (8, 4, 2, 1), 1),
    ("-O3", (4, 2, 1), 2),
    # the AVX2 clones of the conv steps (chosen at load time on a CPU with AVX2), gcc + glibc
    pytest.param("-O3 -DQB_X86_CLONES", (8, 4, 2, 1), 1,
                 marks=pytest.mark.skipif(not X86_LINUX, reason="target_clones: x86-64 Linux")),
]  # fmt: skip


@pytest.mark.parametrize("opt, channels, pixels", BUILDS)
def test_blocked_conv_bit_exact_at_O3(qdq_graph, run_c, tmp_path, monkeypatch, opt, channels,
                                      pixels):  # fmt: skip
    monkeypatch.setattr(_c_conv, "OB_CHOICES", channels)
    monkeypatch.setattr(_c_conv, "PB", pixels)
    g = qdq_graph((2, 8, 11, 13))
    outputs = [
        # 8 output channels: one block of 8 or two of 4; output width 7 (odd)
        _conv(g, g.x, 8, 8, (3, 3), pads=[1, 1, 2, 1], strides=[2, 2]),
        # 4 groups of 3 output channels: blocks of 1; dilated along W: pixel-by-pixel patches
        _conv(g, g.x, 8, 12, (3, 2), group=4, dilations=[1, 2], pads=[1, 0, 1, 0]),
        # 1x1, 6 output channels (blocks of 2), 8 codes per patch padded to LANES, int8 out
        _conv(g, g.x, 8, 6, (1, 1), dtype=np.int8),
    ]
    prog = qb.lower(g.model(*outputs))
    convs = [s for s in prog.steps if s.op == "conv"]
    assert len(convs) == 3 and 8 % _c_conv.LANES != 0
    x = (np.random.default_rng(0).standard_normal((2, 8, 11, 13)) * 3).astype(np.float32)
    got = run_c(prog, {"x": x}, tmp_path, opt=opt)
    expected = prog.run({"x": x}, integer=True)
    assert len(expected) == 3
    for name, codes in expected.items():
        assert len(np.unique(codes)) > 10, name  # not a saturated, constant output
        np.testing.assert_array_equal(got[name], codes, err_msg=name)
