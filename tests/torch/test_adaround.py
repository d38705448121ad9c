"""AdaRound (``quantbridge.torch.ptq``) through ``quantize(recipe with adaround)``: every exported
integer weight is floor or ceil of ``W / s``; each layer reconstructs its held-out rows better
than round-to-nearest (and the first layer does so in an independent float64 recomputation on
fresh data); the exported file runs in ONNX Runtime and matches torch within 1 LSB."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
import torch.nn.functional as F
from onnx import numpy_helper
from torch import nn

import quantbridge as qb
from quantbridge.numerics import fake_quantize
from quantbridge.torch.ptq import adaround
from quantbridge.torch.ptq._adaround import _run, weighted_layers

# fewer rows than the default: seconds on two cores
CONFIG = qb.AdaRound(rows=2048, calib_batches=8)


def _model() -> nn.Module:
    """conv, grouped conv, depthwise conv, conv1d-free head, linear: no batch norm, so the float
    weights the test checks against are the model's own."""
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, padding=1, groups=4),
        nn.ReLU(),
        nn.Conv2d(16, 16, 3, groups=16),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(16, 10),
    ).eval()


def _data(seed: int, n: int = 8) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 3, 12, 12, generator=g) for _ in range(n)]


@pytest.fixture(scope="module")
def quantized():
    """(float model, round-to-nearest QuantModel, AdaRound QuantModel, per-layer results)."""
    m = _model()
    # 4-bit weights: rounding decides much there (the paper's regime); 8-bit gains are smaller
    recipe = qb.Recipe.preset("w4a8")
    nearest = qb.quantize(m, _data(1), recipe=recipe, progress=False)
    ada = qb.quantize(m, _data(1), recipe=recipe, progress=False)
    results = adaround(ada, [((x,), {}) for x in _data(1)], CONFIG, progress=False)
    return m, nearest, ada, results


def _integer_weights(model: onnx.ModelProto) -> dict[tuple, tuple]:
    """weight shape -> (codes, scale, zero point) of each DequantizeLinear of an integer weight."""
    inits = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
    found = {}
    for node in model.graph.node:
        if node.op_type == "DequantizeLinear" and node.input[0] in inits:
            codes = inits[node.input[0]]
            if np.issubdtype(codes.dtype, np.integer) and codes.ndim >= 2:  # int4 or int8
                found[codes.shape] = (codes, inits[node.input[1]], inits[node.input[2]])
    return found


def test_every_exported_weight_is_floor_or_ceil(quantized, tmp_path):
    m, _, ada, results = quantized
    # opset 18 stores the 4-bit codes in int8 initializers
    qb.export(ada, tmp_path / "ada.onnx", _data(2, 1)[0][:2], opset=18)
    found = _integer_weights(onnx.load(tmp_path / "ada.onnx"))
    layers = [mod for mod in m if isinstance(mod, (nn.Conv2d, nn.Linear))]
    assert len(found) == len(layers) == 4
    q = weighted_layers(ada)[0].quantizer
    flips = 0
    for layer in layers:
        w = layer.weight.detach().numpy()
        codes, scale, zero_point = found[w.shape]
        assert np.all(zero_point == 0)
        # w / s as QuantizeLinear divides (float32), then floor / ceil, saturated to the grid
        t = (w / scale.reshape(-1, *[1] * (w.ndim - 1))).astype(np.float64)
        lo = np.clip(np.floor(t), q.qmin, q.qmax)
        hi = np.clip(np.ceil(t), q.qmin, q.qmax)
        assert np.all((codes == lo) | (codes == hi)), layer
        flips += int((codes != np.clip(np.round(t), q.qmin, q.qmax)).sum())
    # AdaRound changed something, and the per-layer counts add up to the file's
    assert flips == sum(r.flipped for r in results) > 0


def test_each_layer_reconstructs_better_than_nearest(quantized):
    _, _, _, results = quantized
    for r in results:  # a layer keeps AdaRound only where it wins on held-out rows
        assert r.error_adaround < r.error_nearest if r.kept == "adaround" else r.flipped == 0, r
    ratios = [r.error_adaround / r.error_nearest for r in results if r.kept == "adaround"]
    # measured (seed 0, w4a8): the first conv keeps nearest (ratio 1.04: 27 weights per channel
    # and its error is mostly the input's rounding); the others 0.73, 0.71 and 0.35
    assert len(ratios) >= 3 and all(x < 0.8 for x in ratios), ratios


