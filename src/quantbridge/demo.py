"""``quantbridge demo``: a real model, end to end, in under two minutes on two CPU cores.

1. scikit-learn's ``load_digits`` (1797 real 8x8 handwritten digits, shipped with the package, no
   network), scaled to [0, 1], shaped ``N x 1 x 8 x 8``, a fixed stratified split (25 % held out);
2. ``quantbridge.zoo.DigitsCNN`` trained with Adam (seeded, deterministic on one machine);
3. ``quantbridge.quantize`` with 256 training images as calibration data;
4. ``quantbridge.export`` to a QDQ ONNX file, and the float model with plain
   ``torch.onnx.export(dynamo=True)`` for comparison;
5. both files run in ONNX Runtime (CPU) on the held-out images: accuracy, agreement of the INT8
   engine with torch's INT8 semantics in units of the output quantizer's step (LSB), file sizes,
   latency at batch 64;
6. ``quantbridge.to_engine``: the quantized model runs in ONNX Runtime through the model's own
   call (``fast(x_test)``, torch tensors in and out), returning the exported file's logits.

``run_demo`` returns a ``DemoResult`` whose ``checks`` say whether it all worked; ``format()`` is
the table the CLI prints, ``to_dict()`` its ``--json``.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch

from . import Recipe, export, quantize
from ._platform import u8s8_saturates
from .engine import to_engine
from .onnx.inspector import inspect_model
from .optables import WEIGHTED_OPS
from .recipe import native_preset
from .torch._capture import quiet_torch
from .zoo import DigitsCNN

ACCURACY_TOLERANCE = 0.005  # "INT8 within 0.5 points of float"
AGREEMENT_REQUIRED = 0.99  # share of logits where ONNX Runtime and torch INT8 agree within 1 LSB
LATENCY_BATCH = 64
LATENCY_THREADS = 1  # stable medians on a shared machine; the ratio is what the demo shows


@dataclass
class DemoResult:
    """Numbers from one demo run (accuracies are fractions in [0, 1], sizes in bytes)."""

    recipe: str
    epochs: int
    seed: int
    n_train: int
    n_test: int
    n_calibration: int
    float_accuracy: float  # torch, float model
    int8_torch_accuracy: float  # torch, QuantModel (fake quantization)
    int8_ort_accuracy: float  # ONNX Runtime, exported QDQ file
    float_ort_accuracy: float  # ONNX Runtime, float ONNX file
    within_1_lsb: float  # share of logits where |ORT - torch INT8| <= 1 output step
    exact_lsb: float  # share of logits with identical quantized values
    max_lsb: int
    output_scale: float
    argmax_agreement: float  # ORT INT8 vs torch INT8 predictions
    float_onnx_bytes: int
    int8_onnx_bytes: int
    latency_ms: dict[str, float]  # "ort_float", "ort_int8": median per batch of 64
    int8_ops: dict[str, int]
    float_ops: dict[str, int]
    float_weights: list[str]
    seconds: dict[str, float] = field(default_factory=dict)
    files: dict[str, str] = field(default_factory=dict)  # only with out=DIR
    engine_accuracy: float = 0.0  # qb.to_engine(qmodel, "onnxruntime") called as fast(x_test)
    engine_matches_file: bool = False  # fast(x_test) == the exported file's session, bit for bit
    scheme: str = "W8A8"  # as inspect names the exported file: W8A8, W4A8, ...

    @property
    def label(self) -> str:
        """How the quantized model is called in the text: INT8 for int8-stored weights of 5 to 8
        bits and 8-bit activations (int8_avx2's 7-bit weights too), else the scheme (W4A8)."""
        return "INT8" if self.scheme in ("W5A8", "W6A8", "W7A8", "W8A8") else self.scheme

    @property
    def checks(self) -> dict[str, bool]:
        q = self.label
        return {
            f"{q} accuracy within {ACCURACY_TOLERANCE * 100:.1f} points of float":
                self.float_accuracy - self.int8_ort_accuracy <= ACCURACY_TOLERANCE + 1e-9,
            f"ONNX Runtime matches torch {q} (>= {AGREEMENT_REQUIRED:.0%} of logits within 1 LSB)":
                self.within_1_lsb >= AGREEMENT_REQUIRED,
            f"no float weights in the {q} file": not self.float_weights,
            f"every Conv/Gemm of the {q} file runs in int8":
                not any(op in self.float_ops for op in WEIGHTED_OPS),
            f"{q} file smaller than the float file": self.int8_onnx_bytes < self.float_onnx_bytes,
            f"qb.to_engine: fast(x) in ONNX Runtime returns the {q} file's logits":
                self.engine_matches_file,
        }  # fmt: skip

    @property
    def ok(self) -> bool:
        return all(self.checks.values())

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["checks"] = self.checks
        d["ok"] = self.ok
        return d

    def format(self) -> str:
        pct, q = "{:.1%}".format, self.label
        lat = self.latency_ms
        ratio = self.float_onnx_bytes / max(self.int8_onnx_bytes, 1)
        speed = lat["ort_float"] / lat["ort_int8"] if lat["ort_int8"] > 0 else float("nan")
        rows = [
            ("", "float", q, ""),
            ("accuracy, torch", pct(self.float_accuracy), pct(self.int8_torch_accuracy),
             f"{q} = fake quantization"),
            ("accuracy, ONNX Runtime", pct(self.float_ort_accuracy), pct(self.int8_ort_accuracy),
             ""),
            ("ONNX file size", _kib(self.float_onnx_bytes), _kib(self.int8_onnx_bytes),
             f"{ratio:.1f}x smaller" if ratio >= 1 else f"{1 / ratio:.1f}x LARGER"),
            (f"latency, ORT batch {LATENCY_BATCH}", f"{lat['ort_float']:.3f} ms",
             f"{lat['ort_int8']:.3f} ms",
             f"{speed:.2f}x faster (median, {LATENCY_THREADS} thread)" if speed >= 1
             else f"{1 / speed:.2f}x slower (median, {LATENCY_THREADS} thread)"),
        ]  # fmt: skip
        lines = [
            f"quantbridge demo: DigitsCNN on scikit-learn digits (8x8), recipe {self.recipe!r} ({self.scheme})",
            f"{self.n_train} training / {self.n_test} held-out images, {self.epochs} epochs, "
            f"seed {self.seed}, {self.n_calibration} calibration images",
            "",
        ]
        lines += [f"  {a:<26}{b:>10}{c:>12}   {d}".rstrip() for a, b, c, d in rows]
        lines += [
            "",
            f"ONNX Runtime {q} vs torch {q}: {pct(self.within_1_lsb)} of logits within 1 LSB "
            f"({pct(self.exact_lsb)} identical, max {self.max_lsb} LSB, output scale "
            f"{self.output_scale:.4g}); predictions agree on {pct(self.argmax_agreement)}",
            f"{q} file: int8 ops " + (_counts(self.int8_ops) or "none")
            + "; float ops " + (_counts(self.float_ops) or "none"),
            f"{q} file float weights: " + (", ".join(self.float_weights) or "none"),
            "qb.to_engine(qmodel, 'onnxruntime'): fast(x) called like qmodel(x), accuracy "
            f"{pct(self.engine_accuracy)}, logits "
            + ("identical to the file's session" if self.engine_matches_file else "DIFFER"),
        ]  # fmt: skip
        if self.files:
            lines.append("files: " + ", ".join(self.files.values()))
        lines.append("")
        lines += [f"  {name}: {'yes' if ok else 'NO'}" for name, ok in self.checks.items()]
        passed = sum(self.checks.values())
        verdict = "OK" if self.ok else "FAILED"
        times = ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items())
        lines += ["", f"result: {verdict} ({passed}/{len(self.checks)} checks passed; {times})"]
        return "\n".join(lines)


