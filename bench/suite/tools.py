"""The three INT8 quantizers side by side, each given the same calibration batches.

* ``ours``: ``qb.quantize`` (int8 preset: per-channel int8 symmetric narrow-range weights, uint8
  asymmetric activations) + ``qb.export`` (QDQ), run in ONNX Runtime / OpenVINO;
* ``ort``: ONNX Runtime's ``quantize_static`` on the float ONNX export, in its fastest x86 form
  (bench/forms_study): QDQ, ``ActivationType=QUInt8``, ``WeightType=QInt8``, ``per_channel=True``;
  no ``quant_pre_process`` (the float export is already shape-inferred and optimized);
* ``pytorch``: FX graph mode PTQ (``prepare_fx`` / ``convert_fx``), run by torch's own quantized
  CPU kernels (engine ``x86``). torch 2.13 still ships ``torch.ao.quantization.quantize_fx``
  (deprecated); PT2E (``quantize_pt2e``) has moved to torchao, which is not installed.

Calibration methods are matched by name: ``minmax``; ``percentile`` at the same percentile for
both (``PERCENTILE``, ONNX Runtime's default, which is finer than quantbridge's 99.99 default);
``entropy`` with each tool's own defaults (quantbridge: 8192-bin histogram; ONNX Runtime: 128
bins and 128 quantized bins, which leaves a single candidate window - the full range - so ORT's
default "entropy" is max-abs calibration). ``ENTROPY_2048`` is ONNX Runtime's KL search with
TensorRT's 2048 bins, reachable only around ``quantize_static`` (see ``_entropy_cache``).
PyTorch rows use their own observers (named in ``FX_QCONFIGS``).
"""

from __future__ import annotations

import tempfile
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from . import peer_prep

PERCENTILE = 99.999
METHODS = ("minmax", "percentile", "entropy")
ENTROPY_2048 = "entropy (2048 bins)"  # ONNX Runtime only: its entropy with TensorRT's bin count
# ORT's KL search at our resolution: 2048 histogram bins, 256 quantized bins over the window (as
# ours judges a uint8 window: quantbridge.calibrate, ENTROPY_NUM_BINS and num_quant_bins); ORT's
# 128 quantized bins are 64 levels per side of its symmetric window
ENTROPY_EQUAL = "entropy (2048 bins, 256 levels)"
FX_QCONFIGS = {
    "x86": "get_default_qconfig_mapping('x86'): HistogramObserver activations (reduce_range, "
    "7-bit), per-channel int8 weights",
    "minmax": "MinMaxObserver quint8 activations (full 8-bit), per-channel int8 symmetric weights",
}


# -- quantbridge --------------------------------------------------------------------------------
# figure 3's "default": what each tool's user gets with no options - ``qb.quantize`` with no
# recipe (the "default" preset) against ``quantize_static`` at its own defaults (QDQ, int8
# activations and weights, per-tensor, MinMax), both on the same calibration batches
DEFAULT = "default"
ORT_OWN_DEFAULTS = {"activation_type": "QInt8", "weight_type": "QInt8", "per_channel": False}


def ours_recipe(method: str, rules: tuple = ()):
    import quantbridge as qb

    base = qb.Recipe.preset("int8")
    options = (("percentile", PERCENTILE),) if method == "percentile" else ()
    return qb.Recipe(
        weights=base.weights,
        activations=qb.TensorRecipe(base.activations.scheme, method, options),
        rules=tuple(rules),
    )


def float_module(model):
    """``model`` itself, or the torch module ``qb.import_onnx`` makes of an ONNX file."""
    import quantbridge as qb

    return qb.import_onnx(model) if isinstance(model, (str, Path)) else model


def quantize_ours(
    model,
    calib: list,
    method: str | None,
    path: Path,
    example: Any,
    rules: tuple = (),
    recipe: Any = None,
) -> dict[str, float]:
    """(Import,) calibrate, freeze and export; seconds per step. ``model`` may be a float ONNX
    path: then the import is timed too (``import_s``), as ONNX Runtime's time starts from it.
    ``method`` None: ``recipe`` as given (None: ``qb.quantize``'s default)."""
    import quantbridge as qb

    t0 = time.perf_counter()
    model = float_module(model)
    t_import = time.perf_counter()
    if method is not None:
        recipe = ours_recipe(method, rules)
    kwargs = {} if recipe is None else {"recipe": recipe}
    qmodel = qb.quantize(model, calib, progress=False, **kwargs)
    t1 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qb.export(qmodel, path, example_inputs=example)
    t2 = time.perf_counter()
    seconds = {"calibrate_s": t1 - t_import, "export_s": t2 - t1, "total_s": t2 - t0}
    if t_import - t0 > 1e-3:
        seconds["import_s"] = t_import - t0
    return seconds


