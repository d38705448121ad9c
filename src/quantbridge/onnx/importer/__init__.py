"""ONNX import: an ONNX graph as a trainable torch ``nn.Module``.

Owns the op registry keyed by ONNX op type and opset (``_registry``), one file per op family
(``_nn`` weighted layers and normalisation, ``_ops`` elementwise and math, ``_pool`` pooling,
``_recurrent`` LSTM / GRU / RNN as torch recurrent layers, ``_tensor`` shape and data movement),
the module that runs the graph in topological order (``_module``) and the entry point with its
graph-level rewrites (``_import``).

Quantized files (QDQ, QOperator, dynamic): ``_quantized`` normalises them to a float graph with
``Site`` markers and the file's record (rules in ``_qdq``, ``_qoperator``, ``_dynamic``; scales and
zero points validated in ``_qparams``), ``_site`` is the marker op, and ``_qmodel`` builds the
``QuantModel`` with the file's quantizers.
"""

from ._import import import_onnx
from ._module import OnnxModule
from ._registry import supported_ops

__all__ = ["OnnxModule", "import_onnx", "supported_ops"]
