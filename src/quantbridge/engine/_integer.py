"""The integer-only program as an engine, and ``integer_mode``: a QuantModel that computes exactly
the integers the integer-only program computes.

Fake quantization in torch and an integer engine drift apart on deep networks: torch sums float
products and requantizes with a float scale, the engine sums integers and requantizes with a
fixed-point multiplier and one rounding, and a single flipped code grows layer after layer
(DESIGN.md). ``integer_mode(qmodel)`` makes calls of the QuantModel return what
``qb.lower(qb.export(qmodel))`` computes, bit for bit:

* the QuantModel is exported (the same QDQ file ``qb.export`` writes, in memory) and lowered
  once per ``with`` block, at the first call, on that call's inputs;
* every call runs the program: integer accumulation (int8 x int8 sums in float64 BLAS, exact
  below 2**53), + int32 bias, requantization ``(acc * M) >> n`` with one round-half-to-even
  (``numerics.requantize``), lookup tables for elementwise functions; the outputs are dequantized
  with the output quantizer's scale and zero point, as torch tensors on the caller's device, in
  the structure the model returns.

What runs is the program's reference executor (``IntegerProgram.run``, numpy), behind the
QuantModel's own call signature: there is one implementation of the integer arithmetic, and
``integer_mode`` cannot disagree with it. Outputs carry no gradient (integer arithmetic has
none): train with fake quantization, check with ``integer_mode``.

``to_engine(qmodel, "integer")`` is the same program as an ``EngineModel`` kept beyond a block.
Options: ``accumulator_bits`` (32 or 64) and ``float_outputs`` (``"dequantize"``: a final float
function of the last codes, such as a detector's Sigmoid, is applied outside the program, and
float logits of ``Recipe(quantize_outputs=False)`` are the last layer's int32 accumulator times
its scale), as ``qb.lower``. The program is lowered for each call's input shapes.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import numpy as np
import onnx

from ..integer import IntegerProgram, lower
from ..torch import QuantModel
from ._backends import _PACKAGES, ENGINES
from ._model import to_engine


class IntegerSession:
    """``qb.lower`` of the model bytes, run by the numpy executor; lowered once per set of input
    shapes (static sizes let a global average pool over a dynamic H x W lower)."""

    engine = "integer"
    OPTIONS = ("accumulator_bits", "float_outputs")

    def __init__(self, model: bytes, threads: int | None, options: dict):
        del threads  # the executor's BLAS calls use numpy's own threads
        self.model = onnx.load_from_string(model)
        self.options = {"accumulator_bits": options.get("accumulator_bits", 32),
                        "float_outputs": options.get("float_outputs", "dequantize")}  # fmt: skip
        self.programs: dict[tuple, IntegerProgram] = {}
        self.device = "cpu"
        self.output_names = [o.name for o in self.model.graph.output]

    def program(self, feeds: dict[str, np.ndarray]) -> IntegerProgram:
        """The program lowered for the shapes of ``feeds`` (kept for the next call)."""
        shapes = {name: tuple(np.shape(v)) for name, v in feeds.items()}
        key = tuple(sorted(shapes.items()))
        if key not in self.programs:
            self.programs[key] = lower(self.model, input_shapes=shapes, **self.options)
        return self.programs[key]

    def run(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        outputs = self.program(feeds).run(feeds)
        return [outputs[name] for name in self.output_names]


ENGINES["integer"] = IntegerSession
_PACKAGES["integer"] = ("numpy", "quantbridge")


def _example(args: tuple, kwargs: dict) -> Any:
    """A call's inputs in the form ``to_engine``'s ``example_inputs`` takes."""
    if args and kwargs:
        raise TypeError(
            "integer_mode: call the model with positional or with keyword inputs, not both "
            f"(got {len(args)} positional and {sorted(kwargs)})"
        )
    if kwargs:
        return kwargs
    return args[0] if len(args) == 1 else args


@contextlib.contextmanager
def integer_mode(
    model: QuantModel, *, accumulator_bits: int = 32, float_outputs: str = "dequantize"
) -> Iterator[QuantModel]:
    """Within the block, ``model(...)`` returns exactly what the integer-only program of its QDQ
    export computes (module docstring); the fake-quantized forward comes back on exit.

    ``model``: a QuantModel (``qb.quantize`` / ``qb.prepare_qat``). A model with ops that have
    no integer lowering raises ``qb.LoweringError`` at the first call, naming them all.
    """
    if not isinstance(model, QuantModel):
        raise TypeError(
            f"integer_mode takes the QuantModel returned by qb.quantize, got "
            f"{type(model).__name__}; quantize the model first"
        )
    if "forward" in model.__dict__:
        raise RuntimeError("integer_mode: this QuantModel is already in integer_mode")
    engine = None

    def forward(*args: Any, **kwargs: Any) -> Any:
        nonlocal engine
        if engine is None:
            del model.forward  # the export traces (and copies) the fake-quantized forward
            try:
                engine = to_engine(
                    model, "integer", example_inputs=_example(args, kwargs),
                    accumulator_bits=accumulator_bits, float_outputs=float_outputs,
                )  # fmt: skip
            finally:
                model.forward = forward
        return engine(*args, **kwargs)

    model.forward = forward  # an instance attribute: nn.Module.__call__ finds it first
    try:
        yield model
    finally:
        del model.forward
