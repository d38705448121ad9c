"""torchlib's translation registry for the export fast path, built per operator on first lookup.

``ONNXRegistry.from_torchlib`` (torch 2.13) builds an entry for each of onnxscript's ~2000
torchlib functions, and each entry infers the function's ONNX signature, which parses the
function's Python source (``OnnxFunction.function_ir``): 27.7 s of a 63.9 s ResNet-18-style
export (cProfile, 2 cores at load 9), more than the trace. Fresh processes, ResNet-18-style at
64x64, alternating: export 34.7 / 36.5 s with ``from_torchlib``, 24.0 / 25.5 s with this (0.69x,
0.70x; load 13-18), the same file byte for byte.
A graph uses a dozen operators. ``LazyRegistry`` gives the same entries, in the same order,
filtered by opset the same way, for the operators looked up only: torch's own torchlib entries
(built at its import) first, then onnxscript's, the highest ``opset_introduced`` not above the
target opset kept; custom translations (``register_op``) first, as torch sorts them.
``tests/onnx/test_lazy_registry.py`` holds it to ``from_torchlib`` entry by entry.
"""

from __future__ import annotations

from typing import Any

import torch


def lazy_registry(opset: int) -> Any:
    """An ``ONNXRegistry`` for ``opset`` whose torchlib entries are built on first lookup."""
    from torch.onnx._internal.exporter import _registration
    from torch.onnx._internal.exporter._torchlib import _torchlib_registry

    class LazyRegistry(_registration.ONNXRegistry):
        def __init__(self) -> None:
            super().__init__()
            self._opset_version = opset
            self._torch_metas = _by_key(_torchlib_registry.get_torchlib_ops())
            self._onnxscript = _onnxscript_functions()
            self._built: set = set()

        def get_decomps(self, target):
            key = _key(target)
            if key not in self._built:
                self._built.add(key)
                found = self._torchlib_entries(key)
                if found:
                    self.functions.setdefault(key, []).extend(found)
            return super().get_decomps(target)

        def _torchlib_entries(self, key) -> list:
            metas = list(self._torch_metas.get(key, ()))
            for name, function, is_complex in self._onnxscript.get(key, ()):
                try:  # from_torchlib skips an entry whose signature cannot be made
                    meta = _registration.OnnxDecompMeta(
                        onnx_function=function,
                        fx_target=_registration._get_overload(name),
                        signature=None,
                        is_custom=False,
                        is_complex=is_complex,
                    )
                except Exception:
                    continue
                metas.append(meta)
            metas = [m for m in metas if m.opset_introduced <= self._opset_version]
            if not metas:
                return []
            newest = max(m.opset_introduced for m in metas)
            return [m for m in metas if m.opset_introduced == newest]

    return LazyRegistry()


def _key(target: Any) -> Any:
    """The registry's key for a target: an OpOverload's qualified name, else the callable."""
    return target.name() if isinstance(target, torch._ops.OpOverload) else target


def _by_key(metas) -> dict:
    found: dict = {}
    for meta in metas:
        found.setdefault(_key(meta.fx_target), []).append(meta)
    return found


def _onnxscript_functions() -> dict:
    """Registry key -> [(qualified name, function, is_complex)] of onnxscript's torchlib, in
    ``from_torchlib``'s order (overloads, then complex overloads), without their signatures."""
    from onnxscript.function_libs.torch_lib import ops  # noqa: F401  (registers the functions)
    from onnxscript.function_libs.torch_lib.registration import default_registry
    from torch.onnx._internal.exporter import _registration

    found: dict = {}
    for name, overloaded in default_registry.items():
        if name.startswith("internal::"):
            continue
        target = _registration._get_overload(name)
        if target is None:
            continue
        entries = found.setdefault(_key(target), [])
        entries += [(name, f, False) for f in overloaded.overloads]
        entries += [(name, f, True) for f in overloaded.complex]
    return found
