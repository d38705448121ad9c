"""Blocked (group-wise) parameters: ``expand_blocks`` and the affine formulas with ``block_size``.

Property tests against a per-element float64 loop (element ``i`` along ``axis`` uses block
``i // B``), numpy / torch bit equality, and ONNX's own reference DequantizeLinear (opset 21,
``block_size``) as a peer on int4 / uint4 / int8 / uint8 codes."""

import numpy as np
import onnx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from quantbridge.numerics import (
    PerBlock,
    QScheme,
    dequantize,
    expand_blocks,
    fake_quantize,
    granularity_from_dict,
    quantize,
)


@st.composite
def blocked_cases(draw):
    rank = draw(st.integers(1, 3))
    shape = tuple(draw(st.integers(1, 9)) for _ in range(rank))
    axis = draw(st.integers(-rank, rank - 1))
    block = draw(st.integers(1, 10))
    n_blocks = -(-shape[axis] // block)
    pshape = tuple(n_blocks if d == axis % rank else n for d, n in enumerate(shape))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    bits, signed = draw(st.sampled_from([(4, True), (4, False), (8, True), (8, False)]))
    qmin, qmax = (-(2 ** (bits - 1)), 2 ** (bits - 1) - 1) if signed else (0, 2**bits - 1)
    # ONNX Runtime's symmetric block quantizer writes negative scales too: both signs
    scale = (rng.uniform(1e-3, 2.0, pshape) * rng.choice([-1, 1], pshape)).astype(np.float32)
    zero_point = rng.integers(qmin, qmax + 1, pshape)
    x = (rng.standard_normal(shape) * 3).astype(np.float32)
    return x, scale, zero_point, axis, block, qmin, qmax


def _reference_params(p, shape, axis, block):
    """Per-element parameters by an explicit index map (float64)."""
    axis %= len(shape)
    out = np.empty(shape, np.float64)
    for idx in np.ndindex(*shape):
        src = list(idx)
        src[axis] //= block
        out[idx] = p[tuple(src)]
    return out


@settings(max_examples=200, deadline=None)
@given(case=blocked_cases())
def test_blocked_formulas_match_a_per_element_reference(case):
    x, scale, zero_point, axis, block, qmin, qmax = case
    s = _reference_params(scale, x.shape, axis, block)
    z = _reference_params(zero_point, x.shape, axis, block)
    # float64 reference of step 2 rounded to float32 as ours is: x / s is one correctly rounded
    # float32 division, which float64 division then rounding to float32 reproduces exactly
    # (double rounding is innocuous for division: 53 >= 2 * 24 + 2)
    t = (x.astype(np.float64) / s).astype(np.float32).astype(np.float64)
    codes = np.clip(np.round(t) + z, qmin, qmax)
    got = quantize(x, scale, zero_point.astype(np.float32), qmin, qmax, axis, block_size=block)
    np.testing.assert_array_equal(got, codes)
    # dequantize: (q - z) * s, one float32 rounding of the exact float64 product
    want = ((codes - z) * s).astype(np.float32)
    deq = dequantize(codes.astype(np.int64), scale, zero_point, axis, block_size=block)
    np.testing.assert_array_equal(deq, want)
    fq = fake_quantize(x, scale, zero_point, qmin, qmax, axis, block_size=block)
    np.testing.assert_array_equal(fq, want)
    tfq = fake_quantize(torch.from_numpy(x), torch.from_numpy(scale),
                        torch.from_numpy(zero_point).float(), qmin, qmax, axis,
                        block_size=block)  # fmt: skip
    np.testing.assert_array_equal(tfq.numpy(), fq)  # numpy and torch: bit for bit


def test_expand_blocks_partial_last_block_and_shape_errors():
    p = np.array([[1.0, 2.0], [3.0, 4.0]], np.float32)  # 2 blocks of 3 along axis 1, n = 5
    full = expand_blocks(p, "scale", (2, 5), 1, 3)
    np.testing.assert_array_equal(full, [[1, 1, 1, 2, 2], [3, 3, 3, 4, 4]])
    np.testing.assert_array_equal(expand_blocks(torch.from_numpy(p), "s", (2, 5), -1, 3), full)
    with pytest.raises(ValueError, match=r"must have shape \(2, 3\)"):
        expand_blocks(p, "scale", (2, 5), 1, 2)
    with pytest.raises(ValueError, match="need an axis"):
        quantize(np.zeros((2, 5), np.float32), p, np.zeros_like(p), -8, 7, None, block_size=3)
    with pytest.raises(ValueError, match="block_size must be >= 1"):
        expand_blocks(p, "scale", (2, 5), 1, 0)


def test_per_block_granularity_round_trips_and_validates():
    scheme = QScheme(4, True, True, False, PerBlock(axis=1, block_size=32))
    assert QScheme.from_dict(scheme.to_dict()) == scheme
    assert granularity_from_dict({"kind": "per_block", "axis": 0, "block_size": 8}) == PerBlock(
        0, 8
    )
    with pytest.raises(ValueError, match="block_size"):
        PerBlock(axis=0, block_size=0)
    with pytest.raises(ValueError, match="needs a 'block_size'"):
        granularity_from_dict({"kind": "per_block", "axis": 0})


@pytest.mark.parametrize(
    "onnx_type, lo, hi",
    [
        (TensorProto.INT4, -8, 7),
        (TensorProto.UINT4, 0, 15),
        (TensorProto.INT8, -128, 127),
        (TensorProto.UINT8, 0, 255),
    ],
)
@pytest.mark.parametrize("axis", [0, 1])
def test_dequantize_blocked_matches_onnx_reference(onnx_type, lo, hi, axis):
    rng = np.random.default_rng(7)
    shape, block = (6, 10), 4  # 10 / 4: a partial last block along axis 1
    n_blocks = -(-shape[axis] // block)
    pshape = (n_blocks, shape[1]) if axis == 0 else (shape[0], n_blocks)
    codes = rng.integers(lo, hi + 1, shape)
    zero_point = rng.integers(lo, hi + 1, pshape)
    scale = rng.uniform(0.01, 1.0, pshape).astype(np.float32)
    node = helper.make_node("DequantizeLinear", ["q", "s", "z"], ["y"], axis=axis,
                            block_size=block)  # fmt: skip
    graph = helper.make_graph(
        [node], "g", [], [helper.make_tensor_value_info("y", TensorProto.FLOAT, list(shape))],
        [helper.make_tensor("q", onnx_type, shape, codes.reshape(-1).tolist()),
         numpy_helper.from_array(scale, "s"),
         helper.make_tensor("z", onnx_type, pshape, zero_point.reshape(-1).tolist())],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])
    (want,) = ReferenceEvaluator(model).run(None, {})
    got = dequantize(codes, scale, zero_point, axis, block_size=block)
    np.testing.assert_array_equal(got, want)
    assert onnx.checker.check_model(model) is None
