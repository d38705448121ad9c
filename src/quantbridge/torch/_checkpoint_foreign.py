"""Files that ``qb.load`` is given by mistake: a ``torch.save`` file or state dict, a float
safetensors checkpoint, any other pickle, a truncated file. Each is recognised without running
anything from it (``pickletools.genops`` decodes opcodes, never executes) and refused with the
fix (``CheckpointError``)."""

from __future__ import annotations

import contextlib
import io
import pickletools
import zipfile

from ._errors import CheckpointError
from ._placement import CONTAINER

_PREFIX = CONTAINER + "."
_SCAN_LIMIT = 16 << 20  # bytes of a foreign pickle scanned for its strings


def foreign_or_corrupt(path: str, error: Exception) -> CheckpointError:
    strings = _pickle_strings(path)
    if strings is None:
        return CheckpointError(
            f"{path!r} is truncated or corrupted, or not a checkpoint ({error}); "
            "save the model again with qb.save"
        )
    if any("_rebuild_tensor" in s or s.startswith(_PREFIX) for s in strings):
        return foreign(path, strings, "a torch.save file", "torch.load(path, weights_only=True)")
    return CheckpointError(
        f"refused {path!r}: it is a pickle file, not a qb.save checkpoint; quantbridge never "
        "unpickles a file (unpickling can run code from it). Load checkpoints written by qb.save"
    )


def foreign(path: str, keys, what: str, read: str) -> CheckpointError:
    if any(k.startswith(_PREFIX) for k in keys):
        return CheckpointError(
            f"{path!r} is {what} holding a QuantModel state_dict without the recipe and placement "
            "qb.load needs: re-create the QuantModel the way you made it (qb.quantize or "
            f"qb.prepare_qat) and call qmodel.load_state_dict({read}); qb.save writes a "
            "self-contained file"
        )
    return CheckpointError(
        f"this is a float checkpoint ({path!r} is {what}, with no quantizer state), not a "
        f"quantbridge one: load it with model.load_state_dict({read}), then qb.quantize(model, "
        "calib_data)"
    )


def _pickle_strings(path: str) -> set[str] | None:
    """Strings in a torch.save zip archive or a raw pickle, by ``pickletools.genops`` (decodes
    opcodes, executes nothing); None when the file is neither."""
    with open(path, "rb") as f:
        raw = f.read(_SCAN_LIMIT)
    if zipfile.is_zipfile(path):  # torch.save's format: the pickle is <archive>/data.pkl
        with contextlib.suppress(Exception), zipfile.ZipFile(path) as z:
            raw = b""
            name = next(n for n in z.namelist() if n.endswith("data.pkl"))
            with z.open(name) as member:
                raw = member.read(_SCAN_LIMIT)
    elif not raw.startswith(b"\x80"):  # pickle protocol 2+ opens with PROTO
        return None
    strings, stream = set(), io.BytesIO(raw)
    with contextlib.suppress(Exception):  # stops at the first byte that is not an opcode
        while stream.tell() < len(raw):
            strings.update(a for _, a, _ in pickletools.genops(stream) if isinstance(a, str))
    return strings
