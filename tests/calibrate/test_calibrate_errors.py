"""Error messages and the registry."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from quantbridge.calibrate import (
    MinMaxObserver,
    Observer,
    make_observer,
    register_observer,
    registered_methods,
)
from quantbridge.numerics import PerChannel, QScheme

ALL = ["minmax", "moving_average_minmax", "mean_minmax", "percentile", "entropy", "mse"]


def test_registry_lists_every_method() -> None:
    assert registered_methods() == tuple(sorted(ALL))


def test_unknown_method_lists_the_registered_ones() -> None:
    with pytest.raises(
        ValueError, match="unknown calibration method 'kl'.*entropy, mean_minmax, minmax"
    ):
        make_observer("kl")


@pytest.mark.parametrize("method", ALL)
def test_range_before_any_data(method: str) -> None:
    obs = make_observer(method)
    obs.update(np.zeros((0, 3), np.float32))  # an empty batch is no data
    with pytest.raises(ValueError, match="observer saw no data"):
        obs.range(QScheme())
    with pytest.raises(ValueError, match="observer saw no data"):
        obs.qparams(QScheme())


@pytest.mark.parametrize("method", ALL)
def test_non_finite_values_are_counted_and_leave_the_observer_unchanged(method: str) -> None:
    obs = make_observer(method)
    obs.update(np.array([1.0, -2.0], np.float32))
    before = obs.state_dict()
    bad = np.array([np.nan, 1.0, np.inf, np.nan, -np.inf, -np.inf], np.float32)
    with pytest.raises(ValueError, match=r"2 NaN, 1 \+inf, 2 -inf among 6 values"):
        obs.update(bad)
    with pytest.raises(ValueError, match="1 NaN, 0 \\+inf, 0 -inf"):
        obs.update(torch.tensor([0.0, float("nan")]))
    after = obs.state_dict()
    assert before.keys() == after.keys()
    for key in before:
        np.testing.assert_array_equal(before[key], after[key])


@pytest.mark.parametrize("method", ["minmax", "moving_average_minmax"])
def test_wrong_channel_count_names_both_shapes(method: str) -> None:
    obs = make_observer(method, PerChannel(1))
    obs.update(np.zeros((2, 4, 3)))
    with pytest.raises(ValueError, match=r"shape \(4,\) \(4 channels\).*shape \(2, 5, 3\) \(5 ch"):
        obs.update(np.zeros((2, 5, 3)))
    other = make_observer(method, PerChannel(1))
    other.update(np.zeros((1, 6)))
    with pytest.raises(ValueError, match=r"shape \(6,\).*shape \(4,\)"):
        obs.merge(other)


def test_axis_out_of_range() -> None:
    with pytest.raises(ValueError, match="axis 3 is out of range"):
        make_observer("minmax", PerChannel(3)).update(np.zeros((2, 2)))


@pytest.mark.parametrize("method", ["percentile", "entropy", "mse"])
def test_histogram_methods_refuse_per_channel(method: str) -> None:
    with pytest.raises(ValueError, match="supports only PerTensor.*'minmax'"):
        make_observer(method, PerChannel(0))


@pytest.mark.parametrize("method", ["entropy", "mse"])
def test_scheme_is_required_where_the_grid_matters(method: str) -> None:
    obs = make_observer(method)
    obs.update(np.arange(10.0))
    with pytest.raises(ValueError, match="needs the quantization scheme"):
        obs.range()


def test_merge_and_load_refuse_other_kinds() -> None:
    a, b = make_observer("minmax"), make_observer("percentile")
    b.update(np.ones(3))
    with pytest.raises(ValueError, match="cannot merge a PercentileObserver"):
        a.merge(b)
    with pytest.raises(ValueError, match="missing keys"):
        a.merge(b.state_dict())
    state = make_observer("minmax", PerChannel(0)).state_dict()
    with pytest.raises(ValueError, match="unexpected keys \\['axis'\\]"):
        a.load_state_dict(state)
    with pytest.raises(ValueError, match="axis=0 but this observer has axis=1"):
        make_observer("minmax", PerChannel(1)).load_state_dict(state)
    with pytest.raises(TypeError, match="state dict"):
        a.merge([1, 2])


def test_bad_options() -> None:
    with pytest.raises(ValueError, match="percentile must be in \\[50, 100\\]"):
        make_observer("percentile", percentile=5)
    with pytest.raises(ValueError, match="averaging_constant"):
        make_observer("moving_average_minmax", averaging_constant=0)
    with pytest.raises(TypeError, match="granularity"):
        make_observer("minmax", "per_tensor")
    with pytest.raises(TypeError, match="real numeric"):
        make_observer("minmax").update(np.array(["a"]))


def test_register_observer_guards() -> None:
    with pytest.raises(ValueError, match="already registered"):
        register_observer("minmax")(type("Other", (MinMaxObserver,), {}))
    with pytest.raises(TypeError, match="Observer subclass"):
        register_observer("thing")(int)
    assert issubclass(MinMaxObserver, Observer)
