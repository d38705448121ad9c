"""A model quantized from dict batches is captured with its inputs in the dict's order; called
with positional inputs, its graph took them in that order, not ``forward``'s. Found by a
newcomer walk: ``{"b": b, "a": a}`` then ``qmodel(a, b)`` failed with torch's
``Guard failed: b.size()[1] == 2``, and with equal shapes it would have swapped the inputs
silently. Then (session 12) a TypeError said to call it with keywords; GPT-2 quantized from
``{"input_ids", "attention_mask"}`` batches still refused ``q(ids, mask)``. Now positional inputs
are bound by the user's ``forward`` (``torch._positional``), in the QuantModel and in its engine
model; a default-valued parameter the capture did not take is dropped, anything else refused."""

from __future__ import annotations

import warnings

import pytest
import torch

import quantbridge as qb


class _TwoInputs(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, a, b):
        return self.fc(a) + b


def _quantized(batch: dict):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the no-VNNI advice; not what this test is about
        return qb.quantize(_TwoInputs().eval(), [batch], progress=False)


def test_positional_call_of_a_model_captured_from_keywords_in_another_order(tmp_path):
    a, b = torch.randn(3, 4), torch.randn(3, 2)
    qmodel = _quantized({"b": b, "a": a})
    ref = qmodel(b=b, a=a)
    assert torch.equal(qmodel(a, b), ref)  # forward(a, b): a first, as the user's model binds
    assert torch.equal(qmodel(a, b=b), ref)
    proto = qb.export(qmodel, tmp_path / "m.onnx", example_inputs=(a, b))
    assert [i.name for i in proto.graph.input] == ["b", "a"]  # the capture's graph, same inputs


def test_positional_call_in_forwards_order_still_works():
    a, b = torch.randn(3, 4), torch.randn(3, 2)
    qmodel = _quantized({"a": a, "b": b})
    assert torch.equal(qmodel(a, b), qmodel(a=a, b=b))


class _Decoder(torch.nn.Module):
    """GPT-2's call shape: ``forward(input_ids, past_key_values=None, attention_mask=None,
    use_cache=True)``; quantized from ``{"attention_mask", "input_ids", "use_cache": False}``."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(20, 8)
        self.fc = torch.nn.Linear(8, 3)

    def forward(self, input_ids, past_key_values=None, attention_mask=None, use_cache=True):
        h = self.emb(input_ids) * attention_mask.unsqueeze(-1).float()
        return self.fc(h) if not use_cache else self.fc(h) * 2


@pytest.fixture(scope="module")
def decoder():
    torch.manual_seed(0)
    ids, mask = torch.randint(0, 20, (2, 5)), torch.ones(2, 5, dtype=torch.long)
    mask[1, 3:] = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        batch = {"attention_mask": mask, "input_ids": ids, "use_cache": False}
        return qb.quantize(_Decoder().eval(), [batch], progress=False), ids, mask


def test_positional_inputs_bind_by_the_users_forward(decoder):
    qmodel, ids, mask = decoder
    ref = qmodel(input_ids=ids, attention_mask=mask, use_cache=False)
    # past_key_values=None is forward's default: passed only to reach attention_mask, dropped
    assert torch.equal(qmodel(ids, None, mask, False), ref)
    assert torch.equal(qmodel(ids, attention_mask=mask, use_cache=False), ref)
    with pytest.raises(TypeError, match=r"missing input 'use_cache' \(captured as use_cache=False"):
        qmodel(ids, None, mask)
    with pytest.raises(TypeError, match=r"'past_key_values'.*not part of the captured call"):
        qmodel(ids, (mask,), mask, False)  # a value the capture never saw: refused, not dropped
    with pytest.raises(TypeError, match=r"bad call of forward\(input_ids, past_key_values"):
        qmodel(ids, None, mask, False, 1)


def test_engine_model_binds_positional_inputs_by_the_users_forward(decoder):
    qmodel, ids, mask = decoder
    ref = qmodel(input_ids=ids, attention_mask=mask, use_cache=False)
    fast = qb.to_engine(qmodel, "onnxruntime")
    # shown in forward's order (the batch dict had attention_mask first)
    assert fast.signature.startswith("forward(input_ids: int64[batch, 5], attention_mask: int64")
    # ORT's float arithmetic vs torch's: a few float32 ulps of the logits, not a step apart
    torch.testing.assert_close(fast(ids, None, mask, False), ref, atol=1e-5, rtol=0)
    with pytest.raises(TypeError, match=r"'past_key_values'.*not part of the captured call"):
        fast(ids, (mask,), mask, False)


class _Variadic(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(4, 2)

    def forward(self, *inputs, **named):
        return self.fc(named["a"]) + named["b"]


def test_a_positional_call_of_a_star_args_forward_is_refused_as_ambiguous():
    a, b = torch.randn(3, 4), torch.randn(3, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmodel = qb.quantize(_Variadic().eval(), [{"a": a, "b": b}], progress=False)
    with pytest.raises(TypeError, match=r"takes \*inputs.*call it with keywords"):
        qmodel(a, b)
