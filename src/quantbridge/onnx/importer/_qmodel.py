"""The ``QuantModel`` of a quantized ONNX file: the float import captured, the file's quantizers in.

The normalised float graph (``_quantized``) is imported as an ``OnnxModule`` and captured with
``torch.export`` like any model (``torch._capture``). Its quantizers come from the file, through
the record, never from a recipe's placement nor from name matching:

* every ``Site`` in the captured graph becomes the ``Quantizer`` of its grid (one per grid; later
  sites of a grid, after data movement, call it with ``observe=False`` as placement does), set to
  the file's scale, zero point and integer range;
* a weighted op (conv, linear) whose weight the file stores as integers gets a ``WeightQuantizer``
  with the file's (per-channel) parameters; the parameter holds the dequantized integers, so
  fake quantization gives back exactly the file's codes. The layer's ONNX node (``onnx_names``)
  says which constant it was. Group-wise weights (``block_size``: opset 21 blocked
  DequantizeLinear, ``MatMulNBits``) get a ``BlockWeightQuantizer`` with the file's blocks (a
  MatMul's ``[K, N]`` weight is ``nn.Linear``'s ``[N, K]``: axis and blocks transposed);
* its int32 bias gets a ``BiasQuantizer`` when the file's bias scale is input scale x weight scale
  (as ONNX Runtime and QLinearConv have it): the codes are then recomputed bit for bit.
  Otherwise the bias stays float, holding the file's dequantized values;
* a per-tensor integer constant read by an add / sub / mul / div (ONNX Runtime quantizes the
  initializer operand of Add / Mul) gets a ``ConstantQuantizer`` with the file's parameters;
* a ``DynamicSite`` becomes a ``DynamicQuantizer`` (``torch/_dynamic.py``).

All quantizers are frozen; ``learn_scales=True`` makes them learnable (LSQ from the file's values).
"""

from __future__ import annotations

import re
import warnings

import numpy as np
import onnx
import torch
from torch import nn

from ...numerics import PerBlock, PerChannel, PerTensor, QScheme, bias_scale, dequantize
from ...recipe import Recipe, TensorRecipe
from ...torch._batches import as_call, input_spec
from ...torch._capture import CaptureError, capture
from ...torch._dynamic import DynamicQuantizer
from ...torch._fakequant import (
    BiasQuantizer,
    BlockWeightQuantizer,
    ConstantQuantizer,
    Quantizer,
    WeightQuantizer,
)
from ...torch._model import QuantModel
from ...torch._nodes import module_of
from ...torch._ops import WEIGHTED_OPS
from ...torch._passes import own_parameters
from ...torch._placement import CONTAINER, QuantPoint
from ...torch._signature import check_call_hook
from ._module import OnnxModule
from ._quantized import QuantRecord
from ._recurrent import warn_integer_weights
from ._site import DYNAMIC_SITE_TARGET, SITE_TARGET

_WEIGHT_INPUT, _BIAS_INPUT = 1, 2  # of Conv, ConvTranspose, Gemm, MatMul
_aten = torch.ops.aten
_ELEMENTWISE = {_aten.add.Tensor, _aten.sub.Tensor, _aten.mul.Tensor, _aten.div.Tensor}
# ops whose weight (and bias) the file may store as integers: (input, weight, bias, out axis)
# positions. LayerNormalization too: ONNX Runtime's QDQ files hold its scale as int8 and its bias
# as int32 with scale input x weight scale, as for a conv (placement never quantizes it itself)
_WEIGHTED = {**WEIGHTED_OPS, _aten.layer_norm.default: (0, 2, 3, 0)}


def example_inputs(proto: onnx.ModelProto, consts: set[str]) -> tuple[tuple, str]:
    """Inputs to capture with, from the file's input shapes (a free batch dimension -> 2), and
    the ``dynamic`` mode; ValueError naming the input when another dimension is free."""
    args, free_dims = [], False
    for v in proto.graph.input:
        if v.name in consts:
            continue
        t = v.type.tensor_type
        shape = []
        for i, d in enumerate(t.shape.dim):
            if d.HasField("dim_value") and d.dim_value > 0:
                shape.append(d.dim_value)
            elif i == 0:
                shape.append(2)
            else:
                free_dims = True
                shape.append(None)
        if None in shape:
            raise ValueError(
                f"input {v.name!r} has shape {_shape(t)} with free dimensions after the first; "
                "pass example_inputs=... to import_onnx (a tensor per input, of a typical size)"
            )
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        args.append(torch.from_numpy(np.zeros(shape, dtype=dtype)))
    return tuple(args), "all" if free_dims else "batch"


