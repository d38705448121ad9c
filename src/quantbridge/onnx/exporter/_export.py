"""QDQ export: a ``QuantModel`` to an ONNX QDQ model that ONNX Runtime runs.

The form (see DESIGN.md "one canonical form"):

* weights: integer initializers (int8; int16 for 9-16 bits and INT4/UINT4 for <= 4 bits at
  opset 21, see ``_int4``) -> DequantizeLinear (per channel, ``axis`` = output channels); never a
  float weight followed by QuantizeLinear;
* biases: int32 initializers -> DequantizeLinear with ``scale = input scale x weight scale``;
* activations: QuantizeLinear -> DequantizeLinear pairs (QuantizeLinear -> Clip -> DequantizeLinear
  for narrow-range or sub-8-bit activations, see ``_translate``);
* the dynamic dimensions ``quantize`` captured (``dynamic="batch"``: the first dimension; ``"all"``:
  every dimension the model does not fix; ``"none"``), named by role: ``batch``, ``height``,
  ``width``, ``sequence`` (not torch's ``s53``).

Opset: the recipe's or the caller's, else 21 when a 16-bit scheme needs int16 QuantizeLinear or
4-bit weights can be stored as INT4 (half the int8 file), else 18 (the torch exporter's native
opset; ONNX Runtime 1.20+ runs it). Opsets 13-17 are reached by ``_opset.downgrade`` from 18.

Export goes through torch's ONNX exporter with our translation table (``_torch_onnx``: no
decomposition re-trace where the graph needs none). The program it translates is written from the
graph ``quantize`` captured (``_reuse``: no second trace) whenever that gives exactly what a trace
would, else traced once; the quantizers
are switched to export mode first (``quantbridge.torch._export_ops``), so the integers in the file
are computed by the same ``numerics`` functions torch used.
"""

from __future__ import annotations

import os
import re
import warnings
from typing import Any

import onnx
import torch

from ..._platform import SaturationWarning, safe_weight_bound, u8s8_saturates
from ...numerics import broken_pairs, pair_bound
from ...torch._batches import as_call
from ...torch._capture import (
    dynamic_shapes,
    fallback_message,
    quiet_torch,
    user_stacklevel,
    widen_batch,
)
from ...torch._deadline import CaptureTimeout, capture_budget, deadline
from ...torch._export_ops import code_extremes, export_mode
from ...torch._model import QuantModel, check_dynamic
from ...torch._nodes import weight_of
from ...torch._placement import CONTAINER
from ...torch._progress import progress_enabled, progress_scope, stage
from ...torch._qat import folded_copy
from ...torch._replace import adopt_replaced_layers
from ...torch._signature import check_example
from ...torch.ptq._pair_bound import engine_rows
from ._blocked_layout import untranspose_blocked_weights
from ._int4 import pack_4bit_weights
from ._io_names import io_names_of, keep_source_names
from ._merged_calls import pop_calls
from ._node_names import name_nodes
from ._opset import downgrade
from ._pad_codes import pad_on_codes
from ._record import record_quantizers
from ._relu_quant import relu_into_quantize
from ._requantize import drop_identity_requantize
from ._reuse import reused_program
from ._torch_onnx import export_program


class PerformanceWarning(UserWarning):
    """The exported form is correct but runs slowly on common engines."""


DEFAULT_OPSET = 18  # the torch exporter's native opset; lower targets go through _opset.downgrade
PACKED_4BIT_OPSET = 21  # DequantizeLinear takes INT4 / UINT4 from here (``_int4``)
_WEIGHT_INPUTS = {"Conv": 1, "Gemm": 1, "ConvTranspose": 1}


