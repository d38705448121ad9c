"""Save and load a ``QuantModel``: one safetensors file, never a pickle.

``save(qmodel, "m.qb")`` writes a safetensors file whose

* tensors are ``qmodel.state_dict()``: the user's weights at their own keys (after BN folding)
  and the quantizer state under ``_quantbridge.*``;
* metadata (str -> str) holds ``format = "quantbridge"``, ``format_version = "1"`` and, under
  ``"quantbridge"``, a JSON object: the recipe, the placement record, how the model was captured
  (input spec, dynamic dims, BN folding), whether BN was frozen, the training mode, per quantizer
  its state as data (``enabled``, the ``QState`` name and the moving-average statistics of a
  tracking quantizer), the model class, the quantbridge and torch versions and a SHA-256 of the
  tensors. Each quantizer's state is in the tensors too (its ``state`` buffer).

Format 1 (before quantizer states) wrote flags instead (``observing``, ``tracking``,
``learnable``, ``ema``) and a ``calibrated`` buffer: ``_state_from_flags`` reads them.

``load(path, model)`` captures the user's fresh ``model`` again from the recorded input spec,
re-places quantizers with the saved recipe, redoes ``freeze_batchnorm`` and ``make_learnable``
where the saved model had them, checks that the placement record matches the saved one (the first
mismatching quantizer is named), then loads the tensors with ``strict=True``. The result computes
bit-identical outputs. Every check runs before anything is returned; ``model`` is never modified.

Not saved: statistics of observers still calibrating (they observe afresh). Tensors load on CPU.

An ``EngineModel`` (the engine layer) has its own format; ``save``/``load`` hand it to the layer
that registered it in ``OTHER_FORMATS`` (``quantbridge.engine._checkpoint``).

Reading never runs code from the file: safetensors parses a JSON header and raw bytes; foreign
files are recognised by their pickle opcodes (``_checkpoint_foreign``) and refused with the
fix. ``torch.load`` cannot read a ``.qb`` file (its hint ``weights_only=False`` does not help):
use ``qb.load``, or ``safetensors.torch.load_file`` for the raw tensors.
``torch.save(qmodel.state_dict())`` + ``qmodel.load_state_dict`` works onto a QuantModel made the
same way; ``QuantModel.load_state_dict`` refuses a float state dict.
"""

from __future__ import annotations

import contextlib
import copy
import hashlib
import importlib
import json
import os
import stat
import warnings
from collections.abc import Callable

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from .._version import __version__
from ..recipe import Recipe
from ._batches import describe, inputs_from_spec
from ._checkpoint_foreign import foreign, foreign_or_corrupt
from ._errors import CheckpointError
from ._fakequant import QState, Quantizer
from ._model import QuantModel, keep_float_weight, kept_float_weights
from ._nodes import weight_of
from ._placement import CONTAINER
from ._qat import freeze_batchnorm
from ._quantize import prepare

FORMAT = "quantbridge"
FORMAT_VERSION = 2  # 2: quantizer states as data; 1: flags (read by _state_from_flags)
_PREFIX = CONTAINER + "."
_FLOAT = "_quantbridge_float_weight."  # + quantizer attribute: a float weight AdaRound kept
_HEADER_KEYS = {"recipe", "points", "capture", "quantizers", "sha256"}


# checkpoint formats of higher layers (the engine layer's "quantbridge-engine"), registered by
# them: format name -> (the type it saves, save(obj, path), load(path, model))
OTHER_FORMATS: dict[str, tuple[type, Callable, Callable]] = {}
# format name -> the module that registers it, imported on the first load of such a file (the
# package's ``__init__`` fills it: ``import quantbridge`` does not import the engine layer)
FORMAT_MODULES: dict[str, str] = {}


def _other_format(path: str | os.PathLike) -> str | None:
    """The safetensors ``format`` of ``path`` when a higher layer registered it, else None."""
    try:
        with safe_open(os.fspath(path), framework="pt", device="cpu") as f:
            fmt = (f.metadata() or {}).get("format")
    except (SafetensorError, OSError):
        return None
    if fmt in FORMAT_MODULES and fmt not in OTHER_FORMATS:
        importlib.import_module(FORMAT_MODULES[fmt])
    return fmt if fmt in OTHER_FORMATS else None


# -- save -----------------------------------------------------------------------------------------
def _mode_of_new_file(path: str | os.PathLike) -> int:
    """The permissions ``open(path, "w")`` would leave: the existing file's, else 0666 & ~umask."""
    try:
        return stat.S_IMODE(os.stat(path).st_mode)
    except FileNotFoundError:
        umask = os.umask(0)
        os.umask(umask)
        return 0o666 & ~umask


