"""One-trace export (``onnx/exporter/_reuse``): the program written from ``quantize``'s captured
graph gives the same ONNX file, byte for byte, as tracing the QuantModel again; where it would
not be exact (a replaced layer, another dynamic setting, an example the capture does not cover)
export traces again.

"Same file" (for ``dynamic="all"``: up to the names of intermediate values, see
``_canonical``) is the strongest check there is: the serialized bytes hold every node, attribute,
initializer, name and the exporter's record of the program's signature and shape ranges. The
reuse exports run with ``torch.export.export`` replaced by a function that fails (``_refuse``), so a reuse
test cannot pass by tracing after all.
"""

from __future__ import annotations

import copy
import warnings

import export_cases
import onnx
import onnxruntime as ort
import pytest
import torch
from torch import nn

import quantbridge as qb
from quantbridge.onnx.exporter import _reuse
from quantbridge.zoo import DigitsCNN


class ConstantHead(nn.Module):
    """In-place ReLU, a mean, a Linear and a constant operand (its own integer initializer)."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.relu = nn.ReLU(inplace=True)
        self.fc = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc(self.relu(self.conv(x)).mean((2, 3))) * 0.5 + 1.0


class FlagKwarg(nn.Module):
    """A plain keyword value in the call (GPT-2's ``use_cache=False``): a constant of the
    program, not a graph input (the reused program once made it an int64 input)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 4)

    def forward(self, x, use_cache=None):
        return self.fc(x) * (2.0 if use_cache is False else 1.0)


CASES = {  # name: (model, batch of n, dynamic)
    **{name: (*case, "batch") for name, case in export_cases.CASES.items()},
    "constant_head_static": (ConstantHead, lambda n: torch.randn(n, 3, 8, 8), "none"),
    "constant_head_all": (ConstantHead, lambda n: torch.randn(n, 3, 8, 8), "all"),
    "flag_kwarg": (FlagKwarg, lambda n: {"x": torch.randn(n, 8), "use_cache": False}, "batch"),
}


def _refuse(*args, **kwargs):
    raise AssertionError("export traced the model again")


def _quantize(name, seed=0):
    make, batch, dynamic = CASES[name]
    torch.manual_seed(seed)
    model = make().eval()
    data = [batch(4) for _ in range(2)]
    return qb.quantize(model, data, progress=False, dynamic=dynamic, recipe="int8"), batch


def _export_bytes(qmodel, path, example, reuse: bool, **kwargs) -> bytes:
    saved = _reuse.ENABLED
    _reuse.ENABLED = reuse
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the no-VNNI saturation warning: not the subject
            qb.export(qmodel, path, example, **kwargs)
    finally:
        _reuse.ENABLED = saved
    return path.read_bytes()


SLOW = {"mobilenetv2_style"}  # ~15 s on a quiet 2-core machine; the others take 1-8 s


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if n in SLOW else []) for n in CASES]
)
def test_reused_program_gives_the_traced_file(name, tmp_path, monkeypatch):
    qmodel, batch = _quantize(name)
    # export's usual example: one sample (the capture saw four; static shapes need those)
    example = batch(4 if CASES[name][2] == "none" else 1)
    traced = _export_bytes(qmodel, tmp_path / "traced.onnx", example, reuse=False)
    with monkeypatch.context() as m:
        m.setattr(torch.export, "export", _refuse)
        reused = _export_bytes(qmodel, tmp_path / "reused.onnx", example, reuse=True)
    if CASES[name][2] == "all":
        # the trace also names the symbolic-size arithmetic it later drops (``add``, ``add_1``),
        # so a later Add becomes ``add_2``: same file up to the names of intermediate values
        reused, traced = _canonical(reused), _canonical(traced)
    assert reused == traced


def _canonical(data: bytes) -> bytes:
    """The file with intermediate values and nodes renamed by order of appearance (graph
    inputs, outputs and initializers keep their names)."""
    model = onnx.load_from_string(data)
    graph = model.graph
    kept = {v.name for v in [*graph.input, *graph.output, *graph.initializer]}
    names: dict[str, str] = {}
    for i, node in enumerate(graph.node):
        node.name = f"node{i}"
        for out in node.output:
            if out not in kept:
                names.setdefault(out, f"value{len(names)}")
        for field in (node.input, node.output):
            field[:] = [names.get(v, v) for v in field]
    return model.SerializeToString()


def test_replaced_layer_traces_again(tmp_path):
    """A new head (other output size) changes the graph's shapes: the captured graph no longer
    describes the model, so export traces; the file has the new head's 5 outputs."""
    qmodel, batch = _quantize("digits_cnn")
    qmodel.fc2 = nn.Linear(64, 5)
    example = batch(2)
    with torch.no_grad():
        qmodel(example)  # adopts the new layer (``_replace``)
    why = _reuse.reuse_refusal(qmodel, (example,), {}, "batch")
    assert why is not None and "replaced layer" in why, why
    path = tmp_path / "new_head.onnx"
    reused = _export_bytes(qmodel, path, example, reuse=True)
    assert reused == _export_bytes(qmodel, tmp_path / "traced.onnx", example, reuse=False)
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    (out,) = sess.run(None, {sess.get_inputs()[0].name: example.numpy()})
    assert out.shape == (2, 5)


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        ({"dynamic": "none"}, "dynamic"),
        ({"example": torch.randn(2, 1, 9, 9)}, "dimension 2 is 9"),
        ({"example": torch.randn(2, 1, 8, 8, dtype=torch.float64)}, "float64"),
    ],
)
def test_export_traces_when_the_capture_does_not_cover_it(change, reason):
    qmodel, batch = _quantize("digits_cnn")
    example = change.get("example", batch(2))
    why = _reuse.reuse_refusal(qmodel, (example,), {}, change.get("dynamic", "batch"))
    assert why is not None and reason in why


def test_reuse_is_refused_after_the_graph_changed():
    """A node added to the graph after capture has no captured value: refused."""
    qmodel, batch = _quantize("digits_cnn")
    out = next(n for n in qmodel.graph.nodes if n.op == "output")
    with qmodel.graph.inserting_before(out):
        extra = qmodel.graph.call_function(torch.ops.aten.neg.default, (out.args[0][0],))
    out.args = ((extra,),)
    qmodel.recompile()
    why = _reuse.reuse_refusal(qmodel, (batch(2),), {}, "batch")
    assert why is not None and "no captured value" in why


def test_copies_and_checkpoints_reuse_their_graph(tmp_path, monkeypatch):
    """A deep copy keeps the captured graph and ranges; ``qb.load`` captures again: both export
    the traced file without a second trace."""
    qmodel, batch = _quantize("digits_cnn")
    qb.save(qmodel, tmp_path / "q.pt")
    loaded = qb.load(tmp_path / "q.pt", DigitsCNN().eval())
    example = batch(1)
    for i, model in enumerate((copy.deepcopy(qmodel), loaded)):
        traced = _export_bytes(model, tmp_path / f"traced{i}.onnx", example, reuse=False)
        with monkeypatch.context() as m:
            m.setattr(torch.export, "export", _refuse)
            reused = _export_bytes(model, tmp_path / f"reused{i}.onnx", example, reuse=True)
        assert reused == traced
