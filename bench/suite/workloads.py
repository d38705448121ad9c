"""Models and data of the suite. Each ``Workload`` carries the float torch model (for the OCR
model, the ONNX file that ``qb.import_onnx`` turns into one), its float ONNX export (what ONNX Runtime's ``quantize_static`` starts from),
calibration batches for torch and the same batches as ONNX Runtime feeds, evaluation batches, the
metric, and the inputs of the latency rows.

Sizes per mode (``Sizes``): the full run uses the issue's sizes; ``--quick`` uses fewer
calibration/evaluation samples and fewer training epochs, never smaller models or inputs, so
the speed rows mean the same thing in both modes.
"""

from __future__ import annotations

import fnmatch
import importlib.util
import os
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def ocr_det_path() -> Path:
    """The PP-OCRv4 detector: from the ``rapidocr-onnxruntime`` wheel (fetched once into a cache,
    as the tests do: ``tests/ppocr_models.py``), else the shared copy."""
    from tests.ppocr_models import ppocr_dir, skip_reason

    folder = ppocr_dir()
    if folder is None:
        raise RuntimeError(skip_reason())
    return folder / "ch_PP-OCRv4_det_infer.onnx"


NAMES = ("digits", "resnet18", "mobilenetv2", "minilm", "ocr_det", "ocr_rec", "ocr_cls")
OCR_LINES = ("ocr_rec", "ocr_cls")  # ONNX files only: ours through qb.quantize_onnx


@dataclass(frozen=True)
class Sizes:
    digits_epochs: int
    digits_calib: int  # images (the demo's 256)
    cnn_calib: int  # 224x224 samples, batches of 8
    cnn_eval: int
    minilm_eval: int | None  # sentences (None = all 222 held-out ones)
    ocr_calib: int  # rendered images
    ocr_eval: int
    ocr_size: int
    lines_calib: int = 32  # recognizer lines (classifier: half as many), 4 batches
    lines_eval: int = 128  # recognizer and classifier lines


# OCR detector evaluation images: 16 quick / 32 full (4 / 8 until session 11: on 4 images the
# same quantized model scored 0.3-0.45 dB apart between float backends, ORT fused / node by node
# / torch float32 / float64, per calibration repeat; more images average that out)
FULL = Sizes(8, 256, 64, 16, None, 32, 32, 480, 32, 128)
# CNNs: quick calibrates on 64 images and evaluates 16, as full (16 and 8 until session 16: the
# MobileNetV2-style model trained on an AVX2-only CPU (training's float rounding differs by ISA)
# met one of the 8 evaluation images with 9.3-magnitude logits, 2.4x beyond the ranges 16
# calibration images set in the last blocks; that image held most of the logits' energy, and
# every tool's SQNR fell to 3-11 dB (ours default 7.5 in torch; 24.8 with 32 calibration images
# and 30.6 with 64, on 16 evaluation images): the row measured one image's extrapolation, not a
# tool (/work/helpers/notes/s16/mnv2_clip.py)
QUICK = Sizes(3, 256, 64, 16, 64, 8, 16, 480, 16, 32)


@dataclass
class Workload:
    name: str
    title: str
    metric: str  # "top1" | "cosine" | "sqnr" | "lines" | "agreement"
    float_onnx: Path
    calib: list  # torch batches (tensor or dict of tensors) for qb.quantize / FX
    calib_feeds: list[dict[str, np.ndarray]]  # the same batches for ONNX Runtime
    eval_feeds: list[dict[str, np.ndarray]]
    eval_torch: list = field(default_factory=list)
    model: Any = (
        None  # float torch model, or a float ONNX path for qb.import_onnx (None: ONNX only)
    )
    example: Any = None  # example input for qb.export
    labels: Any = None  # digits' classes; the recognizer's texts
    characters: list[str] = field(default_factory=list)  # the recognizer's CTC classes
    ours_onnx: bool = False  # ours through qb.quantize_onnx (the ONNX file's own path)
    speed_feeds: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    variants: dict[str, tuple] = field(
        default_factory=dict
    )  # extra rows: name -> (ours rules, ORT excluded nodes)


