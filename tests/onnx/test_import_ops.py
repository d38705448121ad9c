"""Single-op differential tests of ``import_onnx`` against ONNX Runtime.

Each case is one ONNX node (inputs random, constants as initializers) at a stated opset, run by
ONNX Runtime's CPU provider and by the imported module. Tolerance: 1e-5 relative + 1e-5 absolute
for float ops on O(1) values - both engines compute in float32 with different summation orders
(convolutions, reductions), which moves results by a few ulp; integer and index results must be
equal. The cases sit where ONNX and torch differ if translated naively: coordinate transforms of
Resize, opset-dependent attributes (axes / split / clip bounds as attributes or inputs, Softmax's
2-D coercion before opset 13), asymmetric and automatic padding, negative slice steps and gather
indices, integer division (truncation), count_include_pad's default.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

import quantbridge as qb

F32 = TensorProto.FLOAT


def _rand(*shape, seed=0, dtype=np.float32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _model(op, inputs, consts=None, attrs=None, opset=13, out_types=(F32,), n_outputs=1):
    """One-node model: ``inputs`` are graph inputs (name -> array), ``consts`` initializers;
    the node reads them in the order of ``order`` (inputs first, then constants, or as given)."""
    consts = consts or {}
    names = list(inputs) + list(consts)
    outputs = [f"y{i}" for i in range(n_outputs)]
    node = helper.make_node(op, names, outputs, name=f"test.{op}.0", **(attrs or {}))
    graph = helper.make_graph(
        [node],
        "g",
        [
            helper.make_tensor_value_info(
                n, helper.np_dtype_to_tensor_dtype(a.dtype), list(a.shape)
            )
            for n, a in inputs.items()
        ],
        [
            helper.make_tensor_value_info(o, t, None)
            for o, t in zip(outputs, out_types, strict=True)
        ],
        initializer=[numpy_helper.from_array(np.asarray(v), n) for n, v in consts.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8 if opset <= 17 else 9
    return model


def _compare(model, inputs, atol=1e-5, rtol=1e-5):
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    expected = sess.run(None, inputs)
    module = qb.import_onnx(model)
    with torch.no_grad():
        got = module(*[torch.from_numpy(v) for v in inputs.values()])
    got = got if isinstance(got, tuple) else (got,)
    assert len(got) == len(expected)
    for g, e in zip(got, expected, strict=True):
        g = g.numpy()
        assert g.shape == e.shape, (g.shape, e.shape)
        assert g.dtype == e.dtype, (g.dtype, e.dtype)
        if np.issubdtype(e.dtype, np.floating):
            np.testing.assert_allclose(g, e, rtol=rtol, atol=atol)
        else:
            np.testing.assert_array_equal(g, e)


X4 = _rand(2, 3, 7, 9)


def f32(*v):
    return np.array(v, dtype=np.float32)


def i64(*v):
    return np.array(v, dtype=np.int64)


E = np.array([], dtype=np.float32)

# name -> (op, inputs, constants, attributes, opset, output types, number of outputs)
CASES = {
    # Resize: every mapped (mode, coordinate transform, rounding) up and down
    "resize_nearest_asym_floor_x2": ("Resize", {"x": X4}, {"roi": E, "s": f32(1, 1, 2, 2)},
        dict(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor"), 12),
    "resize_nearest_asym_floor_x0.5": ("Resize", {"x": X4}, {"roi": E, "s": f32(1, 1, 0.5, 0.5)},
        dict(mode="nearest", coordinate_transformation_mode="asymmetric", nearest_mode="floor"), 12),
    "resize_nearest_half_pixel_ceil": ("Resize", {"x": X4}, {"roi": E, "s": f32(1, 1, 1.5, 2.5)},
        dict(mode="nearest", coordinate_transformation_mode="half_pixel", nearest_mode="round_prefer_ceil"), 13),
    "resize_linear_half_pixel_up": ("Resize", {"x": X4}, {"roi": E, "s": f32(1, 1, 2, 3)},
        dict(mode="linear", coordinate_transformation_mode="half_pixel"), 13),
    "resize_linear_half_pixel_down": ("Resize", {"x": X4}, {"roi": E, "s": f32(1, 1, 0.5, 0.5)},
        dict(mode="linear", coordinate_transformation_mode="half_pixel"), 13),
    "resize_linear_align_corners_sizes": ("Resize", {"x": X4}, {"roi": E, "s": E, "sz": i64(2, 3, 11, 5)},
        dict(mode="linear", coordinate_transformation_mode="align_corners"), 13),
    "resize_cubic_half_pixel": ("Resize", {"x": X4}, {"roi": E, "s": f32(1, 1, 2, 2)},
        dict(mode="cubic", coordinate_transformation_mode="half_pixel"), 13),
    # opset-dependent forms
    "softmax_opset11_axis1_coerced": ("Softmax", {"x": X4}, {}, dict(axis=1), 11),
    "softmax_opset13_axis1": ("Softmax", {"x": X4}, {}, dict(axis=1), 13),
    "log_softmax_opset11_axis2": ("LogSoftmax", {"x": X4}, {}, dict(axis=2), 11),
    "clip_opset6_attributes": ("Clip", {"x": X4}, {}, dict(min=-0.5, max=0.7), 6),
    "clip_opset12_min_only": ("Clip", {"x": X4}, {"lo": np.float32(-0.3)}, {}, 12),
    "squeeze_opset11": ("Squeeze", {"x": _rand(2, 1, 3, 1)}, {}, dict(axes=[1, -1]), 11),
    "squeeze_opset13": ("Squeeze", {"x": _rand(2, 1, 3, 1)}, {"a": i64(1)}, {}, 13),
    "unsqueeze_opset11": ("Unsqueeze", {"x": _rand(2, 3)}, {}, dict(axes=[0, -1]), 11),
    "unsqueeze_opset13": ("Unsqueeze", {"x": _rand(2, 3)}, {"a": i64(1, 3)}, {}, 13),
    "reduce_mean_opset12_keepdims0": ("ReduceMean", {"x": X4}, {}, dict(axes=[1, -1], keepdims=0), 12),
    "reduce_sum_opset13_axes_input": ("ReduceSum", {"x": X4}, {"a": i64(2)}, {}, 13),
    "reduce_max_all": ("ReduceMax", {"x": X4}, {}, dict(keepdims=1), 13),
    "reduce_l2": ("ReduceL2", {"x": X4}, {}, dict(axes=[3]), 13),
    # ScatterND (Swin's shifted-window mask) and CumSum (EdgeNeXt's positional encoding)
    "scatter_nd_slices": ("ScatterND", {"x": X4}, {"i": i64(0, 1, 1, 2).reshape(2, 2), "u": _rand(2, 7, 9, seed=1)}, {}, 13),
    "scatter_nd_elements_negative": ("ScatterND", {"x": X4}, {"i": i64(1, -1, 0, 0, -2, 1, 2, 3).reshape(2, 4), "u": f32(5, -7)}, {}, 18),
    "scatter_nd_add": ("ScatterND", {"x": X4}, {"i": i64(1, 0).reshape(2, 1), "u": _rand(2, 3, 7, 9, seed=2)}, dict(reduction="add"), 16),
    "cumsum_axis1": ("CumSum", {"x": X4}, {"a": np.array(1, np.int64)}, {}, 14),
    "cumsum_exclusive_reverse": ("CumSum", {"x": X4}, {"a": np.array(-1, np.int64)}, dict(exclusive=1, reverse=1), 14),
    "cumsum_int64_exclusive": ("CumSum", {"x": i64(3, 1, 4, 1, 5, 9).reshape(2, 3)}, {"a": np.array(0, np.int64)}, dict(exclusive=1), 14, (TensorProto.INT64,)),
    "split_opset11_attribute": ("Split", {"x": X4}, {}, dict(axis=3, split=[2, 3, 4]), 11, (F32,) * 3, 3),
    "split_opset13_input": ("Split", {"x": X4}, {"s": i64(4, 3)}, dict(axis=2), 13, (F32,) * 2, 2),
    "split_equal": ("Split", {"x": X4}, {}, dict(axis=1), 13, (F32,) * 3, 3),
    # slicing, gathering, broadcasting
    "slice_negative_step": ("Slice", {"x": X4}, {"b": i64(-1, 6), "e": i64(-100, 1), "a": i64(3, 2), "st": i64(-2, -3)}, {}, 13),
    "slice_large_end_negative_axis": ("Slice", {"x": X4}, {"b": i64(1), "e": i64(2**62), "a": i64(-2)}, {}, 13),
    "slice_opset9_attributes": ("Slice", {"x": X4}, {}, dict(starts=[1, 0], ends=[3, -1], axes=[1, 3]), 9),
    "gather_negative_indices": ("Gather", {"x": X4}, {"i": i64(-1, 0, 2)}, dict(axis=1), 13),
    "gather_scalar_index": ("Gather", {"x": X4}, {"i": np.array(-2, np.int64)}, dict(axis=2), 13),
    "gather_runtime_indices": ("Gather", {"x": X4, "i": np.array([[3, -1], [0, 2]], np.int64)}, {}, dict(axis=3), 13),
    "expand_bidirectional": ("Expand", {"x": _rand(3, 1)}, {"s": i64(2, 1, 4)}, {}, 13),
    "tile": ("Tile", {"x": _rand(2, 3)}, {"r": i64(2, 3)}, {}, 13),
    "flatten_axis2": ("Flatten", {"x": X4}, {}, dict(axis=2), 13),
    "flatten_axis0": ("Flatten", {"x": X4}, {}, dict(axis=0), 13),
    "transpose_default_perm": ("Transpose", {"x": X4}, {}, {}, 13),
    # Flatten at axis = rank (torch's TorchScript export of a BERT attention mask): (all, 1)
    "flatten_axis_rank": ("Flatten", {"x": _rand(2, 3)}, {}, dict(axis=2), 13),
    "flatten_axis_2_of_4": ("Flatten", {"x": X4}, {}, dict(axis=2), 13),
    "depth_to_space_dcr": ("DepthToSpace", {"x": _rand(1, 8, 2, 3)}, {}, dict(blocksize=2), 13),
    "depth_to_space_crd": ("DepthToSpace", {"x": _rand(1, 8, 2, 3)}, {}, dict(blocksize=2, mode="CRD"), 13),
    "pad_reflect": ("Pad", {"x": X4}, {"p": i64(0, 0, 1, 2, 0, 0, 2, 1)}, dict(mode="reflect"), 13),
    "pad_edge": ("Pad", {"x": X4}, {"p": i64(0, 0, 1, 0, 0, 0, 0, 3)}, dict(mode="edge"), 13),
    "pad_constant_value": ("Pad", {"x": X4}, {"p": i64(0, 1, 0, 1, 0, 0, 2, 0), "v": np.float32(1.5)}, {}, 13),
    "pad_opset2_attributes": ("Pad", {"x": X4}, {}, dict(pads=[0, 0, 1, 1, 0, 0, 1, 1], value=-1.0), 2),
    "concat_negative_axis": ("Concat", {"x": X4, "y": _rand(2, 3, 7, 2, seed=1)}, {}, dict(axis=-1), 13),
    # elementwise
    "div_int64_truncates": ("Div", {"x": np.array([-7, 7, -8, 9], np.int64)}, {"d": i64(2, -2, 3, -4)}, {}, 13, (TensorProto.INT64,)),
    "pow_scalar": ("Pow", {"x": np.abs(X4)}, {"e": np.float32(1.5)}, {}, 13),
    "sub_scalar_first": ("Sub", {"x": X4}, {"c": f32(3.0)}, {}, 13),
    "where_equal": ("Where", {"c": X4 > 0, "x": X4}, {"y": f32(0.25)}, {}, 13),
    "cast_truncates": ("Cast", {"x": X4 * 3}, {}, dict(to=TensorProto.INT32), 13, (TensorProto.INT32,)),
    "hard_sigmoid": ("HardSigmoid", {"x": X4 * 3}, {}, dict(alpha=0.2, beta=0.5), 13),
    "hard_swish": ("HardSwish", {"x": X4 * 3}, {}, {}, 14),
    "leaky_relu": ("LeakyRelu", {"x": X4}, {}, dict(alpha=0.1), 13),
    "erf": ("Erf", {"x": X4}, {}, {}, 13),
    "prelu_channel_slope": ("PRelu", {"x": X4}, {"s": _rand(3, 1, 1, seed=2)}, {}, 13),
    "argmax_select_last": ("ArgMax", {"x": np.array([[1, 3, 3, 0], [2, 2, 1, 2]], np.float32)}, {}, dict(axis=1, select_last_index=1), 13, (TensorProto.INT64,)),
    "einsum": ("Einsum", {"a": _rand(2, 3, 4), "b": _rand(2, 4, 5, seed=3)}, {}, dict(equation="bij,bjk->bik"), 13),
    # layers: padding and geometry
    "conv_same_upper_stride2": ("Conv", {"x": X4}, {"w": _rand(4, 3, 3, 3, seed=4)}, dict(auto_pad="SAME_UPPER", strides=[2, 2]), 13),
    "conv_same_lower_even_kernel": ("Conv", {"x": X4}, {"w": _rand(4, 3, 2, 4, seed=4)}, dict(auto_pad="SAME_LOWER"), 13),
    "conv_asymmetric_pads_group_dilation": ("Conv", {"x": _rand(1, 4, 9, 8)}, {"w": _rand(6, 2, 3, 3, seed=5), "b": _rand(6, seed=6)}, dict(pads=[0, 1, 2, 1], group=2, dilations=[2, 1]), 13),
    "conv1d": ("Conv", {"x": _rand(2, 3, 10)}, {"w": _rand(5, 3, 3, seed=7)}, dict(pads=[1, 1], strides=[2]), 13),
    "conv_runtime_weight": ("Conv", {"x": X4, "w": _rand(2, 3, 3, 3, seed=8)}, {}, dict(pads=[1, 1, 1, 1]), 13),
    "conv_transpose_output_padding": ("ConvTranspose", {"x": X4}, {"w": _rand(3, 2, 3, 3, seed=9), "b": _rand(2, seed=10)}, dict(strides=[2, 2], pads=[1, 1, 1, 1], output_padding=[1, 0]), 13),
    "conv_transpose_asymmetric_pads_group": ("ConvTranspose", {"x": _rand(1, 4, 5, 6)}, {"w": _rand(4, 3, 2, 3, seed=11)}, dict(strides=[2, 1], pads=[0, 1, 1, 0], group=2), 13),
    "conv_transpose_output_shape": ("ConvTranspose", {"x": X4}, {"w": _rand(3, 2, 3, 3, seed=12)}, dict(strides=[2, 2], output_shape=[12, 17]), 13),
    "conv_transpose_same_upper": ("ConvTranspose", {"x": X4}, {"w": _rand(3, 2, 4, 3, seed=27)}, dict(strides=[2, 2], auto_pad="SAME_UPPER"), 13),
    "conv_transpose_same_lower": ("ConvTranspose", {"x": X4}, {"w": _rand(3, 2, 3, 4, seed=28)}, dict(strides=[2, 3], auto_pad="SAME_LOWER"), 13),
    "gemm_trans_alpha_beta": ("Gemm", {"a": _rand(5, 4)}, {"b": _rand(6, 5, seed=13), "c": _rand(6, seed=14)}, dict(transA=1, transB=1, alpha=0.5, beta=2.0), 13),
    "gemm_matrix_c": ("Gemm", {"a": _rand(4, 5)}, {"b": _rand(5, 6, seed=15), "c": _rand(4, 6, seed=16)}, {}, 13),
    "matmul_3d_constant_weight": ("MatMul", {"a": _rand(2, 3, 5)}, {"b": _rand(5, 4, seed=17)}, {}, 13),
    "matmul_runtime": ("MatMul", {"a": _rand(2, 3, 5), "b": _rand(2, 5, 4, seed=18)}, {}, {}, 13),
    "batch_norm": ("BatchNormalization", {"x": X4}, {"s": _rand(3, seed=19), "b": _rand(3, seed=20), "m": _rand(3, seed=21), "v": np.abs(_rand(3, seed=22)) + 0.5}, dict(epsilon=1e-3), 13),
    "instance_norm": ("InstanceNormalization", {"x": X4}, {"s": _rand(3, seed=23), "b": _rand(3, seed=24)}, {}, 13),
    "layer_norm": ("LayerNormalization", {"x": _rand(2, 5, 8)}, {"s": _rand(8, seed=25), "b": _rand(8, seed=26)}, {}, 17),
    "max_pool_asymmetric_pads_ceil": ("MaxPool", {"x": X4}, {}, dict(kernel_shape=[3, 3], strides=[2, 2], pads=[0, 1, 1, 0], ceil_mode=1), 13),
    "max_pool_dilated": ("MaxPool", {"x": X4}, {}, dict(kernel_shape=[2, 2], dilations=[2, 2]), 13),
    "avg_pool_exclude_pad": ("AveragePool", {"x": X4}, {}, dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1]), 13),
    "avg_pool_include_pad": ("AveragePool", {"x": X4}, {}, dict(kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1), 13),
    "avg_pool_asymmetric_exclude_pad": ("AveragePool", {"x": X4}, {}, dict(kernel_shape=[2, 3], strides=[2, 2], pads=[0, 2, 1, 0]), 13),
    "avg_pool_ceil_mode": ("AveragePool", {"x": X4}, {}, dict(kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1), 13),
    "global_average_pool": ("GlobalAveragePool", {"x": X4}, {}, {}, 13),
    "lrn": ("LRN", {"x": X4}, {}, dict(size=3, alpha=1e-2, beta=0.75, bias=2.0), 13),
    # regression: a mask Where with two scalar float32 branches gave float64 (MiniLM's SDPA mask)
    "where_scalar_branches": ("Where", {"c": np.array([[True, False, True]])}, {"a": np.array(0.0, np.float32), "b": np.array(-3.4e38, np.float32)}, {}, 13),
    # GatherND (a torch SDPA export's attention mask, MiniLM) and IsNaN / IsInf (its masked rows)
    "gather_nd_slices": ("GatherND", {"x": X4}, {"i": i64(1, 2, 0, -1).reshape(2, 2)}, {}, 13),
    "gather_nd_elements": ("GatherND", {"x": X4}, {"i": i64(1, 0, 6, 8, 0, 2, -3, 0).reshape(2, 4)}, {}, 13),
    "gather_nd_batch_dims": ("GatherND", {"x": X4}, {"i": i64(2, 5, 0, 1, 1, 3, 0, 6, 2, 4, 1, -2).reshape(2, 3, 2)}, dict(batch_dims=1), 13),
    "is_nan": ("IsNaN", {"x": f32(1.0, np.nan, -np.inf, 0.0, np.inf, np.nan)}, {}, {}, 13, (TensorProto.BOOL,)),
    "is_inf": ("IsInf", {"x": f32(1.0, np.nan, -np.inf, 0.0, np.inf)}, {}, {}, 13, (TensorProto.BOOL,)),
    "is_inf_negative_only": ("IsInf", {"x": f32(1.0, np.nan, -np.inf, 0.0, np.inf)}, {}, dict(detect_positive=0), 13, (TensorProto.BOOL,)),
}  # fmt: skip


@pytest.mark.parametrize("case", list(CASES))
def test_op_matches_onnxruntime(case):
    op, inputs, consts, attrs, opset, *rest = CASES[case]
    out_types = rest[0] if rest else (F32,)
    n_outputs = rest[1] if len(rest) > 1 else 1
    model = _model(op, inputs, consts, attrs, opset, out_types, n_outputs)
    _compare(model, inputs)


def test_shape_arithmetic_runs_on_python_sizes():
    """Shape -> Gather -> Unsqueeze -> Concat -> Reshape, and ConstantOfShape / Range of a
    shape: the reshape gets python ints, and the module exports with a dynamic batch."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["n"], axis=0),
        helper.make_node("Unsqueeze", ["n", "axes0"], ["n1"]),
        helper.make_node("Concat", ["n1", "minus1"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["flat"]),
        helper.make_node("Shape", ["flat"], ["flat_shape"]),
        helper.make_node("ConstantOfShape", ["flat_shape"], ["ones"], value=numpy_helper.from_array(f32(1.0))),
        helper.make_node("Add", ["flat", "ones"], ["y"]),
    ]  # fmt: skip
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", F32, ["n", 3, 4])],
        [helper.make_tensor_value_info("y", F32, None)],
        initializer=[
            numpy_helper.from_array(np.array(0, np.int64), "zero"),
            numpy_helper.from_array(i64(0), "axes0"),
            numpy_helper.from_array(i64(-1), "minus1"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    x = _rand(5, 3, 4)
    _compare(model, {"x": x})
    module = qb.import_onnx(model)
    program = torch.export.export(
        module,
        (torch.from_numpy(x),),
        dynamic_shapes={"x": {0: torch.export.Dim.AUTO}},
        strict=False,
    )
    integer_tensors = [
        n.target
        for n in program.graph.nodes
        if n.op == "call_function"
        and isinstance(n.meta.get("val"), torch.Tensor)
        and not n.meta["val"].is_floating_point()
    ]
    assert integer_tensors == []  # no shape tensors: sizes stayed python / SymInt
    y = program.module()(torch.ones(7, 3, 4))
    assert tuple(y.shape) == (7, 12) and float(y.min()) == 2.0


def test_gather_elements_of_a_table_expanded_to_the_input_shape():
    """Hugging Face BERT's token type ids as torch's TorchScript exporter writes them: a constant
    row Expand-ed to the input's shape (computed on python sizes, a numpy array) read by
    GatherElements at constant indices; torch.gather refused the numpy array (found running
    'quantbridge quantize' on a BERT from a config)."""
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Expand", ["row", "shape"], ["table"]),
        helper.make_node("GatherElements", ["table", "idx"], ["picked"], axis=1),
        helper.make_node("Add", ["x", "picked"], ["y"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", F32, [2, 4])],
        [helper.make_tensor_value_info("y", F32, None)],
        initializer=[
            numpy_helper.from_array(f32(1, 2, 3, 4).reshape(1, 4), "row"),
            numpy_helper.from_array(np.array([[3, 2, 1, 0], [0, 0, -1, -1]], np.int64), "idx"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    _compare(model, {"x": _rand(2, 4)})


def test_duplicate_node_names_get_their_own_layers():
    """The checker does not enforce unique node names (ONNX Runtime refuses such models; the
    reference here is numpy); two MatMuls called 'dense' are two layers."""
    w1, w2 = _rand(4, 5, seed=30), _rand(5, 3, seed=31)
    graph = helper.make_graph(
        [
            helper.make_node("MatMul", ["x", "w1"], ["h"], name="dense"),
            helper.make_node("MatMul", ["h", "w2"], ["y"], name="dense"),
        ],
        "g",
        [helper.make_tensor_value_info("x", F32, [2, 4])],
        [helper.make_tensor_value_info("y", F32, [2, 3])],
        initializer=[numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(w2, "w2")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    x = _rand(2, 4, seed=32)
    module = qb.import_onnx(model)
    with torch.no_grad():
        y = module(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(y, x @ w1 @ w2, rtol=1e-5, atol=1e-6)
    layers = dict(module.named_children())
    assert len(layers) == 2 and all(isinstance(m, torch.nn.Linear) for m in layers.values())


def test_embedding_table_constant_read_at_input_indices():
    """Regression: Gather(constant table, input ids) - an embedding, as every transformer export
    writes it - failed ('numpy.ndarray' object has no attribute 'index_select') in the module and
    in capture (``quantbridge compare`` on MiniLM)."""
    table = _rand(11, 6, seed=3)
    node = helper.make_node("Gather", ["table", "ids"], ["y"], name="embed", axis=0)
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["n", 4])],
        [helper.make_tensor_value_info("y", F32, None)],
        initializer=[numpy_helper.from_array(table, "table")],
    )  # fmt: skip
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    ids = np.array([[0, 3, 10, -1], [5, 5, 2, 1]], np.int64)
    _compare(model, {"ids": ids})
    module = qb.import_onnx(model)
    # captures it; an embedding alone has nothing to quantize: said, and the result is float
    with pytest.warns(UserWarning, match="nothing in OnnxModule is quantized"):
        qmodel = qb.quantize(module, [torch.from_numpy(ids)], progress=False, recipe="int8")
    assert list(qmodel.quantizers()) == []
    np.testing.assert_array_equal(qmodel(torch.from_numpy(ids)).numpy(), np.take(table, ids, 0))
