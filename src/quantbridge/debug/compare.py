"""``compare``: the same inputs through every form of a quantized model, tensor by tensor, in
LSBs of each tensor's step; the first diverging tensor is the automatic bisection.

Runs are streamed: the reference engine's tensors are kept, every other engine runs in turn, is
measured against them and dropped, so memory holds two engines' tensors, not every engine's.
"""

from __future__ import annotations

import re
from collections import Counter
from typing import Any

import numpy as np
import onnx

from ..onnx._control_flow import refusal
from ..onnx._weight_only import int8_activation_products
from ..onnx.inspector import inspect_model
from ._classify import classify
from ._engines import ENGINES, Values, engine_spec, subject_kind
from ._gain import chain_values, conv_bound
from ._gain_norm import (
    attention_bound,
    l2_ratio_bound,
    masked_attention_bound,
    norm_bound,
    quotient_bound,
)
from ._gain_output import terms_bound
from ._match import (
    Site,
    find_sites,
    has_weight_only_weights,
    match_other_file,
    quantizer_sites,
)
from ._match_float import match_float_file
from ._metrics import tensor_metrics
from ._result import SCHEMA, CompareResult
from ._subject import Subject, array_inputs, feeds, load_subject, read_inputs

# preferred reference engines, best first (the node-by-node reference of the quantized file)
_REFERENCES = ("ort-ref", "integer", "ort", "ort-qop", "torch-quant", "openvino")
# with two models, each runs one engine by default: the first of these that runs its form
_PAIR_DEFAULTS = ("ort-ref", "torch-quant", "torch-float")


def _one_line(e: BaseException) -> str:
    """The error's first line; for OpenVINO's, whose first line is only the C++ location
    ("Exception from src/core/...cpp:298:"), its last line, which says what failed."""
    text = [line for line in str(e).strip().splitlines() if line.strip()]
    if len(text) > 1 and re.fullmatch(r"Exception from \S+:\d+:", text[0].strip()):
        text = text[-1:]
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


class _Run:
    """One engine on one subject: name, whether it is float, and how its names map to sites."""

    def __init__(self, name, engine: str, subject: Subject, sites, rename: dict[str, str]):
        self.name, self.engine, self.subject = name, engine, subject
        self.sites = sites  # the subject's own sites (the reference's for a float model)
        self.spec = ENGINES[engine]
        self.is_float = subject_kind(subject) in self.spec.float_for
        self.rename = rename  # the subject's site name -> reference site name

    def matched_by(self, site: str, ref_subj: Subject) -> str:
        """How this run's tensor was paired with the reference's site (the report's
        ``matched_by``)."""
        subj = self.subject
        if subj.float_pairs is not None:
            return subj.float_pairs[site][1]
        if subj is not ref_subj and subj.onnx is not None:
            return "name, else the QuantizeLinear's input or quantizer record"  # match_other_file
        if self.engine.startswith("torch"):
            return "placement record" if subj.onnx is not None else "output position"
        return "same file"


def _default_engines(kind: str, pair: bool) -> list[str]:
    """Every engine that runs the form; with two models, the first of ``_PAIR_DEFAULTS``."""
    usable = [e for e, s in ENGINES.items() if kind in s.forms and s.available()]
    if pair:
        usable = [e for e in _PAIR_DEFAULTS if e in usable][:1]
    return usable


def _plan(subjects, engines, sites, own_sites) -> tuple[list[_Run], dict[str, str]]:
    runs, errors = [], {}
    for subj in subjects:
        kind = subject_kind(subj)
        names = engines or _default_engines(kind, len(subjects) > 1)
        rename = {s.name: s.name for s in sites}
        subj_sites = own_sites.get(subj.tag, sites)
        if subj_sites is not sites:
            recorded = quantizer_sites(subj.onnx)
            rename = {v: k for k, v in match_other_file(sites, subj_sites, recorded).items()}
        for engine in names:
            spec = engine_spec(engine)
            name = engine if len(subjects) == 1 else f"{subj.tag}:{engine}"
            if kind not in spec.forms:
                errors[name] = f"does not run a {kind} model (runs {', '.join(spec.forms)})"
                continue
            runs.append(_Run(name, engine, subj, subj_sites, rename))
    return runs, errors