def _feeds(batches: list, names: tuple[str, ...]) -> list[dict[str, np.ndarray]]:
    out = []
    for b in batches:
        if isinstance(b, dict):
            out.append({k: v.numpy() for k, v in b.items()})
        else:
            out.append({names[0]: b.numpy()})
    return out


def export_float(model, path: Path, example) -> Path:
    """Float ONNX as users export it (dynamo exporter, dynamic batch) - quantize_static's input."""
    import torch

    from quantbridge.demo import export_float as demo_export_float

    if isinstance(example, torch.Tensor):
        demo_export_float(model, str(path), example)
    else:
        raise TypeError(example)
    return path


def _input_name(path: Path) -> str:
    import onnx

    return onnx.load(str(path), load_external_data=False).graph.input[0].name


def seeded_randn(seed: int, n: int, batch: int, shape=(3, 224, 224)) -> list[np.ndarray]:
    data = np.random.default_rng(seed).standard_normal((n, *shape), dtype=np.float32)
    return [data[i : i + batch].copy() for i in range(0, n, batch)]


CALIB_SEED = 1234


# -- digits -------------------------------------------------------------------------------------
def digits(work: Path, sizes: Sizes, log: Callable[[str], None]) -> Workload:
    import torch

    from quantbridge.demo import load_digits_split, train

    x_train, y_train, x_test, y_test = load_digits_split(0)
    model = train(x_train, y_train, sizes.digits_epochs, 0, lambda line: None)
    pick = torch.randperm(len(x_train), generator=torch.Generator().manual_seed(0))
    calib = list(x_train[pick[: sizes.digits_calib]].split(64))  # as quantbridge.demo does
    path = export_float(model, work / "digits.float.onnx", x_test[:64])
    name = _input_name(path)
    return Workload(
        name="digits",
        title="DigitsCNN on scikit-learn digits (8x8, trained as quantbridge.demo does)",
        metric="top1",
        float_onnx=path,
        calib=calib,
        calib_feeds=_feeds(calib, (name,)),
        eval_feeds=_feeds([x_test], (name,)),
        eval_torch=[x_test],
        model=model,
        example=x_test[:64],
        labels=y_test.numpy(),
        notes=[
            f"{sizes.digits_epochs} epochs, {len(x_test)} held-out images, "
            f"{sizes.digits_calib} calibration images (batches of 64)"
        ],
    )


# -- CNNs ---------------------------------------------------------------------------------------
BN_SEED = 4321  # the inputs BatchNorm statistics are measured on (not calibration's, not eval's)


def input_driven_bn(model, n: int = 32, batch: int = 8, size: int = 224, data=None):
    """``model`` (in place, returned in eval mode) with every BatchNorm's running statistics
    measured on its own activations for ``n`` N(0,1) inputs (seed ``BN_SEED``), as a trained
    network's are. ``quantbridge.zoo``'s random statistics do not match the random weights'
    activations: the signal shrinks layer after layer under constant BN shifts, and the logits
    stop depending on the input (bench quick, an output that ignores the input scores 45.8 dB on
    ResNet-18-style and 142 dB on MobileNetV2-style: ``accuracy.constant_output_sqnr_db``), so
    SQNR vs float measured how well a tool keeps a constant. With these statistics: 16.3 dB on
    ResNet-18-style (see ``notes``). ``data``: the inputs instead (an n x C x H x W array; the
    ``mobilenetv2`` workload's are ``synthetic.images(BN_SEED, ...)``)."""
    import torch

    if data is None:
        data = np.random.default_rng(BN_SEED).standard_normal((n, 3, size, size), np.float32)
    n = len(data)
    norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # a cumulative average over every batch
    model.train()
    with torch.no_grad():
        for i in range(0, n, batch):
            model(torch.from_numpy(data[i : i + batch]))
    for m in norms:
        m.momentum = 0.1
    return model.eval()


N01_NOTE = (
    "random weights (seeded), BN statistics of its own activations on N(0,1) inputs "
    "(workloads.input_driven_bn); inputs N(0,1)"
)


