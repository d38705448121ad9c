"""Empirical bias correction (``torch.ptq._bias_correction``): the quantized model's mean output
error against the float model falls, on a net where per-tensor weights shift it (depthwise)."""

from __future__ import annotations

import copy
import dataclasses
import types
from functools import partial

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from test_ptq_equalize import DepthwiseNet, _data, _recipe

import quantbridge as qb
from quantbridge.numerics import PerTensor, QScheme, shrink_bias_shift
from quantbridge.torch import _fakequant, _heap
from quantbridge.torch.ptq import _bias_correction, _graph, _sequential
from quantbridge.torch.ptq._bias_correction import _channel_means, mean_output, tap_means
from quantbridge.torch.ptq._graph import record

aten = torch.ops.aten


def _errors(model, qmodel, batches) -> tuple[float, float]:
    """(mean over classes of |mean error|, mean squared error) against the float64 model."""
    with torch.no_grad():
        ref = torch.cat([model.double()(x.double()) for x in batches])
        model.float()
        err = torch.cat([qmodel(x).double() for x in batches]) - ref
    return float(err.mean(0).abs().mean()), float(err.pow(2).mean())


def _quantized(model, calib, bias_correction, **kw):
    recipe = dataclasses.replace(_recipe(False), bias_correction=bias_correction)
    return qb.quantize(model, calib, recipe, progress=False, **kw)


@pytest.mark.parametrize(
    "variant, mean_factor, mse_factor",
    # measured on held-out data (not the calibration batches): mean error 1.13 -> 0.25 (one
    # pass) / 0.012 (sequential), mse 2.65 -> 0.086 / 0.0022; per-tensor weights on this net
    # shift every class's mean by ~1 (output std ~4.8)
    [(True, 3.0, 10.0), ("sequential", 20.0, 20.0)],
)
def test_bias_correction_lowers_mean_output_error(variant, mean_factor, mse_factor):
    model = DepthwiseNet()
    calib, held_out = _data(8, 1), _data(4, 2)
    plain = _quantized(model, calib, False)
    corrected = _quantized(model, calib, variant)
    mean_before, mse_before = _errors(model, plain, held_out)
    mean_after, mse_after = _errors(model, corrected, held_out)
    print(
        f"{variant}: mean error {mean_before:.4f} -> {mean_after:.4f}, mse {mse_before:.4f} -> {mse_after:.4f}"
    )
    assert mean_after < mean_before / mean_factor
    assert mse_after < mse_before / mse_factor
    # the correction went into the float biases, and only the biases
    for name, p in plain.named_parameters():
        q = corrected.get_parameter(name)
        assert torch.equal(p, q) == (not name.endswith("bias")), name


def test_bias_correction_with_forward_loop_matches_calib_data():
    model = DepthwiseNet()
    calib = _data(4, 1)

    def loop(m):
        for x in calib:
            m(x)

    a = _quantized(model, calib, "sequential")
    b = _quantized(model, None, "sequential", forward_loop=loop)
    for name, p in a.named_parameters():
        assert torch.equal(p, b.get_parameter(name)), name


def test_bias_correction_survives_save_and_load(tmp_path):
    model = DepthwiseNet()
    calib = _data(4, 1)
    q = _quantized(model, calib, True)
    qb.save(q, tmp_path / "m.qb")
    loaded = qb.load(tmp_path / "m.qb", model)
    x = _data(1, 3)[0]
    with torch.no_grad():
        assert torch.equal(q(x), loaded(x))


