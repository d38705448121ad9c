"""QAT with dropout in training mode (issue 8, regression).

Dropout is the identity in eval mode but multiplies the kept values by ``1 / (1 - p)`` in
training. It used to be placed like a data-movement op: its output re-quantized on its input's
grid, which in QAT clipped every scaled value above the input's range (``p = 0.5``: every kept
value above half the range) and zeroed its gradient (the straight-through estimator's mask).
Measured before the fix on the model below: 9 of 113 kept values clipped, and the same 9 got a
zero gradient.
Now the output keeps the input's grid for placement (no new quantizer, the same export) but no
quantizer runs after dropout, so training sees exactly ``mask * q(x) / (1 - p)``.
"""

from __future__ import annotations

import torch
from torch import nn

import quantbridge as qb

aten = torch.ops.aten
P = 0.5


class _Recorder(torch.fx.Interpreter):
    """Runs the QuantModel's graph and keeps dropout's input and output, and the second
    linear's activation input (whatever quantizers sit in between)."""

    def __init__(self, gm):
        super().__init__(gm)
        self.seen: dict[str, torch.Tensor] = {}
        self.linears = 0

    def call_function(self, target, args, kwargs):
        out = super().call_function(target, args, kwargs)
        if target is aten.dropout.default:
            if args[0].requires_grad:
                args[0].retain_grad()
            self.seen["dropout_in"], self.seen["dropout_out"] = args[0], out
        elif target is aten.linear.default:
            self.linears += 1
            if self.linears == 2:
                self.seen["linear2_in"] = args[0]
        return out


def _qat_model():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 24), nn.Dropout(P), nn.Linear(24, 4))
    calib = [torch.randn(16, 8) for _ in range(4)]
    return qb.prepare_qat(model, "int8", calib, progress=False)


def test_train_mode_dropout_is_neither_clipped_nor_cut_off_from_gradients():
    qm = _qat_model().train()
    x = torch.randn(10, 8, generator=torch.Generator().manual_seed(3))
    run = _Recorder(qm)
    run.run(x).sum().backward()
    d_in, d_out, v = run.seen["dropout_in"], run.seen["dropout_out"], run.seen["linear2_in"]
    kept = (d_out != 0) & (d_in != 0)
    assert 0 < int(kept.sum()) < kept.numel()  # the mask really drops and keeps
    # values: exactly dropout's own output, mask * q(x) / (1 - p), nothing clipped after it
    torch.testing.assert_close(d_out, torch.where(kept, d_in / (1 - P), 0.0), rtol=0, atol=0)
    assert torch.equal(v, d_out)
    # scaled values do leave the input quantizer's range: its grid would clip them
    first_out = qm.quantizers()["0/linear"]
    z, s = first_out.integer_zero_point(), first_out.scale
    lo, hi = (first_out.qmin - z) * s, (first_out.qmax - z) * s
    assert bool(((d_out > hi) | (d_out < lo)).any())
    # gradients: every kept value passes its gradient, scaled by 1 / (1 - p)
    grad = d_in.grad
    assert bool((grad[kept] != 0).all()) and bool((grad[~kept & (d_in != 0)] == 0).all())


def test_dropout_keeps_its_input_grid_in_eval_and_adds_no_quantizer():
    """Placement: dropout neither creates a quantizer nor re-applies one; in eval mode the QDQ
    semantics are unchanged (dropout is the identity between the two linears)."""
    qm = _qat_model().eval()
    names = [q.name for q in qm.quantizers().values()]
    assert not any("dropout" in n for n in names), names
    dropout = [n for n in qm.graph.nodes if n.target is aten.dropout.default]
    assert len(dropout) == 1 and all(u.op != "call_module" for u in dropout[0].users)
    run = _Recorder(qm)
    x = torch.randn(10, 8)
    with torch.no_grad():
        run.run(x)
    assert torch.equal(run.seen["dropout_out"], run.seen["dropout_in"])
    # the second linear's input is the first linear's output quantizer's grid: one quantizer
    first_out = qm.quantizers()["0/linear"]
    codes = run.seen["linear2_in"] / first_out.scale + first_out.integer_zero_point()
    assert torch.equal(codes, codes.round())
