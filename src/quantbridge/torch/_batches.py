"""Calibration data as users have it, turned into ``(args, kwargs)`` calls of the model.

A batch is one of:

* a ``torch.Tensor`` - the model's single positional input;
* a ``tuple`` or ``list`` - positional inputs;
* a ``dict`` (or a Hugging Face ``BatchEncoding``, a Mapping) - keyword inputs.

A ``DataLoader`` yielding ``(inputs, labels)`` works through ``transform=lambda b: b[0]`` (as NNCF's
``transform_fn``); a ``forward_loop(model)`` callable (as ModelOpt's) may drive the model itself.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch.utils._pytree import tree_flatten


def as_call(batch: Any, index: int | str) -> tuple[tuple, dict]:
    """One calibration batch (``index``: its number) or one named example (``index``: the
    argument's name, ``"example_inputs"``) as ``(args, kwargs)``; TypeError naming it otherwise."""
    what = f"calibration batch {index}" if isinstance(index, int) else index
    if isinstance(batch, torch.Tensor):
        return (batch,), {}
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    if isinstance(batch, Mapping):
        return (), dict(batch)
    if isinstance(batch, np.ndarray):
        each = " for each batch, or transform=torch.from_numpy" if isinstance(index, int) else ""
        raise TypeError(
            f"{what} is a numpy array {batch.dtype}{list(batch.shape)}; pass "
            f"torch tensors: torch.from_numpy(a){each}"
        )
    loader = (
        ". For a DataLoader of (inputs, labels) pass transform=lambda batch: batch[0]"
        if isinstance(index, int)
        else ": one batch as the model takes it, e.g. example_inputs=x"
    )
    raise TypeError(
        f"{what} is a {type(batch).__name__}; expected a tensor (one input), "
        f"a tuple (positional inputs) or a dict (keyword inputs){loader}"
    )


def iter_calls(
    data: Iterable, transform: Callable | None, limit: int | None
) -> Iterator[tuple[int, tuple, dict]]:
    if data is None:
        raise ValueError(
            "calibration data is missing: pass an iterable of batches or forward_loop="
        )
    if isinstance(data, np.ndarray):
        raise TypeError(
            "calib_data must be an iterable of batches (a list or a DataLoader), not a single "
            f"numpy array {data.dtype}{list(data.shape)}; pass [torch.from_numpy(a)], or a list "
            "of such tensors, one per batch"
        )
    if isinstance(data, (torch.Tensor, Mapping)):
        raise TypeError(
            "calib_data must be an iterable of batches (a list or a DataLoader), not a single "
            f"{type(data).__name__}; wrap it: [batch]"
        )
    if isinstance(data, (str, bytes, os.PathLike)):
        raise TypeError(
            f"calib_data is a path ({os.fspath(data)!r}); quantize takes the batches themselves: "
            "load them first (a list of tensors, or a DataLoader); the command line's "
            "'quantbridge quantize' and qb.quantize_onnx read .npz files"
        )
    if not isinstance(data, Iterable):
        raise TypeError(
            f"calib_data must be an iterable of batches (a list or a DataLoader), got "
            f"{type(data).__name__}"
        )
    if limit is not None and (isinstance(limit, bool) or not isinstance(limit, int) or limit < 1):
        raise ValueError(f"max_batches={limit!r}: give a positive int, or None for every batch")
    for i, batch in enumerate(data):
        if limit is not None and i >= limit:
            return
        if transform is not None:
            batch = transform(batch)
        args, kwargs = as_call(batch, i)
        yield i, args, kwargs


def describe(args: tuple, kwargs: dict) -> str:
    def one(t: Any) -> str:
        if isinstance(t, torch.Tensor):
            return f"{str(t.dtype).replace('torch.', '')}{list(t.shape)}"
        return type(t).__name__

    parts = [one(a) for a in args] + [f"{k}={one(v)}" for k, v in kwargs.items()]
    return "(" + ", ".join(parts) + ")"


def nonfinite_source(args: tuple, kwargs: dict) -> str:
    """What to say after "observer got non-finite values" during calibration: the batch's input
    holding NaN / inf (the data is to blame), else that the batch is finite, so the model (or its
    capture) computed them: ModernBERT's fully masked attention rows gave NaN in the decomposed
    attention while the float model's own output was finite (``_sdpa``)."""
    leaves, _ = torch.utils._pytree.tree_flatten_with_path((args, kwargs))
    for path, t in leaves:
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not t.isfinite().all():
            top = path[1]  # positional index or keyword name, then the place inside it
            where = repr(getattr(top, "key", getattr(top, "idx", top)))
            where += torch.utils._pytree.keystr(path[2:])
            return f"; the batch's input {where} holds NaN / inf: clean the calibration data"
    return (
        "; the batch's inputs are all finite, so the model computed these values from finite "
        "data: if the float model's own output on this batch is finite, quantbridge's captured "
        "graph computes differently from the model here: please report it with the model; "
        "otherwise the model itself produces them (0 / 0, log(0), an overflow)"
    )


def input_spec(args: tuple, kwargs: dict) -> dict:
    """JSON-able description of a model call (shapes, dtypes, plain values) to re-create it."""

    def one(x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return {"tensor": {"shape": list(x.shape), "dtype": str(x.dtype).replace("torch.", "")}}
        if x is None or isinstance(x, (bool, int, float, str)):
            return {"value": x}
        if isinstance(x, (list, tuple)):  # forward(self, xs) given a list of tensors
            return {type(x).__name__: [one(v) for v in x]}
        if isinstance(x, dict) and all(isinstance(k, str) for k in x):
            return {"dict": {k: one(v) for k, v in x.items()}}
        raise TypeError(
            f"cannot record a model input of type {type(x).__name__}: an input is a tensor, a "
            "Python number, string or None, or a list, tuple or str-keyed dict of them; wrap the "
            "model so that forward takes those"
        )

    return {"args": [one(a) for a in args], "kwargs": {k: one(v) for k, v in kwargs.items()}}


def inputs_from_spec(spec: dict) -> tuple[tuple, dict]:
    """Zero-filled inputs matching ``input_spec`` (enough to capture the model again)."""

    def one(d: dict) -> Any:
        if "tensor" in d:
            t = d["tensor"]
            return torch.zeros(t["shape"], dtype=getattr(torch, t["dtype"]))
        if "list" in d or "tuple" in d:
            items = [one(v) for v in d.get("list", d.get("tuple"))]
            return items if "list" in d else tuple(items)
        if "dict" in d:
            return {k: one(v) for k, v in d["dict"].items()}
        return d["value"]

    return tuple(one(a) for a in spec["args"]), {k: one(v) for k, v in spec["kwargs"].items()}


def check_like(args: tuple, kwargs: dict, ref_args: tuple, ref_kwargs: dict, index: int) -> None:
    """Same structure, dtypes and ranks as the batch the model was captured with."""
    flat, spec = tree_flatten((args, kwargs))
    ref_flat, ref_spec = tree_flatten((ref_args, ref_kwargs))
    problem = None
    if spec != ref_spec:
        problem = "has a different structure"
    else:
        for a, r in zip(flat, ref_flat, strict=False):
            if isinstance(r, torch.Tensor) and (
                not isinstance(a, torch.Tensor) or a.dtype != r.dtype or a.ndim != r.ndim
            ):
                problem = "has a different dtype or rank"
                break
    if problem:
        raise ValueError(
            f"calibration batch {index} {describe(args, kwargs)} {problem} than the first batch "
            f"{describe(ref_args, ref_kwargs)} the model was captured with; make every batch "
            "look alike (same inputs, dtypes and number of dimensions)"
        )
