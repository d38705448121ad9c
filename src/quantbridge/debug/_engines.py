"""The engines ``compare`` runs, in a registry keyed by name; each captures the model's
quantized intermediate tensors (its "sites", ``_match``) as real values.

An engine is built on a ``Subject`` and a list of sites and returns ``{site name: float64
array}`` from ``run(feeds)``; integer codes are dequantized with the site's own scale and zero
point (``r = scale * (q - zero_point)``, ``numerics.dequantize``).

* ``torch-float``  the torch model with its quantizers bypassed (``float_mode``); for an ONNX
  file, the ``import_onnx`` model of it (its weights are the file's dequantized integers); a
  plain float module gives its outputs only;
* ``torch-quant``  the ``QuantModel`` (fake-quant), or ``import_onnx`` of the quantized file;
* ``ort-ref``      ONNX Runtime with graph optimizations off: the node-by-node reference;
* ``ort``          ONNX Runtime with all optimizations (the fused int8 kernels users run);
* ``ort-qop``      ONNX Runtime on ``fold(model)`` (QLinearConv, QGemm, ...);
* ``openvino``     OpenVINO CPU on the QDQ model;
* ``integer``      the numpy executor of ``lower(model)`` (integer-only program).

ONNX engines capture a site by making it a graph output. Only quantized tensors are exposed, the
outputs of QuantizeLinear: ORT's QDQ fusion produces them under the same name (a fused
``QLinearConv`` writes the Q output), so the optimized session still runs the int8 kernels
(``tests/debug/test_engines.py`` counts them in the optimized model).
"""

from __future__ import annotations

import copy
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnx
import onnxruntime as ort
import torch

from ..engine._backends import make_session
from ..engine._signature import CallSignature
from ..integer import lower
from ..numerics import dequantize
from ..onnx import fold, import_onnx
from ..onnx.exporter import SIGNATURE_KEY
from ..onnx.passes._openvino import openvino_crash_site
from ..torch import QuantModel, float_mode
from ..torch._record import CONTAINER
from ._match import Site, has_weight_only_weights, match_names, match_sources
from ._match_torch import match_quantizers, quantizer_scales, recorded_calls
from ._subject import Subject, torch_args

Values = dict[str, np.ndarray]


def _real(codes: np.ndarray, site: Site) -> np.ndarray:
    if site.scale is None:
        return np.asarray(codes, dtype=np.float64)
    return _dequantize64(codes, site.scale, site.zero_point)


def _dequantize64(codes: np.ndarray, scale: float, zero_point: int) -> np.ndarray:
    """``numerics.dequantize`` in float64 (codes given as float64): two engines' codes then
    differ by exactly ``k * scale`` and the LSB error is an integer up to float64 rounding."""
    return np.asarray(dequantize(np.asarray(codes, np.float64), scale, zero_point))


def _graph_names(model: onnx.ModelProto) -> set[str]:
    return {o for n in model.graph.node for o in n.output} | {i.name for i in model.graph.input}


