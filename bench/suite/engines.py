"""ONNX Runtime and OpenVINO (CPU) sessions with the suite's settings, and what they fused.

Both engines get the same two threads (the machine's cores). ORT: ``ORT_ENABLE_ALL``,
sequential execution, intra-op spinning off (spinning workers amplify contention on a shared
machine; see bench/forms_study/FINDINGS.md). OpenVINO: ``INFERENCE_NUM_THREADS=2``,
``NUM_STREAMS=1``, ``PERFORMANCE_HINT=LATENCY``; its float default on a CPU with AVX512-BF16 is
bf16 (``INFERENCE_PRECISION_HINT``), so float rows say which precision ran.
"""

from __future__ import annotations

import collections
import os
from collections.abc import Callable
from pathlib import Path

import numpy as np
import onnx

from quantbridge.optables import INTEGER_OPS, ORT_FUSED_WEIGHTED_OPS, WEIGHTED_OPS

THREADS = min(2, os.cpu_count() or 1)
INT8_ORT_OPS = set(INTEGER_OPS)  # ONNX Runtime's integer operators (quantbridge.optables)
FLOAT_COMPUTE_OPS = set(WEIGHTED_OPS) | ORT_FUSED_WEIGHTED_OPS


def ort_session(
    path: Path, optimized_path: Path | None = None, optimize: bool = True, threads: int = THREADS
):
    """The suite's session; ``optimize=False``: graph optimizations off, so QDQ models run node
    by node (the reference engine outputs are checked against: exact with any weights)."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    so.inter_op_num_threads = 1
    so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    so.graph_optimization_level = (
        ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        if optimize
        else ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    )
    so.log_severity_level = 3
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if optimized_path is not None:
        so.optimized_model_filepath = str(optimized_path)
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def ort_runner(session, feeds: dict[str, np.ndarray]) -> Callable[[], object]:
    names = {i.name for i in session.get_inputs()}
    feeds = {k: v for k, v in feeds.items() if k in names}
    return lambda: session.run(None, feeds)


def ort_outputs(session, batches: list[dict[str, np.ndarray]]) -> np.ndarray:
    run = [ort_runner(session, b)()[0] for b in batches]
    return np.concatenate(run)


def kernel_counts(model_path: Path) -> collections.Counter:
    """How many nodes of each op type the main graph of ``model_path`` has (for an ORT-optimized
    graph: the kernels it runs)."""
    model = onnx.load(str(model_path), load_external_data=False)
    return collections.Counter(n.op_type for n in model.graph.node)


def compute_ops(model_path: Path) -> dict[str, int]:
    """Integer and float compute ops of an (ORT-optimized) graph: what ran in int8."""
    c = kernel_counts(model_path)
    keep = INT8_ORT_OPS | FLOAT_COMPUTE_OPS | {"QuantizeLinear", "DequantizeLinear"}
    return {k: v for k, v in sorted(c.items()) if k in keep}


def openvino_available() -> str | None:
    """None when OpenVINO imports, else the reason."""
    try:
        import openvino  # noqa: F401
    except Exception as e:  # ImportError, or a broken native library
        return (
            f"openvino not importable ({type(e).__name__}: {e}); pip install 'quantbridge[bench]'"
        )
    return None


def ov_compile(path: Path, precision: str | None = None):
    """Compiled model; ``precision`` None = OpenVINO's default, or 'f32' / 'bf16' forced."""
    import openvino as ov

    config = {"INFERENCE_NUM_THREADS": THREADS, "NUM_STREAMS": 1, "PERFORMANCE_HINT": "LATENCY"}
    if precision is not None:
        config["INFERENCE_PRECISION_HINT"] = precision
    return ov.Core().compile_model(str(path), "CPU", config)


def ov_default_precision(compiled) -> str:
    try:
        text = str(compiled.get_property("INFERENCE_PRECISION_HINT"))
    except Exception:
        return "unknown"
    for name, short in (("bfloat16", "bf16"), ("float32", "f32"), ("float16", "f16")):
        if name in text:
            return short
    return text


def ov_runner(compiled, feeds: dict[str, np.ndarray]) -> Callable[[], object]:
    request = compiled.create_infer_request()
    names = [p.get_any_name() for p in compiled.inputs]
    data = {n: feeds[n] for n in names if n in feeds}
    if len(data) != len(names):  # positional fallback for unnamed inputs
        data = {i: v for i, v in enumerate(feeds.values())}
    return lambda: request.infer(data)


def ov_int8_layers(compiled) -> dict[str, int]:
    """Runtime layers by precision (Convolution:u8 means an int8 kernel)."""
    c: collections.Counter = collections.Counter()
    for op in compiled.get_runtime_model().get_ordered_ops():
        rt = op.get_rt_info()
        layer = rt["layerType"].astype(str)
        if layer not in ("Convolution", "FullyConnected", "MatMul", "GroupConvolution"):
            continue
        precision = rt["runtimePrecision"].astype(str) if "runtimePrecision" in rt else "?"
        c[f"{layer}:{precision}"] += 1
    return dict(sorted(c.items()))
