"""``one_thread``: torch's intra-op pool at one thread inside the block, the caller's count back
after it, also when the block raises; bias correction's per-layer statistics run inside it with
the same result."""

import dataclasses

import pytest
import torch
from torch import nn

import quantbridge as qb
from quantbridge.torch._threads import one_thread
from quantbridge.torch.ptq import _bias_correction as bc


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_one_thread_inside_and_restored_also_on_error(two_threads):
    with one_thread():
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError, match="boom"), one_thread():
        assert torch.get_num_threads() == 1
        raise RuntimeError("boom")
    assert torch.get_num_threads() == 2


def test_bias_correction_pins_only_its_small_ops_with_the_same_result(two_threads, monkeypatch):
    """One-pass bias correction (the default's until stop 14; the default is "sequential" now,
    which reads no tap means): the per-layer statistics (tap means) run at one thread, the float pass's layers at the
    caller's count; the corrected model is bit-identical to one computed without the pin."""
    seen = []
    real = bc.tap_means

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).eval()
    calib = [torch.randn(4, 3, 12, 12, generator=g) for _ in range(2)]
    monkeypatch.setattr(bc, "tap_means", spy)
    one_pass = dataclasses.replace(qb.Recipe.preset("default"), bias_correction=True)
    pinned = qb.quantize(model, calib, one_pass, progress=False)
    assert seen and set(seen) == {1} and torch.get_num_threads() == 2
    monkeypatch.setattr(bc, "one_thread", _Unpinned)
    seen.clear()
    free = qb.quantize(model, calib, one_pass, progress=False)
    assert set(seen) == {2}
    for name, value in pinned.state_dict().items():
        assert torch.equal(value, free.state_dict()[name]), name


class _Unpinned:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
