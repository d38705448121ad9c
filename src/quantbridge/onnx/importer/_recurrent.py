"""Recurrent ops of ``import_onnx``: ONNX ``LSTM``, ``GRU`` and ``RNN`` as ``nn.LSTM`` / ``nn.GRU``
/ ``nn.RNN`` layers (one ONNX node is one layer), so an imported model is fine-tunable and a
quantized file's float recurrent layer (placement leaves them float) imports back.

ONNX semantics (opset 7 on; ``layout`` from 14) and how each maps to torch:

* Gate order. ONNX stacks an LSTM's gates ``i, o, f, c`` (torch: ``i, f, g, o``) and a GRU's
  ``z, r, h`` (torch: ``r, z, n``); ``W [D, G*H, I]``, ``R [D, G*H, H]`` and each half of
  ``B [D, 2*G*H]`` (``Wb`` then ``Rb``) are reordered block by block (``_ORDER``).
* GRU ``linear_before_reset=1`` is torch's cell (``n = tanh(W_n x + b_in + r * (R_n h + b_hn))``);
  ``linear_before_reset=0`` (ONNX's default: ``n = tanh(W_n x + b_in + R_n (r * h) + b_hn)``) has
  no torch kernel: ``GRUResetFirst``, an ``nn.GRU`` (same parameters) whose forward steps through
  time in torch ops (slower than torch's kernel, as trainable).
* ``direction``: ``forward``; ``bidirectional`` is a bidirectional torch layer (ONNX direction 1
  is torch's ``_reverse`` weights); ``reverse`` runs a forward layer on the time-flipped sequence
  and flips its output back (exact when every sequence has the full length, as required below).
* Outputs: ``Y [T, D, B, H]`` is torch's ``[T, B, D*H]`` split by direction; ``Y_h`` / ``Y_c``
  ``[D, B, H]`` are torch's ``h_n`` / ``c_n``. ``layout=1`` is batch first for ``X``,
  ``initial_h`` / ``initial_c`` (``[B, D, H]``), ``Y [B, T, D, H]`` and ``Y_h`` / ``Y_c``.
* ``initial_h`` / ``initial_c`` absent: zeros (torch's default).
* ``sequence_lens``: accepted when every length is the sequence length (checked at each call on
  real data; a traced or fake run has none to check); shorter sequences are refused, naming
  the node (torch's packed sequences would be needed).
* Integer weights (a QDQ file's ``DequantizeLinear`` of int8 ``W`` / ``R``): the layer holds their
  dequantized values as float parameters (outputs exact) and the import warns
  (``warn_integer_weights``): no quantizer keeps them on the file's grid.
* Refused, naming the node: activations other than the defaults (LSTM ``Sigmoid, Tanh, Tanh``,
  GRU ``Sigmoid, Tanh``, RNN ``Tanh``; RNN ``Relu`` is ``nn.RNN(nonlinearity="relu")``),
  ``clip``, LSTM ``input_forget=1`` and non-zero peepholes ``P``.

With constant ``W``, ``R`` (and ``B``) the layer holds them as ``nn.Parameter`` (``LayerSpec``);
with run-time weights the same reordering feeds ``torch.lstm`` / ``torch.gru`` / ``torch.rnn_*``.

Agreement with ONNX Runtime (float32, ``tests/onnx/test_import_recurrent.py``): max 1.2e-7 absolute
on a torch-exported 2-layer bidirectional LSTM and GRU (ORT's sigmoid / tanh approximations).
``torch.export`` (``qb.quantize`` of the imported model) pins the sequence length of a torch
recurrent layer to the example's, as it does for the user's own ``nn.LSTM``.
"""

from __future__ import annotations

import warnings
from collections.abc import Container

import numpy as np
import torch
from torch import nn

from ._registry import LayerSpec, OnnxNode, as_tensor, ints, register

# ONNX gate blocks in torch's order: LSTM iofc -> ifco (torch's i, f, g, o); GRU zrh -> rzh
_ORDER = {"LSTM": (0, 2, 3, 1), "GRU": (1, 0, 2), "RNN": (0,)}
_DEFAULT_ACTIVATIONS = {"LSTM": ("sigmoid", "tanh", "tanh"), "GRU": ("sigmoid", "tanh")}
_RNN_ACTIVATIONS = {"tanh": "tanh", "relu": "relu"}  # ONNX RNN activation -> nonlinearity
_LSTM_P = 7  # input position of the peephole weights