def test_float_mode_runs_the_float_weights(quantized):
    """Regression: AdaRound writes its rounding into the weights, and ``float_mode`` ran those
    rounded weights, so the sequential bias correction after it (whose float reference is
    ``float_mode``) corrected towards the rounded model. Now ``float_mode`` runs the float
    weights and gives the float model back; leaving it restores the rounded weights bitwise."""
    m, _, ada, _ = quantized
    x = _data(3, 1)[0]
    with torch.no_grad():
        before = ada(x)
        with qb.float_mode(ada):
            got = ada(x)
        after = ada(x)
        ref = m(x)
    # the same float32 graph math as the float model (measured: equal to the last bit here;
    # 1e-6 allows another summation order)
    torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6)
    assert torch.equal(before, after)
    # a weight written after AdaRound (say, loaded) is no longer replaced by the old float copy
    layer = weighted_layers(ada)[0]
    w, record = layer.weight, layer.quantizer.__dict__["_float_weight"]
    saved = w.detach().clone()
    with torch.no_grad():
        w.mul_(2.0)
        with qb.float_mode(ada):
            assert torch.equal(w, saved * 2.0)
        w.copy_(saved)
    layer.quantizer.__dict__["_float_weight"] = (w, record[1], w._version)  # for the next tests


def test_float_weights_survive_save_load_pickle_and_deepcopy(quantized, tmp_path):
    """Regression: the kept float weights lived only in the quantizers' ``__dict__`` with the
    parameter's version counter: ``qb.save`` / ``qb.load`` dropped them, and a pickled or copied
    model (whose counters restart) forgot them, so ``float_mode`` ran the rounded weights."""
    m, _, ada, _ = quantized
    x = _data(4, 1)[0]
    qb.save(ada, tmp_path / "ada.qb")
    copies = {
        "qb.load": qb.load(tmp_path / "ada.qb", model=_model()),
        "pickle": pickle.loads(pickle.dumps(ada)),
        "deepcopy": copy.deepcopy(ada),
    }
    with torch.no_grad():
        ref, rounded = m(x), ada(x)
        for how, other in copies.items():
            assert torch.equal(other(x), rounded), how  # the rounded weights, as saved
            with qb.float_mode(other):
                got = other(x)
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6, msg=how)  # as above
            assert torch.equal(other(x), rounded), how  # leaving float_mode restores them


def test_one_pass_bias_correction_sees_the_adaround_weights(quantized):
    """The one-pass correction quantizes each weight inside ``float_mode``; there the float
    weight is swapped in, and the quantizer must give AdaRound's rounding back, not round the
    float weight to nearest. Its shift for the grouped conv (AdaRound kept there) against an
    independent float64 mean of ``conv(x, W_float) - conv(Q(x), W_adaround)``, ``x`` the float
    model's input to it."""
    from quantbridge.torch.ptq._bias_correction import _corrected_layers, _local_shifts

    m, _, ada, results = quantized
    assert results[1].kept == "adaround" and results[1].flipped > 0
    data = _data(7, 2)
    node = _corrected_layers(ada)[1]
    shift = _local_shifts(ada, [node], [((x,), {}) for x in data])[node]
    xq_of = ada.get_submodule(node.args[0].target)  # the quantizer of its input
    w_ada = weighted_layers(ada)[1].weight.detach().double()
    w = m[2].weight.detach().double()
    with torch.no_grad():
        diffs = []
        for x in data:
            h = m[1](m[0](x))
            y = F.conv2d(h.double(), w, padding=1, groups=4)
            diffs.append(y - F.conv2d(xq_of(h).double(), w_ada, padding=1, groups=4))
    ref = torch.cat(diffs).mean((0, 2, 3))
    # float64 both ways, different summation orders: 1e-9 of the shifts' size
    torch.testing.assert_close(shift.double(), ref, rtol=1e-9, atol=1e-9 * float(ref.abs().max()))


