"""Rows measured after a run, merged into its results: ``python -m bench --render RUN.json --add ROWS.json``.

A whole ``python -m bench`` run takes about 100 minutes here. When one quantbridge row changes
(a new recipe, a fix), ``python -m bench.peer_rows W --tools quantbridge --ours-recipes NAME
--repeats R --json ROWS.json`` measures that workload's rows again with the same data, sizes,
calibration repeats and scoring; ``add_rows`` puts them into the run's results: a row with the
same tool and configuration is replaced, a new one is appended. Every added row carries
``"added"`` (the command, the git version and when it finished), and the results list every
addition under ``"added_rows"``, which the report's header prints: the report says which numbers
were measured when, at which version.

A partial run (``python -m bench --quick --only W1,W2 --json PART.json``, same mode) can be added
too: each figure it measured of a workload replaces the run's (accuracy: the rows of every tool;
speed), a figure it did not run (``--figures accuracy``) stays the run's; its cost figure replaces
the run's; each is listed in ``"added_rows"`` the same way, with the instruction-set flags on
which its machine differs from the run's (``isa_differences``).

Refused (``ValueError`` naming the file and the fix): a rows file for a workload the run did not
measure, with another number of calibration repeats (the verdicts compare repeat by repeat), or a
partial run of another mode.
"""

from __future__ import annotations

import json
from pathlib import Path

__all__ = ["add_rows", "add_run", "add_files", "isa_differences"]


def add_rows(results: dict, added: dict, source: str = "rows file") -> list[str]:
    """Merge ``added`` (a ``bench.peer_rows`` JSON) into ``results`` in place; returns the
    ``tool/config`` names merged."""
    workload = added.get("workload")
    rows = added.get("rows")
    if not workload or rows is None:
        raise ValueError(f"{source}: not a `python -m bench.peer_rows` file (no workload / rows)")
    accuracy = results.get("workloads", {}).get(workload, {}).get("accuracy")
    if accuracy is None:
        measured = sorted(w for w, e in results.get("workloads", {}).items() if "accuracy" in e)
        raise ValueError(
            f"{source}: workload {workload!r} has no accuracy figure in this run (it has "
            f"{measured}); add rows only to a workload the run measured"
        )
    repeats = added.get("repeats")
    if repeats != accuracy.get("repeats"):
        raise ValueError(
            f"{source}: {repeats} calibration repeats, the run has {accuracy.get('repeats')}; "
            f"measure again with `--repeats {accuracy.get('repeats')}`"
        )
    stamp = {
        "command": added.get("command", "?"),
        "git": added.get("git") or {},
        "finished": added.get("finished", "?"),
    }
    index = {(r["tool"], r["config"]): i for i, r in enumerate(accuracy["rows"])}
    names = []
    for row in rows:
        row = {**row, "added": stamp}
        key = (row["tool"], row["config"])
        if key in index:
            accuracy["rows"][index[key]] = row
        else:
            index[key] = len(accuracy["rows"])
            accuracy["rows"].append(row)
        names.append(f"{key[0]}/{key[1]}")
    load = added.get("load_average")
    results.setdefault("added_rows", []).append(
        {"workload": workload, "rows": names, **stamp, "load_average": load}
    )
    return names


def add_run(results: dict, part: dict, source: str = "partial run") -> list[str]:
    """Replace ``results``' workloads (and cost figures) by those of ``part``, a partial
    ``python -m bench`` run of the same mode; returns the names replaced."""
    if part.get("mode") != results.get("mode"):
        raise ValueError(
            f"{source}: a {part.get('mode')!r} run cannot replace parts of a "
            f"{results.get('mode')!r} run; measure again with the run's mode"
        )
    repeats = (part.get("plan") or {}).get("repeats")
    if repeats != (results.get("plan") or {}).get("repeats"):
        raise ValueError(
            f"{source}: {repeats} calibration repeats, the run has "
            f"{(results.get('plan') or {}).get('repeats')}; measure again with the same --repeats"
        )
    names = []
    for name, entry in part.get("workloads", {}).items():
        old = results["workloads"].get(name, {})
        results["workloads"][name] = {**old, **entry, "added": True}  # figures not run: kept
        names.append(name)
    for key in ("cost", "cost_ocr_det"):
        if key in part:
            results[key] = part[key]
            names.append(f"{key} figure")
    machine = part.get("machine") or {}
    load = machine.get("load_average_end")
    results.setdefault("added_rows", []).append(
        {
            "workload": "whole workloads",
            "rows": names,
            "command": part.get("command", "?"),
            "git": machine.get("git") or {},
            "finished": part.get("started", "?") + " (started)",
            "load_average": load,
            "isa_differs": isa_differences(
                (results.get("machine") or {}).get("isa"), machine.get("isa")
            ),
        }  # fmt: skip
    )
    return names


def isa_differences(run: dict | None, part: dict | None) -> list[str]:
    """The instruction-set flags on which the part's machine differs from the run's, as
    ``"avx512_vnni no (run: yes)"``: int8 kernels differ between them (without VNNI, ONNX
    Runtime's u8s8 pair sums saturate), so the report says where a merged figure was measured."""
    if not run or not part:
        return []
    word = {True: "yes", False: "no", None: "?"}
    return [
        f"{flag} {word[part.get(flag)]} (run: {word[run.get(flag)]})"
        for flag in sorted(set(run) | set(part))
        if run.get(flag) != part.get(flag)
    ]


def add_files(results: dict, paths: list[Path]) -> None:
    """``add_rows`` (a ``bench.peer_rows`` file) or ``add_run`` (a partial run) for each file,
    in order (a later file wins over an earlier one)."""
    for path in paths:
        doc = json.loads(Path(path).read_text())
        if "workloads" in doc:
            add_run(results, doc, source=str(path))
        else:
            add_rows(results, doc, source=str(path))
