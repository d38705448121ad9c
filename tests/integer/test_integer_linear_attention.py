"""efficientvit's linear attention (timm ``efficientvit_mit`` / ``efficientvit_msra``
``LiteMLA``, float32 path) quantized and exported by quantbridge, lowered to an integer program:
ReLU kernels on q and k, ``v`` padded with a column of ones (``F.pad(value=1)``), ``q @ (k^T
v)``, the last column the denominator ``q . sum_n k_n``, ``out[..., :-1] / (out[..., -1:] +
eps)``. Placement quantizes the MatMul's output for the numerator slice, but the denominator
slice reads the float MatMul result: its ``+ eps`` is realized on the accumulator's own int32
grid (``lowering._divide.accumulator_plus_constant``); it was refused at that Add, telling the
user to re-quantize with quantbridge. No timm here: the module below writes the pattern out."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import quantbridge as qb

SHAPE = (2, 16, 4, 4)


class LiteMLA(nn.Module):
    """timm's ``LiteMLA._attn`` (the float32 branch) between a 1x1 qkv conv and a 1x1 proj."""

    def __init__(self, channels: int = 16, heads: int = 2, eps: float = 1e-5):
        super().__init__()
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.proj = nn.Conv2d(channels, channels, 1)
        self.heads, self.eps = heads, eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        qkv = self.qkv(x).reshape(b, -1, 3 * c // self.heads, h * w).transpose(-1, -2)
        q, k, v = qkv.chunk(3, dim=-1)
        q, k = F.relu(q), F.relu(k)
        v = F.pad(v, (0, 1), mode="constant", value=1.0)
        out = q @ (k.transpose(-1, -2) @ v)
        out = out[..., :-1] / (out[..., -1:] + self.eps)
        return self.proj(out.transpose(-1, -2).reshape(b, -1, h, w))


@pytest.fixture(scope="module")
def lite_mla(tmp_path_factory):
    path = tmp_path_factory.mktemp("lite_mla") / "lite_mla.onnx"
    torch.manual_seed(0)
    model = LiteMLA().eval()
    data = [torch.randn(*SHAPE) for _ in range(4)]
    qmodel = qb.quantize(model, data, recipe="int8", progress=False)
    with warnings.catch_warnings():  # without VNNI: the engine-saturation warning
        warnings.simplefilter("ignore")
        qb.export(qmodel, path, example_inputs=torch.zeros(*SHAPE))
    return onnx.load(path), qb.lower(path)


def _inputs(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float32)


def test_denominator_stays_on_the_accumulator_grid(lite_mla):
    model, prog = lite_mla
    adds = [n for n in model.graph.node if n.op_type == "Add"]
    assert len(adds) == 1 and adds[0].input[0] not in {
        o for n in model.graph.node if n.op_type == "QuantizeLinear" for o in n.output
    }
    (div,) = [s for s in prog.steps if s.op == "divide"]
    den = prog.tensors[div.inputs[1]]
    assert den.dtype == np.int32 and den.zero_point == 0
    (eps_add,) = [s for s in prog.steps if s.output == div.inputs[1]]
    assert eps_add.op == "rescale_sum" and eps_add.attrs["multipliers"] == [1, 1]
    assert eps_add.attrs["shift"] == 0  # exact: acc + e on one grid
    eps_codes = int(prog.constants[eps_add.inputs[1]])
    # eps rounded up onto the grid: e >= 1 and within one step of the float eps
    assert eps_codes >= 1 and 0 <= eps_codes * den.scale - 1e-5 < den.scale


def test_linear_attention_agrees_with_onnx_runtime(lite_mla, layerwise):
    """Each quantized tensor computed by ORT (node by node) from the program's own input codes.

    The program's denominator is the exact integer ``q . sum k`` on a grid ``2**s`` finer than
    the accumulator unit (``s`` about 11 here), plus eps rounded up: it exceeds ORT's float32
    ``acc + eps`` by less than one grid step (relative 2**-11 of a unit, far below half an
    output code) plus ORT's float32 sum rounding (~2**-24 relative). The quotient's multiplier
    has 30 bits and one rounding (ties to even, as QuantizeLinear). So only values within
    ~1e-4 of a code boundary can move, by 1 LSB: max 1 LSB, >= 99% exact."""
    model, prog = lite_mla
    every = []
    for seed in range(3):
        diffs = layerwise(model, prog, {"x": _inputs(seed)})
        every.append(np.concatenate([d.reshape(-1) for d in diffs.values()]))
    every = np.concatenate(every)
    print(f"\n{len(diffs)} quantized tensors: max {every.max()} LSB, "
          f"{(every == 0).mean():.2%} exact")  # fmt: skip
    assert every.max() <= 1 and (every == 0).mean() >= 0.99


def test_zero_queries_give_zero_not_a_division_by_zero(lite_mla, layerwise):
    """A token whose ReLU'd query is all 0 in a head: the float denominator is eps and the
    quotient 0; the program's denominator is ``e >= 1`` grid steps (never 0), its quotient the
    output zero point, and ORT agrees at every quantized tensor (max 1 LSB, as above)."""
    model, prog = lite_mla
    (div,) = [s for s in prog.steps if s.op == "divide"]
    eps_add = next(s for s in prog.steps if s.output == div.inputs[1])
    e = int(prog.constants[eps_add.inputs[1]])
    for seed in range(20):
        x = _inputs(seed)
        env = prog.run_integer({"x": x})
        zero_rows = env[div.inputs[1]][..., 0] == e
        if zero_rows.any():
            break
    assert zero_rows.any(), "no input in 20 seeds has a token with an all-zero query"
    assert np.all(env[div.output][zero_rows] == div.attrs["out_zero"])
    diffs = layerwise(model, prog, {"x": x})
    assert max(int(d.max()) for d in diffs.values()) <= 1


def test_refusal_says_whose_export_left_it_float(lite_mla):
    """The refusal's advice depends on who wrote the file: ``acc - eps`` (a Sub, which has no
    lowering on the accumulator) in quantbridge's export asks for a report, not for
    re-quantizing with quantbridge; the same graph from another tool (no ``_quantbridge.``
    initializers) still suggests quantbridge."""
    model, _ = lite_mla
    ours = onnx.ModelProto()
    ours.CopyFrom(model)
    next(n for n in ours.graph.node if n.op_type == "Add").op_type = "Sub"
    with pytest.raises(qb.LoweringError) as err:
        qb.lower(ours)
    text = str(err.value)
    assert "Sub 'add': its input 'slice_2' is a float value" in text, text
    assert "quantbridge's export left it float" in text and "re-quantize" not in text
    theirs = onnx.ModelProto()
    theirs.CopyFrom(ours)
    renamed = {t.name: t.name.replace("_quantbridge.", "q_") for t in theirs.graph.initializer}
    for t in theirs.graph.initializer:
        t.name = renamed[t.name]
    for n in theirs.graph.node:
        n.input[:] = [renamed.get(i, i) for i in n.input]
    with pytest.raises(qb.LoweringError) as err:
        qb.lower(theirs)
    text = str(err.value)
    assert "re-quantize the float model with quantbridge" in text, text
    assert "quantbridge's export" not in text


def test_three_emitters_identical(lite_mla, three_emitters, tmp_path):
    _, prog = lite_mla
    three_emitters(prog, {"x": _inputs(11) * 2}, tmp_path)