class OnnxCapture:
    """An ONNX session (ORT or OpenVINO) on a copy of the model whose sites are graph outputs."""

    def __init__(
        self,
        model: onnx.ModelProto,
        sites: list[Site],
        engine: str,
        options: dict,
        float_pairs: dict[str, tuple[str, str]] | None = None,
    ):
        model = copy.deepcopy(model)
        names = _graph_names(model)
        float_model = not any(s.quantized and s.name in names for s in sites)
        float_model = float_model and not has_weight_only_weights(model)  # weight-only: by name
        if float_model and float_pairs is not None:  # paired by name and structure
            self.where = {s: t for s, (t, _) in float_pairs.items() if t in names}
        elif float_model:  # a float file: the float tensor each QuantizeLinear reads
            self.where = match_sources(sites, names)
        else:
            self.where = match_names(sites, names)
        by_name = {s.name: s for s in sites}
        # a per-channel site (no single step) is read as its DequantizeLinear's real values
        self.real = {
            s for s, t in self.where.items()
            if not float_model and by_name[s].scale is None and by_name[s].quantized
            and by_name[s].aliases and by_name[s].aliases[0] in names
        }  # fmt: skip
        for s in self.real:
            self.where[s] = by_name[s].aliases[0]
        outputs = {o.name for o in model.graph.output}
        scale_types = {i.name: i.data_type for i in model.graph.initializer}
        for site_name, tensor in self.where.items():
            if tensor not in outputs:
                site = by_name[site_name]
                elem = onnx.TensorProto.FLOAT if float_model else site.elem_type
                if site_name in self.real:  # DequantizeLinear's output: its scale's type
                    elem = scale_types.get(site.scale_init, onnx.TensorProto.FLOAT)
                model.graph.output.append(onnx.helper.make_tensor_value_info(tensor, elem, None))
                outputs.add(tensor)
        self.sites = {s: by_name[s] for s in self.where}
        self.float_model = float_model
        self.model = model  # the model the session runs (tests read its fused form)
        if engine == "openvino":
            _openvino_survives(model)
        self.session = make_session(engine, model.SerializeToString(), None, options)

    def run(self, feeds: dict[str, np.ndarray]) -> Values:
        out = dict(zip(self.session_names(), self.session.run(feeds), strict=True))
        if self.float_model:
            return {s: np.asarray(out[t], np.float64) for s, t in self.where.items()}
        return {
            s: np.asarray(out[t], np.float64) if s in self.real else _real(out[t], self.sites[s])
            for s, t in self.where.items()
        }

    def session_names(self) -> list[str]:
        if hasattr(self.session, "output_names"):
            return self.session.output_names
        return [o.get_any_name() for o in self.session.outputs]