def _choose_opset(qmodel: QuantModel, opset: int | None) -> int:
    if opset is None:
        opset = qmodel.qb_recipe.opset
    need, why = 13, ""
    for q in qmodel.quantizers().values():
        scheme = getattr(q, "scheme", None)
        if scheme is not None and scheme.bits > 8:
            need, why = 21, "16-bit quantization"
        if getattr(q, "block_size", None) is not None:  # DequantizeLinear(block_size): opset 21
            need, why = 21, f"group-wise (blocked) quantization of weight {q.name!r}"
    if opset is None:  # 4-bit weights: opset 21 stores them as INT4, half the int8 file
        return max(DEFAULT_OPSET, need, PACKED_4BIT_OPSET if _has_4bit_weights(qmodel) else 0)
    if opset < 13:  # checked first: below 13 the 16-bit message below would be the wrong reason
        raise ValueError(f"opset {opset}: QDQ export needs opset >= 13 (per-axis DequantizeLinear)")
    if opset > (known := onnx.defs.onnx_opset_version()):  # else the checker's "Unrecognized ..."
        raise ValueError(
            f"opset {opset}: the installed onnx {onnx.__version__} knows opsets up to {known}; "
            f"pass opset={known} or less (None: {DEFAULT_OPSET}, what every engine reads)"
        )
    if opset < need:
        raise ValueError(
            f"opset {opset} cannot hold this model: {why} needs opset >= {need}; "
            f"pass opset={need} or more"
        )
    return opset


def _has_4bit_weights(qmodel: QuantModel) -> bool:  # per channel (group-wise: MatMulNBits)
    return any(
        getattr(q, "kind", "") == "weight" and q.scheme.bits <= 4 and not hasattr(q, "block_size")
        for q in qmodel.quantizers().values()
    )


def _check_writable(path: str | os.PathLike) -> str:
    path = os.fspath(path)
    if os.path.isdir(path):
        raise ValueError(
            f"cannot export to {path!r}: it is a directory; give a file name such as model.onnx"
        )
    folder = os.path.dirname(os.path.abspath(path)) or "."
    if not os.path.isdir(folder):
        raise ValueError(
            f"cannot export to {path!r}: folder {folder!r} does not exist; create it first"
        )
    if not os.access(folder, os.W_OK) or (os.path.exists(path) and not os.access(path, os.W_OK)):
        raise PermissionError(f"cannot export to {path!r}: not writable; choose a writable path")
    return path


def to_onnx(
    qmodel: QuantModel,
    example_inputs: Any,
    *,
    opset: int | None = None,
    dynamic: str | None = None,
) -> onnx.ModelProto:
    """The QDQ ``ModelProto`` of ``qmodel`` (see the module docstring). ``dynamic``: as
    ``quantize`` captured the model unless given (``"batch"``, ``"all"``, ``"none"``)."""
    if not isinstance(qmodel, QuantModel):
        raise TypeError(
            f"export writes the QuantModel returned by qb.quantize or qb.prepare_qat, got "
            f"{type(qmodel).__name__}: quantize it first (qmodel = qb.quantize(model, calib)); "
            "for the fp32 ONNX of a float model use qb.to_engine(model, 'onnxruntime', "
            "example_inputs=x).save_onnx(path)"
        )
    check_dynamic(qmodel, dynamic, "export")
    opset = _choose_opset(qmodel, opset)
    messages = slow_form_warnings(qmodel)
    if opset >= PACKED_4BIT_OPSET and _has_4bit_weights(qmodel):
        messages.append(
            "INT4 weights: ONNX Runtime (1.32, CPU) runs Conv/Gemm with INT4 weights in float "
            "(DigitsCNN W4A8: 16 ms vs 1.1 ms per batch of 64 with the same codes in int8); "
            "pass opset=18 to store them in int8 for ONNX Runtime's int8 kernels (file ~1.5x)"
        )
    for message in messages:
        warnings.warn(message, PerformanceWarning, stacklevel=user_stacklevel())
    adopt_replaced_layers(qmodel)  # a layer replaced since the last call (transfer learning)
    for message in saturation_warnings(qmodel):  # after: reads the weights' codes
        warnings.warn(message, SaturationWarning, stacklevel=user_stacklevel())
    with quiet_torch():
        qmodel = folded_copy(qmodel)  # QAT models may still hold batch norms
    if dynamic is None:  # a model quantized with dynamic="all" exports with dynamic sizes
        dynamic = qmodel.qb_capture.get("dynamic", "batch")
    args, kwargs = check_example(qmodel, example_inputs)  # capture's layout; one-line errors
    with export_mode(qmodel):
        model = _trace(qmodel, (args, kwargs), opset, dynamic)
    relu_into_quantize(model)  # symmetric int8 grids after a ReLU: the form ONNX Runtime fuses
    pad_on_codes(model)  # a zero / copying Pad on its input's grid pads the codes
    drop_identity_requantize(model)  # DQ -> Add(0) -> Q on one grid: one pair (OpenVINO)
    untranspose_blocked_weights(model)  # group-wise weights as [K, N]: ORT fuses MatMulNBits
    if opset >= 21:
        pack_4bit_weights(model, _weight_bits(qmodel))
    record_quantizers(model, qmodel)
    return model


