"""The engine layer: a model quantbridge can export, run by an inference engine from Python and
called exactly like the user's model.

Owns ``to_engine`` and ``EngineModel`` (``_model``: forms, lazy sessions, the float/INT8 switch),
the mapping of calls onto graph inputs and of graph outputs back to the user's structure
(``_signature``), the engines in a registry keyed by name (``_backends``: ONNX Runtime, OpenVINO;
``_integer``: the integer-only program, and ``integer_mode``) and the engine-model checkpoint (``_checkpoint``, reached through ``qb.save``/``qb.load``).
Sits above ``onnx`` (whose exporter records the call signature it reads); ``debug`` may use it.
"""

from ._backends import ENGINES
from ._checkpoint import load as load_engine_model
from ._integer import integer_mode
from ._model import TRAIN_MESSAGE, EngineModel, to_engine

__all__ = [
    "ENGINES",
    "TRAIN_MESSAGE",
    "EngineModel",
    "integer_mode",
    "load_engine_model",
    "to_engine",
]
