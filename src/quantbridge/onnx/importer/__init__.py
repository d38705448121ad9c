"""ONNX import: an ONNX graph as a trainable torch ``nn.Module``.

Owns the op registry keyed by ONNX op type and opset (``_registry``), one file per op family
(``_nn`` weighted layers and normalisation, ``_ops`` elementwise and math, ``_pool`` pooling,
``_tensor`` shape and data movement), the module that runs the graph in topological order
(``_module``) and the entry point with its graph-level rewrites (``_import``).
"""

from ._import import import_onnx
from ._module import OnnxModule
from ._registry import supported_ops

__all__ = ["OnnxModule", "import_onnx", "supported_ops"]