def _free_dims(proto: onnx.ModelProto, consts: set[str]) -> bool:
    """Whether an input has a free dimension besides the first (image sizes, lengths)."""
    return any(
        not (d.HasField("dim_value") and d.dim_value > 0)
        for v in proto.graph.input
        if v.name not in consts
        for d in list(v.type.tensor_type.shape.dim)[1:]
    )


def _capture_file(module, args, kwargs, dynamic: str, proto: onnx.ModelProto, consts: set[str]):
    """``capture`` with a free batch; a file that fixes every input's batch dimension and whose
    graph depends on it (a Reshape to ``[1, 512]``, as torch's dynamo exporter writes for a model
    exported at batch 1: PT2E, Brevitas) is captured at the file's own shapes instead, with a
    warning: the imported model then takes that batch size only, as the file does."""
    try:
        return capture(module, args, kwargs, dynamic), dynamic
    except CaptureError:
        fixed = {
            v.name: _shape(v.type.tensor_type) for v in proto.graph.input if v.name not in consts
        }
        if dynamic != "batch" or not all(s and isinstance(s[0], int) and s[0] > 0
                                         for s in fixed.values()):  # fmt: skip
            raise
    gm = capture(module, args, kwargs, "none")
    warnings.warn(
        f"the file fixes its inputs' batch size ({', '.join(f'{k!r} {v}' for k, v in fixed.items())}) "
        "and its graph depends on it (a Reshape to a fixed shape, as torch's exporter writes "
        "for a model exported without a dynamic batch): the imported model takes that batch "
        "size only. To train at other batch sizes, export the float model with a dynamic batch "
        "(torch.onnx.export(..., dynamic_shapes=...) or dynamic_axes) and quantize that file",
        stacklevel=4,
    )
    return gm, "none"


def _shape(t) -> list:
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in t.shape.dim]


