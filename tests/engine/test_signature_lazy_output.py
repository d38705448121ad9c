"""A file whose recorded output is a Hugging Face ``ModelOutput`` subclass loads in a fresh
process: transformers imports its model modules lazily and registers a ``ModelOutput`` class with
pytree only when its module loads, so importing ``transformers`` alone left
``DeiTForImageClassificationWithTeacherOutput`` / ``DepthEstimatorOutput`` unregistered and
``to_engine`` / ``compare`` failed on DeiT and DPT files (session 13 sweep)."""

from __future__ import annotations

import subprocess
import sys

import pytest

pytest.importorskip("transformers")

_CODE = """
import sys
from quantbridge.engine._signature import _load_spec
assert "transformers.models.dpt.modeling_dpt" not in sys.modules
spec = _load_spec(sys.argv[1])
print(spec.type.__name__)
"""


def test_a_lazily_imported_model_output_type_loads():
    import torch
    import torch.utils._pytree as pytree
    from transformers.modeling_outputs import DepthEstimatorOutput

    out = DepthEstimatorOutput(predicted_depth=torch.zeros(1))
    text = pytree.treespec_dumps(pytree.tree_structure(out))
    proc = subprocess.run(
        [sys.executable, "-c", _CODE, text], capture_output=True, text=True, check=False
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == "DepthEstimatorOutput"
