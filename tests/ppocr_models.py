"""The PP-OCR ONNX models the tests use, fetched the way a user can get them.

They ship inside the ``rapidocr-onnxruntime`` 1.4.4 wheel on PyPI (Apache-2.0; models by
PaddleOCR, exported with Paddle2ONNX, opset 12). ``ppocr_dir()`` returns a folder holding all
three, trying in order:

1. the cache, ``$QB_MODEL_CACHE/ppocr-1.4.4`` (default ``~/.cache/quantbridge/ppocr-1.4.4``);
2. ``pip download --no-deps rapidocr-onnxruntime==1.4.4`` into a temporary folder, the three
   ``.onnx`` files extracted into the cache (about 15 MB, once);
3. a shared copy next to the checkout, ``../shared/models/ppocr`` (machines without the registry).

Every file is checked against its SHA-256, so each source gives the same bytes. ``None`` when none
of them works; ``MISSING`` then says what was tried (the tests' skip reason).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

WHEEL = "rapidocr-onnxruntime==1.4.4"
SHA256 = {
    "ch_PP-OCRv4_det_infer.onnx": "d2a7720d45a54257208b1e13e36a8479894cb74155a5efe29462512d42f49da9",
    "ch_PP-OCRv4_rec_infer.onnx": "48fc40f24f6d2a207a2b1091d3437eb3cc3eb6b676dc3ef9c37384005483683b",
    "ch_ppocr_mobile_v2.0_cls_infer.onnx": (
        "e47acedf663230f8863ff1ab0e64dd2d82b838fceb5957146dab185a89d6215c"
    ),
}
SHARED = Path(__file__).resolve().parents[1] / ".." / "shared" / "models" / "ppocr"
MISSING: list[str] = []  # why each source failed, filled by ppocr_dir()


def cache_dir() -> Path:
    root = os.environ.get("QB_MODEL_CACHE") or Path.home() / ".cache" / "quantbridge"
    return Path(root) / "ppocr-1.4.4"


def _complete(folder: Path) -> bool:
    for name, digest in SHA256.items():
        path = folder / name
        if not path.is_file() or hashlib.sha256(path.read_bytes()).hexdigest() != digest:
            return False
    return True


def _download(target: Path) -> None:
    """The wheel from the package registry, its three models into ``target`` (atomically)."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", "-d", tmp, WHEEL]
        subprocess.run(cmd, check=True, capture_output=True, timeout=600)
        (wheel,) = Path(tmp).glob("*.whl")
        staging = Path(tmp) / "models"
        staging.mkdir()
        with zipfile.ZipFile(wheel) as archive:
            for name in SHA256:
                (staging / name).write_bytes(archive.read(f"rapidocr_onnxruntime/models/{name}"))
        if not _complete(staging):
            raise RuntimeError(f"{wheel.name}: the models differ from the pinned SHA-256")
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(staging, target, dirs_exist_ok=True)


_FOUND: list[Path | None] = []


def ppocr_dir() -> Path | None:
    """The folder with the three models (see the module docstring); looked up once."""
    if _FOUND:
        return _FOUND[0]
    cache = cache_dir()
    found = None
    if _complete(cache):
        found = cache
    else:
        try:
            _download(cache)
            found = cache if _complete(cache) else None
        except (OSError, subprocess.SubprocessError, RuntimeError, ValueError, KeyError) as e:
            detail = getattr(e, "stderr", b"") or b""
            MISSING.append(f"pip download {WHEEL} failed: {e} {detail.decode()[-200:]}".strip())
        if found is None and _complete(SHARED):
            found = SHARED.resolve()
        elif found is None:
            MISSING.append(f"no shared copy in {SHARED.resolve()}")
    _FOUND.append(found)
    return found


def skip_reason() -> str:
    return "PP-OCR models unavailable: " + "; ".join(MISSING)