def _kib(n: int) -> str:
    return f"{n / 1024:.1f} KiB"


def _counts(counts: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


# -- the steps ----------------------------------------------------------------------------------
def load_digits_split(
    seed: int = 0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)``: digits in [0, 1], ``N x 1 x 8 x 8``, 25 % held out."""
    try:
        from sklearn.datasets import load_digits
        from sklearn.model_selection import train_test_split
    except ImportError:
        raise ImportError(
            "the demo needs scikit-learn (its load_digits data set): pip install 'quantbridge[demo]'"
        ) from None
    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32).reshape(-1, 1, 8, 8)
    x_train, x_test, y_train, y_test = train_test_split(
        x, digits.target, test_size=0.25, stratify=digits.target, random_state=seed
    )
    return (torch.from_numpy(x_train), torch.from_numpy(y_train),
            torch.from_numpy(x_test), torch.from_numpy(y_test))  # fmt: skip


def train(
    x: torch.Tensor,
    y: torch.Tensor,
    epochs: int,
    seed: int,
    log: Callable[[str], None],
    batch_size: int = 32,
    lr: float = 3e-3,
) -> DigitsCNN:
    """Adam with a cosine learning-rate decay; one log line per epoch.

    Runs on one thread: batches of 32 tiny images gain nothing from more, and on a busy machine
    two spinning threads made training 10x slower. One thread also makes the result the same on
    every machine, whatever its core count.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _train(x, y, epochs, seed, log, batch_size, lr)
    finally:
        torch.set_num_threads(threads)


def _train(x, y, epochs, seed, log, batch_size, lr) -> DigitsCNN:
    torch.manual_seed(seed)
    model = DigitsCNN()
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    steps = epochs * ((len(x) + batch_size - 1) // batch_size)
    schedule = torch.optim.lr_scheduler.CosineAnnealingLR(opt, max(steps, 1))
    shuffle = torch.Generator().manual_seed(seed)
    for epoch in range(epochs):
        start, model = time.perf_counter(), model.train()
        total_loss, correct = 0.0, 0
        for idx in torch.randperm(len(x), generator=shuffle).split(batch_size):
            logits = model(x[idx])
            loss = torch.nn.functional.cross_entropy(logits, y[idx])
            opt.zero_grad()
            loss.backward()
            opt.step()
            schedule.step()
            total_loss += loss.item() * len(idx)
            correct += int((logits.argmax(1) == y[idx]).sum())
        log(
            f"  epoch {epoch + 1}/{epochs}: loss {total_loss / len(x):.4f}, "
            f"train accuracy {correct / len(x):.1%} ({time.perf_counter() - start:.1f} s)"
        )
    return model.eval()


def _accuracy(logits: np.ndarray | torch.Tensor, y: torch.Tensor) -> float:
    return float((np.asarray(logits).argmax(1) == y.numpy()).mean())


def export_float(model: torch.nn.Module, path: str, example: torch.Tensor) -> None:
    """The float baseline, exported the way users do it without quantbridge."""
    with warnings.catch_warnings(), quiet_torch():  # no "torchvision is not installed" lines
        warnings.simplefilter("ignore")
        torch.onnx.export(
            model,
            (example,),
            path,
            dynamo=True,
            dynamic_shapes=({0: torch.export.Dim("batch")},),
            external_data=False,  # one self-contained file, as the INT8 export writes
            verbose=False,
        )


def _session(path: str):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors only
    options.intra_op_num_threads = LATENCY_THREADS
    return ort.InferenceSession(path, options, providers=["CPUExecutionProvider"])


def _run(session, x: np.ndarray) -> np.ndarray:
    return session.run(None, {session.get_inputs()[0].name: x})[0]


def median_latency_ms(session, x: np.ndarray, repeats: int = 200, warmup: int = 20) -> float:
    for _ in range(warmup):
        _run(session, x)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        _run(session, x)
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def lsb_agreement(
    ort_out: np.ndarray, torch_out: np.ndarray, scale: float
) -> tuple[float, float, int]:
    """(share within 1 LSB, share identical, max difference) of two dequantized outputs."""
    lsb = np.rint(np.abs(ort_out.astype(np.float64) - torch_out.astype(np.float64)) / scale)
    return float((lsb <= 1).mean()), float((lsb == 0).mean()), int(lsb.max(initial=0))


# -- the whole run ------------------------------------------------------------------------------
def run_demo(
    epochs: int = 8,
    out: str | os.PathLike | None = None,
    recipe: str = "native",
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    n_calibration: int = 256,
) -> DemoResult:
    """Train, quantize, export and run DigitsCNN (module docstring). ``log`` gets progress lines
    (default: stderr); files go to ``out`` (kept) or a temporary folder (deleted)."""
    if epochs < 1:
        raise ValueError(f"epochs must be >= 1, got {epochs}")
    Recipe.preset(recipe)  # an unknown name fails now, not after training
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    if recipe == "native":
        recipe = native_preset()
        if recipe != "int8":
            log(
                f"recipe 'native' is {recipe!r} here: this CPU's int8 kernels saturate full-range weights"
            )
    recipe = exact_here(recipe, log)
    if out is not None:
        os.makedirs(out, exist_ok=True)
        return _run_demo(epochs, os.fspath(out), recipe, seed, log, n_calibration, keep=True)
    with tempfile.TemporaryDirectory(prefix="quantbridge-demo-") as folder:
        return _run_demo(epochs, folder, recipe, seed, log, n_calibration, keep=False)


def exact_here(name: str, log: Callable[[str], None]) -> tuple[str, Recipe]:
    """``(label, recipe)``: the preset ``name``, with 7-bit weights where this CPU's int8 kernels
    saturate full-range 8-bit weights (``quantbridge._platform``; what 'native' does for 'int8'),
    so that ONNX Runtime computes the file exactly here. Signed activations count: ONNX Runtime
    runs them as uint8 + 128."""
    recipe = Recipe.preset(name)
    weights = recipe.weights.scheme
    if not (u8s8_saturates() and weights.signed and weights.bits == 8):
        return name, recipe
    log(
        f"recipe {name!r} with 7-bit weights here: this CPU's int8 kernels saturate "
        "full-range weights (as 'native' does for 'int8')"
    )
    seven = replace(recipe.weights, scheme=replace(weights, bits=7))
    return f"{name}, 7-bit weights", replace(recipe, weights=seven)


def _run_demo(epochs, folder, named, seed, log, n_calibration, keep) -> DemoResult:
    label, recipe = named
    seconds: dict[str, float] = {}
    clock = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal clock
        now = time.perf_counter()
        seconds[name] = now - clock
        clock = now

    x_train, y_train, x_test, y_test = load_digits_split(seed)
    lap("data")
    log(f"training DigitsCNN on {len(x_train)} digits for {epochs} epochs")
    model = train(x_train, y_train, epochs, seed, log)
    with torch.no_grad():
        float_accuracy = _accuracy(model(x_test), y_test)
    lap("train")

    log(f"quantizing (recipe {label!r}, {n_calibration} calibration images)")
    pick = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(seed))
    calibration = list(x_train[pick[:n_calibration]].split(64))
    qmodel = quantize(model, calibration, recipe=recipe, progress=False)
    with torch.no_grad():
        torch_int8 = qmodel(x_test).numpy()
    lap("quantize")

    log("exporting the quantized (QDQ) and the float ONNX files")
    int8_path = os.path.join(folder, "digits_cnn.int8.onnx")
    float_path = os.path.join(folder, "digits_cnn.float.onnx")
    export(qmodel, int8_path, example_inputs=x_test[:LATENCY_BATCH])
    export_float(model, float_path, x_test[:LATENCY_BATCH])
    report = inspect_model(int8_path)
    lap("export")

    log("running both files in ONNX Runtime (CPU)")
    int8_session, float_session = _session(int8_path), _session(float_path)
    x_np = x_test.numpy()
    ort_int8, ort_float = _run(int8_session, x_np), _run(float_session, x_np)
    output_scale = float(qmodel.output_quantizer().scale)
    within, exact, max_lsb = lsb_agreement(ort_int8, torch_int8, output_scale)
    batch, batch_t = x_np[:LATENCY_BATCH], x_test[:LATENCY_BATCH]
    latency = {
        "ort_float": median_latency_ms(float_session, batch),
        "ort_int8": median_latency_ms(int8_session, batch),
    }
    lap("onnxruntime")

    log("running the quantized model in ONNX Runtime through its own call (qb.to_engine)")
    fast = to_engine(qmodel, "onnxruntime", example_inputs=batch_t, threads=LATENCY_THREADS)
    engine_int8 = fast(x_test).numpy()  # torch tensor in, torch tensor out, as qmodel(x_test)
    lap("engine")

    return DemoResult(
        recipe=label,
        epochs=epochs,
        seed=seed,
        n_train=len(x_train),
        n_test=len(x_test),
        n_calibration=min(n_calibration, len(x_train)),
        float_accuracy=float_accuracy,
        int8_torch_accuracy=_accuracy(torch_int8, y_test),
        int8_ort_accuracy=_accuracy(ort_int8, y_test),
        float_ort_accuracy=_accuracy(ort_float, y_test),
        within_1_lsb=within,
        exact_lsb=exact,
        max_lsb=max_lsb,
        output_scale=output_scale,
        argmax_agreement=float((ort_int8.argmax(1) == torch_int8.argmax(1)).mean()),
        float_onnx_bytes=os.path.getsize(float_path),
        int8_onnx_bytes=os.path.getsize(int8_path),
        latency_ms=latency,
        int8_ops=report.int8_ops,
        float_ops=report.float_ops,
        float_weights=[w.name for w in report.float_weights],
        seconds=seconds,
        files={"int8": int8_path, "float": float_path} if keep else {},
        engine_accuracy=_accuracy(engine_int8, y_test),
        engine_matches_file=bool(np.array_equal(engine_int8, ort_int8)),
        scheme=report.scheme or "float",
    )


__all__ = ["DemoResult", "load_digits_split", "run_demo", "train"]
