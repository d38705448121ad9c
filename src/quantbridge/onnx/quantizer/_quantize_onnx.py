"""``quantize_onnx``: a float ONNX file in, a calibrated QDQ ONNX file out.

There is no second quantizer: the file goes through the same steps as a torch model,

1. ``import_onnx`` (a float ``nn.Module``; a file below opset 13 whose ops the importer refuses at
   that opset is first upgraded with ``onnx.version_converter``);
2. ``quantize`` (capture, placement, calibration on the checked ``CalibrationSet``, freeze),
   with the output head in float (``_head``: ``-> Sigmoid`` / ``-> Softmax`` layers; ``_outputs``:
   a layer writing a graph output whose channels span ranges too far apart for one scale);
3. ``to_onnx`` (QDQ export at the recipe's opset, >= 13), then ``onnx.checker`` (full check).

The output keeps the source's interface: graph input and output names, static dimensions, and
dynamic dimensions dynamic (under the source's symbolic names). Which dimensions the capture
treats as dynamic follows the file: none, the batch dimension, or all of them (``Dim.AUTO``:
those the model pins, such as channels, stay static).
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import onnx
from onnx import version_converter

from ...optables import is_quantized_op
from ...recipe import Recipe, resolve_recipe
from ...torch import CaptureError, QuantModel, quantize
from ...torch._progress import progress_scope
from .._load import parse_onnx
from ..exporter import to_onnx
from ..exporter._export import _check_writable as check_writable
from ..importer import import_onnx
from ._calib_data import CalibrationSet, GraphInput, graph_inputs
from ._head import head_rules
from ._outputs import output_rules

MIN_OPSET = 13  # per-axis DequantizeLinear


def quantize_onnx(
    src: str | os.PathLike | onnx.ModelProto,
    calib,
    dst: str | os.PathLike | None = None,
    recipe: Recipe | str | dict | os.PathLike | None = "default",
    method: str | None = None,
    opset: int | None = None,
    progress: bool = True,
    batch_size: int | None = None,
    float_head: bool = True,
) -> onnx.ModelProto:
    """Quantize the float ONNX model ``src`` to QDQ INT8; write it to ``dst`` when given.

    ``calib``: an ``.npz`` keyed by input name (samples on axis 0), a folder of ``.npy`` /
    ``.npz`` files, or a mapping ``{input name: array}`` (see ``_calib_data``). ``recipe``: a
    preset name, a ``Recipe``, its dict, or a ``.yaml`` / ``.json`` file. ``method`` overrides the
    activations' calibration method (minmax, percentile, entropy, mse). ``opset``: of the output
    (>= 13; default the recipe's, else 18). ``batch_size``: samples per calibration forward pass
    (default 8, or the file's static batch size). ``float_head``: keep the weighted layers whose
    outputs reach a graph output through float ops only (``-> Sigmoid``, ``-> Softmax``) in
    float (``_head``), and those writing a graph output of mixed channel ranges (``_outputs``).
    """
    model = load_model(src)
    _refuse_quantized(model)
    if dst is not None:  # before minutes of calibration, not after
        check_writable(dst)
    inputs = graph_inputs(model)
    data = CalibrationSet(calib, inputs, batch_size)
    the_recipe = _recipe(recipe, method)
    if opset is not None and opset < MIN_OPSET:
        raise ValueError(f"opset {opset}: a QDQ file needs opset >= {MIN_OPSET}; use --opset 13+")
    module = _import(model)
    _refuse_quantized(model, module)
    if float_head:
        the_recipe = the_recipe.with_rules(*head_rules(model, module.onnx_names))
        the_recipe = the_recipe.with_rules(*output_rules(model, module, data.first()))
    dynamic = dynamic_mode(inputs)
    try:
        qmodel = quantize(module, data, the_recipe, progress=progress, dynamic=dynamic)
    except CaptureError as e:  # its advice is about user torch code; here the code is generated
        first = str(e).strip().splitlines()[0]
        raise ValueError(
            f"the imported graph could not be captured for quantization: {first}"
        ) from e
    with progress_scope(progress):  # progress=False: no export stage line either
        out = to_onnx(qmodel, data.first(), opset=opset, dynamic=dynamic)
    keep_interface(out, model)
    onnx.checker.check_model(out, full_check=True)
    if dst is not None:
        onnx.save_model(out, os.fspath(dst))
    return out


def load_model(src) -> onnx.ModelProto:
    """The ModelProto of ``src``; one-line ValueError for a missing, truncated or non-ONNX file."""
    if isinstance(src, onnx.ModelProto):
        return src
    if not isinstance(src, (str, os.PathLike)):
        raise TypeError(
            f"quantize_onnx expects a path or an onnx.ModelProto, got {type(src).__name__}"
        )
    path = Path(src)
    if not path.is_file():
        raise ValueError(f"no ONNX file at {str(path)!r}")
    model = parse_onnx(lambda: onnx.load(str(path)), repr(str(path)))
    if not model.graph.node:
        raise ValueError(f"{str(path)!r} holds no ONNX graph (empty or not an ONNX file)")
    return model


def _recipe(recipe, method: str | None) -> Recipe:
    resolved = resolve_recipe(recipe)  # a preset, a Recipe, its dict or a .yaml / .json file
    if method is not None:
        resolved = replace(resolved, activations=replace(resolved.activations, method=method))
    return resolved


def _refuse_quantized(model: onnx.ModelProto, module=None) -> None:
    """ValueError when the file is already INT8 (QDQ, QOperator, dynamic): nothing to calibrate.
    Checked on the file's ops first (before the calibration data is read against its inputs),
    then on what ``import_onnx`` made of it (a ``QuantModel``: weight-only files too)."""
    ops = sorted({n.op_type for n in model.graph.node if is_quantized_op(n.op_type)})
    if not ops and not isinstance(module, QuantModel):
        return
    found = f" ({', '.join(ops)})" if ops else ""
    raise ValueError(
        f"the model is already quantized{found}; quantize_onnx takes a float model: "
        "pass the float file it came from, or fine-tune this one as it is "
        "(qb.import_onnx gives a trainable QuantModel)"
    )


def default_opset(model: onnx.ModelProto) -> int:
    return next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)


def _import(model: onnx.ModelProto):
    """``import_onnx``; a file below opset 13 that it refuses is upgraded and tried again."""
    try:
        return import_onnx(model)
    except ValueError as refused:
        if default_opset(model) >= MIN_OPSET:
            raise
        try:
            upgraded = version_converter.convert_version(model, MIN_OPSET)
            return import_onnx(upgraded)
        except Exception:  # noqa: BLE001 - the original refusal names the op; report that
            raise refused from None


def dynamic_mode(inputs: list[GraphInput]) -> str:
    """``none`` (every float input dimension static), ``batch`` (only dimension 0 dynamic) or
    ``all`` (another one dynamic), as the file declares its inputs."""
    dynamic = {axis for i in inputs for axis, d in enumerate(i.dims) if not isinstance(d, int)}
    if not dynamic:
        return "none"
    return "batch" if dynamic == {0} else "all"


def keep_interface(out: onnx.ModelProto, source: onnx.ModelProto) -> None:
    """Give ``out`` the graph input / output names and dimensions of ``source`` (in order)."""
    inits = {i.name for i in source.graph.initializer}
    src_inputs = [v for v in source.graph.input if v.name not in inits]
    pairs = list(zip(out.graph.input, src_inputs, strict=False))
    pairs += list(zip(out.graph.output, source.graph.output, strict=False))
    taken = {n for node in out.graph.node for n in list(node.input) + list(node.output)}
    taken |= {i.name for i in out.graph.initializer}
    for new, old in pairs:
        if new.name != old.name:
            if old.name in taken:
                _rename(out.graph, old.name, f"{old.name}__qb_internal")
            _rename(out.graph, new.name, old.name)
        _copy_dims(new, old)


def _rename(graph: onnx.GraphProto, old: str, new: str) -> None:
    for node in graph.node:
        node.input[:] = [new if n == old else n for n in node.input]
        node.output[:] = [new if n == old else n for n in node.output]
    for value in list(graph.input) + list(graph.output) + list(graph.value_info):
        if value.name == old:
            value.name = new


def _copy_dims(new: onnx.ValueInfoProto, old: onnx.ValueInfoProto) -> None:
    """Static sizes and symbolic names of ``old``; an unknown dimension of ``old`` keeps the
    export's (symbolic) one."""
    src, dst = old.type.tensor_type.shape.dim, new.type.tensor_type.shape.dim
    if len(src) != len(dst):
        return
    for s, d in zip(src, dst, strict=True):
        if s.dim_value > 0:
            d.dim_value = s.dim_value
        elif s.dim_param:
            d.dim_param = s.dim_param
