"""``one_thread``: torch's intra-op pool at one thread inside the block, the caller's count back
after it, also when the block raises; bias correction runs inside it with the same result."""

import pytest
import torch
from torch import nn

import quantbridge as qb
from quantbridge.torch._threads import one_thread


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


def test_quantize_leaves_the_thread_count_and_corrects_biases_alike(two_threads, monkeypatch):
    seen = []
    real = qb.torch._quantize.correct_bias

    def spy(*args, **kwargs):
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    g = torch.Generator().manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).eval()
    calib = [torch.randn(4, 3, 12, 12, generator=g) for _ in range(2)]
    monkeypatch.setattr(qb.torch._quantize, "correct_bias", spy)
    pinned = qb.quantize(model, calib, progress=False)  # the default: bias correction on
    assert seen == [1] and torch.get_num_threads() == 2
    # the same corrected biases as at two threads (float64 sums of a few thousand terms)
    monkeypatch.setattr(qb.torch._quantize, "one_thread", lambda: _two())
    free = qb.quantize(model, calib, progress=False)
    assert seen == [1, 2]
    for name, value in pinned.state_dict().items():
        assert torch.equal(value, free.state_dict()[name]), name


class _two:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False
