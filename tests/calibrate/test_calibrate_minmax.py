"""minmax and moving_average_minmax: streaming, per-channel, merge and state dicts."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from quantbridge.calibrate import make_observer
from quantbridge.numerics import PerChannel, PerTensor, QScheme, choose_qparams

finite = st.floats(-1e6, 1e6, allow_nan=False, width=32)
arrays = hnp.arrays(
    np.float32, hnp.array_shapes(min_dims=1, max_dims=3, max_side=6), elements=finite
)


@settings(max_examples=60, deadline=None)
@given(st.lists(arrays, min_size=1, max_size=5))
def test_minmax_streaming_equals_concatenation(chunks: list[np.ndarray]) -> None:
    obs = make_observer("minmax")
    for chunk in chunks:
        obs.update(chunk)
    everything = np.concatenate([c.ravel() for c in chunks])
    lo, hi = obs.range()
    assert lo.shape == hi.shape == ()
    assert lo.dtype == hi.dtype == np.float64
    assert lo == everything.min() and hi == everything.max()


@settings(max_examples=40, deadline=None)
@given(
    hnp.arrays(
        np.float32,
        st.tuples(st.integers(1, 5), st.integers(1, 4), st.integers(1, 5)),
        elements=finite,
    ),
    st.sampled_from([0, 1, 2, -1, -2]),
    st.integers(1, 4),
)
def test_per_channel_minmax_any_axis(x: np.ndarray, axis: int, pieces: int) -> None:
    obs = make_observer("minmax", PerChannel(axis))
    other_axes = tuple(i for i in range(3) if i != axis % 3)
    split_axis = other_axes[0]  # batches split along a non-channel axis
    for piece in np.array_split(x, pieces, axis=split_axis):
        obs.update(piece)
    lo, hi = obs.range()
    np.testing.assert_array_equal(lo, x.min(axis=other_axes))
    np.testing.assert_array_equal(hi, x.max(axis=other_axes))
    assert lo.shape == (x.shape[axis],)


def test_merge_of_halves_equals_one_observer_per_channel() -> None:
    x = np.random.default_rng(0).standard_normal((16, 8, 5)).astype(np.float32)
    whole, a, b = (make_observer("minmax", PerChannel(1)) for _ in range(3))
    whole.update(x)
    a.update(x[:7])
    b.update(x[7:])
    a.merge(b)
    for got, want in zip(a.range(), whole.range(), strict=True):
        np.testing.assert_array_equal(got, want)
    assert a.values_seen == whole.values_seen == x.size


def test_merge_via_state_dict_and_round_trip() -> None:
    x = np.random.default_rng(1).standard_normal(1000)
    a, b = make_observer("minmax"), make_observer("minmax")
    a.update(x[:300])
    b.update(x[300:])
    a.merge(b.state_dict())  # as received from another process
    assert (a.range()[0], a.range()[1]) == (x.min(), x.max())
    restored = make_observer("minmax")
    restored.load_state_dict(a.state_dict())
    assert restored.range() == a.range()
    state = a.state_dict()
    assert state["method"] == "minmax" and state["granularity"] == "per_tensor"
    assert all(isinstance(v, (np.ndarray, float, int, str)) for v in state.values())


def test_merge_with_empty_observers() -> None:
    a, empty = make_observer("minmax", PerChannel(0)), make_observer("minmax", PerChannel(0))
    a.merge(empty)  # empty into empty stays empty
    assert a.values_seen == 0
    empty.update(np.arange(6.0).reshape(3, 2))
    a.merge(empty)
    np.testing.assert_array_equal(a.range()[1], [1.0, 3.0, 5.0])
    a.merge(make_observer("minmax", PerChannel(0)))
    np.testing.assert_array_equal(a.range()[0], [0.0, 2.0, 4.0])
    fresh = make_observer("minmax", PerChannel(0))
    fresh.load_state_dict(make_observer("minmax", PerChannel(0)).state_dict())
    with pytest.raises(ValueError, match="saw no data"):
        fresh.range()


def test_torch_tensors_are_read_like_numpy() -> None:
    t = torch.randn(4, 3, requires_grad=True)
    obs = make_observer("minmax", PerChannel(1))
    obs.update(t * 2)  # a non-leaf tensor that requires grad
    np.testing.assert_array_equal(obs.range()[1], (t * 2).detach().numpy().max(axis=0))
    half = make_observer("minmax")
    half.update(torch.tensor([1.5, -2.25], dtype=torch.bfloat16))
    assert half.range() == (-2.25, 1.5)


def test_all_zero_data_gives_zero_range() -> None:
    obs = make_observer("minmax")
    obs.update(np.zeros(10, np.float32))
    assert obs.range() == (0.0, 0.0)
    scale, zero_point = obs.qparams(QScheme())
    assert scale > 0 and zero_point == 0  # numerics owns the fallback


def test_qparams_is_choose_qparams_of_range() -> None:
    x = np.random.default_rng(2).standard_normal((6, 4)).astype(np.float32)
    scheme = QScheme(signed=False, symmetric=False, granularity=PerChannel(0))
    obs = make_observer("minmax", PerChannel(0))
    obs.update(x)
    for got, want in zip(obs.qparams(scheme), choose_qparams(*obs.range(), scheme), strict=True):
        np.testing.assert_array_equal(got, want)
    with pytest.raises(ValueError, match="does not match"):
        obs.qparams(QScheme(granularity=PerTensor()))


def test_moving_average_matches_torch_observer() -> None:
    rng = np.random.default_rng(3)
    chunks = [rng.standard_normal(50).astype(np.float32) * (1 + i) for i in range(20)]
    ours = make_observer("moving_average_minmax")
    ref = torch.ao.quantization.MovingAverageMinMaxObserver(averaging_constant=0.01)
    for chunk in chunks:
        ours.update(chunk)
        ref(torch.from_numpy(chunk))
    np.testing.assert_allclose(ours.range()[0], ref.min_val.item(), rtol=1e-6)
    np.testing.assert_allclose(ours.range()[1], ref.max_val.item(), rtol=1e-6)


def test_moving_average_per_channel_matches_torch() -> None:
    rng = np.random.default_rng(4)
    chunks = [rng.standard_normal((3, 10)).astype(np.float32) for _ in range(5)]
    ours = make_observer("moving_average_minmax", PerChannel(0))
    ref = torch.ao.quantization.MovingAveragePerChannelMinMaxObserver(
        averaging_constant=0.01, ch_axis=0
    )
    for chunk in chunks:
        ours.update(chunk)
        ref(torch.from_numpy(chunk))
    np.testing.assert_allclose(ours.range()[0], ref.min_val.numpy(), rtol=1e-6)
    np.testing.assert_allclose(ours.range()[1], ref.max_val.numpy(), rtol=1e-6)


def test_moving_average_first_batch_initialises_and_merge_is_batch_weighted() -> None:
    a = make_observer("moving_average_minmax", averaging_constant=0.5)
    a.update(np.array([-1.0, 1.0]))
    assert a.range() == (-1.0, 1.0)
    a.update(np.array([-3.0, 5.0]))
    assert a.range() == (-2.0, 3.0)  # -1 + 0.5 (-3 - -1), 1 + 0.5 (5 - 1)
    b = make_observer("moving_average_minmax", averaging_constant=0.5)
    b.update(np.array([-8.0, 8.0]))
    a.merge(b)  # (2 * a + 1 * b) / 3
    assert a.range() == ((2 * -2.0 + -8.0) / 3, (2 * 3.0 + 8.0) / 3)
    assert a.state_dict()["batches"] == 3
    restored = make_observer("moving_average_minmax")
    restored.load_state_dict(a.state_dict())
    assert restored.range() == a.range() and restored.batches == 3
