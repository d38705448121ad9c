"""Save/load: one safetensors file re-created on the user's class with bit-identical outputs, and a
clear CheckpointError (model untouched, nothing returned) for every file that cannot be loaded."""

from __future__ import annotations

import json
import os
import pickle
import stat

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from unprivileged import call_as_nobody, is_root, reachable_folder

import quantbridge as qb
from quantbridge.torch import prepare
from quantbridge.zoo import BasicBlock, DigitsCNN, TwoInputConcat, resnet18_style

X_DIGITS = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(5))


@pytest.fixture(scope="module")
def resnet_ckpt(tmp_path_factory):
    torch.manual_seed(0)
    qm = qb.quantize(
        resnet18_style(num_classes=10, width=8), [torch.randn(2, 3, 32, 32)], recipe="int8"
    )
    path = tmp_path_factory.mktemp("ckpt") / "resnet.qb"
    qb.save(qm, path)
    return qm, path


@pytest.fixture(scope="module")
def digits_ckpt(tmp_path_factory):
    torch.manual_seed(0)
    qm = qb.quantize(DigitsCNN(), [torch.randn(8, 1, 8, 8)], recipe="int8")
    path = tmp_path_factory.mktemp("ckpt") / "digits.qb"
    qb.save(qm, path)
    return qm, path


def _refused(path, model, match):
    """qb.load raises CheckpointError matching ``match`` and leaves ``model`` exactly as it was."""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(qb.CheckpointError, match=match) as info:
        qb.load(path, model)
    after = model.state_dict()
    assert before.keys() == after.keys()
    assert all(torch.equal(before[k], after[k]) for k in before)
    return str(info.value)