def _directions(node: OnnxNode) -> int:
    return 2 if node.attr("direction", "forward") == "bidirectional" else 1


def _nonlinearity(node: OnnxNode) -> str:
    """The RNN's torch nonlinearity (``tanh`` / ``relu``), the same for every direction."""
    names = {a.lower() for a in node.attr("activations", ["Tanh"])}
    return _RNN_ACTIVATIONS[names.pop()]


def _check(node: OnnxNode) -> None:
    def refuse(what: str, fix: str) -> None:
        raise ValueError(f"{node.where()}: {what} is not supported by import_onnx; {fix}")

    direction = node.attr("direction", "forward")
    if direction not in ("forward", "reverse", "bidirectional"):
        refuse(f"direction {direction!r}", "use forward, reverse or bidirectional")
    acts = [a.lower() for a in node.attr("activations", [])]
    if node.op_type == "RNN":
        if acts and (len(set(acts)) != 1 or acts[0] not in _RNN_ACTIVATIONS):
            refuse(f"activations {node.attr('activations')}", "use Tanh or Relu (one for all)")
    elif acts:
        default = _DEFAULT_ACTIVATIONS[node.op_type]
        if acts != list(default * (len(acts) // len(default))):
            refuse(
                f"activations {node.attr('activations')}",
                f"only the defaults ({', '.join(default)} per direction) map to torch's layers",
            )
    if node.attr("clip") is not None:
        refuse(f"clip={node.attr('clip')}", "re-export the model without cell clipping")
    if node.op_type == "LSTM" and node.attr("input_forget", 0):
        refuse("input_forget=1 (coupled input and forget gates)", "re-export without it")


def _input(node: OnnxNode, consts: dict, i: int):
    """(given, constant value or None) of input ``i``."""
    given = i < len(node.inputs) and bool(node.inputs[i])
    return given, consts.get(node.inputs[i]) if given else None


def _concrete(t: torch.Tensor) -> bool:
    """A tensor holding data (not a fake tensor or a proxy of a trace)."""
    return torch._guards.detect_fake_mode(t) is None and not isinstance(t, torch.fx.Proxy)


def _check_lengths(node: OnnxNode, lengths, steps) -> None:
    """Refuse ``sequence_lens`` shorter than the sequence (no check on fake / traced values)."""
    if lengths is None:
        return
    if isinstance(lengths, torch.Tensor):
        if not _concrete(lengths):
            return
        values = [int(v) for v in lengths.reshape(-1).tolist()]
    else:
        values = ints(lengths)
    if not all(isinstance(v, int) for v in values) or not isinstance(steps, int):
        return
    if any(v != steps for v in values):
        raise ValueError(
            f"{node.where()}: sequence_lens {values[:8]} differ from the sequence length {steps}; "
            "import_onnx supports sequence_lens only when every sequence has the full length "
            "(pad the batch to one length, or export without sequence_lens)"
        )


# -- weights -------------------------------------------------------------------------------------
def _torch_order(node: OnnxNode, t: torch.Tensor) -> torch.Tensor:
    """``t`` (gate blocks stacked along dim 0) with its blocks in torch's order."""
    order = _ORDER[node.op_type]
    blocks = t.chunk(len(order), 0)
    return torch.cat([blocks[i] for i in order]) if len(order) > 1 else t


def _flat_weights(node: OnnxNode, w, r, b) -> list[torch.Tensor]:
    """torch's ``[w_ih, w_hh, b_ih, b_hh]`` per direction (biases only when ``B`` is given)."""
    w, r, b = as_tensor(w), as_tensor(r), as_tensor(b)
    out = []
    for d in range(w.shape[0]):
        out += [_torch_order(node, w[d]), _torch_order(node, r[d])]
        if b is not None:
            out += [_torch_order(node, half) for half in b[d].chunk(2)]
    return out


def _layer(node: OnnxNode, input_size: int, hidden: int, bias: bool) -> nn.RNNBase:
    bidirectional = _directions(node) == 2
    if node.op_type == "RNN":
        return nn.RNN(input_size, hidden, nonlinearity=_nonlinearity(node), bias=bias,
                      bidirectional=bidirectional)  # fmt: skip
    cls = nn.LSTM if node.op_type == "LSTM" else nn.GRU if _reset_after(node) else GRUResetFirst
    return cls(input_size, hidden, bias=bias, bidirectional=bidirectional)


def _reset_after(node: OnnxNode) -> bool:
    """A GRU whose reset gate scales ``R_n h + b_hn`` (torch's cell, ``linear_before_reset=1``)."""
    return bool(node.attr("linear_before_reset", 0))


def gru_reset_first(x, hx, flat: list, has_bias: bool, bidirectional: bool):
    """ONNX's GRU with ``linear_before_reset=0`` in torch's conventions: ``x [T, B, I]``, ``hx
    [D, B, H]`` or None, ``flat`` torch's ``[w_ih, w_hh, b_ih, b_hh]`` per direction (gates
    ``r, z, n``); returns ``(y [T, B, D*H], h_n [D, B, H])``. Per step, direction ``d``:
    ``r, z = sigmoid(W_rz x + b_irz + R_rz h + b_hrz)``, ``n = tanh(W_n x + b_in + R_n (r * h) +
    b_hn)``, ``h = (1 - z) * n + z * h``; direction 1 runs from the last step to the first."""
    directions, per = (2 if bidirectional else 1), (4 if has_bias else 2)
    steps = x.shape[0]
    ys, states = [], []
    for d in range(directions):
        w_ih, w_hh, *b = flat[d * per : (d + 1) * per]
        hidden = w_hh.shape[-1]
        h = None if hx is None else hx[d]  # None: zeros, whose terms the first step skips
        gates_x = torch.matmul(x, w_ih.t()) + (b[0] if b else 0)  # [T, B, 3H], all steps at once
        w_rz, w_n = w_hh[: 2 * hidden], w_hh[2 * hidden :]
        b_rz, b_n = (b[1][: 2 * hidden], b[1][2 * hidden :]) if b else (0, 0)
        out = [None] * steps
        for t in range(steps) if d == 0 else reversed(range(steps)):
            x_rz, x_n = gates_x[t, :, : 2 * hidden], gates_x[t, :, 2 * hidden :]
            if h is None:  # R h = 0 and r * h = 0: no all-zero tensors for calibration to see
                r, z = torch.sigmoid(x_rz + b_rz).chunk(2, -1)
                h = (1 - z) * torch.tanh(x_n + b_n)
            else:
                r, z = torch.sigmoid(x_rz + torch.matmul(h, w_rz.t()) + b_rz).chunk(2, -1)
                n = torch.tanh(x_n + torch.matmul(r * h, w_n.t()) + b_n)
                h = (1 - z) * n + z * h
            out[t] = h
        ys.append(torch.stack(out))
        states.append(h)
    return torch.cat(ys, -1), torch.stack(states)


class GRUResetFirst(nn.GRU):
    """``nn.GRU``'s parameters with ONNX's ``linear_before_reset=0`` cell (``gru_reset_first``):
    the reset gate scales ``h`` before ``R_n``. Time-major input, no packed sequences."""

    def forward(self, x, hx=None):
        # the parameters by attribute, not ``self._flat_weights`` (a list torch.export lifts as
        # constants ``lifted_tensor_0``...: not trained, and named so in quantize's warnings)
        flat = [getattr(self, name) for name in self._flat_weights_names]
        return gru_reset_first(x, hx, flat, self.bias, self.bidirectional)


def _build(node: OnnxNode, consts: dict):
    (_, w), (_, r), (has_b, b) = (_input(node, consts, i) for i in (1, 2, 3))
    has_p, p = _input(node, consts, _LSTM_P) if node.op_type == "LSTM" else (False, None)
    if w is None or r is None or (has_b and b is None) or (has_p and p is None):
        return None
    if _input(node, consts, 0)[1] is not None or w.dtype not in (np.float32, np.float64):
        return None
    _refuse_peepholes(node, p)
    dtype = torch.float64 if w.dtype == np.float64 else torch.float32
    module = _layer(node, w.shape[2], r.shape[2], b is not None).to(dtype)
    flat = _flat_weights(node, w, r, b)
    with torch.no_grad():
        for name, value in zip(module._flat_weights_names, flat, strict=True):
            getattr(module, name).copy_(value)
    consumed = (1, 2, 3) + ((_LSTM_P,) if has_p else ())
    return module, tuple(i for i in consumed if i < len(node.inputs))


def _refuse_peepholes(node: OnnxNode, p) -> None:
    if p is not None and np.any(np.asarray(p) != 0):
        raise ValueError(
            f"{node.where()}: peephole weights P are not supported by import_onnx (torch's LSTM "
            "has none); re-export the model without peepholes"
        )


# -- the computation -----------------------------------------------------------------------------
def _recurrent(node: OnnxNode, run, x, lengths=None, h0=None, c0=None):
    """ONNX's ``(Y, Y_h[, Y_c])`` of ``run(x [T, B, I], hx) -> (y [T, B, D*H], h_n[, c_n])``,
    a torch layer on time-major input with torch's initial-state layout ``[D, B, H]``."""
    batch_first = node.attr("layout", 0) == 1
    h0, c0 = as_tensor(h0), as_tensor(c0)  # zeros of a run-time shape are numpy (host) values
    if batch_first:
        x = x.transpose(0, 1)
        h0 = h0.transpose(0, 1) if h0 is not None else None
        c0 = c0.transpose(0, 1) if c0 is not None else None
    _check_lengths(node, lengths, x.shape[0])
    reverse = node.attr("direction", "forward") == "reverse"
    if reverse:
        x = x.flip(0)
    if node.op_type == "LSTM" and (h0 is not None or c0 is not None):
        h0 = h0 if h0 is not None else torch.zeros_like(c0)
        hx = (h0, c0 if c0 is not None else torch.zeros_like(h0))
    else:
        hx = h0
    y, *states = run(x, hx)
    if reverse:
        y = y.flip(0)
    steps, batch = y.shape[0], y.shape[1]
    y = y.reshape(steps, batch, _directions(node), -1).permute(0, 2, 1, 3)  # [T, D, B, H]
    if batch_first:
        y = y.permute(2, 0, 1, 3)  # [B, T, D, H]
        states = [s.transpose(0, 1) for s in states]
    return (y, *states)


def _call(node: OnnxNode, module: nn.RNNBase, x, lengths=None, h0=None, c0=None, p=None):
    def run(x, hx):
        y, state = module(x, hx)
        return (y, *state) if isinstance(state, tuple) else (y, state)

    return _recurrent(node, run, x, as_tensor(lengths), h0, c0)


_FUNCTIONS = {"LSTM": torch.lstm, "GRU": torch.gru}


def _functional(node: OnnxNode, x, w, r, b=None, lengths=None, h0=None, c0=None, p=None):
    """The op with run-time weights: torch's recurrent functions on the reordered weights."""
    p = as_tensor(p)
    _refuse_peepholes(node, p.detach().numpy() if p is not None and _concrete(p) else None)
    flat = _flat_weights(node, w, r, b)
    bidirectional = _directions(node) == 2

    def run(x, hx):
        if hx is None:
            shape = (_directions(node), x.shape[1], as_tensor(r).shape[-1])
            hx = x.new_zeros(shape)
            hx = (hx, hx) if node.op_type == "LSTM" else hx
        if node.op_type == "GRU" and not _reset_after(node):
            return gru_reset_first(x, hx, flat, b is not None, bidirectional)
        fn = _FUNCTIONS.get(node.op_type) or getattr(torch, f"rnn_{_nonlinearity(node)}")
        return fn(x, hx, flat, b is not None, 1, 0.0, False, bidirectional, False)

    return _recurrent(node, run, x, as_tensor(lengths), h0, c0)


def warn_integer_weights(module: nn.Module, nodes: dict, integer: Container[str]) -> None:
    """Warn for each recurrent layer of ``module`` (an ``OnnxModule``) whose ``W``, ``R`` or
    ``B`` the file stores as integers (``integer``: their names): they are float parameters."""
    for attr, name in module.onnx_names.items():
        node = nodes.get(name)
        if node is None or not isinstance(getattr(module, attr, None), nn.RNNBase):
            continue
        stored = [n for n in node.inputs[1:4] if n and n in integer]
        if stored:
            warnings.warn(
                f"{node.where()}: its weights {stored} are integers in the file; torch's "
                f"{node.op_type} layer holds their dequantized values as float parameters (the "
                "outputs are exact), with no quantizer: fine-tuning moves them off the file's "
                "grid and export writes them in float",
                stacklevel=3,
            )


_SPEC = LayerSpec(_build, _call)
register(("LSTM", "GRU", "RNN"), since=7, layer=_SPEC, check=_check)(_functional)
