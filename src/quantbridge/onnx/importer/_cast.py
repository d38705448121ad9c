"""``Cast`` and ``ConstantOfShape`` in a quantized graph (rules of ``_quantized``).

torch's TorchScript exporter writes a quantized eager-mode model (``torch.ao.quantization``
``convert``) as QDQ with two habits no other producer has:

* ``QuantizeLinear -> Cast(to=uint8) -> DequantizeLinear``: a Cast of integer codes to their own
  type. It changes nothing, so it is the identity on the codes' grid (a Cast to another type
  would change the codes' meaning and is refused, naming the node);
* the zero point of an int32 bias computed as ``ConstantOfShape([C]) -> Cast(to=int32)``. Both
  ops on constants are folded here, so the DequantizeLinear sees a constant zero point.

A Cast or ConstantOfShape of run-time float tensors stays the float op it is.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ._quantized import Normaliser, rule


@rule("Cast", quantized=False)
def _cast(ctx: Normaliser, node: onnx.NodeProto) -> None:
    x, out = node.input[0], node.output[0]
    to = int(ctx.attrs(node)["to"])
    if x in ctx.consts and x not in ctx.const_types:  # a constant: folded
        ctx.add_const(out, np.asarray(ctx.consts[x]).astype(helper.tensor_dtype_to_np_dtype(to)))
        return
    site = ctx.grid(x)
    if site is None:
        ctx.default(node)  # a float Cast
        return
    if to != site.qparams.onnx_type:
        name = onnx.TensorProto.DataType.Name
        raise ValueError(
            f"{ctx.where(node)} casts the {name(site.qparams.onnx_type)} codes of {x!r} to "
            f"{name(to)}, which changes what they mean; quantbridge imports a Cast of codes to "
            "their own type only (re-export the model, or remove the Cast)"
        )
    ctx.emit("Identity", [x], [out], name=node.name)  # codes cast to their own type
    ctx.record.tensor_grid[out] = site.grid


@rule("ConstantOfShape", quantized=False)
def _constant_of_shape(ctx: Normaliser, node: onnx.NodeProto) -> None:
    shape = ctx.const(node.input[0])
    if shape is None:
        ctx.default(node)
        return
    value = ctx.attrs(node).get("value")
    fill = numpy_helper.to_array(value) if value is not None else np.zeros(1, np.float32)
    ctx.add_const(node.output[0], np.full(tuple(int(d) for d in shape), fill.reshape(-1)[0]))
