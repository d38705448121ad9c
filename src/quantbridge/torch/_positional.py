"""Positional calls of a model captured from keyword inputs, bound by the user's ``forward``.

A model quantized from dict batches (``{"input_ids": ..., "attention_mask": ...}``) is captured
with keyword inputs only: its graph's call has no positional parameters, or has them in the
dict's order. The user's own model takes ``model(ids, mask)`` and binds it by ``forward``'s
parameter order; so do the QuantModel (``_signature.check_call``) and the engine model
(``engine._signature``), through ``to_capture_layout``:

* the call is bound to the user's ``forward`` (``parameters``: its names, kinds and defaults,
  ``forward_parameters``) as Python would bind it;
* the inputs the capture took positionally stay positional, every other one becomes a keyword;
* a parameter the capture did not take is dropped where it holds its default (``past_key_values=
  None`` passed positionally to reach ``attention_mask``), else refused naming it.

Refused as ambiguous, with the fix (call with keywords): positional inputs reaching a
``*args`` parameter, whose names the signature does not give.
"""

from __future__ import annotations

import inspect
import json
from typing import Any

_NO_DEFAULT = object()
_POSITIONAL = ("POSITIONAL_ONLY", "POSITIONAL_OR_KEYWORD")


def forward_parameters(forward: Any) -> list[list] | None:
    """``[[name, kind, default], ...]`` of ``forward`` (kinds by ``inspect.Parameter`` name;
    ``default``: ``{"constant": value}`` for a JSON value, ``{"constant_repr": repr}`` for
    another, ``{}`` for none). None when Python cannot read the signature."""
    try:
        params = inspect.signature(forward).parameters.values()
    except (TypeError, ValueError):
        return None
    out = []
    for p in params:
        if p.default is inspect.Parameter.empty:
            default: dict = {}
        else:
            try:
                json.dumps(p.default)
                default = {"constant": p.default}
            except (TypeError, ValueError):
                default = {"constant_repr": repr(p.default)}
        out.append([p.name, p.kind.name, default])
    return out


def _signature(parameters: list[list]) -> inspect.Signature:
    kinds = {kind.name: kind for kind in type(inspect.Parameter.POSITIONAL_ONLY)}
    empty = inspect.Parameter.empty
    return inspect.Signature(
        [
            inspect.Parameter(name, kinds[kind], default=_NO_DEFAULT if default else empty)
            for name, kind, default in parameters
        ]
    )


def is_default(value: Any, default: dict) -> bool:
    """Whether ``value`` is the recorded default (plain values only; a tensor never is)."""
    if "constant" not in default:
        return False
    want = default["constant"]
    if value is None or want is None:
        return value is want
    return type(value) is type(want) and value == want


def to_capture_layout(
    parameters: list[list], n_args: int, names: list[str], args: tuple, kwargs: dict
) -> tuple[tuple, dict] | None:
    """``(args, kwargs)`` in the capture's layout (``n_args`` positional inputs, then the keyword
    ``names``) for a call with more positional inputs than the capture took, bound by the user's
    ``forward`` ``parameters`` (``forward_parameters``); None when the call has no more
    positional inputs than the capture (nothing to map). TypeError, naming ``forward`` and the
    fix, for a call ``forward`` refuses, an ambiguous one (``*args``) and an input the capture
    did not take."""
    if len(args) <= n_args:
        return None
    signature = _signature(parameters)
    shown = f"forward{_shown(parameters)}"
    try:
        bound = signature.bind(*args, **kwargs).arguments
    except TypeError as e:
        raise TypeError(f"bad call of {shown}: {e}") from None
    var = next((n for n, k, _ in parameters if k == "VAR_POSITIONAL"), None)
    if var is not None and bound.get(var):
        raise TypeError(
            f"{shown} takes *{var}, so positional inputs cannot be matched to the keyword inputs "
            f"{names} the model was captured with; call it with keywords: model(**batch)"
        )
    order = [n for n, k, _ in parameters if k in _POSITIONAL]
    positional = order[:n_args]
    missing = [n for n in positional if n not in bound]
    if missing:
        raise TypeError(f"{shown}: missing input {missing[0]!r}")
    defaults = {n: d for n, _, d in parameters}
    kinds = {n: k for n, k, _ in parameters}
    out: dict = {}
    for name, value in bound.items():
        if name in positional:
            continue
        if kinds[name] == "VAR_KEYWORD":
            out.update(value)
        elif name in names:
            out[name] = value
        elif not is_default(value, defaults[name]):
            raise TypeError(
                f"input {name!r} ({shown}) was not part of the captured call, whose keyword "
                f"inputs are {names}; pass {name}={default_text(defaults[name])} or "
                "leave it out, or quantize with batches that include it"
            )
    rank = {n: i for i, n in enumerate(names)}  # the capture's keyword order (torch.export's)
    ordered = dict(sorted(out.items(), key=lambda kv: rank.get(kv[0], len(rank))))
    return tuple(bound[n] for n in positional), ordered


def default_text(default: dict) -> str:
    if "constant" in default:
        return repr(default["constant"])
    return default.get("constant_repr", "its default")


def _shown(parameters: list[list]) -> str:
    marks = {"VAR_POSITIONAL": "*", "VAR_KEYWORD": "**"}
    return "(" + ", ".join(marks.get(k, "") + n for n, k, _ in parameters) + ")"
