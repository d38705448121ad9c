"""A file whose recorded output type is registered with pytree only when its own module loads
(Hugging Face imports its model modules lazily and registers each ``ModelOutput`` class then)
loads in a process that has not imported that module: ``_load_spec`` imports the type's module,
not only its package. Importing ``transformers`` alone left
``DeiTForImageClassificationWithTeacherOutput`` / ``DepthEstimatorOutput`` unregistered, and
``to_engine`` / ``compare`` failed on the sweep's DeiT and DPT files (session 13).

Here a package of our own stands for transformers (an allowed output package), with the output
type in a sub-module its ``__init__`` does not import: no transformers import, in-process."""

from __future__ import annotations

import sys

import torch
import torch.utils._pytree as pytree

from quantbridge.engine import _signature

_SUB = """
import torch.utils._pytree as pytree


class Out:
    def __init__(self, depth):
        self.depth = depth


pytree.register_pytree_node(
    Out,
    lambda o: ([o.depth], None),
    lambda values, _: Out(*values),
    serialized_type_name="qblazypkg.outputs.Out",
)
"""


def test_the_output_types_module_is_imported_before_deserializing(tmp_path, monkeypatch):
    package = tmp_path / "qblazypkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "outputs.py").write_text(_SUB)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(_signature, "_OUTPUT_PACKAGES", ("qblazypkg",))
    # the spec text, written with the type registered once under its serialized name
    stand_in = type("Out", (), {"__init__": lambda self, depth: setattr(self, "depth", depth)})
    pytree.register_pytree_node(
        stand_in,
        lambda o: ([o.depth], None),
        lambda values, _: stand_in(*values),
        serialized_type_name="qblazypkg.outputs.Out",
    )
    try:
        text = pytree.treespec_dumps(pytree.tree_structure(stand_in(torch.zeros(1))))
    finally:
        pytree._deregister_pytree_node(stand_in)
    assert "qblazypkg.outputs" not in sys.modules
    try:
        spec = _signature._load_spec(text)
        assert spec.type.__module__ == "qblazypkg.outputs" and spec.type.__name__ == "Out"
    finally:
        if "qblazypkg.outputs" in sys.modules:
            pytree._deregister_pytree_node(sys.modules["qblazypkg.outputs"].Out)
        for name in ("qblazypkg.outputs", "qblazypkg"):
            sys.modules.pop(name, None)