class _Builder:
    def __init__(self, gm: torch.fx.GraphModule, module: OnnxModule, nodes: dict, record):
        self.gm, self.module, self.nodes, self.record = gm, module, nodes, record
        self.container = nn.Module()
        gm.add_submodule(CONTAINER, self.container)
        self.points: list[QuantPoint] = []
        self.by_grid: dict[int, tuple[Quantizer, str]] = {}

    def _add(self, module: nn.Module, point: QuantPoint) -> str:
        base = re.sub(r"\W", "_", point.name).strip("_") or "q"
        attr, i = base, 1
        while hasattr(self.container, attr):
            i += 1
            attr = f"{base}_{i}"
        self.container.add_module(attr, module)
        point.attr = attr
        self.points.append(point)
        return f"{CONTAINER}.{attr}"

    def _call(self, target: str, before: torch.fx.Node, value, kwargs=None) -> torch.fx.Node:
        with self.gm.graph.inserting_before(before):
            node = self.gm.graph.call_module(target, (value,), kwargs or {})
        node.meta["val"] = getattr(value, "meta", {}).get("val")
        node.meta["nn_module_stack"] = before.meta.get("nn_module_stack", {})
        return node

    # -- activations ----------------------------------------------------------------------------
    def sites(self) -> None:
        for node in list(self.gm.graph.nodes):
            if node.op == "call_function" and node.target is DYNAMIC_SITE_TARGET:
                self._dynamic(node)
                continue
            if node.op != "call_function" or node.target is not SITE_TARGET:
                continue
            x, grid, observe = node.args
            q, target = self._quantizer(grid, node)
            new = self._call(target, node, x, {} if observe else {"observe": False})
            node.replace_all_uses_with(new)
            self.gm.graph.erase_node(node)

    def _dynamic(self, node: torch.fx.Node) -> None:
        """A ``DynamicQuantizeLinear`` of the file: a ``DynamicQuantizer`` (kind ``dynamic``)."""
        x = node.args[0]
        name = getattr(x, "name", node.name)
        q = DynamicQuantizer(name)
        point = QuantPoint("", name, "dynamic", module_of(node)[0], node.name,
                           q.scheme.to_dict(), "file")  # fmt: skip
        new = self._call(self._add(q, point), node, x)
        node.replace_all_uses_with(new)
        self.gm.graph.erase_node(node)

    def _quantizer(self, grid: int, node: torch.fx.Node) -> tuple[Quantizer, str]:
        if grid not in self.by_grid:
            site = self.record.sites[grid]
            axis = site.qparams.axis  # per channel: NNCF's inputs of depthwise convs
            scheme = _scheme_on_axis(site.qparams.scheme(), axis)
            q = Quantizer(site.tensor, TensorRecipe(scheme), "activation", axis)
            q.set_qparams(site.qparams.scale, site.qparams.zero_point)
            point = QuantPoint("", site.tensor, "activation", module_of(node)[0], node.name,
                               scheme.to_dict(), "file")  # fmt: skip
            self.by_grid[grid] = (q, self._add(q, point))
        return self.by_grid[grid]

    # -- weights and biases ---------------------------------------------------------------------
    def weighted(self) -> None:
        for node in list(self.gm.graph.nodes):
            if node.op != "call_function" or node.target not in _WEIGHTED:
                continue
            i_x, i_w, i_b, _ = _WEIGHTED[node.target]
            w = node.args[i_w]
            if not (isinstance(w, torch.fx.Node) and w.op == "get_attr"):
                continue
            onnx_node = self.nodes.get(self.module.onnx_names.get(w.target.rpartition(".")[0]))
            if onnx_node is None or len(onnx_node.inputs) <= _WEIGHT_INPUT:
                continue
            found = self.record.weights.get(onnx_node.inputs[_WEIGHT_INPUT])
            if found is None:
                continue  # a float weight in the file: the op stays float
            wq = self._weight(w, *found, node)
            b = node.args[i_b] if len(node.args) > i_b else None
            if isinstance(b, torch.fx.Node) and b.op == "get_attr":
                self._bias(node, b, onnx_node, wq)

    def constants(self) -> None:
        """A tensor constant of an add / sub / mul / div that the file stores as integers (ONNX
        Runtime's ``Mul`` / ``Add`` by an initializer, QDQ or QLinearMul / QLinearAdd): a
        ``ConstantQuantizer`` on the file's per-tensor grid, so that export writes the file's codes
        again (``export(import(f))``). The buffer holds the dequantized codes, on that grid. A
        scalar (``x * 0.5`` with a DequantizeLinear'd code) is a buffer too (``_module``); a
        per-channel constant keeps its axis. One also read by other ops stays a float constant."""
        for node in list(self.gm.graph.nodes):
            if node.op != "get_attr":
                continue
            found = self.record.weights.get(self.module.onnx_names.get(node.target))
            if found is None:
                continue
            users = list(node.users)
            if not users or any(
                u.op != "call_function" or u.target not in _ELEMENTWISE for u in users
            ):
                continue
            qp = found[0]
            scheme = _scheme_on_axis(qp.scheme(), qp.axis)
            cq = ConstantQuantizer(
                node.target, TensorRecipe(scheme), self.gm.get_buffer(node.target), axis=qp.axis
            )
            cq.set_qparams(qp.scale, qp.zero_point)
            cq.constant_name = node.target
            point = QuantPoint("", node.target, "constant", module_of(users[0])[0], node.name,
                               scheme.to_dict(), "file")  # fmt: skip
            new = self._call(self._add(cq, point), node.next, node)
            for user in users:
                user.replace_input_with(node, new)

    def _weight(self, w: torch.fx.Node, qp, codes: np.ndarray, user) -> WeightQuantizer:
        param = self.gm.get_parameter(w.target).detach().numpy()
        values = np.asarray(
            dequantize(codes, qp.scale, qp.zero_point.astype(np.float32), qp.axis, qp.block_size),
            np.float32,
        )
        axis, scale, zero_point = qp.axis, qp.scale, qp.zero_point
        if param.shape == values.shape and np.array_equal(param, values):
            pass
        elif param.ndim == 2 and np.array_equal(param, values.T):
            axis = (
                None if axis is None else 1 - axis
            )  # MatMul / Gemm(transB=0) weights, in nn.Linear
            if qp.block_size is not None:  # the blocks transpose with the weight
                scale, zero_point = scale.T, zero_point.T
        else:
            raise ValueError(
                f"{qp.where}: the weight of shape {codes.shape} became a parameter of shape "
                f"{param.shape} with other values; this layout is not supported"
            )
        scheme = _scheme_on_axis(qp.scheme(), axis)
        if qp.block_size is not None:
            wq = BlockWeightQuantizer(w.target, TensorRecipe(scheme), axis, qp.block_size)
        else:
            wq = WeightQuantizer(w.target, TensorRecipe(scheme), axis)
        wq.weight_name = w.target
        wq.set_qparams(scale, zero_point)
        point = QuantPoint("", w.target, "weight", w.target.rpartition(".")[0], w.name,
                           scheme.to_dict(), "file")  # fmt: skip
        new = self._call(self._add(wq, point), user, w)
        user.replace_input_with(w, new)
        return wq

    def _bias(self, node: torch.fx.Node, b: torch.fx.Node, onnx_node, wq) -> None:
        inputs = onnx_node.inputs
        found = self.record.biases.get(inputs[_BIAS_INPUT]) if len(inputs) > _BIAS_INPUT else None
        grid = self.record.dequantized.get(inputs[0], self.record.tensor_grid.get(inputs[0]))
        if found is None or grid is None or grid not in self.by_grid:
            return
        iq = self.by_grid[grid][0]
        scale, codes = found
        if not np.array_equal(np.broadcast_to(bias_scale(iq.scale, wq.scale), scale.shape), scale):
            return  # another bias scale than input x weight: the float bias keeps the file's values
        bq = BiasQuantizer(b.target, iq, wq)
        bq.bias_name = b.target
        got = bq.integer_bias(self.gm.get_parameter(b.target)).numpy()
        if not np.array_equal(got.reshape(-1), codes.reshape(-1)):
            return  # codes beyond float32's integers: keep the file's values as a float bias
        point = QuantPoint("", b.target, "bias", b.target.rpartition(".")[0], b.name,
                           {"bits": 32, "signed": True}, "derived")  # fmt: skip
        node.replace_input_with(b, self._call(self._add(bq, point), node, b))