def static_inputs(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> onnx.ModelProto:
    """A copy of ``model`` whose graph inputs have the feeds' shapes (lowering needs static
    sizes where an op averages or reshapes over a free dimension)."""
    model = copy.deepcopy(model)
    for v in model.graph.input:
        if v.name in feeds:
            dims = v.type.tensor_type.shape.dim
            for d, size in zip(dims, feeds[v.name].shape, strict=False):
                d.Clear()
                d.dim_value = int(size)
    return model


class IntegerCapture:
    """The integer program's numpy executor; sites through ``IntegerProgram.onnx_tensors``.
    The program is lowered for the shapes of the inputs compared."""

    def __init__(self, model: onnx.ModelProto, sites: list[Site], feeds: dict[str, np.ndarray]):
        self.program = lower(static_inputs(model, feeds))
        self.sites = sites
        self.outputs = {b.name for b in self.program.outputs}

    def run(self, feeds: dict[str, np.ndarray]) -> Values:
        env = self.program.run_integer(feeds)
        found: Values = {}
        for s in self.sites:
            t = self.program.onnx_tensors.get(s.name)
            if t is not None and s.quantized:
                qt = self.program.tensors[t]
                found[s.name] = _dequantize64(env[t], qt.scale, qt.zero_point)
        floats = [s for s in self.sites if not s.quantized and s.name in self.outputs]
        if floats:
            outs = self.program.run(feeds)
            found.update({s.name: np.asarray(outs[s.name], np.float64) for s in floats})
        return found


class TorchCapture:
    """A torch model; a QuantModel's quantizer outputs through forward hooks (first call), and
    the model outputs by position onto the ONNX graph outputs' sites."""

    def __init__(self, module, sites: list[Site], onnx_model: onnx.ModelProto, quant: bool):
        self.module, self.quant = module.eval(), quant
        self.names = _input_names(onnx_model)
        self.signature = _call_signature(onnx_model)
        # site -> (the quantizer attributes whose calls it is, which call in execution order)
        self.where: dict[str, tuple[tuple[str, ...], int]] = {}
        self.exact: dict[str, tuple[tuple[str, ...], int]] = {}  # the record's own pairing
        if isinstance(module, QuantModel):
            scales = quantizer_scales(onnx_model)
            self.where = match_quantizers(sites, module.qb_points, scales)
            self.exact = recorded_calls(sites, module.qb_points, onnx_model)
            self.where.update(self.exact)
        self.output_sites = _output_sites(onnx_model, sites)

    def run(self, feeds: dict[str, np.ndarray]) -> Values:
        container = getattr(self.module, CONTAINER, None)
        calls: dict[str, list[torch.Tensor]] = {}  # quantizer attribute -> its outputs, in order
        order: list[str] = []  # the attribute of each call, in execution order
        hooks = []
        for attr in {a for attrs, _ in self.where.values() for a in attrs}:

            def hook(mod, args, out, attr=attr):
                calls.setdefault(attr, []).append(out.detach())
                order.append(attr)

            hooks.append(getattr(container, attr).register_forward_hook(hook))
        try:
            if self.signature is not None:  # as the export was called: keywords, constants
                args, kwargs = self.signature.call_of(feeds)
            else:
                args, kwargs = torch_args(feeds, self.names), {}
            with torch.no_grad():
                if self.quant:
                    outs = self.module(*args, **kwargs)
                else:
                    with float_mode(self.module):
                        outs = self.module(*args, **kwargs)
        finally:
            for h in hooks:
                h.remove()
        # the calls of the quantizers sharing a scale initializer, in execution order
        merged: dict[tuple[str, ...], list[torch.Tensor]] = {}
        for attrs in {attrs for attrs, _ in self.where.values()}:
            seen = dict.fromkeys(attrs, 0)
            merged[attrs] = []
            for a in order:
                if a in seen:
                    merged[attrs].append(calls[a][seen[a]])
                    seen[a] += 1
        # the k-th call is the k-th site reading the scale initializer only where the counts
        # agree; else (an initializer the record does not trace to all of its quantizers) only
        # the first site of a single quantizer, the one the initializer is named after, is certain
        sites_of = Counter(attrs for attrs, _ in self.where.values())
        found = {
            site: merged[attrs][k]
            for site, (attrs, k) in self.where.items()
            if k < len(merged[attrs])
            and (
                site in self.exact
                or len(merged[attrs]) == sites_of[attrs]
                or (k == 0 and len(attrs) == 1)
            )
        }
        leaves = torch.utils._pytree.tree_leaves(outs)
        for site, leaf in zip(self.output_sites, leaves, strict=False):
            if site is not None and site not in found:
                found[site] = leaf.detach()
        return {k: v.double().numpy() for k, v in found.items()}


def _call_signature(model: onnx.ModelProto) -> CallSignature | None:
    """The call quantbridge's export recorded in ``model`` (GPT-2's ``use_cache=False``, keyword
    inputs), or None for a file without the record: its inputs go positionally, in graph order."""
    if not any(p.key == SIGNATURE_KEY for p in model.metadata_props):
        return None
    try:
        return CallSignature(model)
    except ValueError:  # an output type that cannot be imported: the positional call still works
        return None


def _input_names(model: onnx.ModelProto) -> list[str]:
    init = {i.name for i in model.graph.initializer}
    return [i.name for i in model.graph.input if i.name not in init]


def _output_sites(model: onnx.ModelProto, sites: list[Site]) -> list[str | None]:
    """For each graph output, the site holding its values (a DequantizeLinear output is its
    QuantizeLinear's site), or None."""
    owner = {a: s.name for s in sites for a in (s.name, *s.aliases)}
    return [owner.get(o.name) for o in model.graph.output]


@dataclass(frozen=True)
class EngineSpec:
    """An engine: the subject forms it runs, whether it computes in float, its factory."""

    forms: tuple[str, ...]
    build: Callable[[Subject, list[Site], onnx.ModelProto, dict[str, np.ndarray]], object]
    float_for: tuple[str, ...] = ()  # subject forms on which its results are float
    # optional engines (TensorRT) run by default only where present; asked for by name elsewhere,
    # they fail in the table with the reason
    available: Callable[[], bool] = lambda: True


def _ort(level: str):
    return lambda subj, sites, ref, feeds: OnnxCapture(
        subj.onnx,
        sites,
        "onnxruntime",
        {"optimization": level, "device": "cpu"},
        subj.float_pairs,
    )


def _tensorrt_providers() -> list[str]:
    return [p for p in ort.get_available_providers() if p == "TensorrtExecutionProvider"]


def _tensorrt(subj: Subject, sites: list[Site], ref: onnx.ModelProto, feeds: dict):
    if not _tensorrt_providers():
        raise RuntimeError(
            "skipped: TensorRT needs an NVIDIA GPU and an onnxruntime with the "
            "TensorrtExecutionProvider (pip install onnxruntime-gpu, with TensorRT installed); "
            f"this onnxruntime has {', '.join(ort.get_available_providers())}"
        )
    return OnnxCapture(
        subj.onnx, sites, "onnxruntime",
        {"providers": ["TensorrtExecutionProvider", "CUDAExecutionProvider"]},
    )  # fmt: skip


def _openvino(subj: Subject, sites: list[Site], ref: onnx.ModelProto, feeds: dict):
    return OnnxCapture(subj.onnx, sites, "openvino", {"device": "CPU"}, subj.float_pairs)


def _openvino_survives(model: onnx.ModelProto) -> None:
    """RuntimeError for a file OpenVINO 2026.4 dies on with a segmentation fault (HF DeiT, AST,
    YOLOS, DPT, TimeSformer exports with compare's extra outputs): a crash must be this engine's
    failure, not the end of ``compare``. The known pattern (``openvino_crash_site``) is refused
    at no cost; any other crash is caught by compiling in a child process first (about 1.5 s,
    ``QB_COMPARE_OPENVINO_CHILD=0`` skips it; the tests do, for the CI budget)."""
    site = openvino_crash_site(model)
    if site is not None:
        raise RuntimeError(  # short: compare shows the first 300 characters
            f"not run: OpenVINO 2026.4 segfaults compiling Concat {site!r} -> Q -> DQ -> Q (or "
            "Add of zeros -> Q); qb.openvino_layout(file) compiles (to_engine's OpenVINO layout)"
        )
    if os.environ.get("QB_COMPARE_OPENVINO_CHILD", "1") != "0":
        _compiles_in_child(model)


_PROBE = (
    "import io, sys, openvino as ov; c = ov.Core(); "
    "c.compile_model(ov.convert_model(io.BytesIO(sys.stdin.buffer.read())), 'CPU')"
)


def _compiles_in_child(model: onnx.ModelProto) -> None:
    """RuntimeError when compiling ``model`` in OpenVINO (CPU) kills a child process."""
    import signal
    import subprocess
    import sys

    data = model.SerializeToString()
    proc = subprocess.run(
        [sys.executable, "-c", _PROBE], input=data, capture_output=True, check=False
    )
    if proc.returncode < 0:  # killed by a signal; an ordinary error is raised in-process below
        name = signal.Signals(-proc.returncode).name
        raise RuntimeError(
            f"OpenVINO crashed compiling the file ({name}, signal {-proc.returncode}); try "
            "qb.openvino_layout(file), the layout qb.to_engine(..., 'openvino') uses"
        )


def _torch(quant: bool):
    def build(subj: Subject, sites: list[Site], ref: onnx.ModelProto, feeds: dict):
        model = subj.onnx if subj.onnx is not None else ref
        module = subj.torch
        if module is None:  # example inputs: files with free sizes besides the batch need them
            module = import_onnx(subj.onnx, example_inputs=torch_args(feeds, _input_names(model)))
        return TorchCapture(module, sites, model, quant)

    return build


ENGINES: dict[str, EngineSpec] = {
    "torch-float": EngineSpec(("qdq", "qop", "torch"), _torch(False), ("qdq", "qop", "torch")),
    "torch-quant": EngineSpec(("qdq", "qop"), _torch(True)),
    "ort-ref": EngineSpec(("qdq", "qop", "float"), _ort("disable"), ("float",)),
    "ort": EngineSpec(("qdq", "qop", "float"), _ort("all"), ("float",)),
    "ort-qop": EngineSpec(
        ("qdq",),
        lambda subj, sites, ref, feeds: OnnxCapture(
            fold(subj.onnx), sites, "onnxruntime", {"optimization": "all", "device": "cpu"}
        ),
    ),
    "openvino": EngineSpec(("qdq", "float"), _openvino, ("float",)),
    "integer": EngineSpec(
        ("qdq", "qop"), lambda subj, sites, ref, feeds: IntegerCapture(subj.onnx, sites, feeds)
    ),
    "tensorrt": EngineSpec(
        ("qdq",), _tensorrt, available=lambda: bool(_tensorrt_providers())
    ),  # ORT's TensorRT provider on the QDQ file (TensorRT reads explicit QDQ); GPU only
}


def subject_kind(subj: Subject) -> str:
    """The form an engine sees: the ONNX form, or 'torch' for a float torch module alone."""
    return subj.form or "torch"


def engine_spec(name: str) -> EngineSpec:
    """The registered engine ``name``; ValueError listing the known ones."""
    if name not in ENGINES:
        raise ValueError(f"unknown engine {name!r}; known engines: {', '.join(ENGINES)}")
    return ENGINES[name]
