"""The engines an ``EngineModel`` runs on, in a registry keyed by engine name.

Each entry builds a session from serialized ONNX bytes and runs it on a dict of numpy arrays,
returning the graph outputs in graph order. Sessions know nothing of torch or of the user's call
signature (``_signature`` does that).

* ``onnxruntime``: CPU, or CUDA where ``CUDAExecutionProvider`` is available (``device="auto"``,
  the default; ``"cpu"`` / ``"cuda"`` / ``"cuda:N"`` to choose, in any case, or a ``torch.device``). ``threads`` sets intra-op threads;
  ``providers=[...]`` passes an explicit provider list; ``optimization="all"|"extended"|"basic"|
  "disable"`` the graph optimization level (default: all, as ORT's own default, less the one
  rewrite in ``_ORT_DISABLED_OPTIMIZERS``); ``config={}`` adds session config entries
  (``{"session.intra_op.allow_spinning": "0"}``).
* ``openvino``: ``device="CPU"`` (any OpenVINO device name, in any case), ``threads`` sets
  ``INFERENCE_NUM_THREADS``, ``hint="LATENCY"|"THROUGHPUT"`` the performance hint; ``config={}``
  adds raw OpenVINO properties. On CPU and GPU the float arithmetic runs in float32
  (``INFERENCE_PRECISION_HINT="f32"``): OpenVINO's own default there is bf16 on CPUs with
  AVX512_BF16 / AMX and f16 on GPUs, which would make ``precision="fp32"`` untrue and add bf16
  rounding to the float ops between an INT8 model's integer ones (measured on an AVX512_BF16 EPYC:
  the fp32 form 2.7% off torch, 4.5% of an INT8 model's outputs a step off ONNX Runtime's);
  ``config={"INFERENCE_PRECISION_HINT": "bf16"}`` asks for it.

An engine that is not installed raises ``ImportError`` naming the pip extra that installs it.
"""

from __future__ import annotations

import importlib
import io
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

# engine name -> (module to import, pip extra that installs it)
_PACKAGES = {"onnxruntime": ("onnxruntime", "quantbridge"), "openvino": ("openvino", "openvino")}
_ORT_LEVELS = {
    "all": "ORT_ENABLE_ALL",
    "extended": "ORT_ENABLE_EXTENDED",
    "basic": "ORT_ENABLE_BASIC",
    "disable": "ORT_DISABLE_ALL",
}
# ORT graph rewrites that change what an exported QDQ graph computes, turned off in every session.
# DoubleQDQPairsRemover (basic level) replaces Q(s1,z1) -> DQ -> Q(s2,z2) -> DQ by ONE pair whose
# scale and zero point it derives from the intersection of the two ranges: a grid that is neither
# s1 nor s2 (onnxruntime/core/optimizer/double_qdq_pairs_remover.cc). Our exports hold such a
# requantization where a quantized tensor goes through a value-preserving op (a transpose, a
# same-dtype type_as) into the shared quantizer of a rotary embedding's rotate_half (Gemma3, Phi3):
# measured with ORT 1.32 on tiny random Gemma3 / Phi3, ORT's default session was 27.5 / 32.1 dB
# from the QuantModel, and exact (333 dB) with this rewrite off. Pairs of equal scales, which
# it leaves as they were, lose nothing to it being off (ORT runs the second Q/DQ in float).
_ORT_DISABLED_OPTIMIZERS = ("DoubleQDQPairsRemover",)


def _import(engine: str):
    module, extra = _PACKAGES[engine]
    try:
        return importlib.import_module(module)
    except ImportError as e:
        install = (
            "pip install quantbridge"
            if extra == "quantbridge"
            else (f"pip install 'quantbridge[{extra}]'")
        )
        raise ImportError(f"engine {engine!r} needs the {module} package: {install}") from e


def _check_options(engine: str, options: dict, known: tuple[str, ...]) -> None:
    unknown = sorted(set(options) - set(known))
    if unknown:
        raise TypeError(
            f"engine {engine!r} has no option {unknown[0]!r}; its options are {', '.join(known)}"
        )


class OrtSession:
    """An ONNX Runtime ``InferenceSession`` on the model bytes."""

    engine = "onnxruntime"
    OPTIONS = ("device", "providers", "optimization", "config")

    def __init__(self, model: bytes, threads: int | None, options: dict):
        ort = _import(self.engine)
        _check_options(self.engine, options, self.OPTIONS)
        so = ort.SessionOptions()
        level = options.get("optimization", "all")
        if level not in _ORT_LEVELS:
            raise ValueError(f"optimization={level!r}: use one of {sorted(_ORT_LEVELS)}")
        so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, _ORT_LEVELS[level])
        if threads is not None:
            so.intra_op_num_threads = int(threads)
            so.inter_op_num_threads = 1
        for key, value in (options.get("config") or {}).items():
            so.add_session_config_entry(str(key), str(value))
        providers = options.get("providers") or self._providers(ort, options.get("device", "auto"))
        self.session = ort.InferenceSession(
            model, so, providers=list(providers), disabled_optimizers=list(_ORT_DISABLED_OPTIMIZERS)
        )
        self.device = "cuda" if self.session.get_providers()[0].startswith("CUDA") else "cpu"
        self.output_names = [o.name for o in self.session.get_outputs()]

    @staticmethod
    def _providers(ort, device: str) -> list:
        device = ort_device(device)
        available = ort.get_available_providers()
        cuda = "CUDAExecutionProvider" in available
        if device.startswith("cuda") and not cuda:
            raise ValueError(
                f"device={device!r}: this onnxruntime has no CUDAExecutionProvider (it has "
                f"{', '.join(available)}); pip install onnxruntime-gpu, or use device='cpu'"
            )
        if device.startswith("cuda:"):
            index = int(device.partition(":")[2])
            return [("CUDAExecutionProvider", {"device_id": index}), "CPUExecutionProvider"]
        if device == "cuda" or (device == "auto" and cuda):
            return ["CUDAExecutionProvider", "CPUExecutionProvider"]
        return ["CPUExecutionProvider"]

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        return self.session.run(self.output_names, feeds)


