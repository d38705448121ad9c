"""The program as arrays (``.npz``): integer arrays under ``step{i}/{attr}`` and
``const/{tensor}``, float output tables under ``output{i}/table``, an accumulator output's
float32 scale and its axis under ``output{i}/scale`` and ``output{i}/axis``, everything else
(tensor formats, steps, boundaries, scalar attributes) as one JSON document under
``program.json``. ``load_npz`` rebuilds an equal program."""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

from ._program import Boundary, IntegerProgram, QTensor, Step

FORMAT = "quantbridge.integer/1"


def _tensor(t: QTensor) -> dict[str, Any]:
    return {"name": t.name, "dtype": np.dtype(t.dtype).name, "scale": t.scale,
            "zero_point": t.zero_point}  # fmt: skip


def _scalar(v: Any) -> Any:
    if isinstance(v, np.dtype) or (isinstance(v, type) and issubclass(v, np.generic)):
        return {"dtype": np.dtype(v).name}
    if isinstance(v, dict):
        return {"dict": {str(k): _scalar(x) for k, x in v.items()}}
    if isinstance(v, (tuple, list)):
        return [_scalar(x) for x in v]
    if isinstance(v, np.generic):
        return v.item()
    return v


def _unscalar(v: Any) -> Any:
    if isinstance(v, dict) and "dtype" in v:
        return np.dtype(v["dtype"])
    if isinstance(v, dict) and "dict" in v:
        return {int(k): _unscalar(x) for k, x in v["dict"].items()}
    if isinstance(v, list):
        return tuple(_unscalar(x) for x in v)
    return v


def save_npz(program: IntegerProgram, path: str | os.PathLike) -> None:
    arrays: dict[str, np.ndarray] = {}
    steps = []
    for i, s in enumerate(program.steps):
        attrs, array_keys = {}, []
        for k, v in s.attrs.items():
            if isinstance(v, np.ndarray):
                arrays[f"step{i}/{k}"] = v
                array_keys.append(k)
            else:
                attrs[k] = _scalar(v)
        steps.append({"op": s.op, "node": s.node, "inputs": list(s.inputs), "output": s.output,
                      "attrs": attrs, "arrays": array_keys})  # fmt: skip
    for name, q in program.constants.items():
        arrays[f"const/{name}"] = q
    for i, b in enumerate(program.outputs):
        if b.table is not None:
            arrays[f"output{i}/table"] = b.table
        if b.scale is not None:
            arrays[f"output{i}/scale"] = b.scale
            arrays[f"output{i}/axis"] = np.array(b.axis)
    doc = {
        "format": FORMAT,
        "tensors": [_tensor(t) for t in program.tensors.values()],
        "inputs": [[b.name, b.tensor.name, b.is_float] for b in program.inputs],
        "outputs": [[b.name, b.tensor.name, b.is_float] for b in program.outputs],
        "steps": steps,
        "onnx_tensors": program.onnx_tensors,
        "input_shapes": {k: list(v) if v else None for k, v in program.input_shapes.items()},
    }
    arrays["program.json"] = np.array(json.dumps(doc))
    np.savez_compressed(path, **arrays)


def load_npz(path: str | os.PathLike) -> IntegerProgram:
    with np.load(path, allow_pickle=False) as data:
        doc = json.loads(str(data["program.json"]))
        if doc.get("format") != FORMAT:
            raise ValueError(
                f"{os.fspath(path)!r} is not a {FORMAT} program (format {doc.get('format')!r})"
            )
        arrays = {k: data[k] for k in data.files if k != "program.json"}
    tensors = {t["name"]: QTensor(t["name"], np.dtype(t["dtype"]), t["scale"], t["zero_point"])
               for t in doc["tensors"]}  # fmt: skip
    steps = []
    for i, s in enumerate(doc["steps"]):
        attrs = {k: _unscalar(v) for k, v in s["attrs"].items()}
        attrs.update({k: arrays[f"step{i}/{k}"] for k in s["arrays"]})
        steps.append(Step(s["op"], s["node"], tuple(s["inputs"]), s["output"], attrs))
    constants = {k[len("const/") :]: v for k, v in arrays.items() if k.startswith("const/")}
    inputs = [Boundary(n, tensors[t], f) for n, t, f in doc["inputs"]]
    outputs = [Boundary(n, tensors[t], f, arrays.get(f"output{i}/table"),
                        arrays.get(f"output{i}/scale"), int(arrays.get(f"output{i}/axis", -1)))
               for i, (n, t, f) in enumerate(doc["outputs"])]  # fmt: skip
    shapes = {k: tuple(v) if v else None for k, v in doc["input_shapes"].items()}
    return IntegerProgram(inputs, outputs, steps, tensors, constants, doc["onnx_tensors"], shapes)