def _scheme_on_axis(scheme: QScheme, axis: int | None) -> QScheme:
    """``scheme`` per channel along ``axis`` (the file's axis, or a weight's axis in torch)."""
    if axis is None:
        return scheme
    g = scheme.granularity
    granularity = PerBlock(axis, g.block_size) if isinstance(g, PerBlock) else type(g)(axis)
    return type(scheme)(**{**scheme.__dict__, "granularity": granularity})


def _recipe(points: list[QuantPoint], opset: int) -> Recipe:
    """The recipe a QuantModel carries: the file's first activation (per-tensor) and weight
    schemes."""
    first = {}
    for p in points:
        if p.kind not in ("activation", "weight"):
            continue
        scheme = QScheme.from_dict(p.scheme)
        if isinstance(scheme.granularity, PerBlock):  # recipes hold no blocks: that axis
            opset = max(opset, 21)  # a MatMulNBits file's opset (18): blocked DQ needs 21
            scheme = _scheme_on_axis(scheme, None)
            scheme = QScheme(**{**scheme.__dict__, "granularity": PerChannel(0)})
        if p.kind == "weight" or isinstance(scheme.granularity, PerTensor):
            first.setdefault(p.kind, scheme)  # a recipe's activations are per tensor
    defaults = Recipe()
    weights = TensorRecipe(first["weight"]) if "weight" in first else defaults.weights
    acts = TensorRecipe(first["activation"]) if "activation" in first else defaults.activations
    return Recipe(weights=weights, activations=acts, opset=opset if opset >= 13 else None)


def quant_model(
    module: OnnxModule,
    graph,
    record: QuantRecord,
    proto: onnx.ModelProto,
    example=None,
    learn_scales: bool = False,
) -> QuantModel:
    """The ``QuantModel`` of the normalised import ``module`` (see the module docstring)."""
    if example is None:
        args, dynamic = example_inputs(proto, set(graph.consts))
        kwargs = {}
    else:
        args, kwargs = as_call(example, "example_inputs")
        dynamic = "all" if _free_dims(proto, set(graph.consts)) else "batch"
    gm, dynamic = _capture_file(module, args, kwargs, dynamic, proto, set(graph.consts))
    own_parameters(gm)
    builder = _Builder(gm, module, {n.name: n for n in graph.nodes}, record)
    builder.sites()
    builder.weighted()
    builder.constants()
    warn_integer_weights(module, builder.nodes, record.weights)
    gm.graph.lint()
    gm.recompile()
    opset = next((o.version for o in proto.opset_import if o.domain in ("", "ai.onnx")), 13)
    qmodel = QuantModel(gm, recipe=_recipe(builder.points, opset), points=builder.points,
                        source=module)  # fmt: skip
    qmodel.qb_capture = {
        "inputs": input_spec(args, kwargs),
        "dynamic": dynamic,
        "fold_bn": False,
        "made_by": "import_onnx",  # qb.load re-creates it from a fresh import, not by capture
        "io_names": module.qb_io_names,  # export and input errors keep the file's names
    }
    qmodel.register_forward_pre_hook(check_call_hook, with_kwargs=True)  # as quantize's models
    if learn_scales:
        for q in qmodel._all_quantizers():
            if isinstance(q, Quantizer):
                q.make_learnable()
    return qmodel.eval()