def float_to_onnx(
    model: torch.nn.Module,
    example_inputs: Any,
    *,
    opset: int | None = None,
    dynamic: str = "batch",
) -> onnx.ModelProto:
    """The fp32 ``ModelProto`` of a float torch model, by the same one-trace path as ``to_onnx``
    (the engine layer runs it; a QuantModel's fp32 form is ``to_onnx`` under ``float_mode``)."""
    if isinstance(model, QuantModel) or not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"float_to_onnx exports a float torch model, got a {type(model).__name__}; export a "
            "QuantModel with quantbridge.export"
        )
    call = as_call(example_inputs, "example_inputs")
    proto = _trace(model, call, DEFAULT_OPSET if opset is None else opset, dynamic)
    pop_calls(proto)  # no quantizer here
    return proto


def _trace(module: torch.nn.Module, call: tuple, opset: int, dynamic: str):
    """One trace of ``module`` in eval mode on ``call`` (args, kwargs), translated, at ``opset``,
    without debug info. ``dynamic="all"`` runs under the capture time limit (``_deadline``, as
    ``quantize``'s capture): past it the export is redone with ``"batch"`` and a warning names
    the dimensions that became static."""
    args, kwargs = call
    if dynamic != "none":
        args, kwargs = widen_batch(args, kwargs)
    shapes = dynamic_shapes(module.forward, args, kwargs, dynamic)
    limit = capture_budget() if dynamic == "all" else None
    was_training = module.training
    module.eval()
    try:
        with (
            stage(f"exporting to ONNX (opset {opset}, dynamic={dynamic!r})"),
            quiet_torch(),
            warnings.catch_warnings(),
            deadline(limit),
        ):
            warnings.simplefilter("ignore")
            program = reused_program(module, args, kwargs, dynamic)  # None: trace it
            model = export_program(module, args, kwargs, shapes, max(opset, DEFAULT_OPSET), program)
    except CaptureTimeout:
        warnings.warn(fallback_message(shapes, limit, "export"), stacklevel=user_stacklevel())
        return _trace(module, call, opset, "batch")
    finally:
        module.train(was_training)
    name_nodes(model, _imported_names(module))  # from the metadata, stripped next
    model = downgrade(model, opset)
    _strip_debug_info(model)
    _name_dynamic_dims(model)
    keep_source_names(model, io_names_of(module))  # an imported ONNX file's input/output names
    return model


def _imported_names(module: torch.nn.Module) -> dict[str, str] | None:
    """An imported ONNX file's node names by module attribute (``OnnxModule.onnx_names``; a
    QuantModel reads its source's), for ``name_nodes``."""
    names = getattr(module, "onnx_names", None)
    return names if isinstance(names, dict) else None


def slow_form_warnings(qmodel: QuantModel) -> list[str]:
    """Forms that x86 engines run slowly (measured in bench/forms_study/FINDINGS.md)."""
    found = []  # int8 (signed) activations: stored as uint8 where non-negative (``_relu_quant``)
    weights = [q for q in qmodel.quantizers().values() if getattr(q, "kind", "") == "weight"]
    if any(not q.scheme.signed for q in weights):
        found.append(
            "uint8 weights: OpenVINO runs no int8 kernel for them and ONNX Runtime is 2.5x "
            "slower than with int8 weights. Use signed symmetric weights."
        )
    return found


