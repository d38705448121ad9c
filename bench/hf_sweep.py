"""Sweep of Hugging Face ``transformers`` architectures: is any layer silently left float?

    python -m bench.hf_sweep                         # every architecture, table on stdout
    python -m bench.hf_sweep --only llama,mixtral --json out.jsonl --work /tmp/sweep

Each architecture is built from a tiny random config (``AutoConfig.for_model``, hidden 32-64,
2 layers, small vocabulary; no download: ``HF_HUB_OFFLINE=1``), wrapped so that it takes
positional tensors and returns its main output (``last_hidden_state`` / ``logits``), quantized
with the default recipe from 3 calibration batches, exported, and run in ONNX Runtime. Per row:

* status, the error of the first step that failed (quantize, export, ort, to_engine);
* agreement with the float model on a held-out batch: cosine and SQNR (dB) of ONNX Runtime
  (``ORT_ENABLE_ALL``), of the QuantModel, and of ``qb.to_engine(qm, 'onnxruntime')`` against the
  QuantModel;
* ``float_left``: every MatMul / Gemm / Conv / ConvTranspose / Einsum of the exported file that
  reads a float parameter not through a DequantizeLinear, or a quantized weight with a float
  activation (``float_layers``); ``act_float``: products of two activations not both Q/DQ'd
  (attention's probabilities @ V stays float by design: ``_ops.KEEP_FLOAT_OUTPUT_OPS``);
* ``ort``: int8 / all MatMul-Gemm-Conv kernels of ONNX Runtime's optimized graph
  (``bench.int8_coverage.FAMILIES``);
* ``warned``: the layers quantize's "stay float" warning named.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
import traceback
import warnings
from pathlib import Path

import numpy as np
import onnx
import torch
from torch import nn

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXT = dict(vocab_size=128, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
            intermediate_size=64, max_position_embeddings=64)  # fmt: skip
DECODER = dict(TEXT, num_key_value_heads=2)
MOE = dict(DECODER, num_local_experts=4, num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=32, shared_expert_intermediate_size=32)  # fmt: skip
S2S = dict(vocab_size=128, d_model=32, encoder_layers=2, decoder_layers=2,
           encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
           decoder_ffn_dim=64, max_position_embeddings=64)  # fmt: skip
VIT = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
           image_size=32, patch_size=8)  # fmt: skip
CNN = dict(hidden_sizes=[16, 32], depths=[1, 1], embedding_size=16)
AUDIO = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
             conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
             num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4)  # fmt: skip

# name -> (model_type, config overrides, input kind)
MODELS: dict[str, tuple[str, dict, str]] = {
    # encoders
    "bert": ("bert", TEXT, "text"),
    "roberta": ("roberta", dict(TEXT, pad_token_id=1), "text"),
    "deberta-v2": ("deberta-v2", TEXT, "text"),
    "distilbert": ("distilbert", dict(vocab_size=128, dim=32, n_layers=2, n_heads=4,
                                      hidden_dim=64, max_position_embeddings=64), "text"),
    "albert": ("albert", dict(TEXT, embedding_size=16), "text"),
    "electra": ("electra", dict(TEXT, embedding_size=16), "text"),
    "xlm-roberta": ("xlm-roberta", dict(TEXT, pad_token_id=1), "text"),
    "mpnet": ("mpnet", TEXT, "text"),
    # decoders
    "llama": ("llama", DECODER, "text"),
    "mistral": ("mistral", DECODER, "text"),
    "qwen2": ("qwen2", DECODER, "text"),
    "qwen3": ("qwen3", dict(DECODER, head_dim=8), "text"),
    "phi": ("phi", DECODER, "text"),
    "phi3": ("phi3", dict(DECODER, pad_token_id=0), "text"),
    "gemma": ("gemma", dict(DECODER, head_dim=8), "text"),
    "gemma2": ("gemma2", dict(DECODER, head_dim=8), "text"),
    "gemma3_text": ("gemma3_text", dict(DECODER, head_dim=8, sliding_window=8), "text"),
    "gpt2": ("gpt2", dict(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64), "text"),
    "gpt_neox": ("gpt_neox", TEXT, "text"),
    "gptj": ("gptj", dict(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                          rotary_dim=4), "text"),
    "opt": ("opt", dict(TEXT, ffn_dim=64, word_embed_proj_dim=32), "text"),
    "bloom": ("bloom", dict(vocab_size=128, hidden_size=32, n_layer=2, n_head=4), "text"),
    "falcon": ("falcon", dict(TEXT, new_decoder_architecture=True, num_kv_heads=2), "text"),
    "stablelm": ("stablelm", DECODER, "text"),
    "olmo": ("olmo", DECODER, "text"),
    "cohere": ("cohere", DECODER, "text"),
    "starcoder2": ("starcoder2", DECODER, "text"),
    # mixture of experts
    "mixtral": ("mixtral", MOE, "text"),
    "qwen2_moe": ("qwen2_moe", MOE, "text"),
    "olmoe": ("olmoe", MOE, "text"),
    "qwen3_moe": ("qwen3_moe", dict(MOE, head_dim=8), "text"),
    # the experts as ``W[ids]`` then ``bmm`` (HF's batched_mm): the form that exports
    "mixtral-bmm": ("mixtral", dict(MOE, experts_implementation="batched_mm"), "text"),
    "qwen2_moe-bmm": ("qwen2_moe", dict(MOE, experts_implementation="batched_mm"), "text"),
    # sequence to sequence
    "t5": ("t5", dict(vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                      decoder_start_token_id=0), "s2s"),
    "bart": ("bart", S2S, "s2s"),
    "marian": ("marian", dict(S2S, decoder_start_token_id=0, pad_token_id=0), "s2s"),
    "whisper-encoder": ("whisper", dict(S2S, num_mel_bins=16, max_source_positions=16,
                                          pad_token_id=0, decoder_start_token_id=1,
                                          bos_token_id=1, eos_token_id=2), "mel"),
    # vision
    "vit": ("vit", VIT, "image"),
    "deit": ("deit", VIT, "image"),
    "dinov2": ("dinov2", VIT, "image"),
    "clip-vision": ("clip_vision_model", VIT, "image"),
    "swin": ("swin", dict(image_size=32, patch_size=4, embed_dim=16, depths=[1, 1],
                          num_heads=[2, 4], window_size=4), "image"),
    "convnext": ("convnext", dict(CNN, num_stages=2), "image"),
    "convnextv2": ("convnextv2", dict(CNN, num_stages=2), "image"),
    "resnet": ("resnet", CNN, "image"),
    "mobilenet_v2": ("mobilenet_v2", dict(depth_multiplier=0.35, image_size=32), "image"),
    "efficientnet": ("efficientnet", dict(width_coefficient=0.25, depth_coefficient=0.25,
                                          image_size=32, hidden_dim=320), "image"),
    "segformer": ("segformer", dict(num_encoder_blocks=2, depths=[1, 1], sr_ratios=[2, 1],
                                    hidden_sizes=[16, 32], patch_sizes=[7, 3], strides=[4, 2],
                                    num_attention_heads=[1, 2], mlp_ratios=[2, 2]), "image"),
    # audio
    "wav2vec2": ("wav2vec2", AUDIO, "audio"),
    "hubert": ("hubert", AUDIO, "audio"),
}  # fmt: skip
COMPUTE = ("MatMul", "Gemm", "Conv", "ConvTranspose", "Einsum")
# ops a weight passes through on its way to a product (its layout, not its values)
LAYOUT = {"Transpose", "Reshape", "Unsqueeze", "Squeeze", "Cast", "Identity", "Flatten", "Expand",
          "Gather", "Slice", "Split", "Concat", "Tile"}  # fmt: skip


class Main(nn.Module):
    """The model called with positional tensors, returning its main output tensor."""

    def __init__(self, model: nn.Module, kind: str):
        super().__init__()
        self.model, self.kind = model, kind

    def forward(self, *xs):
        if self.kind == "s2s":
            out = self.model(input_ids=xs[0], decoder_input_ids=xs[1])
        elif self.kind == "text":
            out = self.model(input_ids=xs[0])
        elif self.kind == "mel":
            out = self.model(input_features=xs[0])
        elif self.kind == "audio":
            out = self.model(input_values=xs[0])
        else:
            out = self.model(pixel_values=xs[0])
        return out[0] if isinstance(out, tuple) else next(iter(out.values()))


def build(name: str) -> tuple[nn.Module, list[tuple]]:
    """The wrapped tiny model and 4 batches (3 to calibrate, the last held out)."""
    from transformers import AutoConfig, AutoModel

    model_type, overrides, kind = MODELS[name]
    torch.manual_seed(0)
    config = AutoConfig.for_model(model_type, **overrides)
    model = AutoModel.from_config(config)
    if name == "whisper-encoder":
        model = model.get_encoder()
    g = torch.Generator().manual_seed(1)

    def batch():
        if kind in ("text", "s2s"):
            ids = torch.randint(3, 128, (2, 16), generator=g)
            return (ids, ids[:, :8]) if kind == "s2s" else (ids,)
        if kind == "mel":
            return (torch.randn(2, 16, 32, generator=g),)
        if kind == "audio":
            return (torch.randn(2, 1600, generator=g),)
        return (torch.randn(2, 3, 32, 32, generator=g),)

    return Main(model.eval(), kind).eval(), [batch() for _ in range(4)]


def _source(graph_index: dict, name: str, inits: dict, depth: int = 0) -> str:
    """What a product's input reads: 'wdq' (a DequantizeLinear of a constant: an int8 weight),
    'dq' (a DequantizeLinear of an activation), 'param' (a float initializer or Constant, through
    layout ops), 'const' (an integer / scalar constant) or 'act'."""
    if name in inits:
        t = inits[name]
        floating = t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16,
                                   onnx.TensorProto.BFLOAT16, onnx.TensorProto.DOUBLE)  # fmt: skip
        return "param" if floating and np.prod(t.dims, dtype=np.int64) > 1 else "const"
    node = graph_index.get(name)
    if node is None or depth > 12:
        return "act"
    if node.op_type == "DequantizeLinear":
        return "wdq" if _source(graph_index, node.input[0], inits, depth + 1) == "const" else "dq"
    if node.op_type == "Constant":
        t = node.attribute[0].t if node.attribute and node.attribute[0].HasField("t") else None
        return "param" if t is not None and np.prod(t.dims, dtype=np.int64) > 1 else "const"
    if node.op_type in LAYOUT:
        kinds = {_source(graph_index, i, inits, depth + 1) for i in node.input[:1] if i}
        if node.op_type == "Concat":
            kinds = {_source(graph_index, i, inits, depth + 1) for i in node.input if i}
        for k in ("act", "param", "wdq", "dq"):
            if k in kinds:
                return k
        return "const"
    return "act"


def float_products(model: onnx.ModelProto) -> dict[str, list[str]]:
    """The products of ``model`` that do not read int8 (Q/DQ'd) inputs, by what they read."""
    graph = model.graph
    inits = {t.name: t for t in graph.initializer}
    producer = {o: n for n in graph.node for o in n.output}
    found: dict[str, list[str]] = {"float_layers": [], "act_float": [], "int8": []}
    for node in graph.node:
        if node.op_type not in COMPUTE:
            continue
        operands = node.input[:2] if node.op_type != "Einsum" else node.input
        kinds = [_source(producer, i, inits) for i in operands if i]
        label = f"{node.op_type} {node.name}"
        if all(k in ("dq", "wdq", "const") for k in kinds):
            found["int8"].append(label)
        elif "param" in kinds or "wdq" in kinds:
            found["float_layers"].append(label + f" ({'/'.join(kinds)})")
        else:
            found["act_float"].append(label)
    return found


def _metrics(ref: np.ndarray, out: np.ndarray) -> dict:
    ref, out = ref.astype(np.float64).ravel(), out.astype(np.float64).ravel()
    noise = np.sum((ref - out) ** 2)
    cos = float(ref @ out / (np.linalg.norm(ref) * np.linalg.norm(out) + 1e-30))
    sqnr = float(10 * np.log10(np.sum(ref**2) / noise)) if noise > 0 else float("inf")
    return {"cos": round(cos, 5), "sqnr": round(sqnr, 2)}


def _ort_kernels(path: Path) -> dict:
    from bench.int8_coverage import FAMILIES
    from bench.suite import engines

    optimized = path.with_suffix(".ort.onnx")
    sess = engines.ort_session(path, optimized_path=optimized)
    kernels = engines.kernel_counts(optimized)
    fam = {"MatMul", "Gemm", "Conv"}
    int8 = sum(n for op, n in kernels.items() if FAMILIES.get(op, ("", 0))[0] in fam
               and FAMILIES[op][1])  # fmt: skip
    total = sum(n for op, n in kernels.items() if FAMILIES.get(op, ("", 0))[0] in fam)
    return sess, {"int8": int8, "all": total, "float": {
        op: n for op, n in kernels.items() if op in FAMILIES and not FAMILIES[op][1]
        and FAMILIES[op][0] in fam}}  # fmt: skip


def _recipe(name: str):
    import dataclasses

    import quantbridge as qb

    if name == "default-nobc":  # the default less its sequential bias correction (CPU time)
        return dataclasses.replace(qb.Recipe.preset("default"), bias_correction=False)
    return name


def run_one(name: str, work: Path, recipe: str = "default", engine: bool = True) -> dict:
    import quantbridge as qb

    row: dict = {"model": name, "status": "ok"}
    step = "build"
    t0 = time.time()
    try:
        model, batches = build(name)
        calib, held = batches[:3], batches[3]
        with torch.no_grad():
            ref = model(*held).numpy()
        step = "quantize"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            qm = qb.quantize(model, calib, recipe=_recipe(recipe), progress=False)
        row["warned"] = [str(w.message)[:400] for w in caught
                         if "stay float" in str(w.message) or "float" in str(w.message)]  # fmt: skip
        with torch.no_grad():
            qout = qm(*held).numpy()
        row["quantmodel"] = _metrics(ref, qout)
        step = "export"
        path = work / f"{name}.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            qb.export(qm, path, held, progress=False)
        found = float_products(onnx.load(str(path)))
        row["float_left"] = found["float_layers"]
        row["act_float"] = found["act_float"]
        row["int8_products"] = len(found["int8"])
        step = "ort"
        sess, row["ort"] = _ort_kernels(path)
        feeds = {i.name: x.numpy() for i, x in zip(sess.get_inputs(), held, strict=True)}
        row["onnxruntime"] = _metrics(ref, sess.run(None, feeds)[0])
        step = "to_engine"
        if not engine:
            row["seconds"] = round(time.time() - t0, 1)
            return row
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            fast = qb.to_engine(qm, "onnxruntime", example_inputs=held)
        row["engine_vs_quantmodel"] = _metrics(qout, np.asarray(fast(*held)))
    except Exception as e:  # noqa: BLE001 - a sweep row records any failure
        row["status"] = f"{step} failed"
        row["error"] = f"{type(e).__name__}: {str(e)[:600]}"
        row["trace"] = traceback.format_exc()[-1500:]
    row["seconds"] = round(time.time() - t0, 1)
    return row


def table(rows: list[dict]) -> str:
    lines = ["| model | status | ORT vs float cos / SQNR dB | QuantModel SQNR | engine vs QM SQNR "
             "| ORT int8/all products | float layers left | act x act float |",
             "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        if r["status"] != "ok":
            lines.append(f"| {r['model']} | {r['status']}: {r.get('error', '')[:160]} |||||||")
            continue
        o, q = r["onnxruntime"], r["quantmodel"]
        e = r.get("engine_vs_quantmodel", {"sqnr": float("nan")})
        left = len(r["float_left"])
        lines.append(
            f"| {r['model']} | ok | {o['cos']:.4f} / {o['sqnr']:.1f} | {q['sqnr']:.1f} | "
            f"{e['sqnr']:.1f} | {r['ort']['int8']}/{r['ort']['all']} | {left} | "
            f"{len(r['act_float'])} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.hf_sweep")
    parser.add_argument("--only", default=",".join(MODELS), help="comma-separated names")
    parser.add_argument("--json", help="append one JSON line per model to this file")
    parser.add_argument("--work", help="folder for the ONNX files (default: a temporary one)")
    parser.add_argument(
        "--recipe",
        default="default",
        help="a preset, or 'default-nobc': the default less bias correction",
    )
    parser.add_argument("--no-engine", action="store_true", help="skip qb.to_engine")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(args.work or tmp)
        work.mkdir(parents=True, exist_ok=True)
        for name in args.only.split(","):
            row = run_one(name, work, args.recipe, not args.no_engine)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k != "trace"}), flush=True)
            if args.json:
                with open(args.json, "a") as f:
                    f.write(json.dumps(row) + "\n")
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