def _execute(run: _Run, ref_model, inputs: Any) -> Values:
    subj = run.subject
    model = subj.onnx if subj.onnx is not None else ref_model
    checked = feeds(model, inputs, subj.label)
    values = run.spec.build(subj, run.sites, ref_model, checked).run(checked)
    return {run.rename[k]: v for k, v in values.items() if k in run.rename}


def compare(
    a: Any,
    b: Any = None,
    *,
    inputs: Any,
    engines: list[str] | None = None,
    reference: str | None = None,
) -> CompareResult:
    """Run ``inputs`` through the engines and compare every quantized tensor with the reference.

    ``a`` / ``b``: ONNX paths or ``ModelProto`` (QDQ, QOperator or float), ``QuantModel``s or
    float torch modules; one of them must be quantized (its tensors are the ones compared).
    ``inputs``: a dict input name -> array, an ``.npz`` path, an array or a tuple of arrays.
    ``engines``: names from ``ENGINES`` (default: every engine that runs the model's form; with
    two models, ``ort-ref`` on each, ``torch-quant`` / ``torch-float`` for a torch model; runs
    are then named ``a:ort-ref``, ``b:ort-ref``).
    ``reference``: the run the others are measured against (default: ``ort-ref`` of the first
    quantized model). An engine that fails to load or run is reported in ``errors``; tensors an
    engine does not produce are reported in ``unmatched``; neither stops the others.
    """
    if engines is not None:
        for e in engines:
            engine_spec(e)
    data = read_inputs(inputs)
    subjects = [load_subject(a, "a", data)]
    if b is not None:
        subjects.append(load_subject(b, "b", data))
    data = array_inputs(data)  # plain values (use_cache=False) were for the QuantModels' export
    quantized = [s for s in subjects if s.quantized]
    for s in subjects if not quantized else ():
        why = refusal(s.onnx, "compare") if isinstance(s.onnx, onnx.ModelProto) else None
        if why:
            raise ValueError(f"{s.label}: {why}")
    if not quantized:
        raise ValueError(
            "compare needs a quantized model (QDQ or QOperator ONNX, or a QuantModel); got "
            + " and ".join(f"{s.label} ({subject_kind(s)})" for s in subjects)
        )
    ref_subj = quantized[0]
    own_sites = {s.tag: find_sites(s.onnx) for s in quantized}
    sites = own_sites[ref_subj.tag]
    for subj in subjects:  # a float file: its tensors paired with the sites by name and structure
        if subj.form == "float":
            subj.float_pairs = match_float_file(ref_subj.onnx, sites, subj.onnx)
    for subj in subjects:  # bad inputs are the user's error, not an engine's
        feeds(subj.onnx if subj.onnx is not None else ref_subj.onnx, data, subj.label)
    runs, errors = _plan(subjects, engines, sites, own_sites)
    ref_run = _pick_reference(runs, ref_subj, reference)
    ref_values = None
    for run in [ref_run] + [r for r in runs if r is not ref_run and r.subject is ref_subj]:
        try:
            ref_values = _execute(run, ref_subj.onnx, data)
            ref_run = run
            break
        except Exception as e:  # noqa: BLE001  (an engine's failure is reported, others go on)
            errors[run.name] = _one_line(e)
    if ref_values is None:
        raise RuntimeError(f"no engine could run {ref_subj.label}: {errors}")
    result = _measure(runs, ref_run, ref_values, sites, ref_subj, data, errors)
    result["models"] = [s.label for s in subjects]
    blocked = _group_wise_weights(ref_subj.onnx)
    if blocked:  # optional key: weight-only files have no activation grid to count LSBs on
        result["group_wise_weights"] = blocked
    int8_inputs = int8_activation_products(ref_subj.onnx) if ref_subj.onnx is not None else []
    if int8_inputs:  # optional key: where ONNX Runtime rounds a weight-only product's input
        result["int8_activation_products"] = int8_inputs
    return CompareResult(result)


