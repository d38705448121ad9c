"""Issue 12 part 5 bench: what ``import_onnx``'s dynamic-dimension check costs on PP-OCR.

    python -m bench.import_check                 # det and rec, 2 rounds
    python -m bench.import_check --rounds 3 --models det

``import_onnx(f, check_dynamic=True)`` runs the imported module once on fake tensors whose
declared-dynamic dimensions are symbols (``onnx/importer/_symbolic.check_at_import``). Per model,
in one process and alternating (so machine load hits all alike), it times the plain import
(``check_dynamic=False``) and the check itself with and without the elementwise stand-ins
(``_symbolic.STAND_INS``), and prints the warnings each check gave: they must be the same.
The first round pays torch's one-time fake-tensor setup; later rounds show the steady cost.
"""

from __future__ import annotations

import argparse
import functools
import time
import warnings

import onnx

import quantbridge as qb
from quantbridge.onnx.importer import _symbolic

from .suite.workloads import ocr_det_path

MODELS = {"det": "ch_PP-OCRv4_det_infer.onnx", "rec": "ch_PP-OCRv4_rec_infer.onnx"}


def _timed(fn) -> tuple[float, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        start = time.perf_counter()
        fn()
        seconds = time.perf_counter() - start
    return seconds, sorted({str(w.message)[:70] for w in caught})


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--models", nargs="+", choices=sorted(MODELS), default=sorted(MODELS))
    args = parser.parse_args(argv)
    folder = ocr_det_path().parent
    stand_ins = dict(_symbolic.STAND_INS)
    for name in args.models:
        proto = onnx.load(folder / MODELS[name])
        for r in range(args.rounds):
            plain, _ = _timed(functools.partial(qb.import_onnx, proto, check_dynamic=False))
            module = qb.import_onnx(proto, check_dynamic=False)
            row = [f"{name} round {r}: import without check {plain:.2f} s"]
            for label, table in (("check, ops run", {}), ("check, stand-ins", stand_ins)):
                _symbolic.STAND_INS = table
                try:
                    check = functools.partial(_symbolic.check_at_import, module, proto, None)
                    seconds, said = _timed(check)
                finally:
                    _symbolic.STAND_INS = stand_ins
                row.append(f"{label} {seconds:.2f} s {said}")
            print("; ".join(row), flush=True)


if __name__ == "__main__":
    main()