def save(qmodel: QuantModel, path: str | os.PathLike) -> None:
    """Write ``qmodel`` to ``path`` (one safetensors file; see the module docstring)."""
    for cls, save_other, _ in OTHER_FORMATS.values():
        if isinstance(qmodel, cls):
            return save_other(qmodel, path)
    if not isinstance(qmodel, QuantModel):
        raise TypeError(
            f"qb.save saves the QuantModel returned by quantbridge.quantize or prepare_qat, got a "
            f"{type(qmodel).__name__}; save a float model with torch.save(model.state_dict(), path)"
        )
    if not qmodel.qb_capture:
        raise ValueError(
            "this QuantModel does not record how it was captured, so it cannot be re-created on "
            "load; make it with quantbridge.quantize or prepare_qat"
        )
    path = _check_writable(path)
    kept = kept_float_weights(qmodel)  # AdaRound's float weights, for float_mode after load
    tensors = {
        k: v.detach().to("cpu", memory_format=torch.contiguous_format, copy=True)
        for k, v in (qmodel.state_dict() | {_FLOAT + a: w for a, (_, w) in kept.items()}).items()
    }
    header = {
        "recipe": qmodel.qb_recipe.to_dict(),
        "points": [p.to_dict() for p in qmodel.qb_points],
        "capture": qmodel.qb_capture,
        "bn_frozen": bool(qmodel.qb_bn_frozen),
        "training": qmodel.training,
        "quantizers": {a: _state(q) for a, q in getattr(qmodel, CONTAINER).named_children()},
        "model_class": _class_name(qmodel.__dict__.get("_qb_source")),
        "float_weights": {attr: name for attr, (name, _) in kept.items()},
        "versions": {"quantbridge": __version__, "torch": torch.__version__},
        "sha256": _digest(tensors),
    }
    text = json.dumps(header, sort_keys=True)
    metadata = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "quantbridge": text}
    tmp = f"{path}.tmp-{os.getpid()}"  # never leave a half-written file at ``path``
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.chmod(tmp, _mode_of_new_file(path))  # safetensors' tmp file is 0600 whatever the umask
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def _state(q: nn.Module) -> dict:
    """A quantizer's state as data: enabled, its QState and a tracking quantizer's statistics."""
    record: dict = {"enabled": bool(q.enabled)}
    if isinstance(q, Quantizer):
        record["state"] = q.qstate.value
        tracker = q.tracker_state()  # float64 values: exact through JSON
        if tracker is not None:
            record["tracker"] = tracker
    return record


def _state_from_flags(record: dict) -> dict:
    """A format-1 record (flags) as a format-2 one: learnable > tracking > observing > frozen,
    the moving-average range ``ema = [lo, hi]`` as the tracker's statistics."""
    if "state" in record:
        return record
    if record.get("learnable"):
        state = QState.LEARNED
    elif record.get("tracking"):
        state = QState.TRACKING
    elif record.get("observing"):
        state = QState.CALIBRATING
    else:
        state = QState.FROZEN
    new = {"enabled": record.get("enabled", True), "state": state.value}
    if "ema" in record:
        lo, hi = record["ema"]
        new["tracker"] = {
            "method": "moving_average_minmax",
            "granularity": "per_tensor",
            "values_seen": 1,
            "min": lo,
            "max": hi,
            "batches": 1,
        }
    return new


