"""Who produces and who reads each tensor of one ONNX graph, and which tensors are constants: the
index the fold pass's ``GraphView`` (``passes/_graph.py``) and the inspector's ``Graph``
(``inspector/_graph.py``) both start from; and ``unique_name``, a name not yet used in it."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper


def unique_name(base: str, used: set[str]) -> str:
    """``base``, else ``base_1``, ``base_2`` ...: the first not in ``used``, which it joins."""
    name, k = base, 0
    while name in used:
        k += 1
        name = f"{base}_{k}"
    used.add(name)
    return name


class GraphIndex:
    """``producer`` (tensor -> node), ``consumers`` (tensor -> nodes reading it, once per input
    slot), ``constants`` (initializers and the values of ``Constant`` nodes) and ``outputs`` (the
    graph outputs' names) of ``nodes``."""

    def __init__(
        self,
        nodes: list[onnx.NodeProto],
        initializers: dict[str, TensorProto],
        outputs: Iterable[str],
    ):
        self.nodes = nodes
        self.outputs = set(outputs)
        self.producer = {t: n for n in nodes for t in n.output if t}
        self.consumers: dict[str, list[onnx.NodeProto]] = {}
        for n in nodes:
            for t in n.input:
                if t:
                    self.consumers.setdefault(t, []).append(n)
        self.constants = dict(initializers)
        for n in nodes:
            if n.op_type == "Constant" and n.attribute and n.attribute[0].name == "value":
                self.constants[n.output[0]] = n.attribute[0].t

    def array(self, name: str) -> np.ndarray | None:
        """The value of constant ``name`` (None: not a constant)."""
        c = self.constants.get(name)
        return None if c is None else numpy_helper.to_array(c)