def _group_wise_weights(model: onnx.ModelProto | None) -> list[str]:
    """``inspect``'s line for each group-wise (blocked) weight of ``model`` (bits, block size)."""
    if model is None or not has_weight_only_weights(model):
        return []
    return [w.describe() for w in inspect_model(model).weights if "per-block" in w.granularity]


def _pick_reference(runs: list[_Run], ref_subj: Subject, reference: str | None) -> _Run:
    own = [r for r in runs if r.subject is ref_subj and not r.is_float]
    if reference is not None:
        for r in runs:
            if r.name == reference:
                return r
        raise ValueError(f"reference {reference!r} is not a run; runs: {[r.name for r in runs]}")
    for name in _REFERENCES:
        for r in own:
            if r.engine == name:
                return r
    if not own:
        raise ValueError(f"no quantized engine runs {ref_subj.label}; give engines=[...]")
    return own[0]


def _measure(runs, ref_run, ref_values, sites, ref_subj, data, errors) -> dict[str, Any]:
    outputs = {o.name for o in ref_subj.onnx.graph.output}
    table = {
        s.name: {
            "name": s.name, "order": s.order, "op": s.op, "layer": s.layer, "scale": s.scale,
            "zero_point": s.zero_point if s.scale is not None else None,
            "output": next((n for n in (s.name, *s.aliases) if n in outputs), None),
            "pairs": [],
        }
        for s in sites
    }  # fmt: skip
    unmatched: dict[str, list[str]] = {}
    missing = [s.name for s in sites if s.name not in ref_values]
    if missing:
        unmatched[ref_run.name] = missing
    ran = [ref_run.name]
    uses = Counter(f for s in sites for f in s.factors)  # the products reading each site
    for run in runs:
        if run is ref_run or run.name in errors:
            continue
        try:
            values = _execute(run, ref_subj.onnx, data)
        except Exception as e:  # noqa: BLE001  (an engine's failure is reported, others go on)
            errors[run.name] = _one_line(e)
            continue
        ran.append(run.name)
        lost = []
        carried: dict[str, float] = {}  # site -> this pair's max_abs, for the sites after it
        diffs: dict[str, np.ndarray] = {}  # a product's factor -> this pair's differences
        factors = Counter(uses)  # products still to read each factor
        for s in sites:
            if s.name not in ref_values:
                continue
            if s.name not in values:
                lost.append(s.name)
                continue
            upstream = _carried(s, carried, diffs, ref_values)
            for f in s.factors:  # a factor's differences are dropped after its last product
                factors[f] -= 1
                if not factors[f]:
                    diffs.pop(f, None)
            b = values.pop(s.name)
            if factors.get(s.name) and b.shape == ref_values[s.name].shape:
                diffs[s.name] = b - ref_values[s.name]  # signed: a linear op carries its sign
            pair = _pair(ref_run, run, s, ref_values[s.name], b, upstream)
            if pair is None:
                lost.append(s.name)
            else:
                carried[s.name] = pair["max_abs"]
                pair["matched_by"] = run.matched_by(s.name, ref_subj)
                if run.subject.float_pairs is not None:
                    pair["float_tensor"] = run.subject.float_pairs[s.name][0]
                table[s.name]["pairs"].append(pair)
        if lost:
            unmatched[run.name] = lost
        del values
    return {
        "schema": SCHEMA,
        "models": [],
        "engines": ran,
        "reference": ref_run.name,
        "errors": errors,
        "unmatched": unmatched,
        "tensors": list(table.values()),
        "first_divergence": _first_divergence(table),
    }


