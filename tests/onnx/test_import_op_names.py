"""Recipe rules can name one arithmetic op of an imported ONNX file (issue 9).

A hand-written model's functional add sits inside its block's module (``layer1.0``), so a rule
``Rule(pattern="layer1.0", skip=True)`` keeps it float. An imported file has no blocks: its
non-layer ops used to sit in the root module ``""``, where no rule, no sensitivity ranking and
no ``float_outlier_residuals`` could single one out. Each non-layer Add / Sub / Mul / Div /
MatMul now runs in an ``OnnxOp`` submodule named after its ONNX node (as a python identifier)
and of class ``<op type>``, so a rule matches it by name or by op type.

The file is a real ONNX export (torch's TorchScript exporter, node names such as
``/layer1/layer1.0/Add``) of the ResNet-18-style model: eight residual Adds.
"""

from __future__ import annotations

import warnings

import onnx
import pytest
import torch
from test_import_quantized import float_file

import quantbridge as qb
from quantbridge import zoo
from quantbridge.onnx.importer._module import OnnxOp
from quantbridge.recipe import Recipe, Rule


@pytest.fixture(scope="module")
def resnet(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("names") / "resnet.onnx"
    return float_file(zoo.resnet18_style(10, width=8), torch.randn(2, 3, 32, 32), path)


def _quantized_adds(model: onnx.ModelProto) -> int:
    """Add nodes all of whose inputs are dequantized (an engine runs them on int8 codes). A
    skipped Add reads its conv's float output: placement leaves a value float when every reader
    is left float (the same rule as for MiniLM's residual adds)."""
    producer = {o: n.op_type for n in model.graph.node for o in n.output}
    return sum(
        n.op_type == "Add" and all(producer.get(i) == "DequantizeLinear" for i in n.input)
        for n in model.graph.node
    )


def _quantize(path: str, recipe: Recipe, tmp_path, name: str):
    calib = [
        torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(i)) for i in range(2)
    ]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the no-VNNI advice; not what this test is about
        qmodel = qb.quantize(qb.import_onnx(path), calib, recipe=recipe, progress=False)
        out = tmp_path / f"{name}.onnx"
        qb.export(qmodel, out, example_inputs=calib[0])
    return qmodel, onnx.load(str(out))


def test_each_add_is_a_named_scope(resnet):
    adds = [n.name for n in onnx.load(resnet).graph.node if n.op_type == "Add"]
    module = qb.import_onnx(resnet)
    scoped = {
        name: attr
        for attr, name in module.onnx_names.items()
        if isinstance(getattr(module, attr), OnnxOp)
    }
    assert len(adds) == 8 and set(adds) <= set(scoped)
    assert scoped["/layer1/layer1.0/Add"] == "layer1_layer1_0_Add"
    assert all(type(getattr(module, scoped[a])).__name__ == "Add" for a in adds)
    assert not dict(module.named_parameters(recurse=False)) and all(
        not list(getattr(module, attr).parameters()) for attr in scoped.values()
    )


def test_a_rule_keeps_one_imported_add_float(resnet, tmp_path):
    recipe = Recipe.preset("native")
    base, base_file = _quantize(resnet, recipe, tmp_path, "base")
    target = "layer2_layer2_1_Add"
    kept, kept_file = _quantize(
        resnet, recipe.with_rules(Rule(pattern=target, skip=True)), tmp_path, "kept"
    )
    assert any(p.module == target for p in base.qb_points)
    assert not any(p.module == target for p in kept.qb_points)
    assert _quantized_adds(base_file) == 8
    assert _quantized_adds(kept_file) == 7  # that one Add runs in float


def test_a_rule_by_op_type_matches_every_add(resnet, tmp_path):
    recipe = Recipe.preset("native").with_rules(Rule(module_type="Add", skip=True))
    _, model = _quantize(resnet, recipe, tmp_path, "no_adds")
    assert _quantized_adds(model) == 0


class _Residual(torch.nn.Module):
    """BERT's output block, ``LayerNorm(dense(h) + residual)``."""

    def __init__(self, d_in: int, d: int):
        super().__init__()
        self.dense, self.norm = torch.nn.Linear(d_in, d), torch.nn.LayerNorm(d)

    def forward(self, h, residual):
        return self.norm(self.dense(h) + residual)


class _Block(torch.nn.Module):
    """Two residual blocks; the feed-forward output has one outlier channel (bias 200), as
    BERT's grow (``tests/torch/test_outlier_residuals.py`` has the torch form)."""

    def __init__(self, d: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.attention, self.up, self.ffn = (
            _Residual(d, d),
            torch.nn.Linear(d, 4 * d),
            _Residual(4 * d, d),
        )
        with torch.no_grad():
            self.ffn.dense.bias[3] = 200.0

    def forward(self, x):
        a = self.attention(x, x)
        return self.ffn(torch.relu(self.up(a)), a)


def test_float_outlier_residuals_names_the_imported_add(tmp_path):
    x = torch.randn(8, 10, 32, generator=torch.Generator().manual_seed(0))
    path = float_file(_Block().eval(), x, tmp_path / "block.onnx")
    calib = list(torch.randn(4, 8, 10, 32, generator=torch.Generator().manual_seed(1)))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        qmodel = qb.quantize(
            qb.import_onnx(path), calib, recipe=Recipe(float_outlier_residuals=True), progress=False
        )
    # the outlier residual add, by its ONNX node name (``/ffn/Add``); the attention one stays int8
    assert qmodel.qb_recipe.rules == (Rule(pattern="ffn_Add", skip=True),)
    assert any(p.module == "attention_Add" for p in qmodel.qb_points)
