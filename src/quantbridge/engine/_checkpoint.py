"""Save and load an ``EngineModel``: ONNX bytes and the signature in one safetensors file.

``qb.save(fast, "m.qb")`` (dispatched here by ``quantbridge.torch._checkpoint``) writes

* tensors: ``onnx.int8`` and/or ``onnx.fp32``, each the serialized ONNX model as a uint8 tensor
  (the float form of a QuantModel is exported now if it was not built yet, so the loaded model
  keeps its float/INT8 switch). The call signature lives inside each ONNX file's metadata;
* metadata: ``format = "quantbridge-engine"``, ``format_version = "1"`` and, under
  ``"quantbridge"``, JSON: the engine, threads, engine options, the form in use, the class of
  the model it was made from, the quantized form's layout (``layout``; absent in files written
  before it existed, read as None), versions and a SHA-256 per form.

``qb.load(path)`` refuses, with ``CheckpointError`` and the fix, a file from a newer format, a
form whose bytes do not match their checksum, a header without its keys, and a ``model=`` of a
different class than the one the engine model was made from (``model`` is only checked: the
graph holds everything). Nothing is unpickled: safetensors reads a JSON header and raw bytes.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os

import numpy as np
import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from .._version import __version__
from ..torch._checkpoint import OTHER_FORMATS, CheckpointError
from ._model import FLOAT, QUANTIZED, EngineModel

FORMAT = "quantbridge-engine"
FORMAT_VERSION = 1
_KEYS = {QUANTIZED: "onnx.int8", FLOAT: "onnx.fp32"}
_HEADER_KEYS = {"engine", "threads", "options", "quantized", "source_class", "sha256"}


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def save(model: EngineModel, path: str | os.PathLike) -> None:
    """Write ``model`` to ``path`` (see the module docstring)."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    if os.path.isdir(path) or not os.path.isdir(folder):
        raise ValueError(f"cannot save to {path!r}: give a file name in an existing folder")
    try:
        json.dumps(model.options)
    except (TypeError, ValueError):
        raise TypeError(
            f"cannot save engine options {model.options!r}: only JSON values (str, int, lists, "
            "dicts) can be stored; pass the others again after qb.load"
        ) from None
    forms = {q: model.onnx_bytes(q) for q in (QUANTIZED, FLOAT) if q in model._forms}
    tensors = {
        _KEYS[q]: torch.from_numpy(np.frombuffer(data, dtype=np.uint8).copy())
        for q, data in forms.items()
    }
    header = {
        "engine": model.engine,
        "threads": model.threads,
        "options": model.options,
        "quantized": model.quantized,
        "source_class": model.source_class,
        "layout": model.layout,
        "versions": {"quantbridge": __version__, "torch": torch.__version__},
        "sha256": {_KEYS[q]: _sha(data) for q, data in forms.items()},
    }
    metadata = {
        "format": FORMAT,
        "format_version": str(FORMAT_VERSION),
        "quantbridge": json.dumps(header, sort_keys=True),
    }
    tmp = f"{path}.tmp-{os.getpid()}"  # never leave a half-written file at ``path``
    try:
        save_file(tensors, tmp, metadata=metadata)
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)


def load(path: str | os.PathLike, model: nn.Module | None = None) -> EngineModel:
    """The ``EngineModel`` saved at ``path`` (see the module docstring)."""
    path = os.fspath(path)
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            version = metadata.get("format_version", "")
            if not version.isdigit() or int(version) > FORMAT_VERSION:
                raise CheckpointError(
                    f"{path!r} is an engine model of format {version!r}; this quantbridge reads "
                    f"format {FORMAT_VERSION}: pip install -U quantbridge"
                )
            forms = {
                q: f.get_tensor(k).numpy().tobytes() for q, k in _KEYS.items() if k in f.keys()
            }
    except SafetensorError as e:
        raise CheckpointError(f"{path!r} is truncated or corrupted ({e}); save it again") from None
    try:
        header = json.loads(metadata["quantbridge"])
        missing = sorted(_HEADER_KEYS - set(header))
    except (KeyError, TypeError, ValueError) as e:
        missing = [str(e)]
    if missing or not forms:
        raise CheckpointError(f"{path!r} is corrupted: its header lacks {missing or 'forms'}")
    for q, data in forms.items():
        if _sha(data) != header["sha256"].get(_KEYS[q]):
            raise CheckpointError(
                f"{path!r} is corrupted: {_KEYS[q]} does not match the checksum written by "
                "qb.save; save the engine model again or restore the file from a copy"
            )
    saved_class = header["source_class"]
    if model is not None and saved_class and type(model).__qualname__ != saved_class:
        raise CheckpointError(
            f"{path!r} is an engine model made from a {saved_class}, not a "
            f"{type(model).__qualname__}; load it with qb.load(path) (it needs no model), or "
            "load the checkpoint that belongs to this model"
        )
    return EngineModel(
        forms,
        header["engine"],
        header["threads"],
        header["options"],
        bool(header["quantized"]),
        saved_class,
        header.get("layout"),
    )


OTHER_FORMATS[FORMAT] = (EngineModel, save, load)
