"""The observers' exact merge as tensors (``tensor_merge``: merge_maxima / load_maxima /
merge_sums / load_sums), run here with numpy's elementwise max and sum standing in for the
all-reduce of ``torch._distributed``: the combined observer equals one observer that saw every
shard (state dicts equal, including extrema, histogram range and counts), whatever the shards'
sizes, ranges and order, and with shards that saw nothing."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from quantbridge.calibrate import make_observer, registered_methods
from quantbridge.numerics import PerChannel, PerTensor

EXACT = [("minmax", PerTensor()), ("minmax", PerChannel(1)), ("percentile", PerTensor()),
         ("entropy", PerTensor()), ("mse", PerTensor())]  # fmt: skip


def _all_reduce(observers):
    """The two rounds of ``torch._distributed._reduce_tensors``, every 'rank' in this process."""
    seen = sum(o.values_seen for o in observers)
    sizes = {o.merge_size() for o in observers} - {0}
    assert len(sizes) <= 1
    size = sizes.pop() if sizes else 0
    maxima = np.max([o.merge_maxima(size) for o in observers], axis=0)
    for o in observers:
        o.load_maxima(maxima, size)
    sums = np.sum([o.merge_sums() for o in observers], axis=0)
    for o in observers:
        o.load_sums(sums, seen)


def _equal_states(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for key in a:
        np.testing.assert_array_equal(np.asarray(a[key]), np.asarray(b[key]), err_msg=key)


@settings(max_examples=25, deadline=None)
@given(
    case=st.sampled_from(EXACT),
    scales=st.lists(st.sampled_from([0.0, 1e-3, 1.0, 7.0, 300.0]), min_size=1, max_size=4),
    empty=st.integers(0, 3),
    seed=st.integers(0, 2**16),
)
def test_tensor_merge_equals_one_observer_over_every_shard(case, scales, empty, seed):
    method, granularity = case
    rng = np.random.default_rng(seed)
    shards = [(rng.standard_normal((5, 3)) * s + s / 3).astype(np.float32) for s in scales]
    ranks = [make_observer(method, granularity) for _ in range(len(shards) + 1)]
    whole = make_observer(method, granularity)
    for i, shard in enumerate(shards):
        target = ranks[i] if i != empty else ranks[-1]  # one rank may hold two shards ...
        target.update(shard)
        whole.update(shard)
    # ... so at least one rank saw nothing
    _all_reduce(ranks)
    for obs in ranks:
        _equal_states(obs.state_dict(), whole.state_dict())


def test_only_the_averages_merge_by_state_dicts():
    """The moving average depends on batch order, and mean_minmax averages by sample counts:
    no elementwise max reproduces either."""
    by_states = {m for m in registered_methods() if not make_observer(m).tensor_merge}
    assert by_states == {"moving_average_minmax", "mean_minmax"}
    with pytest.raises(NotImplementedError, match="merges by state dicts only"):
        make_observer("moving_average_minmax").merge_maxima(1)