def test_grouped_conv_error_in_float64_on_fresh_data(quantized):
    """Independent of the module's rows and bookkeeping: the grouped conv's output on new inputs,
    recomputed in float64 by F.conv2d from the same quantized input, is closer to the float model
    (float input, float weights) with AdaRound's weights than with round-to-nearest."""
    m, nearest, ada, _ = quantized
    conv = m[2]
    layer = weighted_layers(ada)[1]
    x = torch.cat(_data(3, 4))
    seen = []
    _run(ada, [((x,), {})], {layer.node: lambda inp, out: seen.append(inp)}, stop=layer.node)

    def out(inputs, weight):
        return torch.relu(
            F.conv2d(inputs.double(), weight.double(), conv.bias.double(), padding=1, groups=4)
        )

    q = layer.quantizer
    with torch.no_grad():
        ref = out(m[1](m[0](x)), conv.weight)  # the float model's own path
        w_near = fake_quantize(conv.weight, q.scale, q.zero_point, q.qmin, q.qmax, 0)
        err_near = float(((out(seen[0], w_near) - ref) ** 2).sum())
        err_ada = float(((out(seen[0], layer.weight) - ref) ** 2).sum())
    # measured 0.7x; the held-out rows said 0.73
    assert err_ada < 0.85 * err_near, (err_ada, err_near)


def test_a_layer_with_fewer_rows_than_weights_keeps_nearest():
    """Regression: a squeeze-excite conv reads one pooled position per image, so it has as many
    rows as calibration images (7 on PP-OCRv4 det): AdaRound fitted 6 rows with hundreds of
    weight flips per layer and "checked" them on one held-out row. With fewer training rows than
    weights per output channel the layer now keeps round-to-nearest; the conv before it (12 x 12
    positions per image) still learns."""
    torch.manual_seed(0)
    m = nn.Sequential(
        nn.Conv2d(3, 16, 3, padding=1),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Conv2d(16, 16, 1),  # 16 weights per output channel, 8 rows (8 images)
    ).eval()
    data = _data(6, 2)[:2]
    data = [x[:4] for x in data]
    qm = qb.quantize(m, data, recipe="w4a8", progress=False)
    config = dataclasses.replace(CONFIG, iterations=30, rows=256)
    results = adaround(qm, [((x,), {}) for x in data], config, progress=False)
    assert [r.rows for r in results] == [256, 8]
    assert results[1].kept == "nearest" and results[1].flipped == 0
    assert results[0].flipped > 0


def test_exported_file_matches_torch_in_onnx_runtime(tmp_path):
    ada = qb.quantize(_model(), _data(1), recipe="native", progress=False)
    assert any(r.flipped for r in adaround(ada, [((x,), {}) for x in _data(1)], CONFIG, False))
    x = torch.cat(_data(4, 4))
    path = tmp_path / "ada.onnx"
    qb.export(ada, path, x[:2])
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    y_ort = sess.run(None, {sess.get_inputs()[0].name: x.numpy()})[0]
    with torch.no_grad():
        y = ada(x).numpy()
    # recipe "native": 7-bit weights on this AVX2 CPU, so ORT's fused u8s8 kernels are exact;
    # both sides then differ only where float32 sums land on a rounding tie: at most 1 LSB
    lsb = np.abs(y_ort - y) / ada.output_quantizer().scale.item()
    assert lsb.max() <= 1.0 + 1e-3, lsb.max()


def test_quantize_runs_adaround_from_the_recipe_and_forward_loop_agrees():
    """The recipe option wires it into ``quantize``; a ``forward_loop`` over the same batches
    gives bit-identical weights (same cached batches, same seed)."""
    m = _model()
    recipe = dataclasses.replace(
        qb.Recipe.preset("native"), adaround=dataclasses.replace(CONFIG, iterations=40)
    )
    data = _data(5, 3)
    a = qb.quantize(m, data, recipe=recipe, progress=False)

    def loop(model):
        for x in data:
            model(x)

    b = qb.quantize(m, recipe=recipe, forward_loop=loop, progress=False)
    plain = qb.quantize(m, data, recipe="native", progress=False)
    for name, _ in m.named_parameters():
        if name.endswith("weight"):
            assert torch.equal(a.get_parameter(name), b.get_parameter(name)), name
    changed = [
        n
        for n, _ in m.named_parameters()
        if n.endswith("weight") and not torch.equal(a.get_parameter(n), plain.get_parameter(n))
    ]
    assert changed  # at least one layer's rounding moved off round-to-nearest
    assert m[0].weight.data_ptr() != a.get_parameter("0.weight").data_ptr()  # user model untouched


