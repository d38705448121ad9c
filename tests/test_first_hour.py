"""Issue 13, the first hour of a new user: each test is a call as a user makes it, asserting on the
one-line message or the result they get.

Part 10 (a self-contained repository): the PP-OCR models come from the package registry, the test
extra holds every engine the tests use, the README links only files in the repository, ``qb.save``
honours the umask, ``python -m bench --help`` speaks to users.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from ppocr_models import SHA256, ppocr_dir, skip_reason
from torch import nn

import quantbridge as qb

ROOT = Path(__file__).resolve().parents[1]


def _linear_qmodel() -> qb.QuantModel:
    return qb.quantize(nn.Sequential(nn.Linear(4, 4)).eval(), [torch.randn(2, 4)], progress=False)


# -- part 10 ---------------------------------------------------------------------------------------
def test_ppocr_models_are_found_without_the_shared_folder():
    folder = ppocr_dir()
    assert folder is not None, skip_reason()
    assert sorted(p.name for p in folder.glob("*.onnx")) == sorted(SHA256)


@pytest.mark.parametrize("umask, expected", [(0o022, 0o644), (0o027, 0o640), (0o077, 0o600)])
def test_save_writes_with_the_users_umask(tmp_path, umask, expected):
    qmodel = _linear_qmodel()
    old = os.umask(umask)
    try:
        qb.save(qmodel, tmp_path / "model.qb")
    finally:
        os.umask(old)
    assert oct((tmp_path / "model.qb").stat().st_mode & 0o777) == oct(expected)


def test_save_over_an_existing_file_keeps_its_permissions(tmp_path):
    path = tmp_path / "model.qb"
    path.write_bytes(b"")
    path.chmod(0o664)
    qb.save(_linear_qmodel(), path)
    assert oct(path.stat().st_mode & 0o777) == oct(0o664)


def test_readme_links_only_files_in_the_repository():
    text = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#]+)\)", text) + re.findall(r"`(\.\./[^`]+)`", text)
    local = [t for t in targets if "://" not in t]
    assert local, "the README links no local file"
    for target in local:
        path = (ROOT / target).resolve()
        assert path.is_relative_to(ROOT) and path.exists(), f"README links {target}"


def test_test_extra_has_every_engine_the_tests_import():
    text = (ROOT / "pyproject.toml").read_text()  # no tomllib on Python 3.10
    block = re.search(r"^test = \[(.*?)^\]", text, re.M | re.S).group(1)
    names = set(re.findall(r'^\s*"([A-Za-z0-9_.-]+)', block, re.M))
    assert {"openvino", "pillow", "hypothesis", "scikit-learn"} <= names


def test_bench_help_describes_itself():
    out = subprocess.run(
        [sys.executable, "-m", "bench", "--help"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    ).stdout
    assert "quantbridge side by side with ONNX Runtime and PyTorch" in out
    assert not re.search(r"issue|#\d", out), out