class OpenVinoSession:
    """An OpenVINO compiled model on the model bytes (ONNX front end, in memory)."""

    engine = "openvino"
    OPTIONS = ("device", "hint", "config")

    def __init__(self, model: bytes, threads: int | None, options: dict):
        ov = _import(self.engine)
        _check_options(self.engine, options, self.OPTIONS)
        self.device = openvino_device(options.get("device", "CPU"))
        config = {"PERFORMANCE_HINT": str(options.get("hint", "LATENCY"))}
        base = self.device.split(":")[0].split(".")[0]
        if base in ("CPU", "GPU"):  # float32 as the file says, not the device's bf16 / f16
            config["INFERENCE_PRECISION_HINT"] = "f32"
        if threads is not None:
            config["INFERENCE_NUM_THREADS"] = int(threads)
        config.update(options.get("config") or {})
        core = ov.Core()
        seen = {d.split(".")[0] for d in core.available_devices}
        if base not in seen | {"AUTO", "MULTI", "HETERO", "BATCH"}:
            raise ValueError(
                f"device={self.device!r}: OpenVINO sees {', '.join(core.available_devices)}"
            )
        compiled = core.compile_model(ov.convert_model(io.BytesIO(model)), self.device, config)
        self.outputs = list(compiled.outputs)
        self.request = compiled.create_infer_request()
        self.lock = threading.Lock()  # one infer request: calls from several threads take turns

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        with self.lock:
            result = self.request.infer(feeds, share_inputs=True, share_outputs=False)
            return [np.asarray(result[o]) for o in self.outputs]


def ort_device(device: Any) -> str:
    """ONNX Runtime's ``device`` as ``"auto"``, ``"cpu"``, ``"cuda"`` or ``"cuda:N"``, from any
    spelling torch users write (``"CPU"``, ``"cuda:0"``, ``torch.device("cpu")``)."""
    text = str(device).strip().lower()
    base, colon, index = text.partition(":")
    if base == "cuda" and colon and index.isdigit():
        return f"cuda:{int(index)}"
    if text not in ("auto", "cpu", "cuda"):
        raise ValueError(f"device={device!r}: use 'auto', 'cpu' or 'cuda' (or 'cuda:N')")
    return text


def openvino_device(device: Any) -> str:
    """OpenVINO's device name (``"CPU"``, ``"GPU.1"``, ``"AUTO:GPU,CPU"``: OpenVINO spells them in
    capitals) from any case or a ``torch.device``; CUDA is not an OpenVINO device."""
    text = str(device).strip().upper()
    if text.split(":")[0] == "CUDA":
        raise ValueError(
            f"device={device!r}: OpenVINO runs on Intel CPUs, GPUs and NPUs, not CUDA; use "
            "device='CPU' (or 'GPU' for an Intel GPU), or engine='onnxruntime' with device='cuda'"
        )
    return text


_DEVICES = {"onnxruntime": ort_device, "openvino": openvino_device}


def normalized_options(engine: str, options: dict) -> dict:
    """``options`` with ``device`` in the engine's own spelling (a ``torch.device`` becomes its
    string, so the options stay JSON for ``qb.save``); ValueError for a device it cannot be."""
    options = dict(options)
    if "device" in options:
        options["device"] = _DEVICES[engine_name(engine)](options["device"])
    return options


ENGINES: dict[str, Callable[[bytes, int | None, dict], Any]] = {
    "onnxruntime": OrtSession,
    "openvino": OpenVinoSession,
}
_ALIASES = {"ort": "onnxruntime", "ov": "openvino"}
# names users try that run through a known engine: what to write instead
_THROUGH = {
    "tensorrt": "TensorRT runs through ONNX Runtime: engine='onnxruntime', "
    "providers=['TensorrtExecutionProvider', 'CUDAExecutionProvider'] (onnxruntime-gpu with "
    "TensorRT installed)",
    "cuda": "CUDA is a device: engine='onnxruntime', device='cuda' (onnxruntime-gpu)",
    "cpu": "CPU is a device: engine='onnxruntime' (or 'openvino'), device='cpu'",
}
_THROUGH["trt"] = _THROUGH["tensorrt"]


def engine_name(engine: str) -> str:
    """The registry key for ``engine`` (aliases ``ort``, ``ov``); ValueError listing the known."""
    if not isinstance(engine, str):
        raise TypeError(f"engine must be a name such as 'onnxruntime', got {type(engine).__name__}")
    name = _ALIASES.get(engine.lower(), engine.lower())
    if name in _THROUGH:
        raise ValueError(f"engine={engine!r}: {_THROUGH[name]}")
    if name not in ENGINES:
        raise ValueError(f"unknown engine {engine!r}; known engines: {', '.join(ENGINES)}")
    return name


def check_options(engine: str, options: dict) -> None:
    """ImportError naming the pip extra when ``engine`` is not installed; TypeError naming the
    known options when ``options`` has one ``engine`` does not take."""
    _import(engine_name(engine))
    _check_options(engine, options, ENGINES[engine_name(engine)].OPTIONS)


def make_session(engine: str, model: bytes, threads: int | None, options: dict):
    """A session of ``engine`` on the serialized ONNX ``model``."""
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise ValueError(f"threads={threads!r}: give a positive int, or None for the default")
    return ENGINES[engine_name(engine)](model, threads, dict(options))
