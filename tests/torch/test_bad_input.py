"""Bad input gets a clear error naming the thing and the fix; nothing silently wrong."""

from __future__ import annotations

import sys
import warnings

import pytest
import torch
from torch import nn
from unprivileged import call_as_nobody, is_root, reachable_folder

import quantbridge as qb
from quantbridge.zoo import DigitsCNN


def test_empty_calibration_data():
    with pytest.raises(ValueError, match="calibration data is empty"):
        qb.quantize(DigitsCNN(), [], recipe="int8")


def test_missing_calibration_data():
    with pytest.raises(ValueError, match="calibration data is missing"):
        qb.quantize(DigitsCNN(), None, recipe="int8")


def test_single_tensor_instead_of_batches():
    with pytest.raises(TypeError, match=r"wrap it: \[batch\]"):
        qb.quantize(DigitsCNN(), torch.randn(4, 1, 8, 8), recipe="int8")


def test_batch_of_unknown_type_names_the_batch_and_the_fix():
    with pytest.raises(TypeError, match=r"calibration batch 0 is a str.*transform="):
        qb.quantize(DigitsCNN(), ["not a tensor"], recipe="int8")


def test_wrong_dtype_batch():
    data = [torch.randn(4, 1, 8, 8), torch.randint(0, 5, (4, 1, 8, 8))]
    with pytest.raises(ValueError, match=r"calibration batch 1 \(int64\[4, 1, 8, 8\]\).*dtype"):
        qb.quantize(DigitsCNN(), data, recipe="int8")


def test_wrong_shape_batch():
    data = [torch.randn(4, 1, 8, 8), torch.randn(4, 1, 9, 9)]
    with pytest.raises(
        ValueError,
        match=r"calibration batch 1: input 'x': expected shape \[batch, 1, 8, 8\], got "
        r"\[4, 1, 9, 9\]: dimension 2 is fixed to 8; quantize with dynamic=\"all\"",
    ):
        qb.quantize(DigitsCNN(), data, recipe="int8")


def test_wrong_rank_batch():
    data = [torch.randn(4, 1, 8, 8), torch.randn(4, 64)]
    with pytest.raises(ValueError, match="calibration batch 1.*rank"):
        qb.quantize(DigitsCNN(), data, recipe="int8")


def test_nan_in_calibration_names_the_tensor():
    data = [torch.randn(4, 1, 8, 8), torch.full((4, 1, 8, 8), float("nan"))]
    with pytest.raises(ValueError, match=r"calibration batch 1: activation 'input/x'.*NaN"):
        qb.quantize(DigitsCNN(), data, recipe="int8")


def test_inf_in_calibration_names_the_tensor():
    x = torch.randn(4, 1, 8, 8)
    x[0, 0, 0, 0] = float("inf")
    with pytest.raises(ValueError, match=r"activation 'input/x'.*inf"):
        qb.quantize(DigitsCNN(), [x], recipe="int8")