def test_recipe_round_trip_and_errors():
    r = qb.Recipe(adaround=qb.AdaRound(iterations=300, reg_weight=0.1))
    assert qb.Recipe.from_dict(r.to_dict()) == r
    assert qb.Recipe.from_yaml(r.to_yaml()) == r
    assert qb.Recipe.from_json(r.to_json()) == r
    assert qb.Recipe.from_dict({"adaround": True}).adaround == qb.AdaRound()
    assert qb.Recipe.from_dict({"adaround": False}).adaround is None
    assert "adaround" not in qb.Recipe().to_dict()  # recipes without it serialise as before
    with pytest.raises(ValueError, match="unknown key 'iters' in recipe.adaround"):
        qb.Recipe.from_dict({"adaround": {"iters": 10}})
    with pytest.raises(ValueError, match="AdaRound.iterations must be a positive integer"):
        qb.AdaRound(iterations=0)
    with pytest.raises(ValueError, match="AdaRound.warmup"):
        qb.AdaRound(warmup=1.0)


def test_adaround_on_an_imported_onnx_model_with_dict_batches():
    # regression: AdaRound flattened a call by the module's signature, so an imported ONNX
    # model's dict batches ({"x": ...}, keyword inputs named after the file's) raised KeyError:
    # 'x' (PP-OCRv4 det, `Recipe(adaround=...)`). It now flattens as the graph does; the learned
    # weights are still each floor or ceil of w / s, and the model runs
    import io

    torch.manual_seed(0)
    float_model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.ReLU(), nn.Conv2d(8, 4, 3)).eval()
    buf = io.BytesIO()
    x = torch.randn(1, 3, 12, 12)
    torch.onnx.export(float_model, (x,), buf, input_names=["x"], dynamo=False)
    model = qb.import_onnx(onnx.load_from_string(buf.getvalue()))
    batches = [{"x": torch.randn(2, 3, 12, 12)} for _ in range(2)]
    recipe = dataclasses.replace(qb.Recipe(), adaround=qb.AdaRound(iterations=10, rows=256))
    qmodel = qb.quantize(model, batches, recipe=recipe, progress=False)
    y = qmodel(x)
    assert y.shape == (1, 4, 8, 8) and torch.isfinite(y).all()


def test_qdrop_trains_on_float_rows_and_keeps_floor_or_ceil(quantized):
    """``AdaRound(drop=p)`` (QDrop): the training rows mix in the float model's own input to the
    layer (``_float_rows``, checked against the float model run by hand); the rounding it learns
    differs from plain AdaRound's on the same seed and is still floor or ceil of ``W / s``; a
    layer keeps it only where it reconstructs the held-out quantized rows at least as well as
    round-to-nearest."""
    from quantbridge.torch.ptq._adaround import _float_rows, _in_rows

    m, _, _, _ = quantized
    recipe = qb.Recipe.preset("w4a8")
    data = _data(1, 4)
    calls = [((x,), {}) for x in data]
    config = dataclasses.replace(CONFIG, iterations=30, rows=512)  # few steps: ~2 s
    plain = qb.quantize(m, data, recipe=recipe, progress=False)
    dropped = qb.quantize(m, data, recipe=recipe, progress=False)
    layer = weighted_layers(dropped)[1]  # the grouped conv: its input is relu(conv0(x))
    pick = torch.arange(0, 16 * 144, 7)
    got = _float_rows(dropped, calls[:1], layer, [pick])
    with torch.no_grad():
        ref = _in_rows(layer.node, m[1](m[0](data[0])), layer.weight)[pick]
    torch.testing.assert_close(got, ref, rtol=0, atol=0)  # the same float32 ops: bitwise
    adaround(plain, calls, config, progress=False)
    results = adaround(dropped, calls, dataclasses.replace(config, drop=0.5), progress=False)
    changed = False
    for mod, lp, ld, r in zip(
        [x for x in m if isinstance(x, (nn.Conv2d, nn.Linear))],
        weighted_layers(plain),
        weighted_layers(dropped),
        results,
        strict=True,
    ):
        q = ld.quantizer
        shape = (-1, *[1] * (mod.weight.ndim - 1))
        s = q.scale.reshape(shape)
        t = (mod.weight.detach() / s).double()
        codes = torch.round(ld.weight.detach() / s).double()
        lo, hi = t.floor().clamp(q.qmin, q.qmax), t.ceil().clamp(q.qmin, q.qmax)
        assert bool(((codes == lo) | (codes == hi)).all()), r
        assert r.error_adaround <= r.error_nearest if r.kept == "adaround" else r.flipped == 0, r
        changed |= not torch.equal(lp.weight, ld.weight)
    assert changed  # the float rows took part in the training


def test_qdrop_probability_is_checked():
    for bad in (-0.1, 1.0, True):
        with pytest.raises(ValueError, match="AdaRound.drop"):
            qb.AdaRound(drop=bad)
    assert qb.AdaRound.from_value({"drop": 0.5}, "r").drop == 0.5
