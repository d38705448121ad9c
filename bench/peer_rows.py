"""Figure 1's peer rows of one workload, without ours: ``python -m bench.peer_rows WORKLOAD``.

The bench's accuracy rows (``bench.suite.accuracy.run``: same data, sizes, configurations and
scoring as ``python -m bench --quick``) for the peer tools only (``--tools``, default ONNX
Runtime, NNCF and ModelOpt; ``--tools quantbridge`` for ours' rows), to re-run peers after a change in how they are fed without paying
for ours' rows again (the OCR recognizer's quantize + export takes minutes a row on a loaded
machine). ``--sizes full``: the full bench's data sizes (more calibration and evaluation
samples) instead of the quick ones; variant rows still off. Writes the rows as JSON (``--json``) and prints one line per row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

from bench.suite import accuracy, machine, peers, report_accuracy, workloads


def main() -> None:
    p = argparse.ArgumentParser(prog="python -m bench.peer_rows", description=__doc__)
    p.add_argument("workload", choices=workloads.NAMES)
    p.add_argument("--tools", default="onnxruntime,nncf,modelopt")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--ours-recipes", default="", help="with --tools quantbridge: extra rows")
    p.add_argument(
        "--only", default="", help="only the rows of these names (';' between: names hold commas)"
    )
    p.add_argument(
        "--sizes",
        choices=("quick", "full"),
        default="quick",
        help="the data sizes of `python -m bench --quick` (default) or of the full bench",
    )
    p.add_argument("--json", type=Path, required=True)
    args = p.parse_args()
    tools = args.tools.split(",")
    sizes = workloads.FULL if args.sizes == "full" else workloads.QUICK
    with tempfile.TemporaryDirectory(prefix="qb-peer-rows-") as tmp:
        w = workloads.BUILDERS[args.workload](Path(tmp), sizes, print)
        w.variants = {}  # quick mode runs no variant rows (bench.__main__.plan)
        extra = tuple(n for n in args.ours_recipes.split(",") if n)
        configs = [c for c in peers.configs(True, extra) if c.tool in tools]
        if args.only:
            configs = [c for c in configs if c.name in args.only.split(";")]
        result = accuracy.run(w, Path(tmp), configs, print, repeats=args.repeats)
    result.pop("files")
    meta = {"command": "python -m bench.peer_rows " + " ".join(sys.argv[1:]),
            "finished": time.strftime("%Y-%m-%d %H:%M:%S %Z"), "load_average": os.getloadavg(),
            "git": machine._git(workloads.ROOT), "sizes": asdict(sizes)}  # fmt: skip
    args.json.write_text(
        json.dumps({**meta, "workload": args.workload, **result}, indent=1, default=str)
    )
    for r in result["rows"]:
        value = r.get("values") or r.get("error", "")[:160]
        print(f"{r['tool']} | {r['config']}{report_accuracy._fed(r)} | {value} | {r.get('graph')}")


if __name__ == "__main__":
    main()