@settings(max_examples=40, deadline=None)
@given(
    nd=st.integers(1, 3),
    kernel=st.integers(1, 3),
    stride=st.integers(1, 3),
    padding=st.integers(0, 2),
    dilation=st.integers(1, 2),
    groups=st.sampled_from([1, 2]),
    seed=st.integers(0, 2**16),
)
def test_tap_means_give_the_convolutions_mean_output(
    nd, kernel, stride, padding, dilation, groups, seed
):
    # the one-pass shift from tap means (no convolution) against the convolution itself, both
    # in float64: equal to float64 rounding of sums of ~10^3 products (bound 1e-12 of sum|w||x|)
    g = torch.Generator().manual_seed(seed)
    size = 7 if nd < 3 else 5
    x = torch.randn(2, 4, *[size] * nd, generator=g, dtype=torch.float64) + 0.5
    w = torch.randn(6, 4 // groups, *[kernel] * nd, generator=g, dtype=torch.float64)
    op = {1: aten.conv1d.default, 2: aten.conv2d.default, 3: aten.conv3d.default}[nd]
    args = (x, w, None, [stride] * nd, [padding] * nd, [dilation] * nd, groups)
    node = types.SimpleNamespace(target=op, args=args, kwargs={})
    means, count = tap_means(node, x, w)
    y = op(*args)
    assert count == y.shape[0] * y[0, 0].numel()
    want = y.mean(dim=(0, *range(2, 2 + nd)))
    got = mean_output(w, means, groups)
    assert torch.allclose(got, want, rtol=0, atol=1e-12 * float(w.abs().sum() * x.abs().max()))


def test_tap_means_of_a_linear_layer():
    x, w = torch.randn(3, 5, 8, dtype=torch.float64), torch.randn(4, 8, dtype=torch.float64)
    node = types.SimpleNamespace(target=aten.linear.default, args=(x, w), kwargs={})
    means, count = tap_means(node, x, w)
    assert count == 15
    torch.testing.assert_close(mean_output(w, means, 1), (x @ w.T).mean(dim=(0, 1)))


def test_fast_shifts_equal_the_two_convolutions(monkeypatch):
    # the shifts the one-pass correction writes, from tap means and from the two float32
    # convolutions they replace (tap_means made to decline): equal up to float32 rounding
    model = DepthwiseNet()
    calib = _data(4, 1)
    fast = _quantized(model, calib, True)
    monkeypatch.setattr(_bias_correction, "tap_means", lambda node, x, w: None)
    exact = _quantized(model, calib, True)
    plain = _quantized(model, calib, False)
    with torch.no_grad():
        for name, p in plain.named_parameters():
            if not name.endswith("bias"):
                continue
            shift_fast = fast.get_parameter(name) - p
            shift_exact = exact.get_parameter(name) - p
            assert shift_exact.abs().max() > 0, name
            # the replaced path rounds each conv output to float32 (6e-8 of |y|, outputs up to
            # ~10 here, ~100x the corrections) before the mean: measured 1.5e-5 of the largest
            # correction. Bound 1e-3 of it: a wrong tap, stride or padding is off by O(1) of it
            bound = 1e-3 * float(shift_exact.abs().max())
            assert float((shift_fast - shift_exact).abs().max()) <= bound, name


def test_one_pass_quantizes_each_weight_once_not_per_batch(monkeypatch):
    # the weights do not change during the float pass: Q(W) and float64 W are made once per
    # layer, not once per batch (4 batches here); values unchanged (the exported files'
    # SHA-256 are the same before and after on 6 models x 3 recipes, see the commit)
    model = DepthwiseNet()
    calib = _data(4, 4)
    weight_calls: list = []
    real = _bias_correction._quantized

    def spy(qmodel, arg, value):
        if isinstance(arg, torch.fx.Node) and "weight" in str(arg.target):
            weight_calls.append(arg.target)
        return real(qmodel, arg, value)

    monkeypatch.setattr(_bias_correction, "_quantized", spy)
    qmodel = _quantized(model, calib, True)
    layers = _bias_correction._corrected_layers(qmodel)
    assert len(layers) >= 3
    assert sorted(weight_calls) == sorted(node.args[1].target for node in layers)


@pytest.mark.parametrize(
    ("kernel", "stride", "padding", "groups"),
    [
        ((1, 3), (1, 1), (0, 1), 1),  # PP-OCRv4 rec neck convs (conv2d_33, conv2d_36)
        ((5, 5), (2, 1), (2, 2), 4),  # depthwise, height-only stride (conv2d_21, conv2d_29)
        ((3, 3), (1, 2), (1, 1), 4),  # depthwise, width-only stride (conv2d_11)
        ((3, 1), (2, 1), (1, 0), 2),
    ],
)
def test_tap_means_with_per_axis_geometry(kernel, stride, padding, groups):
    # the property test above draws one kernel/stride/padding for every axis and groups <= 2;
    # the PP-OCRv4 recognizer has per-axis ones and depthwise convs (issue 9: its bias correction
    # was checked per layer against the exported file, these are those geometries). float64
    # against the convolution itself: equal to float64 rounding (bound 1e-12 of sum|w| max|x|)
    g = torch.Generator().manual_seed(sum(kernel) + 7 * groups)
    x = torch.randn(2, 4, 6, 9, generator=g, dtype=torch.float64) + 0.5
    w = torch.randn(8, 4 // groups, *kernel, generator=g, dtype=torch.float64)
    args = (x, w, None, list(stride), list(padding), [1, 1], groups)
    node = types.SimpleNamespace(target=aten.conv2d.default, args=args, kwargs={})
    means, count = tap_means(node, x, w)
    y = aten.conv2d.default(*args)
    assert count == y.shape[0] * y.shape[2] * y.shape[3]
    want = y.mean(dim=(0, 2, 3))
    got = mean_output(w, means, groups)
    assert torch.allclose(got, want, rtol=0, atol=1e-12 * float(w.abs().sum() * x.abs().max()))


class _ResidualNet(torch.nn.Module):
    """Strided conv, grouped conv, a residual add and a linear head: the shapes the sequential
    pass walks (a value read twice stays held until its second reader)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        nn = torch.nn
        self.stem = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.grouped = nn.Conv2d(8, 8, 3, padding=1, groups=2)
        self.pw = nn.Conv2d(8, 8, 1)
        self.head = nn.Linear(8, 5)

    def forward(self, x):
        y = torch.relu(self.stem(x))
        y = y + self.pw(torch.relu(self.grouped(y)))
        return self.head(y.mean((2, 3)))


def _quadratic_shifts(qmodel, batches, masks=None) -> None:
    """The reference: per layer in graph order a whole quantized pass over every batch, with the
    corrections before it applied (what the library did before its one-pass walk). ``masks``:
    per batch, the rows (leading positions) of every layer output that the means read."""
    layers = _bias_correction._corrected_layers(qmodel)
    masks = masks or [None] * len(batches)

    def means(nodes, into: dict, counts: dict) -> None:
        for batch, keep in zip(batches, masks, strict=True):
            rows = (lambda v: v) if keep is None else (lambda v, keep=keep: v[keep])
            record(
                qmodel, [batch], nodes, lambda n, v, r=rows: _channel_means(n, r(v), into, counts)
            )

    float_sums: dict = {}
    float_counts: dict = {}
    with qb.float_mode(qmodel):
        means(set(layers), float_sums, float_counts)
    for node in layers:
        sums: dict = {}
        counts: dict = {}
        means({node}, sums, counts)
        shift = float_sums[node] / float_counts[node] - sums[node] / counts[node]
        _bias_correction._add_to_bias(qmodel, node, shift)


def _bias_shifts(before, after) -> dict:
    return {
        name: (after.get_parameter(name) - p).detach()
        for name, p in before.named_parameters()
        if name.endswith("bias")
    }


@pytest.mark.parametrize("memory", [None, 1])
def test_sequential_walk_equals_a_quantized_pass_per_layer(monkeypatch, memory):
    # one quantized pass with every batch at once (bias applied and the layer re-run at each
    # corrected layer) against a whole pass per layer: the same float32 programs on the same
    # values, so the same shifts (bound: float32 rounding of the corrected bias, 2 ulp of it).
    # memory=1 byte: only the first batch fits, so both sides use the first batch only
    g = torch.Generator().manual_seed(5)
    batches = [((torch.randn(n, 3, 10, 10, generator=g),), {}) for n in (4, 4, 3)]
    recipe = dataclasses.replace(qb.Recipe.preset("default"), bias_correction=False)
    plain = qb.quantize(_ResidualNet().eval(), [a[0] for a, _ in batches], recipe, progress=False)
    layers = _bias_correction._corrected_layers(plain)
    assert [n.target for n in layers].count(aten.linear.default) == 1 and len(layers) == 4
    walked, reference = copy.deepcopy(plain), copy.deepcopy(plain)
    if memory is not None:
        monkeypatch.setattr(_sequential, "SEQUENTIAL_MEMORY", memory)
    assert _bias_correction.correct_bias(walked, batches, sequential=True, progress=False) == 4
    _quadratic_shifts(reference, batches if memory is None else batches[:1])
    want, got = _bias_shifts(plain, reference), _bias_shifts(plain, walked)
    assert want.keys() == got.keys() and len(want) == 4
    for name, shift in want.items():
        assert shift.abs().max() > 0, name
        bias = plain.get_parameter(name).abs() + shift.abs()
        bound = 2 * torch.finfo(torch.float32).eps * bias
        assert torch.all((got[name] - shift).abs() <= bound), name


def test_channel_means_are_float64_means_over_every_other_dim():
    # _channel_means reduces in one float64-accumulating sum (no float64 copy, no transpose);
    # reference: float64 copy, channels last, column sums. Equal to float64 rounding; a 1-D
    # linear output (an unbatched call) is its own sum, not a scalar.
    from quantbridge.torch.ptq._bias_correction import _channel_means

    conv = type("N", (), {"target": torch.ops.aten.conv2d.default})()
    linear = type("N", (), {"target": torch.ops.aten.linear.default})()
    y = torch.randn(3, 5, 7, 4) * 100
    for node, axis, value in ((conv, 1, y), (linear, 3, y), (linear, 0, y[0, 0, 0])):
        sums, counts = {}, {}
        _channel_means(node, value, sums, counts)
        ref = value.double().movedim(axis, -1).reshape(-1, value.shape[axis])
        assert counts[node] == ref.shape[0]
        torch.testing.assert_close(sums[node], ref.sum(0), rtol=1e-12, atol=1e-9)


class _TokenNet(torch.nn.Module):
    """Two linears over (batch, tokens, features) with an attention mask, as a transformer's
    padded batch: the padded tokens carry other activations than the real ones."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.fc1 = torch.nn.Linear(16, 12)
        self.fc2 = torch.nn.Linear(12, 6)

    def forward(self, x, attention_mask):
        return self.fc2(torch.relu(self.fc1(x))) * attention_mask.unsqueeze(-1)


def _token_batches(seed: int, sizes=(6, 6, 5), tokens: int = 10) -> list:
    """(args, kwargs) batches, ~80 % padding: real tokens N(1, 1), padded ones N(-1, 0.1) (so
    a weight's rounding error shifts their outputs' means in opposite directions)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in sizes:
        lengths = torch.randint(1, 4, (n,), generator=g)
        mask = (torch.arange(tokens) < lengths[:, None]).long()
        x = 1 + torch.randn(n, tokens, 16, generator=g)
        pad = -1 + 0.1 * torch.randn(n, tokens, 16, generator=g)
        x = torch.where(mask.bool().unsqueeze(-1), x, pad)
        out.append(((), {"x": x, "attention_mask": mask}))
    return out


def test_sequential_mask_means_run_over_the_real_positions_only():
    # the masked walk against the per-layer reference whose means read ``output[mask]`` rows
    # directly: same float32 values, so the same shifts (bound as above, 2 ulp of the bias)
    batches = _token_batches(1)
    recipe = dataclasses.replace(qb.Recipe.preset("default"), bias_correction=False)
    plain = qb.quantize(_TokenNet().eval(), [k for _, k in batches], recipe, progress=False)
    walked, reference, unmasked = (copy.deepcopy(plain) for _ in range(3))
    masks = [k["attention_mask"].bool() for _, k in batches]
    assert _bias_correction.correct_bias(walked, batches, True, False, "attention_mask") == 2
    _quadratic_shifts(reference, batches, masks)
    _bias_correction.correct_bias(unmasked, batches, True, False)
    want, got = _bias_shifts(plain, reference), _bias_shifts(plain, walked)
    everywhere = _bias_shifts(plain, unmasked)
    assert want.keys() == got.keys() and len(want) == 2
    for name, shift in want.items():
        bias = plain.get_parameter(name).abs() + shift.abs()
        bound = 2 * torch.finfo(torch.float32).eps * bias
        assert torch.all((got[name] - shift).abs() <= bound), name
        assert (everywhere[name] - shift).abs().max() > 100 * bound.max(), name  # the mask acts


def _real_token_errors(model, qmodel, batches) -> tuple[float, float]:
    """(mean over channels of |mean error|, mean squared error) on the real tokens only."""
    with torch.no_grad():
        errs = []
        for _, kw in batches:
            keep = kw["attention_mask"].bool()
            errs.append((qmodel(**kw) - model(**kw))[keep].double())
    err = torch.cat(errs)
    return float(err.mean(0).abs().mean()), float(err.pow(2).mean())


def test_sequential_mask_lowers_the_real_tokens_error():
    # regression (MiniLM-L6: the shift from every position, padding included, raised the held-out
    # error on real tokens at all 36 linears). Held-out batches, real tokens, measured mean error
    # / mse: no correction 0.0155 / 9.9e-4, every position 0.0139 / 9.4e-4, real positions only
    # 0.0034 / 5.4e-4; asserted with ~1.5x margin on each ratio
    model = _TokenNet().eval()
    calib, held_out = _token_batches(1), _token_batches(2)
    coarse = qb.TensorRecipe(QScheme(4, True, True, True, PerTensor()), "minmax")  # mean shifts
    base = dataclasses.replace(qb.Recipe.preset("default"), weights=coarse, bias_correction=False)
    errors = {}
    for name, mask in (("none", None), ("every", ""), ("real", "attention_mask")):
        recipe = (
            base
            if mask is None
            else dataclasses.replace(base, bias_correction="sequential", bias_correction_mask=mask)
        )
        qmodel = qb.quantize(model, [k for _, k in calib], recipe, progress=False)
        errors[name] = _real_token_errors(model, qmodel, held_out)
    (real_mean, real_mse), (every_mean, every_mse) = errors["real"], errors["every"]
    assert real_mean < every_mean / 3 and real_mean < errors["none"][0] / 3
    assert real_mse < every_mse / 1.2


def test_sequential_mask_errors_name_the_fix():
    with pytest.raises(ValueError, match="bias_correction_mask='attention_mask'.*sequential"):
        qb.Recipe(bias_correction=True, bias_correction_mask="attention_mask")
    with pytest.raises(TypeError, match="bias_correction_mask=1"):
        qb.Recipe(bias_correction="sequential", bias_correction_mask=1)
    recipe = dataclasses.replace(qb.Recipe.preset("default"), bias_correction_mask="padding_mask")
    with pytest.raises(ValueError, match="'padding_mask'.*batch 0.*'attention_mask', 'x'"):
        qb.quantize(_TokenNet().eval(), [k for _, k in _token_batches(1)], recipe, progress=False)
    r = qb.Recipe(bias_correction="sequential", bias_correction_mask="attention_mask")
    assert qb.Recipe.from_json(r.to_json()) == r
    assert "bias_correction_mask" not in qb.Recipe.preset("default").to_dict()


@pytest.mark.parametrize("sequential", [False, True])
def test_output_check_keeps_a_correction_that_lowers_the_output_error(sequential):
    # DepthwiseNet: the correction lowers the output error (first test): the checked run keeps
    # exactly the unchecked run's biases
    model = DepthwiseNet()
    recipe = dataclasses.replace(_recipe(False), bias_correction=False)
    plain = qb.quantize(model, _data(8, 1), recipe, progress=False)
    batches = [((x,), {}) for x in _data(8, 1)]
    checked, unchecked = copy.deepcopy(plain), copy.deepcopy(plain)
    n = _bias_correction.correct_bias(checked, batches, sequential, False, check=True)
    assert n == _bias_correction.correct_bias(unchecked, batches, sequential, False) > 0
    for name, p in unchecked.named_parameters():
        assert torch.equal(checked.get_parameter(name), p), name


def test_output_check_restores_the_biases_when_the_output_error_rises(monkeypatch):
    # a correction that raises the output error (MiniLM-L6's case, here forced: +1 on every
    # bias) is undone bit for bit, and reported as 0 layers corrected
    model = DepthwiseNet()
    recipe = dataclasses.replace(_recipe(False), bias_correction=False)
    plain = qb.quantize(model, _data(8, 1), recipe, progress=False)
    batches = [((x,), {}) for x in _data(8, 1)]
    wrong = lambda qmodel, layers, batches: {n: torch.ones(1) for n in layers}  # noqa: E731
    monkeypatch.setattr(_bias_correction, "_local_shifts", wrong)
    checked, unchecked = copy.deepcopy(plain), copy.deepcopy(plain)
    with torch.no_grad():
        reference = [[model(x)] for x in _data(8, 1)]
    before = _bias_correction.output_error(plain, batches, reference)
    assert _bias_correction.correct_bias(unchecked, batches, check=False) > 0
    assert _bias_correction.output_error(unchecked, batches, reference) > before
    assert _bias_correction.correct_bias(checked, batches, check=True) == 0
    for name, p in plain.named_parameters():
        assert torch.equal(checked.get_parameter(name), p), name
    with pytest.raises(ValueError, match="bias_correction_check=True with bias_correction=False"):
        qb.Recipe(bias_correction_check=True)


def _residual_batches(seed: int, sizes=(4, 4, 3)):
    g = torch.Generator().manual_seed(seed)
    batches = [((torch.randn(n, 3, 10, 10, generator=g),), {}) for n in sizes]
    recipe = dataclasses.replace(qb.Recipe.preset("default"), bias_correction=False)
    qmodel = qb.quantize(_ResidualNet().eval(), [a[0] for a, _ in batches], recipe, progress=False)
    return qmodel, batches


def test_sequential_walk_holds_other_batches_as_codes(monkeypatch):
    # memory: while one batch runs, every other batch's quantizer outputs are held as integer
    # codes (``_graph._Packed``), never as float tensors; a corrected layer's uncorrected output
    # is not kept (the lockstep walk held every batch's float values at every node)
    qmodel, batches = _residual_batches(6)
    walks: list = []
    sweep, run_node = _graph.Lockstep.sweep, torch.fx.Interpreter.run_node
    float_held: list[int] = []  # per node run: float quantizer outputs held by the other batches
    layers = set(_bias_correction._corrected_layers(qmodel))
    layer_values: list[int] = []  # per node run: corrected layers' values held by any batch

    def watching_sweep(self, *args, **kwargs):
        walks.append(self)
        return sweep(self, *args, **kwargs)

    def is_quantizer(node):
        return (
            node.op == "call_module"
            and isinstance(qmodel.get_submodule(node.target), _fakequant.Quantizer)
            and node.all_input_nodes
            and node.all_input_nodes[0].op != "get_attr"
        )

    def watching_run_node(self, node):
        if walks:
            others = [run for run in walks[0].runs if run is not self]
            float_held.append(
                sum(
                    isinstance(v, torch.Tensor) and is_quantizer(n)
                    for run in others
                    for n, v in run.env.items()
                )
            )
            layer_values.append(
                sum(n in layers for run in walks[0].runs for n in run.env if run is not self)
            )
        return run_node(self, node)

    monkeypatch.setattr(_graph.Lockstep, "sweep", watching_sweep)
    monkeypatch.setattr(torch.fx.Interpreter, "run_node", watching_run_node)
    assert _bias_correction.correct_bias(qmodel, batches, sequential=True, progress=False) == 4
    assert len(float_held) > 50 and max(float_held) == 0
    # the corrected layers' outputs held by other batches: each layer's new output until its
    # reader (a quantizer) ran in that batch, at most one layer's per batch
    assert max(layer_values) <= len(batches) - 1


@pytest.mark.parametrize("shrink", [False, True])
def test_sequential_walk_matches_the_lockstep_walk_bit_for_bit(shrink):
    # the batch-at-a-time walk with packed codes gives the same corrected biases, bit for bit,
    # as the walk that holds every batch's values node by node (the previous implementation,
    # rebuilt here from ``Lockstep.run``): the same float32 values at every node, float64 sums
    # in the same order
    qmodel, batches = _residual_batches(8)
    reference = copy.deepcopy(qmodel)
    layers = _bias_correction._corrected_layers(reference)
    masks = [None] * len(batches)
    samples = {} if shrink else None
    float_means, kept = _sequential._float_means(reference, layers, batches, False, masks, samples)

    def after(node, values, step):
        if node not in float_means:
            return
        if shrink:
            errors, counts = [], []
            for value, (f_sums, f_counts) in zip(values, samples[node], strict=True):
                q_sums, _ = _sequential._sample_means(node, value)
                n = f_counts.clamp(min=1)[:, None]
                errors.append(f_sums / n - q_sums / n)
                counts.append(f_counts)
            shift = torch.from_numpy(shrink_bias_shift(torch.cat(errors), torch.cat(counts)))
        else:
            sums, counts = {}, {}
            for value in values:
                _channel_means(node, value, sums, counts)
            shift = float_means[node] - sums[node] / counts[node]
        _sequential._add_to_bias(reference, node, shift)
        step.rerun([*_sequential._bias_chain(node), node])

    _graph.Lockstep(reference, kept).run(after, constants_late=True)
    _bias_correction.correct_bias(qmodel, batches, sequential=True, progress=False, shrink=shrink)
    for name, p in reference.named_parameters():
        if name.endswith("bias"):
            assert torch.equal(qmodel.get_parameter(name), p), name


def test_codes_round_trip_is_exact_or_refused():
    # a fixed-grid quantizer's output is held as codes only when they give it back bit for bit;
    # anything else (a parameter read, a float value off the grid) is kept as it is
    qmodel, batches = _residual_batches(9, (2,))
    node = next(n for n in qmodel.graph.nodes if n.op == "call_module" and "input" in n.target)
    value = qmodel.get_submodule(node.target)(batches[0][0][0])
    rebuild = _sequential._codes(qmodel, node, value)
    assert rebuild is not None and torch.equal(rebuild(), value)
    assert rebuild().stride() == value.stride()
    assert _sequential._codes(qmodel, node, value + 1e-3) is None  # off the grid
    weight = next(n for n in qmodel.graph.nodes if n.op == "get_attr")
    assert _sequential._codes(qmodel, weight, value) is None


def test_late_constants_run_each_weight_quantizer_just_before_its_layer():
    # the order the sequential walk runs in: every node once, after its inputs; a parameter
    # read and its quantizer come right before the node that reads them; the walk's values at
    # every node are the graph-order walk's, bit for bit
    g = torch.Generator().manual_seed(7)
    x = torch.randn(3, 3, 10, 10, generator=g)
    qmodel = qb.quantize(_ResidualNet().eval(), [x], "int8", progress=False)
    graph = qmodel.graph
    order = _graph.late_constants(graph)
    assert sorted(order, key=id) == sorted(graph.nodes, key=id)
    position = {node: i for i, node in enumerate(order)}
    for node in order:
        assert all(position[a] < position[node] for a in node.all_input_nodes), node
    layers = _bias_correction._corrected_layers(qmodel)
    for layer in layers:
        weight_quantizer = layer.args[1]
        assert weight_quantizer.op == "call_module"
        readers = [position[u] for u in weight_quantizer.users]
        assert min(readers) > position[weight_quantizer] > position[layer] - 6  # the bias chain
        assert position[weight_quantizer.args[0]] == position[weight_quantizer] - 1
    seen = {}

    def after(node, values, step, into):
        into[node] = values[0].clone() if isinstance(values[0], torch.Tensor) else values[0]

    _graph.Lockstep(qmodel, [((x,), {})]).run(partial(after, into=seen))
    late: dict = {}
    _graph.Lockstep(qmodel, [((x,), {})]).run(partial(after, into=late), constants_late=True)
    assert late.keys() == seen.keys()
    for node, value in seen.items():
        if isinstance(value, torch.Tensor):
            assert torch.equal(late[node], value), node


def _no_shrink(errors, counts):
    """``shrink_bias_shift`` without the shrinkage: the count-weighted mean error."""
    w = np.broadcast_to(np.asarray(counts, np.float64)[:, None], errors.shape)
    return (w * np.asarray(errors)).sum(0) / w.sum(0)


@pytest.mark.parametrize("masked", [False, True])
def test_shrink_per_sample_errors_recombine_to_the_plain_shift(monkeypatch, masked):
    # with the shrinkage taken out, the per-sample float / quantized means the shrink path keeps
    # must give back the plain sequential shifts: same float32 values, float64 sums in another
    # order, so within float32 rounding of the corrected bias (2 ulp, as above)
    if masked:
        batches, mask = _token_batches(1), "attention_mask"
        model, calib = _TokenNet().eval(), [k for _, k in _token_batches(1)]
    else:
        g = torch.Generator().manual_seed(5)
        batches = [((torch.randn(n, 3, 10, 10, generator=g),), {}) for n in (4, 4, 3)]
        model, calib, mask = _ResidualNet().eval(), [a[0] for a, _ in batches], ""
    recipe = dataclasses.replace(qb.Recipe.preset("default"), bias_correction=False)
    plain = qb.quantize(model, calib, recipe, progress=False)
    reference, shrunk, unshrunk = (copy.deepcopy(plain) for _ in range(3))
    n = _bias_correction.correct_bias(reference, batches, True, False, mask)
    assert _bias_correction.correct_bias(shrunk, batches, True, False, mask, shrink=True) == n
    monkeypatch.setattr(_sequential, "shrink_bias_shift", _no_shrink)
    _bias_correction.correct_bias(unshrunk, batches, True, False, mask, shrink=True)
    want, got = _bias_shifts(plain, reference), _bias_shifts(plain, unshrunk)
    moved = _bias_shifts(plain, shrunk)
    assert want.keys() == got.keys() and len(want) == n > 0
    for name, shift in want.items():
        bias = plain.get_parameter(name).abs() + shift.abs()
        bound = 2 * torch.finfo(torch.float32).eps * bias
        assert torch.all((got[name] - shift).abs() <= bound), name
        assert (moved[name] - shift).abs().max() > 10 * bound.max(), name  # the shrink acts


def test_shrink_is_a_sequential_option():
    with pytest.raises(ValueError, match="bias_correction_shrink=True.*'sequential'"):
        qb.Recipe(bias_correction=True, bias_correction_shrink=True)
    r = dataclasses.replace(qb.Recipe.preset("default"), bias_correction_shrink=True)
    assert qb.Recipe.from_json(r.to_json()) == r
    assert "bias_correction_shrink" not in qb.Recipe.preset("default").to_dict()


def test_sweep_hands_the_heap_back_after_a_stretch_with_large_values(monkeypatch):
    # glibc keeps freed pages resident around small live blocks (``torch._heap``): after a
    # batch's stretch (or a corrected layer's measuring) that made a value of TRIM_BYTES or
    # more, the walk hands the free pages back; never for small values
    calls: list[int] = []
    monkeypatch.setattr(_graph, "release_free_memory", lambda: calls.append(1))
    qmodel, batches = _residual_batches(10)
    monkeypatch.setattr(_graph, "TRIM_BYTES", 1 << 40)
    _bias_correction.correct_bias(copy.deepcopy(qmodel), batches, sequential=True, progress=False)
    assert calls == []
    monkeypatch.setattr(_graph, "TRIM_BYTES", 1)
    _bias_correction.correct_bias(qmodel, batches, sequential=True, progress=False)
    # 4 corrected layers: per batch, 5 stretches and 4 measurings
    assert len(calls) == len(batches) * (5 + 4)
    _heap.release_free_memory()  # glibc here; a no-op where there is none