class _MagnitudeView:
    """The pair's differences ``b - a`` of the factor sites, read as ``|b - a|`` (``view[f]``)
    by the bounds that take magnitudes, signed (``signed(f)``) by the linear ones."""

    def __init__(self, diffs: dict[str, np.ndarray]):
        self._diffs = diffs

    def __contains__(self, name: str) -> bool:
        return name in self._diffs

    def __getitem__(self, name: str) -> np.ndarray:
        return np.abs(self._diffs[name])

    def signed(self, name: str) -> np.ndarray:
        return self._diffs[name]


def _carried(s: Site, carried: dict, diffs: dict, ref_values: dict) -> float | np.ndarray:
    """The largest error ``s`` can carry from its input sites (``classify``'s ``carried``): a
    site times a constant ``c`` by ``|c|`` times its input's error, an elementwise chain of one
    site (GELU, SiLU, Sigmoid, Exp ...) by its slope bound over that site's codes (``_gain``)
    times it; an Add's two input errors add up (every op in between in ``UNIT_GAIN_OPS``); a
    product ``a * b`` of two sites differs by at most ``|da| |b| + |a| |db| + |da| |db|`` element
    by element (``a``, ``b`` the reference's values), a MatMul ``a @ b`` by the same with each
    product a matrix product (``|a @ b - a' @ b'| <= |da| @ |b| + |a| @ |db| + |da| @ |db|``);
    a Linear of one site by ``|dx @ W|``, a convolution by ``|conv(dx, W)|`` (``dx = b - a`` signed:
    a linear map carries the input difference exactly, ``conv(x_b, W) - conv(x_a, W) = conv(dx,
    W)``; returned element by element, an array, checked element by element in ``_pair``), a
    product or
    sum of two elementwise chains of one site each (``x * sigmoid(y)``) by the product's or the
    sum's bound with each chain's difference at most its slope times its site's (``_gain``);
    a LayerNormalization or Softmax of one site by its row-wise bound, an attention
    ``Softmax(q @ k) @ v`` of three sites by its composed bound (``_gain_norm``);
    other ops that may amplify an error get no credit."""
    if s.gain is not None and len(s.inputs) == 1:
        return carried.get(s.inputs[0], 0.0) * s.gain
    diffs = _MagnitudeView(diffs)  # |b - a| for every bound but the linear ones
    if s.chains is not None and all(f in diffs for f in s.factors):  # g(u) * h(v), g + h
        (g, h), (dg, dh) = (
            [
                chain_values(ref_values[f], table, grid)
                for f, (table, _, grid) in zip(s.factors, s.chains, strict=True)
            ],
            [diffs[f] * slope for f, (_, slope, _) in zip(s.factors, s.chains, strict=True)],
        )
        try:
            if s.combine == "Mul":
                bound = dg * np.abs(h) + np.abs(g) * dh + dg * dh
            else:
                bound = dg + dh
        except ValueError:  # shapes that do not broadcast: no credit
            return 0.0
        return float(bound.max()) if bound.size else 0.0
    if s.unit_gain:
        return sum(carried.get(i, 0.0) for i in s.inputs)
    if s.norm is not None and all(f in diffs for f in s.factors):  # layer norm, softmax ...
        values, dx = [ref_values[f] for f in s.factors], [diffs[f] for f in s.factors]
        try:
            if s.norm["op"] == "attention":  # Softmax(q @ k) @ v of three sites
                bound = attention_bound(values, dx, s.norm)
            elif s.norm["op"] == "masked_attention":  # Softmax(mask(s)) @ v of two sites
                bound = masked_attention_bound(values, dx, s.norm)
            elif s.norm["op"] == "l2_ratio":  # GRN's g / (mean g + eps): element by element
                bound = l2_ratio_bound(values[0], dx[0], s.norm)
                return bound if bound.size else 0.0
            elif s.norm["op"] == "centered_quotient":  # (x - mean x) / sqrt(v), two sites
                bound = quotient_bound(values, dx, s.norm)
            else:
                bound = norm_bound(values[0], dx[0], s.norm)
        except ValueError:  # shapes that do not fit: no credit
            return 0.0
        return float(bound.max()) if bound.size else 0.0
    if s.terms is not None and all(f in diffs for f in s.factors):  # (W1 x1 +- W2 x2) * c
        try:
            bound = terms_bound([diffs.signed(f) for f in s.factors], s.terms)
        except (ValueError, RuntimeError):  # shapes that do not fit: no credit
            return 0.0
        return bound if bound.size else 0.0
    if s.weight is not None and s.factors[0] in diffs:  # x @ W: |dx @ W|; |conv(dx, W)|
        dx = diffs.signed(s.factors[0])
        try:
            bound = np.abs(
                np.matmul(dx, s.weight) if s.conv is None else conv_bound(dx, s.weight, s.conv)
            )
        except (ValueError, RuntimeError):  # shapes that do not fit: no credit
            return 0.0
        return bound if bound.size else 0.0  # element by element (``_pair``)
    if s.factors and all(f in diffs for f in s.factors):
        (a, b), (da, db) = (ref_values[f] for f in s.factors), (diffs[f] for f in s.factors)
        mul = np.matmul if s.matmul else np.multiply  # a MatMul sums the products over k
        try:
            bound = mul(da, np.abs(b)) + mul(np.abs(a), db) + mul(da, db)
        except ValueError:  # shapes that do not broadcast: no credit
            return 0.0
        return float(bound.max()) if bound.size else 0.0
    return 0.0


