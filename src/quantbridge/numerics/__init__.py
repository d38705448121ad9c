"""Numerics: pure array math for affine quantization (no graph, torch-module or ONNX knowledge).

Every formula lives here once; its docstring gives the order of operations, rounding mode,
saturation and dtypes. Array functions accept numpy arrays and torch tensors alike (torch is
never imported by this package).
"""

from ._adaround import (
    adaround_quantize,
    beta_schedule,
    floor_codes,
    hard_rounding,
    rectified_sigmoid,
    rectified_sigmoid_inverse,
    rounding_regularizer,
)
from ._affine import dequantize, fake_quantize, quantize
from ._bias import bias_scale, fit_weight_scale_to_bias, quantize_bias, shrink_bias_shift
from ._fixed_point import (
    multiply_by_quantized_multiplier,
    quantize_multiplier,
    rounding_divide_by_pot,
    saturating_rounding_doubling_high_mul,
)
from ._intmath import ISQRT_MAX, divide_half_even, isqrt_newton, round_divide
from ._pair_bound import broken_pairs, pair_bound, pair_bounded_codes, pair_bounded_scales
from ._qparams import FALLBACK_SCALE, MIN_SCALE, choose_qparams, pow2_ceil
from ._requantize import (
    common_shift_multipliers,
    fixed_point_multiplier,
    fixed_point_multipliers,
    is_power_of_two,
    requantize,
    rounding_shift_right,
)
from ._scheme import (
    Granularity,
    PerBlock,
    PerChannel,
    PerTensor,
    QScheme,
    granularity_from_dict,
    storage_dtype,
)
from ._weight_ranges import weighted_mse_scales, weighted_rounding_error
from ._xp import expand_blocks, normalize_axis

__all__ = [
    "ISQRT_MAX",
    "FALLBACK_SCALE",
    "MIN_SCALE",
    "Granularity",
    "PerBlock",
    "PerChannel",
    "PerTensor",
    "QScheme",
    "adaround_quantize",
    "beta_schedule",
    "bias_scale",
    "broken_pairs",
    "choose_qparams",
    "common_shift_multipliers",
    "dequantize",
    "divide_half_even",
    "expand_blocks",
    "fake_quantize",
    "fit_weight_scale_to_bias",
    "fixed_point_multiplier",
    "fixed_point_multipliers",
    "floor_codes",
    "hard_rounding",
    "granularity_from_dict",
    "is_power_of_two",
    "isqrt_newton",
    "multiply_by_quantized_multiplier",
    "normalize_axis",
    "pair_bound",
    "pair_bounded_codes",
    "pair_bounded_scales",
    "pow2_ceil",
    "quantize",
    "quantize_bias",
    "quantize_multiplier",
    "rectified_sigmoid",
    "rectified_sigmoid_inverse",
    "requantize",
    "rounding_divide_by_pot",
    "rounding_regularizer",
    "round_divide",
    "rounding_shift_right",
    "shrink_bias_shift",
    "saturating_rounding_doubling_high_mul",
    "storage_dtype",
    "weighted_mse_scales",
    "weighted_rounding_error",
]