def saturation_warnings(qmodel: QuantModel) -> list[str]:
    """Full-range int8 weights next to 8-bit activations, on a CPU whose engines add uint8 x int8
    products pairwise in int16 with saturation (x86 without VNNI). Signed activations count too:
    ONNX Runtime runs them as uint8 with zero point + 128."""
    if not u8s8_saturates():
        return []
    quantizers = qmodel.quantizers().values()
    bound = safe_weight_bound()
    wide = [  # by the codes, not the grid: an imported file may hold 7-bit codes on an int8 grid
        q.name
        for q in quantizers
        if getattr(q, "kind", "") == "weight"
        and q.scheme.signed
        and q.scheme.bits == 8
        and max(-q.qmin, q.qmax) > bound
        and _largest_code(qmodel, q) > bound
        and not _pairs_within_bound(qmodel, q)  # ``Recipe.pair_safe_weights``'s codes
    ]
    # uint8 activations, and int8 ones: ONNX Runtime stores those as uint8 + 128 (QDQS8ToU8)
    eight_bit_inputs = any(
        getattr(q, "kind", "") == "activation" and q.scheme.bits == 8 for q in quantizers
    )
    if not (wide and eight_bit_inputs):
        return []
    return [
        f"this CPU has no VNNI: ONNX Runtime and OpenVINO add uint8 x int8 products pairwise in "
        f"int16 with saturation here, and the int8 weights of {len(wide)} layer(s) (first: "
        f"{wide[0]!r}) use codes beyond +-{safe_weight_bound()}, so the engine's results on this "
        f"machine will differ from the model's (ResNet-18-style: 72% of outputs within 1 LSB). "
        f"The file is right for CPUs with VNNI; to run it exactly here, quantize with "
        f"recipe='int8_avx2' (7-bit weights)."
    ]


def _pairs_within_bound(qmodel: QuantModel, q) -> bool:
    """Whether every same-sign pair of the weight's codes in the engines' reduction order keeps
    ``|q0| + |q1| <= numerics.pair_bound(255)``: no int16 pair sum saturates
    (``torch.ptq._pair_bound``)."""
    try:
        w = weight_of(qmodel, q.weight_name)
    except AttributeError:
        return False
    if q.axis != 0 or w.ndim < 2 or q.scale.numel() not in (1, w.shape[0]):
        return False  # blocked or stacked (MoE) grids: not bounded by that pass, so warn
    with torch.no_grad():
        scale = q.scale.reshape((-1,) + (1,) * (w.ndim - 1))
        codes = torch.round(w.detach() / scale).clamp(q.qmin, q.qmax)
    return broken_pairs(engine_rows(codes).numpy(), pair_bound(255)) == 0


def _largest_code(qmodel: QuantModel, q) -> int:
    """Largest |code| of a weight quantizer's integer weights (its grid's bound if the weight is
    not a parameter of the model). Called after ``adopt_replaced_layers``: a replaced layer's
    quantizer holds its new layer's scales by then."""
    try:
        w = weight_of(qmodel, q.weight_name)
    except AttributeError:
        return max(-q.qmin, q.qmax)
    with torch.no_grad():
        return int(code_extremes(q, w).abs().max())


def _weight_bits(qmodel: QuantModel) -> dict[str, tuple[int, bool]]:
    """Exported integer-weight initializer name -> (bits, signed)."""
    container = getattr(qmodel, CONTAINER)
    found = {}
    for p in qmodel.qb_points:
        if p.kind == "weight":
            q = getattr(container, p.attr)
            found[f"{CONTAINER}.{p.attr}.export_qweight"] = (q.scheme.bits, q.scheme.signed)
    return found


def _strip_debug_info(model: onnx.ModelProto) -> None:
    """Drop the exporter's per-node metadata (stack traces, fx names) and intermediate
    value_info: a third of a small model's file, and nothing an engine reads."""
    for node in model.graph.node:
        del node.metadata_props[:]
    del model.graph.value_info[:]


# names of dynamic dimensions by an input's rank and axis (torch's own are s53, s77, ...)
_DIM_ROLES = {
    2: ("batch", "sequence"),
    3: ("batch", "sequence", "features"),
    4: ("batch", "channels", "height", "width"),
    5: ("batch", "channels", "depth", "height", "width"),
}
_SYMBOL = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def _name_dynamic_dims(model: onnx.ModelProto) -> None:
    """Readable names for torch's symbolic dimensions: by role for each input's axes
    (``batch``, ``height``, ``width``, ``sequence``; ``<input>_<role>`` when two inputs vary
    independently), and the same names inside the outputs' dimension expressions."""
    names: dict[str, str] = {}
    for v in list(model.graph.input) + list(model.graph.output):
        dims = v.type.tensor_type.shape.dim
        roles = _DIM_ROLES.get(len(dims), ())
        for axis, d in enumerate(dims):
            if not d.dim_param or not _SYMBOL.fullmatch(d.dim_param) or d.dim_param in names:
                continue
            role = roles[axis] if axis < len(roles) and v in model.graph.input else f"dim{axis}"
            name = role if role not in names.values() else f"{v.name}_{role}"
            names[d.dim_param] = name
    values = list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info)
    for v in values:
        for d in v.type.tensor_type.shape.dim:
            if d.dim_param.isdigit():  # a size the model fixed, written as a name ("3")
                d.dim_value = int(d.dim_param)
            elif d.dim_param:
                d.dim_param = _SYMBOL.sub(lambda m: names.get(m.group(0), m.group(0)), d.dim_param)