def _pair(ref_run, run, site: Site, a, b, carried: float | np.ndarray) -> dict[str, Any] | None:
    if a.shape != b.shape:
        return None
    m = tensor_metrics(a, b, site.scale)
    if isinstance(carried, np.ndarray):
        carried = _credit(a, b, carried, m["max_abs"])
    peak = float(np.abs(a).max()) if a.size else 0.0
    m["carried_lsb"] = carried / site.scale if site.scale else None
    m["class"] = classify(
        m, a_float=ref_run.is_float, b_float=run.is_float, reference_peak=peak,
        carried=carried, scale=site.scale,
    )  # fmt: skip
    return {"a": ref_run.name, "b": run.name, **m}


def _credit(a: np.ndarray, b: np.ndarray, bound: np.ndarray, max_abs: float) -> float:
    """The per-tensor credit equivalent to ``bound``, a bound of the carried error element by
    element: ``max_abs - max_i(|b_i - a_i| - bound_i)``, so that ``classify``'s per-tensor rule
    ``max_abs <= carried + 1 step`` holds exactly when ``|b_i - a_i| <= bound_i + 1 step`` holds
    for every element. It is at most the bound at the element of the largest difference: an
    element far from the others' large differences gets no credit from them. A ``bound`` that
    does not broadcast to the tensor counts with its largest value everywhere."""
    if not bound.size:
        return 0.0
    try:
        excess = np.abs(np.asarray(b, np.float64) - a) - np.broadcast_to(bound, a.shape)
    except ValueError:
        return float(bound.max())
    return max_abs - float(excess.max()) if excess.size else 0.0


def _first_divergence(table: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    for t in sorted(table.values(), key=lambda t: t["order"]):
        bad = [p for p in t["pairs"] if p["class"] == "divergence"]
        if bad:
            worst = max(bad, key=lambda p: p["max_lsb"] if p["max_lsb"] is not None else 0.0)
            return {
                "name": t["name"], "order": t["order"], "layer": t["layer"], "a": worst["a"],
                "b": worst["b"], "max_lsb": worst["max_lsb"], "max_abs": worst["max_abs"],
                "carried_lsb": worst.get("carried_lsb"),
            }  # fmt: skip
    return None