def quantize_ours_onnx(float_path: Path, calib_feeds: list, path: Path, recipe=None) -> dict:
    """``qb.quantize_onnx`` on the float file (import, calibrate, export, check), the path a user
    of an ONNX file takes (``quantbridge quantize``); ``recipe`` None: its default."""
    import quantbridge as qb

    calib = {k: np.concatenate([f[k] for f in calib_feeds]) for k in calib_feeds[0]}
    t0 = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qb.quantize_onnx(float_path, calib, path, recipe=recipe or "default", progress=False)
    return {"total_s": time.perf_counter() - t0}


# -- ONNX Runtime -------------------------------------------------------------------------------
class _Reader:
    """``CalibrationDataReader`` over a list of feed dicts (numpy arrays by input name)."""

    def __init__(self, feeds: list[dict[str, np.ndarray]]):
        self._it = iter(feeds)

    def get_next(self):
        return next(self._it, None)

    def rewind(self):  # not used by quantize_static; part of the protocol
        pass


def quantize_ort(
    float_path: Path,
    calib_feeds: list[dict[str, np.ndarray]],
    method: str,
    path: Path,
    nodes_to_exclude: tuple[str, ...] = (),
    settings: dict | None = None,
) -> dict[str, float]:
    """``quantize_static`` with the suite's x86 form (QDQ u8/s8 per-channel), or ``settings``
    overriding it: ``{"activation_type": "QInt8", "weight_type": "QInt8", "per_channel": False}``
    are ORT's own defaults; ``"preprocess": True`` runs ``quant_pre_process`` first (timed; with
    its documented fallbacks, ``pre_process``; where none runs the float file is quantized as is
    and the reason kept in ``preprocess_error``); ``"opset13": True`` with per-channel weights
    converts a file below opset 13 to opset 13 first (``opset``; figure 1 does, the cost figure
    does not need it), since ``quantize_static`` writes an ``axis`` that older opsets lack and
    ONNX Runtime then refuses the file;
    ``"num_quantized_bins"`` sets the KL search's resolution (with 2048 histogram bins);
    ``"op_types_to_quantize"`` limits the quantized op types; ``"reduce_range": True`` writes
    7-bit weights (ORT's documented setting for x86 CPUs without VNNI)."""
    import logging

    from onnxruntime.quantization import (
        CalibrationDataReader,
        CalibrationMethod,
        QuantFormat,
        QuantType,
        quantize_static,
    )

    class Reader(_Reader, CalibrationDataReader):
        pass

    calibrate_method = {
        "minmax": CalibrationMethod.MinMax,
        "percentile": CalibrationMethod.Percentile,
        "entropy": CalibrationMethod.Entropy,
        ENTROPY_2048: CalibrationMethod.Entropy,
        ENTROPY_EQUAL: CalibrationMethod.Entropy,
    }[method]
    s = {"activation_type": "QUInt8", "weight_type": "QInt8", "per_channel": True}
    s |= settings or {}
    extra = {"CalibPercentile": PERCENTILE} if method == "percentile" else {}
    logging.getLogger().setLevel(logging.ERROR)  # "please consider pre-processing" warnings
    t0 = time.perf_counter()
    info: dict = {}
    with tempfile.TemporaryDirectory(prefix="qb-bench-ort-") as tmp:
        source = Path(float_path)
        if s.get("preprocess"):
            info |= pre_process(float_path, Path(tmp) / "pre.onnx")
            if "preprocess" in info:
                source = Path(tmp) / "pre.onnx"
        if s["per_channel"] and s.get("opset13"):  # DequantizeLinear's axis: opset 13
            source, info = _per_channel_opset(source, Path(tmp) / "opset13.onnx", info)
        reader, cache = Reader(calib_feeds), None
        if method in (ENTROPY_2048, ENTROPY_EQUAL):
            bins = 128 if method == ENTROPY_2048 else s.get("num_quantized_bins", 256)
            cache, reader = _entropy_cache(source, reader, Path(tmp), bins), None
        quantize_static(
            str(source),
            str(path),
            reader,
            quant_format=QuantFormat.QDQ,
            activation_type=getattr(QuantType, s["activation_type"]),
            weight_type=getattr(QuantType, s["weight_type"]),
            per_channel=s["per_channel"],
            reduce_range=s.get("reduce_range", False),
            calibrate_method=calibrate_method,
            nodes_to_exclude=list(nodes_to_exclude),
            op_types_to_quantize=s.get("op_types_to_quantize"),
            extra_options=extra,
            calibration_cache_path=cache,
        )
    return {"total_s": time.perf_counter() - t0, **info}