def _cnn(
    name: str, title: str, model, work: Path, sizes: Sizes, batches=seeded_randn, note=N01_NOTE
) -> Workload:
    """``batches(seed, n, batch)``: the calibration (``CALIB_SEED``) and evaluation (99) inputs,
    numpy batches of 8; ``note``: how the model and its inputs were made."""
    import torch

    x1 = torch.from_numpy(np.random.default_rng(7).standard_normal((1, 3, 224, 224), np.float32))
    path = export_float(model, work / f"{name}.float.onnx", x1)
    input_name = _input_name(path)
    cal = [torch.from_numpy(b) for b in batches(CALIB_SEED, sizes.cnn_calib, 8)]
    ev = [torch.from_numpy(b) for b in batches(99, sizes.cnn_eval, 8)]
    x8 = np.random.default_rng(8).standard_normal((8, 3, 224, 224), np.float32)
    return Workload(
        name=name,
        title=title,
        metric="sqnr",
        float_onnx=path,
        calib=cal,
        calib_feeds=_feeds(cal, (input_name,)),
        eval_feeds=_feeds(ev, (input_name,)),
        eval_torch=ev,
        model=model,
        example=x1,
        speed_feeds={"batch 1": {input_name: x1.numpy()}, "batch 8": {input_name: x8}},
        notes=[
            f"{note}; {sizes.cnn_calib} calibration samples (batches of 8), {sizes.cnn_eval} "
            "evaluation samples; SQNR of the logits vs the float model in ONNX Runtime"
        ],
    )


def resnet18(work: Path, sizes: Sizes, log: Callable[[str], None]) -> Workload:
    """Random weights, on ``mobilenetv2``'s synthetic images (``synthetic.images``): with N(0,1)
    inputs an output that ignores the input scored 16.25 dB (bench quick), with these 8.53 dB,
    and ``qb.quantize``'s default (torch) 29.41 -> 28.54 dB: a margin over the input-blind
    output of 20 dB instead of 13. The cost figure's children still calibrate on N(0,1)
    (``cost_child``: they time quantization, whose cost does not depend on the values)."""
    from quantbridge.zoo import resnet18_style

    from . import synthetic

    bn_data = synthetic.images(BN_SEED, 32)[0]
    return _cnn(
        "resnet18",
        "ResNet-18-style CNN (quantbridge.zoo.resnet18_style), 3x224x224",
        input_driven_bn(resnet18_style(), data=bn_data),
        work,
        sizes,
        batches=synthetic.image_batches,
        note="random weights (seeded), BN statistics of its own activations "
        "(workloads.input_driven_bn) on synthetic natural-image-like images "
        "(bench/suite/synthetic.py); inputs: such images from other seeds",
    )  # ours and ONNX Runtime's INT8 files come from the cost figure's fresh processes


def mobilenetv2(work: Path, sizes: Sizes, log: Callable[[str], None]) -> Workload:
    """Trained briefly on natural-image-like synthetic images (``synthetic``'s docstring says
    why: with random weights no tool's row differed from an output that ignores the input)."""
    from quantbridge.zoo import mobilenetv2_style

    from . import synthetic

    model = synthetic.train(mobilenetv2_style(synthetic.CLASSES))
    bn_data = synthetic.images(BN_SEED, 32)[0]
    return _cnn(
        "mobilenetv2",
        "MobileNetV2-style CNN (quantbridge.zoo.mobilenetv2_style, 10 classes, trained 150 steps "
        "on synthetic images), 3x224x224",
        input_driven_bn(model, data=bn_data),
        work,
        sizes,
        batches=synthetic.image_batches,
        note="trained 150 SGD steps at 64x64 on a synthetic task (the hue of a disc on 1/f "
        "backgrounds with random objects: bench/suite/synthetic.py), BN statistics then "
        "measured at 224x224 (workloads.input_driven_bn); inputs: images of that task from "
        "other seeds",
    )