class _ZeroBranch(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.out = nn.Linear(4, 2)

    def forward(self, x):
        return self.out(self.fc(x) * 0.0)


def test_all_zero_range_falls_back_to_a_finite_scale():
    qm = qb.quantize(_ZeroBranch(), [torch.randn(8, 4)], recipe="int8")
    for name, q in qm.quantizers().items():
        scale = getattr(q, "scale", None)
        if scale is not None:
            assert torch.isfinite(scale).all() and (scale > 0).all(), name
    y = qm(torch.randn(3, 4))
    assert torch.isfinite(y).all()


@pytest.mark.parametrize("bits", [1, 17])
def test_bit_width_out_of_range(bits):
    with pytest.raises(ValueError, match=f"bits={bits}.*2..16"):
        qb.QScheme(bits=bits)


def test_unknown_preset_lists_presets():
    with pytest.raises(ValueError, match="unknown recipe preset 'int7'.*int8"):
        qb.quantize(DigitsCNN(), [torch.randn(2, 1, 8, 8)], recipe="int7")


def test_rule_matching_nothing_warns_with_its_name():
    recipe = qb.Recipe().with_rules(qb.Rule(pattern="encoder.*", skip=True))
    with pytest.warns(UserWarning, match=r"pattern='encoder\.\*'.*matches no layer.*conv1"):
        qb.quantize(DigitsCNN(), [torch.randn(2, 1, 8, 8)], recipe=recipe)


def test_matching_rule_does_not_warn():
    recipe = qb.Recipe().with_rules(qb.Rule(pattern="conv1", skip=True))
    with warnings.catch_warnings():
        warnings.simplefilter("error", UserWarning)
        qb.quantize(DigitsCNN(), [torch.randn(2, 1, 8, 8)], recipe=recipe)


def test_export_to_missing_folder(tmp_path):
    qm = qb.quantize(DigitsCNN(), [torch.randn(2, 1, 8, 8)], recipe="int8")
    with pytest.raises(ValueError, match="does not exist; create it first"):
        qb.export(qm, tmp_path / "nope" / "m.onnx", torch.randn(2, 1, 8, 8))


def test_export_to_unwritable_path(tmp_path):
    """A read-only folder and a read-only file: PermissionError naming the path, nothing written.
    As root (permission bits not enforced) the same calls run in a child that dropped to
    ``nobody``."""
    qm = qb.quantize(DigitsCNN(), [torch.randn(2, 1, 8, 8)], recipe="int8")
    folder = reachable_folder() if is_root() else tmp_path
    target = folder / "m.onnx"
    target.write_bytes(b"")
    target.chmod(0o444)
    readonly_dir = folder / "ro"
    readonly_dir.mkdir()
    readonly_dir.chmod(0o555)
    try:
        for path in (readonly_dir / "m.onnx", target):

            def export(path=path):
                qb.export(qm, path, torch.randn(2, 1, 8, 8))

            if is_root():
                message = call_as_nobody(export)
                assert message.startswith("PermissionError: ") and "not writable" in message
                assert repr(str(path)) in message
            else:
                with pytest.raises(PermissionError, match="not writable"):
                    export()
        assert target.read_bytes() == b"" and not (readonly_dir / "m.onnx").exists()
    finally:
        readonly_dir.chmod(0o755)


def test_export_path_is_a_directory(tmp_path):
    qm = qb.quantize(DigitsCNN(), [torch.randn(2, 1, 8, 8)], recipe="int8")
    with pytest.raises(ValueError, match="is a directory"):
        qb.export(qm, tmp_path, torch.randn(2, 1, 8, 8))


def test_export_of_a_plain_module_is_refused(tmp_path):
    with pytest.raises(TypeError, match=r"QuantModel returned by qb.quantize.*quantize it first"):
        qb.export(DigitsCNN(), tmp_path / "m.onnx", torch.randn(2, 1, 8, 8))


def test_untraceable_model_names_the_users_line():
    class DataDependent(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            if x.sum() > 0:  # data-dependent Python branch
                return self.fc(x)
            return x

    with pytest.raises(
        qb.CaptureError, match=r"test_bad_input.py:\d+ in forward\(\): \"if x.sum\(\) > 0"
    ):
        qb.quantize(DataDependent(), [torch.randn(2, 4)], recipe="int8")


def test_data_dependent_branch_in_a_library_names_the_librarys_line(tmp_path, monkeypatch):
    """Longformer / LED (regression): torch names the guard's line relative to its package
    ("Caused by: (transformers/models/longformer/modeling_longformer.py:549 in forward)"), which
    the traceback-based search skipped as library code: the refusal named no line at all."""
    package = tmp_path / "site-packages" / "qb_fake_hf"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "modeling.py").write_text(
        "import torch\n"
        "class GlobalAttention(torch.nn.Module):\n"
        "    def __init__(self):\n"
        "        super().__init__()\n"
        "        self.fc = torch.nn.Linear(4, 4)\n"
        "    def forward(self, x):\n"
        "        is_global_attn = (x > 100).flatten().any().item()\n"
        "        if is_global_attn:\n"
        "            return self.fc(x) * 2\n"
        "        return self.fc(x)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path / "site-packages"))
    monkeypatch.delitem(sys.modules, "qb_fake_hf.modeling", raising=False)
    from qb_fake_hf.modeling import GlobalAttention

    with pytest.raises(qb.CaptureError) as info:
        qb.quantize(GlobalAttention(), [torch.randn(2, 4)], recipe="int8")
    message = str(info.value)
    assert 'qb_fake_hf/modeling.py:8 in forward(): "if is_global_attn:"' in message
    assert "Python branch on a value computed from the inputs" in message


def test_shape_error_only_when_traced_blames_the_code_not_the_inputs():
    """Nystromformer (regression): under torch.export Hugging Face builds a (batch, 1, seq, seq)
    mask that its landmark attention cannot add; the plain call skips it. The refusal said the
    inputs had the wrong shape."""

    class TracedPathDiffers(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(4, 4)

        def forward(self, x):
            mask = torch.zeros(x.shape[0], 3, 1) if torch.compiler.is_exporting() else 0.0
            return self.fc(x) + mask

    with pytest.raises(qb.CaptureError) as info:
        qb.quantize(TracedPathDiffers(), [torch.randn(2, 4)], recipe="int8")
    message = str(info.value)
    assert 'in forward(): "return self.fc(x) + mask"' in message
    assert "fails only when traced" in message and "do not have the shape" not in message


def test_forward_loop_that_never_calls_the_model():
    with pytest.raises(ValueError, match="forward_loop never called the model"):
        qb.quantize(DigitsCNN(), forward_loop=lambda m: None, recipe="int8")


def test_strided_first_batch_does_not_pin_strides():
    x = torch.randn(16, 1, 8, 8)
    qm = qb.quantize(
        DigitsCNN(), [x[::2], torch.randn(8, 1, 8, 8)], recipe="int8"
    )  # x[::2] is not contiguous
    assert qm(torch.randn(5, 1, 8, 8)).shape == (5, 10)


def test_export_below_opset_13_names_the_real_reason(tmp_path):
    # regression: an 8-bit model at opset 11 was told that 16-bit quantization needs opset 13
    qm = qb.quantize(DigitsCNN(), [torch.randn(2, 1, 8, 8)], recipe="int8")
    with pytest.raises(ValueError, match="opset 11: QDQ export needs opset >= 13"):
        qb.export(qm, tmp_path / "m.onnx", torch.randn(2, 1, 8, 8), opset=11)


def test_nan_from_finite_data_does_not_blame_the_data():
    """NaN computed inside the model from a finite batch: the message names the tensor and says
    the data is finite (regression sweep 2026-12-02: ModernBERT's NaN came from quantbridge's
    attention rewrite, and the message read as if the calibration data held it)."""

    class LogOfNegative(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(torch.log(-x.abs() - 1))  # log of < 0: NaN everywhere

    with pytest.raises(ValueError, match=r"calibration batch 0: activation 'log'.*NaN") as e:
        qb.quantize(LogOfNegative(), [torch.randn(2, 4)], recipe="int8")
    assert "inputs are all finite" in str(e.value)
    assert "clean the calibration data" not in str(e.value)


def test_nan_in_keyword_input_is_named():
    data = [{"x": torch.full((4, 1, 8, 8), float("nan"))}]
    with pytest.raises(ValueError, match=r"input 'x' holds NaN / inf: clean the calibration data"):
        qb.quantize(DigitsCNN(), data, recipe="int8")
