"""The captured graph's input guards, failing with a message that names the input and the fix.

``torch.export`` puts a ``_guards_fn`` module at the top of every captured graph: it asserts
what the capture assumed of the inputs. Its failure is an ``AssertionError`` in torch's words
(``Guard failed: scale == 2.0``, ``Guard failed: x.size()[0] == 2``) raised from generated code.
``CallGuards`` wraps it in a ``QuantModel`` and turns that into a ``ValueError``:

* a guard on a captured input (a python scalar specialised to its calibration value, a size the
  capture fixed): the input, its value and the captured one (``_pickling.InputGuards``' checks);
* a guard the model's own code made (``x.tolist()``, ``int(x.size(0))`` or a Python branch on a
  size made the capture assume that size): torch's condition, what causes it and the fix.

Pickling replaces the wrapper by ``InputGuards`` (``_pickling``), as it replaces torch's module.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import nn

from ._pickling import InputGuards

GUARDS = "_guards_fn"


class CallGuards(nn.Module):
    """``guards`` (torch's ``_guards_fn``) with its failures explained; see the module docstring."""

    def __init__(self, guards: nn.Module, owner: torch.fx.GraphModule):
        super().__init__()
        self.guards = guards
        self.__dict__["_owner"] = weakref.ref(owner)  # its graph is read on failure

    def forward(self, *args: Any) -> Any:
        try:
            return self.guards(*args)
        except AssertionError as e:
            text = str(e).strip()
            if not text.startswith("Guard failed"):
                raise
            condition = text.removeprefix("Guard failed:").strip()
            cause = (
                "forward turned a size or value of its inputs into a Python number when it was "
                "captured (x.tolist(), int(x.size(0)), .item() in a Python condition, a Python "
                "branch on a size), and the graph keeps that number. Call it with inputs like the "
                "calibration batches, or keep that computation in tensor ops (torch.where, "
                "x.shape[0] without int())"
            )
            owner = self._owner()
            try:  # names a captured input and its captured value or size
                if owner is not None:
                    InputGuards.of_graph(owner.graph, {})(*args)
            except ValueError as named:
                if "python scalar" in str(named):
                    raise named from None
                raise ValueError(f"{named}: {cause}") from None
            raise ValueError(
                f"this call does not meet the captured model's condition {condition!r}: {cause}"
            ) from None


def wrap_guards(model: torch.fx.GraphModule) -> None:
    """Wrap ``model``'s ``_guards_fn`` in ``CallGuards`` owned by ``model`` (a copy's wrapper,
    made by ``copy.deepcopy``, is re-owned); no-op where there is none or it is ``InputGuards``."""
    guards = model._modules.get(GUARDS)
    if isinstance(guards, CallGuards):
        guards = guards.guards
    if guards is not None and not isinstance(guards, InputGuards):
        model._modules[GUARDS] = CallGuards(guards, model)
