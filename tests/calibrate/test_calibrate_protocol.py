"""The observer protocol, for every registered method: streaming, merge, state dicts, torch."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from quantbridge.calibrate import make_observer, registered_methods
from quantbridge.numerics import QScheme

SCHEMES = (QScheme(), QScheme(bits=4, signed=False, symmetric=False))


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def ranges(obs) -> list[tuple[np.ndarray, np.ndarray]]:
    return [obs.range(scheme) for scheme in SCHEMES]


@settings(max_examples=25, deadline=None)
@given(
    st.sampled_from(["minmax", "percentile", "entropy", "mse"]),
    st.lists(st.integers(1, 3000), min_size=2, max_size=4),
    st.sampled_from([0.1, 1.0, 300.0]),
    st.integers(0, 2**32 - 1),
)
def test_merge_of_parts_equals_one_observer(method, sizes, spread, seed) -> None:
    """Exact for every method but the moving average: same state, identical ranges."""
    rng = np.random.default_rng(seed)
    parts = [rng.standard_t(3, size=n).astype(np.float32) * spread**i for i, n in enumerate(sizes)]
    whole = make_observer(method, num_bins=512) if method != "minmax" else make_observer(method)
    for part in parts:
        whole.update(part)
    observers = []
    for part in parts:
        obs = make_observer(method, num_bins=512) if method != "minmax" else make_observer(method)
        obs.update(part)
        observers.append(obs)
    merged = observers.pop()
    for i, obs in enumerate(observers):  # observers and received state dicts alike
        merged.merge(obs.state_dict() if i % 2 else obs)
    assert_same_state(merged.state_dict(), whole.state_dict())
    for (lo_a, hi_a), (lo_b, hi_b) in zip(ranges(merged), ranges(whole), strict=True):
        assert lo_a == lo_b and hi_a == hi_b


@pytest.mark.parametrize("method", registered_methods())
def test_state_dict_round_trip(method: str, laplacian: np.ndarray) -> None:
    obs = make_observer(method)
    for batch in np.array_split(laplacian[:20_000], 3):
        obs.update(batch)
    state = obs.state_dict()
    assert all(isinstance(v, (np.ndarray, float, int, str)) for v in state.values())
    assert state["method"] == method and state["values_seen"] == 20_000
    restored = make_observer(method)
    restored.load_state_dict(state)
    assert_same_state(restored.state_dict(), state)
    for (lo_a, hi_a), (lo_b, hi_b) in zip(ranges(restored), ranges(obs), strict=True):
        assert lo_a == lo_b and hi_a == hi_b


@pytest.mark.parametrize("method", registered_methods())
def test_torch_and_numpy_inputs_agree(method: str, gaussian: np.ndarray) -> None:
    from_numpy, from_torch = make_observer(method), make_observer(method)
    from_numpy.update(gaussian[:5000].reshape(50, 100))
    from_torch.update(torch.from_numpy(gaussian[:5000]).reshape(50, 100).requires_grad_())
    assert_same_state(from_numpy.state_dict(), from_torch.state_dict())


@pytest.mark.parametrize("method", registered_methods())
def test_ranges_are_float64_scalars_and_qparams_follow(method: str, gaussian: np.ndarray) -> None:
    obs = make_observer(method)
    obs.update(gaussian)
    for scheme in SCHEMES:
        lo, hi = obs.range(scheme)
        assert lo.dtype == hi.dtype == np.float64 and lo.shape == hi.shape == ()
        assert gaussian.min() <= lo < 0 < hi <= gaussian.max()
        scale, zero_point = obs.qparams(scheme)
        assert scale.dtype == np.float32 and zero_point.dtype == np.int32