# -- MiniLM -------------------------------------------------------------------------------------
def _example_module(name: str):
    """``examples/<name>.py`` as a module (the MiniLM example's functions are reused)."""
    path = ROOT / "examples" / f"{name}.py"
    if not path.exists():
        return None
    if name in sys.modules:
        return sys.modules[name]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.path.insert(0, str(path.parent))
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def onnx_nodes_in_modules(path: Path, patterns: tuple[str, ...]) -> list[str]:
    """Nodes of a dynamo-exported ONNX file whose innermost torch module matches a pattern (the
    exporter's ``pkg.torch.onnx.name_scopes`` metadata): the ONNX side of a quantbridge skip
    Rule, for ONNX Runtime's ``nodes_to_exclude``."""
    import ast

    import onnx

    model = onnx.load(str(path), load_external_data=False)
    found = []
    for node in model.graph.node:
        meta = {p.key: p.value for p in node.metadata_props}
        scopes = meta.get("pkg.torch.onnx.name_scopes")
        if not scopes:
            continue
        modules = ast.literal_eval(scopes)[:-1]
        if modules and any(fnmatch.fnmatchcase(modules[-1], p) for p in patterns):
            found.append(node.name)
    return found


def minilm(work: Path, sizes: Sizes, log: Callable[[str], None]) -> Workload:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    example = _example_module("minilm")
    if example is None:
        raise RuntimeError("examples/minilm.py is not in this checkout (its functions are reused)")
    embedder, tokenizer = example.load_embedder("sdpa")
    calib_sentences, eval_sentences = example.split(48, sizes.minilm_eval)
    calib = example.batched(tokenizer, calib_sentences, 16, 64, "max_length")
    evaluation = example.batched(tokenizer, eval_sentences, 32, 64, "max_length")
    path = work / "minilm.float.onnx"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        example.export_float(embedder, path, calib[0], "max_length")
    speed = {}
    for batch in (1, 32):
        feeds = example.tokenize(tokenizer, (eval_sentences * 32)[:batch], 64, "max_length")
        speed[f"batch {batch}"] = {k: v.numpy() for k, v in feeds.items()}
    skip = tuple(example.DEFAULT_SKIP)
    return Workload(
        name="minilm",
        title="MiniLM-L6 (all-MiniLM-L6-v2, real weights), seq 64, sentence embeddings",
        metric="cosine",
        float_onnx=path,
        calib=calib,
        calib_feeds=_feeds(calib, ()),
        eval_feeds=_feeds(evaluation, ()),
        eval_torch=evaluation,
        model=embedder,
        example=calib[0],
        speed_feeds=speed,
        notes=[
            f"examples/minilm.py's SentenceEmbedder (BERT + mean pooling + L2 norm, sdpa "
            f"attention); {len(calib_sentences)} calibration sentences (batches of 16), "
            f"{len(eval_sentences)} held-out sentences; mean cosine of int8 vs float embeddings",
        ],
        variants={
            "FFN outputs float": (skip, tuple(onnx_nodes_in_modules(path, skip))),
        },
    )


# -- PP-OCRv4 detection -------------------------------------------------------------------------
def ocr_det(work: Path, sizes: Sizes, log: Callable[[str], None]) -> Workload:
    from . import ocr_data

    reason = ocr_data.missing()
    if reason:
        raise RuntimeError(reason)
    det = ocr_det_path()
    import torch

    name = _input_name(det)
    calib = [{name: ocr_data.batch([i], sizes.ocr_size)} for i in range(sizes.ocr_calib)]
    ev = [{name: ocr_data.batch([10_000 + i], sizes.ocr_size)} for i in range(sizes.ocr_eval)]
    as_torch = lambda feeds: [{k: torch.from_numpy(v) for k, v in f.items()} for f in feeds]  # noqa: E731
    calib_torch = as_torch(calib)
    return Workload(
        name="ocr_det",
        title=f"PP-OCRv4 detection (real ONNX, opset 12), 1x3x{sizes.ocr_size}x{sizes.ocr_size} "
        "rendered text",
        metric="sqnr",
        float_onnx=det,
        calib=calib_torch,
        calib_feeds=calib,
        eval_feeds=ev,
        eval_torch=as_torch(ev),
        model=det,  # an ONNX file: ours and FX start from qb.import_onnx (timed with them)
        example=calib_torch[0],
        speed_feeds={"batch 1": ev[0]},
        notes=[
            f"{sizes.ocr_calib} calibration / {sizes.ocr_eval} evaluation images rendered with "
            "Pillow + DejaVu fonts (bench/suite/ocr_data.py); SQNR of the text-probability map vs "
            "float, and IoU of the text masks (p > 0.3)",
            "quantbridge and PyTorch FX start from the same float ONNX file as ONNX Runtime: "
            "`qb.import_onnx` turns it into a torch module first (its time is in their 'quantize "
            "s'), then the same calibration images as ONNX Runtime's",
        ],
    )