def float_weights(model: onnx.ModelProto) -> list[str]:
    """Names of float initializers feeding a weight input directly (must be empty for QDQ)."""
    floats = {
        i.name
        for i in model.graph.initializer
        if i.data_type
        in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16, onnx.TensorProto.DOUBLE)
        and len(i.dims) >= 2
    }
    found = []
    for node in model.graph.node:
        idx = _WEIGHT_INPUTS.get(node.op_type)
        if node.op_type == "MatMul":
            idx = 1
        if idx is not None and len(node.input) > idx and node.input[idx] in floats:
            found.append(f"{node.op_type} {node.name!r}: weight {node.input[idx]!r}")
    return found


TARGETS = ("onnxruntime", "openvino")  # qb.export(target=...): the layouts, first the default


_TORCH_SUFFIXES = (".pt", ".pth", ".ckpt", ".safetensors")  # what qb.save writes, not ONNX


def export(
    qmodel: QuantModel,
    path: str | os.PathLike,
    example_inputs: Any,
    *,
    opset: int | None = None,
    dynamic: str | None = None,
    check: bool = True,
    target: str = "onnxruntime",
    progress: bool | None = None,
) -> onnx.ModelProto:
    """Write ``qmodel`` as a QDQ ONNX file at ``path``; returns the ModelProto.

    ``progress=False``: no progress line on stderr for this call (as ``quantize``'s).

    ``example_inputs``: a tensor, a tuple of positional inputs or a dict of keyword inputs, as in
    a calibration batch. ``onnx.checker`` runs with ``full_check=True`` unless ``check=False``.

    ``target``: the engine the file is laid out for (``TARGETS``). ``"onnxruntime"`` (default):
    the canonical form, a Q/DQ pair on every quantized tensor, which ONNX Runtime fuses into
    QLinearConv / QLinearAdd / QLinearMul and which ``import_onnx``, ``fold`` and ``lower`` read.
    ``"openvino"``: that form through ``quantbridge.openvino_layout`` (Q/DQ pairs only at the
    inputs OpenVINO runs in int8; element-wise ops in float, fused into the convolutions). OpenVINO
    has no int8 element-wise kernel with independent grids: each pair after an Add / Mul of the
    canonical form runs there as a stand-alone float FakeQuantize (PP-OCRv4 detector: 87 of them,
    0.5-0.7x OpenVINO's float speed; in this layout 1.2-1.6x; ``docs/openvino.md``). The layout
    rounds fewer tensors, so its outputs differ from the canonical file's by quantization noise.
    """
    if target not in TARGETS:
        raise ValueError(
            f"export: target={target!r} is not a known engine; use one of {', '.join(TARGETS)} "
            "(an ONNX Runtime file is the canonical QDQ form every other tool reads)"
        )
    path = _check_writable(path)
    if os.path.splitext(path)[1].lower() in _TORCH_SUFFIXES:
        raise ValueError(
            f"export writes an ONNX file, and {str(path)!r} is named as a torch checkpoint: name "
            "it .onnx; to save the QuantModel for torch (qb.load, training on), use "
            f"qb.save(qmodel, {str(path)!r})"
        )
    with progress_scope(progress_enabled(progress)):
        model = to_onnx(qmodel, example_inputs, opset=opset, dynamic=dynamic)
    if target == "openvino":
        from ..passes import openvino_layout  # not at import: the passes import the importer

        model = openvino_layout(model)
    if check:
        onnx.checker.check_model(model, full_check=True)
    onnx.save_model(model, path)
    return model