def _train(qm, steps=3):
    opt = torch.optim.SGD(qm.parameters(), lr=0.01)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        loss = qm(torch.randn(4, 1, 8, 8, generator=g)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


# -- round trips ----------------------------------------------------------------------------------
def test_ptq_resnet_round_trip_is_bit_identical_and_the_header_says_what_it_holds(resnet_ckpt):
    qm, path = resnet_ckpt
    qm2 = qb.load(path, resnet18_style(num_classes=10, width=8, seed=7))  # other random weights
    x = torch.randn(3, 3, 32, 32)  # another batch size: the dynamic batch dim survives
    assert isinstance(qm2, qb.QuantModel) and not qm2.training
    assert torch.equal(qm(x), qm2(x))
    with qb.float_mode(qm), qb.float_mode(qm2):
        assert torch.equal(qm(x), qm2(x))
    assert [p.to_dict() for p in qm2.qb_points] == [p.to_dict() for p in qm.qb_points]
    assert qm2.qb_recipe == qm.qb_recipe and qm2.qb_capture == qm.qb_capture
    with safe_open(path, "pt") as f:
        meta, keys = f.metadata(), set(f.keys())
    assert meta["format"] == "quantbridge" and meta["format_version"] == "2"
    header = json.loads(meta["quantbridge"])
    assert header["recipe"] == qm.qb_recipe.to_dict()
    assert header["model_class"] == "quantbridge.zoo.ResNet18Style"
    assert header["versions"] == {"quantbridge": qb.__version__, "torch": torch.__version__}
    assert len(header["points"]) == len(qm.qb_points) == len(header["quantizers"])
    assert keys == set(qm.state_dict()) and "fc.weight" in keys
    assert "_quantbridge.conv1_weight.scale" in keys


def test_keyword_inputs_round_trip(tmp_path):
    batch = {"image": torch.randn(2, 3, 8, 8), "extra": torch.randn(2, 6), "scale": 2.0}
    qm = qb.quantize(TwoInputConcat(), [batch], recipe="int8")
    qb.save(qm, tmp_path / "two.qb")
    qm2 = qb.load(tmp_path / "two.qb", TwoInputConcat())
    image, extra = torch.randn(5, 3, 8, 8), torch.randn(5, 6)
    assert torch.equal(
        qm(image=image, extra=extra, scale=2.0), qm2(image=image, extra=extra, scale=2.0)
    )


def test_qat_moving_average_after_freeze_batchnorm_keeps_training_identically(tmp_path):
    qm = qb.prepare_qat(DigitsCNN(), calib_data=[torch.randn(8, 1, 8, 8)])
    _train(qm)
    qb.freeze_batchnorm(qm)
    qb.save(qm, tmp_path / "qat.qb")
    qm2 = qb.load(tmp_path / "qat.qb", DigitsCNN())
    assert qm2.training and qm2.qb_bn_frozen
    # in training mode the activation ranges move (moving average): both move identically
    for _ in range(2):
        assert torch.equal(qm(X_DIGITS), qm2(X_DIGITS))
    _train(qm, 1), _train(qm2, 1)
    assert torch.equal(qm.eval()(X_DIGITS), qm2.eval()(X_DIGITS))


def test_lsq_model_round_trip_keeps_learned_parameters(tmp_path):
    qm = qb.prepare_qat(DigitsCNN(), calib_data=[torch.randn(8, 1, 8, 8)], learn_scales=True)
    _train(qm)
    qb.freeze_batchnorm(qm)
    qb.save(qm, tmp_path / "lsq.qb")
    qm2 = qb.load(tmp_path / "lsq.qb", DigitsCNN())
    params, params2 = dict(qm.named_parameters()), dict(qm2.named_parameters())
    assert params.keys() == params2.keys()
    assert any(k.startswith("_quantbridge.input_x.") for k in params)  # a learned step size
    assert all(torch.equal(params[k], params2[k]) for k in params)
    assert params2["_quantbridge.input_x.zero_point"].dtype == torch.float32  # learned offset
    assert torch.equal(qm(X_DIGITS), qm2(X_DIGITS))
    assert torch.equal(qm.eval()(X_DIGITS), qm2.eval()(X_DIGITS))


def test_torch_save_state_dict_round_trip(digits_ckpt, tmp_path):
    qm, _ = digits_ckpt
    torch.save(qm.state_dict(), tmp_path / "sd.pt")
    state = torch.load(tmp_path / "sd.pt", weights_only=True)
    # onto a model calibrated on other data, and onto one never calibrated (scalar scales,
    # observing): per-channel shapes and the calibrated state come from the state dict
    other = qb.quantize(DigitsCNN(), [torch.randn(8, 1, 8, 8) * 3], recipe="int8")
    fresh = prepare(DigitsCNN(), (torch.zeros(8, 1, 8, 8),), {}, qm.qb_recipe)
    assert not torch.equal(other(X_DIGITS), qm(X_DIGITS))
    for target in (other, fresh):
        target.load_state_dict(state)
        assert torch.equal(target(X_DIGITS), qm(X_DIGITS))


def test_save_overwrites_atomically(digits_ckpt, tmp_path):
    qm, _ = digits_ckpt
    path = tmp_path / "m.qb"
    path.write_bytes(b"old")
    qb.save(qm, path)
    assert os.listdir(tmp_path) == ["m.qb"]  # no temporary file left behind
    assert torch.equal(qb.load(path, DigitsCNN())(X_DIGITS), qm(X_DIGITS))


# -- foreign files ----------------------------------------------------------------------------------
def test_float_torch_save_checkpoint_is_refused_with_the_fix(tmp_path):
    model = DigitsCNN()
    torch.save(model.state_dict(), tmp_path / "float.qb")
    msg = _refused(tmp_path / "float.qb", model, "this is a float checkpoint")
    assert "model.load_state_dict(torch.load(path, weights_only=True))" in msg
    assert "qb.quantize" in msg


def test_float_safetensors_checkpoint_is_refused_with_the_fix(tmp_path):
    model = DigitsCNN()
    save_file(model.state_dict(), tmp_path / "float.safetensors", metadata={"format": "pt"})
    msg = _refused(tmp_path / "float.safetensors", model, "this is a float checkpoint")
    assert "safetensors.torch.load_file(path)" in msg and "qb.quantize" in msg


def test_torch_save_of_a_quantmodel_state_dict_says_how_to_load_it(digits_ckpt, tmp_path):
    qm, _ = digits_ckpt
    torch.save(qm.state_dict(), tmp_path / "q.pt")
    _refused(tmp_path / "q.pt", DigitsCNN(), r"re-create the QuantModel .*qmodel.load_state_dict")


def test_float_state_dict_into_a_quantmodel_is_refused(digits_ckpt):
    qm, _ = digits_ckpt
    before = {k: v.clone() for k, v in qm.state_dict().items()}
    with pytest.raises(qb.CheckpointError, match="this is a float checkpoint.*qb.quantize"):
        qm.load_state_dict(DigitsCNN().state_dict())
    assert all(torch.equal(before[k], v) for k, v in qm.state_dict().items())
    qm.load_state_dict({"fc2.bias": before["fc2.bias"]}, strict=False)  # partial loads still work


def test_a_qb_file_is_not_a_torch_load_file_but_safetensors_reads_it(digits_ckpt):
    qm, path = digits_ckpt  # as documented: torch.load fails, load_file gives the raw tensors
    with pytest.raises(pickle.UnpicklingError):
        torch.load(path, weights_only=True)
    assert load_file(path).keys() == qm.state_dict().keys()


class _WritesMarker:
    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_a_pickle_that_runs_code_is_refused_without_running_it(tmp_path):
    marker = tmp_path / "pwned"
    for name, dump in (("raw.qb", pickle.dump), ("zip.qb", torch.save)):
        with open(tmp_path / name, "wb") as f:
            dump({"weight": _WritesMarker(str(marker))}, f)
        msg = _refused(tmp_path / name, DigitsCNN(), "refused|float checkpoint")
        assert not marker.exists(), msg
    assert "never unpickles" in _refused(tmp_path / "raw.qb", DigitsCNN(), "refused")


# -- our files that do not fit ------------------------------------------------------------------
def test_different_architecture_names_the_first_mismatching_layer(resnet_ckpt):
    class RenamedBlock(BasicBlock):  # layer3.1 calls its second conv 'conv3'
        def __init__(self, c):
            super().__init__(c, c)
            self.conv3 = self.conv2
            del self.conv2

        def forward(self, x):
            out = self.relu(self.bn1(self.conv1(x)))
            return self.relu(self.bn2(self.conv3(out)) + x)

    _, path = resnet_ckpt
    model = resnet18_style(num_classes=10, width=8)
    model.layer3[1] = RenamedBlock(32)
    msg = _refused(path, model, "checkpoint was made with a different architecture")
    assert "'layer3.1.conv2.weight' in the checkpoint, 'layer3.1.conv3.weight' in this model" in msg


def test_different_layer_shape_is_named(digits_ckpt):
    _, path = digits_ckpt
    model = DigitsCNN()
    model.fc2 = nn.Linear(64, 12)
    _refused(
        path,
        model,
        r"tensor 'fc2.weight' is float32\[10, 64\] in the checkpoint, float32\[12, 64\]",
    )


def test_model_that_cannot_take_the_recorded_inputs(digits_ckpt):
    _, path = digits_ckpt
    _refused(path, TwoInputConcat(), r"made from a quantbridge.zoo.DigitsCNN called with \(float32")


def test_recipe_resolving_differently_names_the_layer_and_the_schemes(tmp_path):
    class Dense(nn.Linear):  # the rule keyed by module type 'Linear' no longer matches fc1
        pass

    recipe = qb.Recipe().with_rules(
        qb.Rule(module_type="Linear", weights=qb.Recipe.preset("w4a8").weights)
    )
    qb.save(qb.quantize(DigitsCNN(), [torch.randn(4, 1, 8, 8)], recipe=recipe), tmp_path / "r.qb")
    model = DigitsCNN()
    model.fc1 = Dense(512, 64)
    _refused(tmp_path / "r.qb", model, r"different recipe.*'fc1.weight': scheme int4 vs int8")


def _rewrite(src, dst, edit_metadata=None, edit_bytes=None):
    with safe_open(src, "pt") as f:
        meta, tensors = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    save_file(tensors, dst, metadata=edit_metadata(meta) if edit_metadata else meta)
    if edit_bytes:
        dst.write_bytes(edit_bytes(dst.read_bytes()))


def test_newer_format_version_says_upgrade(digits_ckpt, tmp_path):
    _, path = digits_ckpt
    _rewrite(path, tmp_path / "v3.qb", edit_metadata=lambda m: {**m, "format_version": "3"})
    _refused(tmp_path / "v3.qb", DigitsCNN(), r"newer quantbridge \(format 3.*upgrade")


@pytest.mark.parametrize("keep", [0, 7, 100, 0.5, -1])
def test_truncated_file_is_refused(digits_ckpt, tmp_path, keep):
    _, path = digits_ckpt
    data = path.read_bytes()
    n = int(len(data) * keep) if isinstance(keep, float) else keep % len(data)
    (tmp_path / "cut.qb").write_bytes(data[:n])
    _refused(tmp_path / "cut.qb", DigitsCNN(), "truncated or corrupted")


def test_corrupted_tensor_bytes_fail_the_checksum(digits_ckpt, tmp_path):
    _, path = digits_ckpt
    flip = bytearray(path.read_bytes())
    flip[-5] ^= 0x40  # inside the last tensor's data: safetensors itself cannot notice
    (tmp_path / "bad.qb").write_bytes(bytes(flip))
    _refused(tmp_path / "bad.qb", DigitsCNN(), "corrupted: its tensors do not match the checksum")


def test_corrupted_header_json_is_refused(digits_ckpt, tmp_path):
    _, path = digits_ckpt
    _rewrite(path, tmp_path / "h.qb", edit_metadata=lambda m: {**m, "quantbridge": "{not json"})
    _refused(tmp_path / "h.qb", DigitsCNN(), "is corrupted")


# -- bad arguments ----------------------------------------------------------------------------------
def test_save_refuses_a_float_model_and_bad_paths(digits_ckpt, tmp_path):
    qm, _ = digits_ckpt
    with pytest.raises(TypeError, match=r"torch.save\(model.state_dict\(\), path\)"):
        qb.save(DigitsCNN(), tmp_path / "m.qb")
    with pytest.raises(ValueError, match="is a directory"):
        qb.save(qm, tmp_path)
    with pytest.raises(ValueError, match="does not exist; create it"):
        qb.save(qm, tmp_path / "nope" / "m.qb")
    readonly = (reachable_folder() if is_root() else tmp_path) / "ro"
    readonly.mkdir()
    readonly.chmod(0o555)
    try:
        if is_root():  # permission bits are not enforced for root: the call as `nobody`
            message = call_as_nobody(lambda: qb.save(qm, readonly / "m.qb"))
            assert message.startswith("PermissionError: ") and "not writable" in message
            assert repr(str(readonly / "m.qb")) in message
        else:
            with pytest.raises(PermissionError, match="not writable"):
                qb.save(qm, readonly / "m.qb")
        assert not (readonly / "m.qb").exists()
    finally:
        readonly.chmod(0o755)


@pytest.mark.filterwarnings("ignore::UserWarning")  # the no-VNNI note of qb.export
@pytest.mark.parametrize("umask", [0o077, 0o002])
def test_saved_and_exported_files_follow_the_umask(digits_ckpt, tmp_path, umask):
    """The files qb.save and qb.export write get the user's default mode (0o666 & ~umask), as
    any file a user's program creates: no world-readable checkpoint under umask 077, a
    group-writable one under 002."""
    qm, _ = digits_ckpt
    old = os.umask(umask)
    try:
        qb.save(qm, tmp_path / "m.qb")
        qb.export(qm, tmp_path / "m.onnx", torch.randn(2, 1, 8, 8))
    finally:
        os.umask(old)
    for name in ("m.qb", "m.onnx"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o666 & ~umask, name


def test_load_needs_a_fresh_float_model(digits_ckpt):
    qm, path = digits_ckpt
    # named by the class the checkpoint was saved from, not a generic MyModel()
    with pytest.raises(TypeError, match=r"pass model=DigitsCNN\(\) \(a fresh quantbridge\.zoo"):
        qb.load(path, qm)
    with pytest.raises(FileNotFoundError, match="no checkpoint at"):
        qb.load(str(path) + ".missing", DigitsCNN())


class _SamePadding(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(3, 4, 3, padding="same"), nn.Conv2d(4, 2, 1, padding="same")

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def test_checkpoint_from_before_string_padding_convs_were_quantized_still_loads(tmp_path):
    """A checkpoint saved before ``_conv_padding`` (its ``padding="same"`` convs float, no
    ``explicit_padding`` in its header) loads as it was placed, bit for bit; a new one loads
    with those convs quantized. Before: CheckpointError "different architecture"."""
    import quantbridge.torch._capture as capture_module

    torch.manual_seed(0)
    batches = [torch.randn(2, 3, 8, 8) for _ in range(2)]
    rewrite = capture_module.explicit_conv_padding
    capture_module.explicit_conv_padding = lambda gm: 0  # the capture as it was
    try:
        old = qb.quantize(_SamePadding().eval(), batches, progress=False)
    finally:
        capture_module.explicit_conv_padding = rewrite
    del old.qb_capture["explicit_padding"]  # not in old headers
    qb.save(old, tmp_path / "old.qb")
    loaded = qb.load(tmp_path / "old.qb", _SamePadding().eval())
    assert list(loaded.quantizers()) == list(old.quantizers())
    assert torch.equal(loaded(batches[0]), old(batches[0]))
    new = qb.quantize(_SamePadding().eval(), batches, progress=False)
    assert len(new.quantizers()) > len(old.quantizers())  # a.weight, b.weight, ...
    qb.save(new, tmp_path / "new.qb")
    assert list(qb.load(tmp_path / "new.qb", _SamePadding().eval()).quantizers()) == list(
        new.quantizers()
    )