# -- PP-OCRv4 recognition and the direction classifier (ONNX files) -----------------------------
def _lines_workload(name: str, path: Path, calib: np.ndarray, x: np.ndarray, batch: int, **kw):
    from . import ocr_lines

    reason = ocr_lines.missing()
    if reason:
        raise RuntimeError(reason)
    input_name = _input_name(path)
    feeds = ocr_lines.batches(calib, len(calib) // 4, input_name)
    return Workload(
        name=name,
        float_onnx=path,
        calib=feeds,  # not used by torch: ours quantizes the file (ours_onnx)
        calib_feeds=feeds,
        eval_feeds=ocr_lines.batches(x, batch, input_name),
        ours_onnx=True,
        **kw,
    )


def ocr_rec(work: Path, sizes: Sizes, log: Callable[[str], None]) -> Workload:
    from . import ocr_lines

    path = ocr_det_path().with_name("ch_PP-OCRv4_rec_infer.onnx")
    calib, _texts = ocr_lines.rec_lines(ocr_lines.CALIB_SEEDS, sizes.lines_calib)
    x, texts = ocr_lines.rec_lines(ocr_lines.EVAL_SEEDS[0], sizes.lines_eval)
    return _lines_workload(
        "ocr_rec", path, calib, x, 16,
        title="PP-OCRv4 recognition (real ONNX, opset 12), 1x3x48x320 rendered text lines",
        metric="lines", labels=texts, characters=ocr_lines.characters(path),
        notes=[f"{len(calib)} calibration / {len(x)} evaluation lines (separate seeds) rendered "
               "with Pillow + DejaVu fonts (tests/onnx/ocr_data.py, as the tests); fraction of "
               "lines read exactly with greedy CTC (float's own beside)",
               "quantbridge quantizes the ONNX file with `qb.quantize_onnx` (the CLI's "
               "`quantbridge quantize`); its best here is `--method mse --recipe int8_avx2`",
               "ONNX Runtime's default writes per-tensor int8 weights: on this model that alone "
               "reads no line (per-tensor weights on `p2o.Conv.28` alone, every other layer "
               "float: 0/32; `python -m bench.ocr_peers_study layers`, bench/README.md)"],
    )  # fmt: skip


def ocr_cls(work: Path, sizes: Sizes, log: Callable[[str], None]) -> Workload:
    from . import ocr_lines

    path = ocr_det_path().with_name("ch_ppocr_mobile_v2.0_cls_infer.onnx")
    calib = ocr_lines.cls_lines(0, 500, sizes.lines_calib // 2)
    x = ocr_lines.cls_lines(*ocr_lines.EVAL_SEEDS[1:], sizes.lines_eval)
    return _lines_workload(
        "ocr_cls", path, calib, x, 32,
        title="PP-OCR mobile v2.0 direction classifier (real ONNX), 1x3x48x192 text lines",
        metric="agreement",
        notes=[f"{len(calib)} calibration / {len(x)} evaluation lines (separate seeds), half of "
               "each upside down; fraction of lines given the float model's class",
               "quantbridge quantizes the ONNX file with `qb.quantize_onnx`"],
    )  # fmt: skip


BUILDERS: dict[str, Callable[[Path, Sizes, Callable], Workload]] = {
    "digits": digits,
    "resnet18": resnet18,
    "mobilenetv2": mobilenetv2,
    "minilm": minilm,
    "ocr_det": ocr_det,
    "ocr_rec": ocr_rec,
    "ocr_cls": ocr_cls,
}
