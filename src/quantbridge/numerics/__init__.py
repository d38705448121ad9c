"""Numerics: pure array math for affine quantization (no graph, torch-module or ONNX knowledge).

Every formula lives here once; its docstring gives the order of operations, rounding mode,
saturation and dtypes. Array functions accept numpy arrays and torch tensors alike (torch is
never imported by this package).
"""

from ._affine import dequantize, fake_quantize, quantize
from ._bias import bias_scale, quantize_bias
from ._fixed_point import (
    multiply_by_quantized_multiplier,
    quantize_multiplier,
    rounding_divide_by_pot,
    saturating_rounding_doubling_high_mul,
)
from ._qparams import FALLBACK_SCALE, MIN_SCALE, choose_qparams, pow2_ceil
from ._scheme import (
    Granularity,
    PerChannel,
    PerTensor,
    QScheme,
    granularity_from_dict,
    storage_dtype,
)
from ._xp import normalize_axis

__all__ = [
    "FALLBACK_SCALE",
    "MIN_SCALE",
    "Granularity",
    "PerChannel",
    "PerTensor",
    "QScheme",
    "bias_scale",
    "choose_qparams",
    "dequantize",
    "fake_quantize",
    "granularity_from_dict",
    "multiply_by_quantized_multiplier",
    "normalize_axis",
    "pow2_ceil",
    "quantize",
    "quantize_bias",
    "quantize_multiplier",
    "rounding_divide_by_pot",
    "saturating_rounding_doubling_high_mul",
    "storage_dtype",
]
