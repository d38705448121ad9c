"""Issue 10 part 7: ``qb.integer_mode(qmodel)`` - a QuantModel computing exactly the integers of
the integer-only program (``qb.lower`` of its QDQ export, numpy executor).

The reference in every test is built independently of ``integer_mode``: ``qb.export`` to a file,
``qb.lower(file).run(x)``. The outputs must be bit-identical (same float32 values, i.e. the same
codes dequantized the same way). Fake quantization is the second, independent check: on these
small models the two agree within 1 LSB nearly everywhere (a float32 requantization tie can flip
one code; it cannot move it by 2).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn

import quantbridge as qb
from quantbridge.zoo import DigitsCNN


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2, self.fc3 = nn.Linear(20, 64), nn.Linear(64, 32), nn.Linear(32, 5)

    def forward(self, x):
        h = torch.relu(self.fc1(x))
        return self.fc3(torch.sigmoid(self.fc2(h)) + h[:, :32])  # table (sigmoid) + rescaled add


def _quantized(make_model, shape, recipe="int8"):
    torch.manual_seed(0)  # same weights and calibration data for every call
    return qb.quantize(make_model().eval(), [torch.rand(*shape) * 2 - 0.5 for _ in range(3)],
                       recipe=recipe, progress=False)  # fmt: skip


def _program_output(qmodel, x: torch.Tensor, tmp_path) -> np.ndarray:
    path = tmp_path / "model.onnx"
    qb.export(qmodel, path, example_inputs=x)
    return next(iter(qb.lower(path).run({"x": x.numpy()}).values()))


@pytest.fixture(scope="module")
def mlp():
    return _quantized(MLP, (16, 20))


@pytest.mark.parametrize("recipe", ["int8", "int8_symmetric"])
def test_cnn_in_integer_mode_is_the_integer_program_bit_for_bit(recipe, tmp_path):
    qmodel = _quantized(DigitsCNN, (16, 1, 8, 8), recipe)
    x = torch.rand(32, 1, 8, 8)
    with torch.no_grad():
        fake = qmodel(x)
    with qb.integer_mode(qmodel) as same:
        assert same is qmodel
        got = qmodel(x)
        smaller = qmodel(x[:3])  # another batch size: the export has a dynamic batch
    assert isinstance(got, torch.Tensor) and got.dtype == torch.float32 and got.shape == (32, 10)
    np.testing.assert_array_equal(got.numpy(), _program_output(qmodel, x, tmp_path))
    np.testing.assert_array_equal(smaller.numpy(), got[:3].numpy())
    step = float(qmodel.output_quantizer().scale)
    lsb = np.rint(np.abs(got.numpy() - fake.numpy()) / step)
    assert lsb.max() <= 1 and (lsb == 0).mean() >= 0.98
    with torch.no_grad():  # the fake-quantized forward is back
        assert torch.equal(qmodel(x), fake)
    assert "forward" not in qmodel.__dict__


def test_mlp_in_integer_mode_is_the_integer_program_bit_for_bit(mlp, tmp_path):
    x = torch.rand(64, 20) * 2 - 0.5
    with qb.integer_mode(mlp):
        got = mlp(x)
    np.testing.assert_array_equal(got.numpy(), _program_output(mlp, x, tmp_path))


@pytest.fixture(scope="module")
def mlp_program(mlp, tmp_path_factory):
    path = tmp_path_factory.mktemp("mlp") / "mlp.onnx"
    qb.export(mlp, path, example_inputs=torch.zeros(2, 20))
    return qb.lower(path)


@pytest.fixture(scope="module")
def integer_mlp():
    """A second quantized MLP (same weights and calibration), kept in integer_mode for the module:
    one export and lowering for every hypothesis example."""
    qmodel = _quantized(MLP, (16, 20))
    with qb.integer_mode(qmodel):
        yield qmodel


@settings(max_examples=40, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), spread=st.floats(0.01, 20.0), rows=st.integers(1, 9))
def test_integer_mode_equals_the_program_on_any_input(integer_mlp, mlp_program, seed, spread, rows):
    """Inputs from tiny to far beyond the calibrated range (saturation), any batch size."""
    x = torch.from_numpy(np.random.default_rng(seed).normal(0, spread, (rows, 20)).astype("f4"))
    got = integer_mlp(x)
    expected = next(iter(mlp_program.run({"x": x.numpy()}).values()))
    np.testing.assert_array_equal(got.numpy(), expected)


def test_integer_mode_restores_the_model_after_an_error(mlp):
    x = torch.rand(4, 20)
    with torch.no_grad():
        before = mlp(x)
    with pytest.raises(ZeroDivisionError), qb.integer_mode(mlp):
        mlp(x)
        raise ZeroDivisionError
    with torch.no_grad():
        assert torch.equal(mlp(x), before)


def test_integer_mode_bad_input(mlp):
    with pytest.raises(TypeError, match="QuantModel returned by qb.quantize"):
        with qb.integer_mode(nn.Linear(2, 2)):
            pass
    with qb.integer_mode(mlp), pytest.raises(RuntimeError, match="already in integer_mode"):
        with qb.integer_mode(mlp):
            pass
    # a 3-D average pool: the lowering has 1-D and 2-D pools only (a softmax over the batch axis
    # was the example until non-last-axis softmax lowered)
    pool = _quantized(lambda: nn.Sequential(nn.Conv3d(1, 2, 1), nn.AvgPool3d(2)), (2, 1, 4, 4, 4))
    with qb.integer_mode(pool), pytest.raises(qb.LoweringError, match="AveragePool.*2-D pools"):
        pool(torch.rand(2, 1, 4, 4, 4))


def test_to_engine_integer_runs_the_program(mlp, mlp_program):
    fast = qb.to_engine(mlp, "integer", example_inputs=torch.zeros(2, 20))
    x = torch.rand(7, 20)
    expected = next(iter(mlp_program.run({"x": x.numpy()}).values()))
    np.testing.assert_array_equal(fast(x).numpy(), expected)


@pytest.mark.slow
@pytest.mark.parametrize("make, width", [("resnet18_style", 8)])  # mobilenetv2_style(0.25): same
# result measured (bit-identical; 100% of outputs within 1 LSB of fake quantization), left out of
# CI for time (3.5 min on the shared 2-core machine)
def test_zoo_cnns_in_integer_mode_are_the_integer_program(make, width, tmp_path):
    """The zoo CNNs (residual adds, depthwise convolutions, ReLU6, global pooling): bit-identical
    with the program; fake quantization measured against it for the report (deep networks drift,
    DESIGN.md: that drift is what integer_mode removes)."""
    from quantbridge import zoo

    qmodel = _quantized(lambda: getattr(zoo, make)(num_classes=10, width=width), (4, 3, 32, 32))
    x = torch.randn(8, 3, 32, 32)
    with torch.no_grad():
        fake = qmodel(x)
    with qb.integer_mode(qmodel):
        got = qmodel(x)
    np.testing.assert_array_equal(got.numpy(), _program_output(qmodel, x, tmp_path))
    step = float(qmodel.output_quantizer().scale)
    lsb = np.rint(np.abs(got.numpy() - fake.numpy()) / step)
    print(f"{make}: fake quantization vs integer program: {(lsb <= 1).mean():.1%} within 1 LSB, "
          f"max {int(lsb.max())} LSB")  # fmt: skip