def _class_name(model: nn.Module | None) -> str:
    return "" if model is None else f"{type(model).__module__}.{type(model).__qualname__}"


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for key in sorted(tensors):
        t = tensors[key]
        h.update(f"{key}|{t.dtype}|{list(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def _check_writable(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(f"cannot save to {path!r}: it is a directory; give a file name (m.qb)")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        raise ValueError(f"cannot save to {path!r}: folder {folder!r} does not exist; create it")
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise PermissionError(f"cannot save to {path!r}: not writable; choose a writable path")
    return path


# -- load -----------------------------------------------------------------------------------------
def load(path: str | os.PathLike, model: nn.Module | None = None) -> QuantModel:
    """The QuantModel saved at ``path``, re-created on ``model`` (a fresh instance of the user's
    class, left unchanged). Raises ``CheckpointError`` with the fix when that is not possible.

    A model imported from a quantized ONNX file is its own fresh instance: pass
    ``qb.import_onnx(file)`` (the tensors are loaded onto a copy of it). A checkpoint of a
    registered higher-layer format (an engine model) is loaded by its layer."""
    fmt = _other_format(path)
    if fmt is not None:
        return OTHER_FORMATS[fmt][2](path, model)
    if isinstance(model, QuantModel) and model.qb_capture.get("made_by") == "import_onnx":
        header, tensors = _read(os.fspath(path))
        qmodel = copy.deepcopy(model)
        _compare_points(header["points"], [p.to_dict() for p in qmodel.qb_points], header, model)
        _load_tensors(qmodel, header, tensors)
        return qmodel.train(bool(header.get("training", False)))
    header, tensors = _read(os.fspath(path))
    if isinstance(model, QuantModel) or not isinstance(model, nn.Module):
        raise TypeError(_needs_model(path, header, model))
    qmodel = _rebuild(header, model)
    _load_tensors(qmodel, header, tensors)
    return qmodel.train(bool(header.get("training", False)))


def _needs_model(path, header: dict, model) -> str:
    """What ``model=`` the checkpoint at ``path`` is loaded onto, by the class it was saved from."""
    saved = header.get("model_class") or "?"
    if header["capture"].get("made_by") == "import_onnx" or saved.endswith(".OnnxModule"):
        fresh = "qb.import_onnx('<the .onnx file it was made from>')"
    else:
        fresh = f"{saved.rpartition('.')[2]}() (a fresh {saved})"
    return (
        f"qb.load({os.fspath(path)!r}) re-creates the QuantModel on a fresh instance of the model "
        f"it was made from: pass model={fresh}; got {type(model).__name__}"
    )


def _read(path: str) -> tuple[dict, dict[str, torch.Tensor]]:
    if not os.path.isfile(path):
        raise FileNotFoundError(f"no checkpoint at {path!r}")
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            metadata, keys = f.metadata() or {}, list(f.keys())
            ours = metadata.get("format") == FORMAT
            if ours and _format_version(metadata, path) <= FORMAT_VERSION:
                tensors = {k: f.get_tensor(k) for k in keys}
    except SafetensorError as e:
        raise foreign_or_corrupt(path, e) from None
    if not ours:
        raise foreign(path, keys, "a safetensors file", "safetensors.torch.load_file(path)")
    try:
        header = json.loads(metadata["quantbridge"])
        missing = _HEADER_KEYS - set(header)
    except (KeyError, TypeError, ValueError) as e:
        missing = {str(e)}
    if missing:
        raise CheckpointError(f"{path!r} is corrupted: its header lacks {sorted(missing)}")
    if _digest(tensors) != header["sha256"]:
        raise CheckpointError(
            f"{path!r} is corrupted: its tensors do not match the checksum written by qb.save; "
            "save the model again or restore the file from a copy"
        )
    return header, tensors


def _format_version(metadata: dict, path: str) -> int:
    try:
        version = int(metadata.get("format_version", ""))
    except ValueError:
        raise CheckpointError(f"{path!r} is corrupted: no readable format_version") from None
    if version > FORMAT_VERSION:
        raise CheckpointError(
            f"{path!r} was written by a newer quantbridge (format {version}; this one reads "
            f"format {FORMAT_VERSION}); upgrade: pip install -U quantbridge"
        )
    return version


def _rebuild(header: dict, model: nn.Module) -> QuantModel:
    """Capture ``model`` again and place quantizers as the checkpoint's record says."""
    try:
        saved = dict(header["recipe"])
        # written before constants were quantized: their placement had none (the default is on)
        saved.setdefault("quantize_constants", False)
        recipe = Recipe.from_dict(saved)
        capture = header["capture"]
        args, kwargs = inputs_from_spec(capture["inputs"])
        dynamic, fold_bn = capture["dynamic"], capture["fold_bn"]
        separate = capture.get("separate_concats", [])  # older checkpoints: none
        smooth = {"smoothed": capture.get("smoothed")}  # SmoothQuant's divisions (torch.ptq)
        smooth["split"] = capture.get("split_ranges")  # the range-group split (torch.ptq)
        # older checkpoints: padding="same" convs were captured as such and stayed float
        smooth["explicit_padding"] = capture.get("explicit_padding", False)
        # older checkpoints: every pad had a quantizer of its own
        smooth["pads_on_grid"] = capture.get("pads_on_grid", False)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointError(f"the checkpoint's header is corrupted ({e!r})") from None
    saved_class, this_class = header.get("model_class", "?"), _class_name(model)
    try:
        with warnings.catch_warnings():  # a different model is reported below, by name
            warnings.simplefilter("ignore")
            qmodel = prepare(
                model, args, kwargs, recipe, dynamic, fold_bn, separate_concats=separate, **smooth
            )
    except Exception as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise CheckpointError(
            f"the checkpoint was made from a {saved_class} called with {describe(args, kwargs)}; "
            f"this {this_class} cannot be captured that way ({first}); pass a fresh instance of "
            "the class the checkpoint was saved from"
        ) from e
    if header.get("bn_frozen"):
        freeze_batchnorm(qmodel)
    _compare_points(header["points"], [p.to_dict() for p in qmodel.qb_points], header, model)
    return qmodel


def _compare_points(saved: list[dict], rebuilt: list[dict], header: dict, model) -> None:
    rebuilt = json.loads(json.dumps(rebuilt))  # the same normalisation as the saved record
    arch = "checkpoint was made with a different architecture"
    origin = f"(checkpoint from a {header.get('model_class', '?')}, this is a {_class_name(model)})"
    for ours, theirs in zip(saved, rebuilt, strict=False):
        if ours == theirs:
            continue
        name, field = ours["name"], next(k for k in ours if ours[k] != theirs.get(k))
        if (name, ours["kind"]) != (theirs["name"], theirs["kind"]):
            msg = f"{arch}: quantizer {name!r} in the checkpoint, {theirs['name']!r} in this model"
        elif field in ("scheme", "method"):
            diff = _scheme(ours[field], theirs[field]) if field == "scheme" else ""
            msg = (
                f"checkpoint was made with a different recipe for this model: quantizer {name!r}: "
                f"{field} {diff or f'{ours[field]} vs {theirs[field]}'} (checkpoint vs this "
                "model); the recipe's rules resolve differently here (layer names or types changed)"
            )
        else:
            msg = f"{arch}: quantizer {name!r}: {field} {ours[field]!r} vs {theirs[field]!r}"
        raise CheckpointError(f"{msg} {origin}; load it onto the model class it was saved from")
    if len(saved) != len(rebuilt):
        n = min(len(saved), len(rebuilt))
        only = (
            f"{saved[n]['name']!r} only in the checkpoint"
            if len(saved) > n
            else f"{rebuilt[n]['name']!r} only in this model"
        )
        raise CheckpointError(
            f"{arch}: {len(saved)} quantizers in the checkpoint, {len(rebuilt)} in this model, "
            f"{only} {origin}"
        )


def _scheme(a: dict, b: dict) -> str:
    bits_a, bits_b = (f"{'int' if s.get('signed') else 'uint'}{s.get('bits')}" for s in (a, b))
    key = next((k for k in a if a[k] != b.get(k)), "scheme")
    return f"{bits_a} vs {bits_b}" if bits_a != bits_b else f"{key}={a[key]} vs {b.get(key)}"


def _load_tensors(qmodel: QuantModel, header: dict, tensors: dict[str, torch.Tensor]) -> None:
    """States first (a learned quantizer's Parameters, so parameter/buffer kinds match), then a
    strict load."""
    records = {a: _state_from_flags(r) for a, r in header["quantizers"].items()}
    tensors = _tensors_from_format_1(tensors, records)
    floats = {k[len(_FLOAT) :]: tensors.pop(k) for k in list(tensors) if k.startswith(_FLOAT)}
    container = getattr(qmodel, CONTAINER)
    try:
        for attr, q in container.named_children():
            record = records.get(attr, {})
            q.enabled = bool(record.get("enabled", True))
            if isinstance(q, Quantizer) and "state" in record:
                # per-channel shapes follow on load (Quantizer._load_from_state_dict)
                q.restore_state(QState(record["state"]), record.get("tracker"))
    except (TypeError, ValueError) as e:
        raise CheckpointError(f"the checkpoint's quantizer states are corrupted ({e})") from None
    own = qmodel.state_dict()
    problem = None
    if own.keys() != tensors.keys():
        problem = (
            f"tensors missing from the checkpoint {sorted(own.keys() - tensors.keys())[:5]}, "
            f"not in this model {sorted(tensors.keys() - own.keys())[:5]}"
        )
    for key in own if problem is None else ():  # quantizers adapt their own shapes on load
        mine, theirs = own[key], tensors[key]
        if not key.startswith(_PREFIX) and (mine.shape, mine.dtype) != (theirs.shape, theirs.dtype):
            problem = (
                f"tensor {key!r} is {_describe(theirs)} in the checkpoint, {_describe(mine)} in "
                "this model"
            )
            break
    if problem is not None:
        raise CheckpointError(f"checkpoint was made with a different architecture: {problem}")
    qmodel.load_state_dict(tensors, strict=True)
    for attr, name in header.get("float_weights", {}).items():
        keep_float_weight(getattr(container, attr), weight_of(qmodel, name), floats[attr])


def _tensors_from_format_1(tensors: dict, records: dict) -> dict:
    """Format 1 kept a ``calibrated`` flag buffer per quantizer; format 2 its ``state`` code."""
    out = {}
    for key, value in tensors.items():
        head, _, leaf = key.rpartition(".")
        if key.startswith(_PREFIX) and leaf == "calibrated":
            state = records.get(head[len(_PREFIX) :], {}).get("state", QState.FROZEN.value)
            out[f"{head}.state"] = torch.tensor(QState(state).code, dtype=torch.uint8)
        else:
            out[key] = value
    return out


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"