def pre_process(src: Path, dst: Path, run=None) -> dict:
    """ONNX Runtime's ``quant_pre_process`` with the first of its documented options
    (``peer_prep.PRE_PROCESS_OPTIONS``) that runs; returns ``{"preprocess": options used}``, plus
    the first failure as ``preprocess_error`` (alone when none ran). ``run``: the pre-processing
    function (ONNX Runtime's by default). A failing symbolic shape inference leaves
    ``sym_shape_infer_temp.onnx`` in the working directory: removed unless it was there before."""
    if run is None:
        from onnxruntime.quantization.shape_inference import quant_pre_process as run
    leftover = Path("sym_shape_infer_temp.onnx")
    had_leftover = leftover.exists()
    info: dict = {}
    for options in peer_prep.PRE_PROCESS_OPTIONS:
        try:
            run(str(src), str(dst), **options)
        except Exception as e:  # documented as optional: its next documented option
            info.setdefault("preprocess_error", short_error(e))
            continue
        finally:
            if not had_leftover:
                leftover.unlink(missing_ok=True)
        info["preprocess"] = ", ".join(f"{k}={v}" for k, v in options.items()) or "defaults"
        break
    return info


def _per_channel_opset(source: Path, dst: Path, info: dict) -> tuple[Path, dict]:
    import onnx

    model = onnx.load(str(source))
    upgraded, old = peer_prep.upgrade_opset(model)
    if upgraded is model:
        return source, info
    onnx.save(upgraded, str(dst))
    return dst, {**info, "opset": f"{old} -> {peer_prep.default_opset(upgraded)}"}


def _entropy_cache(float_path: Path, reader, tmp: Path, num_quantized_bins: int = 128) -> Path:
    """ORT's entropy calibrator with TensorRT's 2048 histogram bins (128 quantized bins), its
    ranges handed to ``quantize_static`` through a calibration cache: ``quantize_static`` itself
    has no option for the bin count, and its default of 128 bins = 128 quantized bins leaves a
    single candidate window (the full range)."""
    from onnxruntime.quantization import CalibrationMethod
    from onnxruntime.quantization.calibrate import create_calibrator, save_tensors_data

    calibrator = create_calibrator(
        float_path,
        None,
        augmented_model_path=str(tmp / "augmented.onnx"),
        calibrate_method=CalibrationMethod.Entropy,
        extra_options={"num_bins": 2048, "num_quantized_bins": num_quantized_bins},
    )
    calibrator.collect_data(reader)
    cache = tmp / "ranges.json"
    save_tensors_data(calibrator.compute_data(), cache)
    return cache


# -- PyTorch FX ---------------------------------------------------------------------------------
def _fx_qconfig_mapping(kind: str):
    import torch
    from torch.ao.quantization import QConfig, QConfigMapping, get_default_qconfig_mapping
    from torch.ao.quantization.observer import MinMaxObserver, default_per_channel_weight_observer

    if kind == "x86":
        return get_default_qconfig_mapping("x86")
    qconfig = QConfig(
        activation=MinMaxObserver.with_args(dtype=torch.quint8, reduce_range=False),
        weight=default_per_channel_weight_observer,
    )
    return QConfigMapping().set_global(qconfig)


def quantize_fx(model, calib: list, kind: str):
    """FX PTQ of a copy of ``model``; returns (converted model, seconds)."""
    import copy

    import torch

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.ao.quantization.quantize_fx import convert_fx, prepare_fx

        torch.backends.quantized.engine = "x86"
        t0 = time.perf_counter()
        model = float_module(model)  # an ONNX path: qb.import_onnx, timed with FX
        first = calib[0]
        example = tuple(first.values()) if isinstance(first, dict) else (first,)
        try:
            prepared = prepare_fx(copy.deepcopy(model).eval(), _fx_qconfig_mapping(kind), example)
        except (TypeError, torch.fx.proxy.TraceError) as e:  # FX's limit, not the feeding
            raise RuntimeError(
                f"FX symbolic tracing cannot capture the model: {short_error(e)}"
            ) from e
        with torch.no_grad():
            for batch in calib:
                prepared(**batch) if isinstance(batch, dict) else prepared(batch)
        converted = convert_fx(prepared)
    return converted, time.perf_counter() - t0


def torch_outputs(model, batches: list) -> np.ndarray:
    import torch

    with torch.no_grad():
        outs = [model(**b) if isinstance(b, dict) else model(b) for b in batches]
    return np.concatenate([o.float().numpy() for o in outs])


def short_error(e: BaseException) -> str:
    """Type and the informative part of a message (OpenVINO's start with "Exception from"
    location lines; its cause is further down)."""
    lines = [ln.strip() for ln in str(e).strip().splitlines() if ln.strip()]
    useful = [ln for ln in lines if not ln.startswith("Exception from")] or lines
    text = " ".join(useful[:2])
    return f"{type(e).__name__}: {text[:300]}"
