"""Issue 15 bench: the engine model's call ``fast(x)`` against the user's float torch model, the
QuantModel's fake-quant forward ``qmodel(x)`` and a raw ONNX Runtime session on the same graph.

    python -m bench.engine_call                          # ResNet-18-style b1/b8, MiniLM b1/b8
    python -m bench.engine_call --only resnet18 --rounds 8

Rows per workload and batch, timed in one interleaved loop (``bench.suite.timing``: rotating
start, a sample is the fastest of a few back-to-back calls, ratios per round, median [min-max]):

* ``torch/float``: the user's float model, ``torch.no_grad``, eval mode;
* ``torch/qmodel``: the QuantModel (fake quantization in torch), ``torch.no_grad``;
* ``engine/int8``: ``qb.to_engine(qmodel, "onnxruntime", ...)`` called with torch tensors;
* ``raw/int8``: ``session.run(None, feeds)`` on the engine model's own ORT session with
  prepared numpy feeds: what a hand-written session costs. ``engine/int8 : raw/int8 - 1`` is the
  call overhead (binding, checks, tensor <-> numpy, rebuilding the output structure).

Settings: torch and ORT get the same threads (``--threads``, default 2, the machine's cores);
ORT ``ORT_ENABLE_ALL``,
intra-op spinning off, as in the suite (``bench/suite/engines.py``). Workloads: the suite's
(``quantbridge.zoo.resnet18_style`` with random weights at 224x224; MiniLM-L6 with real weights
through ``examples/minilm.py``, seq 64, its default skip rules). Targets (issue 15): engine INT8
>= 3x faster than float torch at batch 8 on ResNet-18; call overhead < 5% at batch 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
THREADS = min(2, os.cpu_count() or 1)  # the default of --threads
RATIOS = (
    ("torch/float", "engine/int8", "float torch time / engine INT8 time (speed-up)"),
    ("torch/qmodel", "engine/int8", "fake-quant torch time / engine INT8 time (speed-up)"),
    ("engine/int8", "raw/int8", "engine call / raw session (call overhead = ratio - 1)"),
)


def _resnet18(batches: tuple[int, ...]):
    from quantbridge.zoo import resnet18_style

    model = resnet18_style()
    g = torch.Generator().manual_seed(0)
    calib = [torch.randn(8, 3, 224, 224, generator=g) for _ in range(2)]
    inputs = {b: torch.randn(b, 3, 224, 224, generator=g) for b in batches}
    return model, calib, "int8", "batch", inputs


def _minilm(batches: tuple[int, ...]):
    from bench.suite.workloads import _example_module

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    example = _example_module("minilm")
    embedder, tokenizer = example.load_embedder("sdpa")
    calib_sentences, eval_sentences = example.split(48, 64)
    calib = example.batched(tokenizer, calib_sentences, 16, 64, "max_length")
    inputs = {
        b: dict(example.tokenize(tokenizer, (eval_sentences * 8)[:b], 64, "max_length"))
        for b in batches
    }
    return embedder, calib, example.make_recipe(), "batch", inputs


WORKLOADS = {"resnet18": _resnet18, "minilm": _minilm}


def _first_tensor(out):
    """The first tensor of an output structure (tensor, tuple, dict, ModelOutput)."""
    while not isinstance(out, torch.Tensor):
        out = next(iter(out.values())) if hasattr(out, "values") else out[0]
    return out.detach().numpy()


def figure(quick: bool, workloads: tuple[str, ...], log) -> dict:
    """Figure 5 of ``python -m bench``: ResNet-18 and MiniLM (those of ``workloads`` that are
    here), batch 1 and 8, the suite's threads; fewer rounds in quick mode."""
    names = [n for n in WORKLOADS if n in workloads]
    torch.set_num_threads(THREADS)
    results = {"threads": THREADS, "rounds": 4 if quick else 12, "workloads": {}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in names:
            try:
                results["workloads"][name] = run_workload(
                    name, (1, 8), results["rounds"], THREADS, log
                )
            except Exception as e:  # a workload that cannot run is a result
                results["workloads"][name] = {"error": f"{type(e).__name__}: {e}"[:300]}
    return results


def _call(fn, x):
    return (lambda: fn(**x)) if isinstance(x, dict) else (lambda: fn(x))


def _wrapper_us(fast, x, repeats: int = 300) -> float:
    """Median microseconds of the engine model's own work per call, without the session: binding
    and checking the inputs (``feeds``), and turning prepared outputs into the user's structure
    (``outputs``). Less sensitive to a loaded machine than a difference of two session timings."""
    sig = fast._signature()
    args, kwargs = ((), x) if isinstance(x, dict) else ((x,), {})
    arrays = fast._session().run(sig.feeds(args, kwargs))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        sig.outputs(arrays, None if not args else args[0].device)
        sig.feeds(args, kwargs)
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def run_workload(name: str, batches: tuple[int, ...], rounds: int, threads: int, log) -> dict:
    import quantbridge as qb
    from bench.suite.speed import check_output
    from bench.suite.timing import interleave, paired_ratio, summary

    model, calib, recipe, dynamic, inputs = WORKLOADS[name](batches)
    t0 = time.perf_counter()
    qmodel = qb.quantize(model, calib, recipe=recipe, dynamic=dynamic, progress=False)
    t1 = time.perf_counter()
    example = next(iter(inputs.values()))
    fast = qb.to_engine(
        qmodel,
        "onnxruntime",
        example_inputs=example,
        threads=threads,
        config={"session.intra_op.allow_spinning": "0"},
        dynamic=dynamic,
    )
    session = fast._session().session  # the engine model's own session, for the raw rows
    t2 = time.perf_counter()
    result = {
        "quantize_s": t1 - t0,
        "to_engine_s": t2 - t1,
        "engine": repr(fast),
        "batches": {},
    }
    log(f"[{name}] quantize {t1 - t0:.1f} s, to_engine {t2 - t1:.1f} s: {fast!r}")
    for batch, x in inputs.items():
        names = [i.name for i in session.get_inputs()]
        if isinstance(x, dict):
            feeds = {k: x[k].numpy() for k in names}
        else:
            feeds = {names[0]: x.numpy()}
        with torch.no_grad():  # the engine's output against a raw session's before timing
            check = check_output(
                session.run(None, feeds)[0],
                _first_tensor(fast(**x) if isinstance(x, dict) else fast(x)),
            )
            runners = {
                "torch/float": _call(model, x),
                "torch/qmodel": _call(qmodel, x),
                "engine/int8": _call(fast, x),
                "raw/int8": lambda feeds=feeds: session.run(None, feeds),
            }
            log(f"[{name}] batch {batch}: {rounds} interleaved rounds")
            samples = interleave(runners, rounds, warmup=2, same_calls=True)
        entry = {
            "outputs": {"engine/int8": check},
            "wrapper_us": _wrapper_us(fast, x),
            "ms": {k: summary(v["wall_ms"]) for k, v in samples.items()},
            "calls_per_sample": {k: v["calls"] for k, v in samples.items()},
            "ratios": {
                f"{a} : {b}": {
                    "what": what,
                    **paired_ratio(samples[a]["wall_ms"], samples[b]["wall_ms"]),
                }
                for a, b, what in RATIOS
            },
        }
        result["batches"][f"batch {batch}"] = entry
    return result


def _ratio(v: dict) -> str:
    return f"{v['median']:.2f}x [{v['min']:.2f}-{v['max']:.2f}]"


def render(results: dict) -> str:
    lines = [
        f"engine model bench ({results['command']}; {results['started']}; threads "
        f"{results['threads']}, "
        f"load average {results['load_average']})",
        "",
        *table(results),
    ]
    return "\n".join(lines)


def table(results: dict) -> list[str]:
    """The figure's markdown table (``render``, and the suite's report)."""
    lines = [
        "| workload | batch | torch float ms | qmodel ms | engine int8 ms | raw session ms | "
        "float/engine | qmodel/engine | engine/raw - 1 | wrapper us (% of raw) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, w in results["workloads"].items():
        if "error" in w:
            lines.append(f"| {name} | - | failed: `{w['error'][:200]}` |||||||||")
            continue
        for batch, e in w["batches"].items():
            ms, r = e["ms"], e["ratios"]

            over = r["engine/int8 : raw/int8"]
            lines.append(
                f"| {name} | {batch.split()[-1]} | {ms['torch/float']['median']:.2f} | "
                f"{ms['torch/qmodel']['median']:.2f} | {ms['engine/int8']['median']:.2f} | "
                f"{ms['raw/int8']['median']:.2f} | {_ratio(r['torch/float : engine/int8'])} | "
                f"{_ratio(r['torch/qmodel : engine/int8'])} | {100 * (over['median'] - 1):+.1f}% "
                f"[{100 * (over['min'] - 1):+.1f}..{100 * (over['max'] - 1):+.1f}] | "
                f"{e['wrapper_us']:.0f} ({e['wrapper_us'] / 10 / ms['raw/int8']['median']:.2f}%) |"
                + _wrong(e)
            )
    return lines


def _wrong(entry: dict) -> str:
    check = entry.get("outputs", {}).get("engine/int8")
    return f" **outputs wrong: {check['why']}**" if check and not check["ok"] else ""


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.engine_call", description=__doc__)
    p.add_argument("--only", default="resnet18,minilm", help="comma-separated of resnet18,minilm")
    p.add_argument("--batches", default="1,8", help="batch sizes (default 1,8)")
    p.add_argument("--rounds", type=int, default=12, help="interleaved rounds per batch")
    p.add_argument("--json", type=Path, default=ROOT / "bench" / "results" / "engine.json")
    p.add_argument("--threads", type=int, default=THREADS, help="torch and ORT threads")
    args = p.parse_args(argv)
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    warnings.simplefilter("ignore")
    torch.set_num_threads(args.threads)
    log = lambda line: print(line, file=sys.stderr, flush=True)  # noqa: E731
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        p.error(f"--only: unknown {unknown}; choose from {list(WORKLOADS)}")
    batches = tuple(int(b) for b in args.batches.split(","))
    results = {
        "command": "python -m bench.engine_call "
        + " ".join(argv if argv is not None else sys.argv[1:]),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "threads": args.threads,
        "workloads": {},
    }
    for name in names:
        results["workloads"][name] = run_workload(name, batches, args.rounds, args.threads, log)
    results["load_average"] = [round(v, 1) for v in os.getloadavg()]
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1))
    print(render(results))
    log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
