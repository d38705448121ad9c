"""ONNX Runtime's ``com.microsoft.MatMulNBits`` (group-wise weights of ``MatMulNBitsQuantizer``)
unfolded into a float ``MatMul`` on the dequantized weight, with the file's blocks recorded.

``MatMulNBits(A, B, scales[, zero_points[, g_idx[, bias]]])`` computes ``A @ W (+ bias)`` with
``W [K, N]`` the transpose of ``dequant(B) [N, K]``. Layout (ONNX Runtime's contrib-op spec and
its ``matmul_nbits_quantizer``), with ``n_blocks = ceil(K / block_size)``:

* ``B``: uint8 ``[N, n_blocks, block_size * bits / 8]``; the codes of row ``n`` are packed along
  ``K`` low bits first (4 bits: code ``2j`` in the low nibble of byte ``j``, ``2j + 1`` in the
  high one); the last block is padded past ``K``.
* ``scales``: float ``[N, n_blocks]`` (or flat ``[N * n_blocks]``).
* ``zero_points``: absent (every block's zero point is ``2 ** (bits - 1)``: 8 for 4 bits), or
  uint8 ``[N, ceil(n_blocks * bits / 8)]`` (or flat), packed per row low bits first as ``B``.
  Float zero points (the type of ``A``) are not affine integer grids: refused.
* ``g_idx`` (act-order, a permutation of ``K``): refused. ``bias``: float ``[N]``, added.
* ``accuracy_level=4``: ONNX Runtime's CPU kernel then quantizes ``A`` too, per row in blocks of
  ``block_size`` along ``K``, symmetric int8 (``s = max|a| / 127``, codes ``round(a / s)``),
  and sums the integer products (measured: that emulation equals ORT's output within 4e-6 where
  the float product differs by 0.02-0.04). The import computes the op's definition with float
  ``A`` (accuracy levels are the engine's choice, not part of the weights): it warns
  (``AccuracyLevelWarning``, naming the node) instead of silently differing from ORT.

The rewrite (Case 8 of ``_quantized``): the codes as a ``[K, N]`` constant blocked along axis 0
(``FileQParams.block_size``), read like a blocked DequantizeLinear's (``Normaliser.read``, the
float constant recorded with its codes), then ``MatMul(A, W)`` and ``Add(., bias)``. The import
gives the layer a ``BlockWeightQuantizer`` (``_qmodel``); export writes the weight back as an
opset-21 ``DequantizeLinear(block_size)`` (UINT4 for 4 bits), not as ``MatMulNBits``.

``com.microsoft.GatherBlockQuantized(data, indices, scales[, zero_points])`` (the embedding table
of ``MatMulNBitsQuantizer(op_types_to_quantize=(..., "Gather"))``) is, by its contrib-op spec,
``Gather(dequant(data), indices, axis=gather_axis)`` with ``dequant`` blocked along
``quantize_axis`` in blocks of ``block_size``: ``data`` INT4 / UINT4 (as written by ONNX Runtime's
quantizer), ``scales`` / ``zero_points`` of the data's rank with ``ceil(D / block_size)`` along
that axis. The rewrite reads it as that blocked DequantizeLinear of a constant (the table recorded
with its codes) followed by a float ``Gather``. Packed ``uint8`` data (the ``bits`` attribute)
and absent zero points are refused by name (ONNX Runtime's quantizer writes neither). A block of
scale 0 (an all-zero row: BERT's padding embedding) is read as scale 1 with its codes on the zero
point: the same values, 0.
"""

from __future__ import annotations

import warnings

import ml_dtypes
import numpy as np
import onnx

from ._qparams import read_qparams
from ._quantized import Normaliser, rule

_BITS = (2, 4, 8)  # packings that fill a byte (the ones ONNX Runtime's CPU kernels run)
_INT8_ACTIVATIONS = 4  # MatMulNBits accuracy_level at which ORT quantizes A to int8


class AccuracyLevelWarning(UserWarning):
    """A ``MatMulNBits`` whose ``accuracy_level`` makes ONNX Runtime quantize its activation to
    int8: the imported model computes it in float (see the module docstring)."""


def unpack_low_first(packed: np.ndarray, bits: int, count: int) -> np.ndarray:
    """The first ``count`` codes of ``bits`` bits packed low bits first along the last axis of
    uint8 ``packed`` (int64; leading axes kept)."""
    per_byte = 8 // bits
    shifts = np.arange(per_byte, dtype=np.uint8) * bits
    codes = (packed[..., None] >> shifts) & np.uint8(2**bits - 1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :count].astype(np.int64)


