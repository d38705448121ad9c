"""QOperator and dynamic-quantization ops unfolded into float ops and ``Site`` nodes (Case 6 of
``_quantized``): each integer operand is read as its dequantized float value, the float op
computes, and a ``Site`` quantizes the result onto the op's output grid."""

from __future__ import annotations