@rule("MatMulNBits")
def _matmul_nbits(ctx: Normaliser, node: onnx.NodeProto) -> None:
    attrs = ctx.attrs(node)
    where = ctx.where(node)
    k, n, bits, block = (int(attrs[a]) for a in ("K", "N", "bits", "block_size"))
    inputs = list(node.input) + [""] * (6 - len(node.input))
    if bits not in _BITS:
        raise ValueError(
            f"{where}: bits={bits}; quantbridge imports MatMulNBits with bits in {_BITS}"
        )
    if inputs[4]:
        raise ValueError(
            f"{where}: g_idx (act-order) is not supported; re-quantize without act-order "
            "(ONNX Runtime's MatMulNBitsQuantizer RTN / HQQ modes write none)"
        )
    packed = ctx.const(inputs[1])
    scale = ctx.const(inputs[2])
    if packed is None or scale is None:
        raise ValueError(f"{where}: B and scales must be constants (initializers)")
    n_blocks = -(-k // block)
    if packed.shape != (n, n_blocks, block * bits // 8):
        raise ValueError(
            f"{where}: B has shape {packed.shape}; with K={k}, N={n}, bits={bits}, "
            f"block_size={block} it must be {(n, n_blocks, block * bits // 8)}"
        )
    if int(attrs.get("accuracy_level", 0)) == _INT8_ACTIVATIONS:
        warnings.warn(
            f"{where}: accuracy_level=4, so ONNX Runtime's CPU kernel quantizes its input A to "
            f"int8 per block of {block} along K (symmetric, scale max|a|/127) before the product; "
            "the imported model computes A in float, as the op defines it, and differs from ORT "
            "by that int8 rounding of A. To compare like with like, set the node's "
            "accuracy_level to 0 in the file (or re-quantize with accuracy_level=None)",
            AccuracyLevelWarning,
            stacklevel=2,
        )
    codes = unpack_low_first(packed.reshape(n, -1), bits, n_blocks * block)[:, :k]  # [N, K]
    zero = _zero_points(ctx, node, inputs[3], n, n_blocks, bits)
    unsigned = ml_dtypes.uint4 if bits == 4 else np.uint8
    qp = read_qparams(
        f"{where} operand {inputs[1]!r}",
        np.ascontiguousarray(scale.reshape(n, n_blocks).T),
        np.ascontiguousarray(zero.T).astype(unsigned),
        0, 2, None, block,
    )  # fmt: skip
    if bits != 4 and bits != 8:
        qp = qp.narrowed(0, 2**bits - 1, where)
    name = ctx.add_const(f"{inputs[1]}_codes", np.ascontiguousarray(codes.T))  # [K, N]
    ctx.const_types[name] = qp.onnx_type
    weight = ctx.read(node, name, qp)
    out = node.output[0]
    if inputs[5]:
        raw = f"{out}_qb_matmul"
        ctx.emit("MatMul", [inputs[0], weight], [raw], name=node.name)
        ctx.emit("Add", [raw, inputs[5]], [out], name=f"{node.name}_bias")
    else:
        ctx.emit("MatMul", [inputs[0], weight], [out], name=node.name)


def _zero_points(ctx: Normaliser, node, name: str, n: int, n_blocks: int, bits: int) -> np.ndarray:
    """``[N, n_blocks]`` integer zero points (``2 ** (bits - 1)`` when absent)."""
    if not name:
        return np.full((n, n_blocks), 2 ** (bits - 1), np.int64)
    packed = ctx.const(name)
    if packed is None or packed.dtype != np.uint8:
        raise ValueError(
            f"{ctx.where(node)}: zero points {name!r} must be a packed uint8 constant; float "
            f"zero points ({'run-time' if packed is None else packed.dtype}) are not an integer "
            "grid quantbridge imports (re-quantize with integer zero points)"
        )
    per_row = -(-n_blocks * bits // 8)
    if packed.size != n * per_row:
        raise ValueError(
            f"{ctx.where(node)}: zero points {name!r} hold {packed.size} bytes; N={n} rows of "
            f"{n_blocks} blocks at {bits} bits need {n * per_row}"
        )
    return unpack_low_first(packed.reshape(n, per_row), bits, n_blocks)


@rule("GatherBlockQuantized")
def _gather_block_quantized(ctx: Normaliser, node: onnx.NodeProto) -> None:
    attrs = ctx.attrs(node)
    where = ctx.where(node)
    data, indices, scale, zero = (list(node.input) + [""] * 4)[:4]
    codes = ctx.const(data)
    if codes is None or str(codes.dtype) not in ("int4", "uint4"):
        kind = "a run-time tensor" if codes is None else str(codes.dtype)
        raise ValueError(
            f"{where}: data {data!r} is {kind}; quantbridge imports GatherBlockQuantized with an "
            "INT4 / UINT4 constant table (as ONNX Runtime's MatMulNBitsQuantizer writes it); "
            "re-quantize the embedding with that quantizer, or keep the Gather in float"
        )
    if not zero:
        raise ValueError(
            f"{where}: no zero points; quantbridge imports GatherBlockQuantized with explicit "
            "zero points (re-quantize with ONNX Runtime's MatMulNBitsQuantizer, which writes them)"
        )
    axis = int(attrs.get("quantize_axis", 1))
    block = int(attrs.get("block_size", 128))
    scale, zero_point = ctx.const(scale), ctx.const(zero)
    if scale is not None and zero_point is not None and (scale == 0).any():
        scale, codes = _zero_blocks(scale, zero_point, codes, axis, block)
        data = ctx.add_const(f"{data}_qb_zero_blocks", codes)
    qp = read_qparams(f"{where} operand {data!r}", scale, zero_point, axis, codes.ndim, None,
                      block)  # fmt: skip
    table = ctx.read(node, data, qp)
    ctx.emit("Gather", [table, indices], [node.output[0]], name=node.name,
             axis=int(attrs.get("gather_axis", 0)))  # fmt: skip


def _zero_blocks(scale, zero_point, codes, axis: int, block: int):
    """Blocks of scale 0 (an all-zero row of the table: BERT's padding embedding) as scale 1 with
    every code on the zero point: the same dequantized values (0), on a valid grid."""
    axis = axis % codes.ndim
    zero_block = np.repeat(scale == 0, block, axis=axis)
    zero_block = np.take(zero_block, np.arange(codes.shape[axis]), axis=axis)
    at_zero = np.repeat(zero_point, block, axis=axis)
    at_zero = np.take(at_zero, np.arange(codes.shape[axis]), axis=axis)
    return np.where(scale == 0, np.float32(1), scale), np.where(zero_block, at_zero, codes)
