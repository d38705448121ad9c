"""Pairing a float ONNX file's tensors with a quantized file's sites, by name and by structure.

``qb.compare(float_file, quantized_file)`` measures each quantized tensor ("site", ``_match``)
against the float tensor it approximates. Names alone often miss: quantbridge's export of a model
imported from the file (or of the torch model the file was exported from) names values after fx
nodes (``add`` for the file's ``add_20``, ``linear`` for its output ``y``); ONNX Runtime's
``quantize_static`` renames a graph output's producer (``y_QuantizeLinear_Input``) and drops a
Relu that the quantizer's clamp computes. ``match_float_file`` pairs the two graphs' ops:

* each graph's compute ops are read with QuantizeLinear -> DequantizeLinear pairs, Identity and
  Dropout passed through; constants are initializers, Constant and Shape outputs and what ops
  compute from them alone (Paddle2ONNX's Reshape of a bias, Concat of a flatten's shape), and a
  DequantizeLinear of an initializer (a weight);
* graph inputs pair by name, else by position;
* in topological order, a quantized op pairs with the unused float op of the same type whose
  non-constant inputs are the pairs of its own (in any order for commutative ops); among several,
  the one whose weight equals the dequantized weight within one step (``structure``); Flatten,
  Squeeze and Unsqueeze count as Reshape (same values in the same order), Gemm as MatMul;
* an op whose inputs are not all paired follows the ops the two graphs spell differently
  upstream (GlobalAveragePool and ReduceMean, HardSigmoid and Mul -> Add -> Clip, Neg and
  Mul(-1)): it pairs with the unused float op of its type whose inputs are its paired inputs'
  pairs and, for each unpaired one, an unpaired float value computed from the same paired values
  through at most ``_REGION`` unweighted ops (a region), the fewest float ops first; the two
  regions' outputs pair (``region``). A quantized graph's own Cast (ModelOpt) pairs with the
  value it reads;
* an op with no such pair pairs by its weight alone: the float op of its type whose weight is its
  dequantized weight within one step (``weight``);
* an op the quantized graph does without follows its pair: a BatchNormalization after a paired
  weighted op (folded into its weights), an Add of a constant after a Conv or Gemm without a bias
  whose pair has one (the bias), a Relu or Clip where every quantized reader of the value is a
  QuantizeLinear whose range lies within its bounds (the clamp computes it; ONNX Runtime's
  quantizer drops such a Clip and names the value it reads after it);
* a site takes the pair of the tensor its QuantizeLinear reads; where structure finds none, the
  same name in the float file (``name``). Values inside a region (the Mul(0.2) of a hard-sigmoid)
  hold nothing the other graph computes and stay unpaired.

The rule is kept with each pair: ``name``, ``structure``, ``name, structure`` (both agree),
``region``, ``weight``, ``input name`` / ``input position``, with `` + Relu absorbed``,
`` + Clip absorbed``, `` + bias Add folded`` or `` + BatchNormalization folded``.
"""

from __future__ import annotations

from collections import defaultdict
from itertools import permutations

import numpy as np
import onnx
from onnx import numpy_helper

from ..numerics import dequantize
from ..onnx._graph_index import GraphIndex
from ._match import Site

_THROUGH = frozenset({"Identity", "Dropout"})
_QDQ = frozenset({"QuantizeLinear", "DequantizeLinear"})
_COMMUTATIVE = frozenset({"Add", "Mul", "Sum", "Max", "Min", "Mean"})
_WEIGHTED = frozenset({"Conv", "ConvTranspose", "Gemm", "MatMul"})
_BIASED = frozenset({"Conv", "ConvTranspose", "Gemm"})  # their third input is a bias
_CONST = "<constant>"
_NOT_IN_REGION = _WEIGHTED | {"BatchNormalization"}
_KEEPS_VALUES = frozenset({"Cast"})  # a quantized graph's op without float counterpart (ModelOpt)
_REGION = 16  # the most values a region (ops the two graphs spell differently) may span
_SHAPE = frozenset({"Constant", "Shape", "Size"})  # their outputs are constants for pairing
# ops that keep the values in order and only change the shape pair with each other (exporters
# write torch.flatten as Flatten or Reshape); compare refuses a pair whose shapes differ. A Gemm
# pairs with a MatMul (ONNX Runtime fuses MatMul and the bias Add into a Gemm; see _follow)
_FAMILY = {"Flatten": "Reshape", "Squeeze": "Reshape", "Unsqueeze": "Reshape", "Gemm": "MatMul"}


class _Graph:
    """One graph's compute ops, values read through Q -> DQ pairs, and constants."""

    def __init__(self, graph: onnx.GraphProto):
        self.inits = {i.name: i for i in graph.initializer}
        index = GraphIndex(list(graph.node), self.inits, (o.name for o in graph.output))
        self.index, self.producer, self.readers = index, index.producer, index.consumers
        # constants: Constant nodes' outputs, tensor shapes, and what ops compute from these alone
        # (Paddle2ONNX writes a bias as Reshape(offset, shape) and a flatten's shape as
        # Concat(Cast(Slice(Shape(x)))), which ONNX Runtime's quantizer folds into initializers);
        # the nodes are in topological order
        self.constants = set(self.inits)
        for n in graph.node:
            live = [i for i in n.input if i]
            if n.op_type in _SHAPE or (live and all(i in self.constants for i in live)):
                self.constants.update(n.output)
        skip = _QDQ | _THROUGH
        self.compute = [
            n for n in graph.node if n.op_type not in skip and n.output[0] not in self.constants
        ]
        self.inputs = [i.name for i in graph.input if i.name not in self.constants]
        self.names = {o for n in graph.node for o in n.output} | set(self.inputs)
        self._weights: dict[int, tuple[np.ndarray, float] | None] = {}

    def resolve(self, t: str) -> str:
        """The value ``t`` carries: through pass-through ops and Q -> DQ pairs; ``_CONST`` for a
        constant or a DequantizeLinear of one."""
        for _ in range(64):
            if t in self.constants:
                return _CONST
            p = self.producer.get(t)
            if p is None:
                return t
            if p.op_type in _THROUGH:
                t = p.input[0]
                continue
            if p.op_type != "DequantizeLinear":
                return t
            if p.input[0] in self.constants:
                return _CONST
            q = self.producer.get(p.input[0])
            if q is None or q.op_type != "QuantizeLinear":
                return t
            t = q.input[0]
        return t

    def signature(self, op: str, inputs: list[str | None]) -> tuple:
        """Op type and non-constant inputs (sorted for commutative ops): constants (weights,
        biases, shapes) do not take part, so a bias added by BatchNormalization folding or a
        shape written as another initializer does not matter."""
        live = [(k, i) for k, i in enumerate(inputs) if i not in ("", _CONST)]
        op = _FAMILY.get(op, op)
        if op in _COMMUTATIVE:
            return (op, tuple(sorted(i for _, i in live)))
        return (op, tuple(live))

    def weight(self, node: onnx.NodeProto) -> tuple[np.ndarray, float] | None:
        """The node's largest constant input as float values, with its step (0.0 for a float
        initializer): a DequantizeLinear of an integer initializer is dequantized."""
        if id(node) in self._weights:
            return self._weights[id(node)]
        best = None
        for t in node.input:
            value = self._constant_value(t)
            if value is not None and (best is None or value[0].size > best[0].size):
                best = value
        self._weights[id(node)] = best
        return best

    def _constant_value(self, t: str) -> tuple[np.ndarray, float] | None:
        if t in self.inits:
            return numpy_helper.to_array(self.inits[t]).astype(np.float64), 0.0
        p = self.producer.get(t)
        if p is None or p.op_type != "DequantizeLinear" or p.input[0] not in self.inits:
            return None
        q = numpy_helper.to_array(self.inits[p.input[0]])
        scale = self._array(p.input[1])
        zero = self._array(p.input[2]) if len(p.input) > 2 and p.input[2] else np.zeros(1)
        if scale is None or zero is None:
            return None
        axis = next((a.i for a in p.attribute if a.name == "axis"), 1) if scale.size > 1 else None
        values = dequantize(q.astype(np.float64), scale.astype(np.float64), zero, axis)
        return np.asarray(values, np.float64), float(np.max(scale))

    def _array(self, t: str) -> np.ndarray | None:
        return numpy_helper.to_array(self.inits[t]) if t in self.inits else None

    def quantized_readers(self, t: str) -> list[onnx.NodeProto]:
        """The ops reading value ``t``, through a QuantizeLinear -> DequantizeLinear pair."""
        found = []
        for r in self.readers.get(t, []):
            if r.op_type != "QuantizeLinear":
                found.append(r)
                continue
            for d in self.readers.get(r.output[0], []):
                found.extend(self.readers.get(d.output[0], []) if d.op_type in _QDQ else [d])
        return found

    def clamps_within(self, t: str, low: float, high: float) -> bool:
        """Every reader of ``t`` is a QuantizeLinear whose range, ``scale * (qmin - zero_point)``
        to ``scale * (qmax - zero_point)``, lies within [low, high] (half a step of slack): its
        clamp then computes a Relu or Clip with those bounds."""
        readers = self.readers.get(t, [])
        if not readers:
            return False
        for r in readers:
            if r.op_type != "QuantizeLinear":
                return False
            scale = self._array(r.input[1])
            zero = self._array(r.input[2]) if len(r.input) > 2 and r.input[2] else None
            if zero is None:  # ONNX default: uint8 zero point 0
                zero = np.zeros(1, np.uint8)
            if scale is None or scale.size != 1 or zero.size != 1:
                return False
            if not np.issubdtype(zero.dtype, np.integer):
                return False
            s, z, info = float(scale.reshape(-1)[0]), int(zero.reshape(-1)[0]), np.iinfo(zero.dtype)
            if s * (info.min - z) < low - s / 2 or s * (info.max - z) > high + s / 2:
                return False
        return True

    def clip_bounds(self, node: onnx.NodeProto) -> tuple[float, float] | None:
        """[low, high] of a Relu or Clip (attributes before opset 11, inputs since); None for
        other ops or bounds that are not constants."""
        if node.op_type == "Relu":
            return 0.0, np.inf
        if node.op_type != "Clip":
            return None
        bounds = [-np.inf, np.inf]
        for a in node.attribute:
            if a.name in ("min", "max"):
                bounds[a.name == "max"] = a.f
        for k, t in enumerate(node.input[1:3]):
            if t:
                value = self.index.array(t)
                if value is None or value.size != 1:
                    return None
                bounds[k] = float(value.reshape(-1)[0])
        return bounds[0], bounds[1]


def _weights_agree(a: tuple[np.ndarray, float] | None, b: tuple[np.ndarray, float] | None):
    """The dequantized weight ``a`` is the float weight ``b`` within one step (rounding to the
    nearest code moves a weight by half a step; clipping by none when the range is the weight's)."""
    if a is None or b is None or a[0].shape != b[0].shape:
        return False
    step = max(a[1], b[1])
    return bool(np.max(np.abs(a[0] - b[0]), initial=0.0) <= step * (1 + 1e-6) + 1e-12)


def _pick(q: _Graph, node: onnx.NodeProto, f: _Graph, candidates: list) -> onnx.NodeProto | None:
    if len(candidates) <= 1:
        return candidates[0] if candidates else None
    mine = q.weight(node)
    for c in candidates:
        if _weights_agree(mine, f.weight(c)):
            return c
    return candidates[0]


def _by_weight(q: _Graph, node: onnx.NodeProto, f: _Graph, free: list) -> onnx.NodeProto | None:
    if node.op_type not in _WEIGHTED:
        return None
    mine = q.weight(node)
    if mine is None:
        return None
    for c in free:
        same = _FAMILY.get(c.op_type, c.op_type) == _FAMILY.get(node.op_type, node.op_type)
        if same and _weights_agree(mine, f.weight(c)):
            return c
    return None


def _has_bias(node: onnx.NodeProto) -> bool:
    return node.op_type in _BIASED and len(node.input) > 2 and bool(node.input[2])


def _follow(
    q: _Graph, node: onnx.NodeProto, out: str, f: _Graph, found: onnx.NodeProto, fo: str
) -> tuple[str, str]:
    """``fo`` moved past float ops the quantized graph does without (module docstring)."""
    extra, bias = "", _has_bias(node) and not _has_bias(found)
    for _ in range(4):
        readers = f.readers.get(fo, [])
        if len(readers) != 1 or not readers[0].output:
            break
        nxt = readers[0]
        if nxt.op_type in {r.op_type for r in q.quantized_readers(out)}:
            break
        if nxt.op_type == "BatchNormalization" and node.op_type in _WEIGHTED:
            extra += " + BatchNormalization folded"
        elif nxt.op_type == "Add" and bias and _CONST in [f.resolve(i) for i in nxt.input]:
            extra, bias = extra + " + bias Add folded", False
        elif (bounds := f.clip_bounds(nxt)) is not None and q.clamps_within(out, *bounds):
            extra += f" + {nxt.op_type} absorbed"
        else:
            break
        fo = nxt.output[0]
    return fo, extra


def _region(g: _Graph, t: str, paired, used: set[int]) -> tuple[frozenset[str], list] | None:
    """The paired values ``t`` is computed from and the unpaired ops between (at most
    ``_REGION``, none in ``used``); None where the walk reaches a graph input, an op in ``used``,
    a weighted op (a region is a different spelling of an activation, not a skipped layer) or
    passes the bound."""
    seen: set[str] = set()
    stack, found, ops = [t], set(), []
    while stack:
        v = stack.pop()
        if v in paired:
            found.add(v)
            continue
        if v in seen:
            continue
        seen.add(v)
        p = g.producer.get(v)
        if p is None or len(seen) > _REGION or id(p) in used or p.op_type in _NOT_IN_REGION:
            return None
        ops.append(p)
        stack.extend(r for r in (g.resolve(i) for i in p.input if i) if r != _CONST)
    return (frozenset(found), ops) if found else None


def _region_inputs(q: _Graph, node, f: _Graph, cand, pairs, paired_f, used) -> tuple | None:
    """How ``node``'s live inputs line up with float op ``cand``'s: each paired one with its pair,
    each unpaired one with a float value computed from the same paired values (the two graphs
    spell that region differently), or with the very value a chain of ``_KEEPS_VALUES`` ops of
    the quantized graph reads. Returns the float ops the regions hold and (value, float value)
    for each unpaired input; None: no fit."""
    mine = [(k, v) for k, v in enumerate(map(q.resolve, node.input)) if v not in ("", _CONST)]
    fin = [(k, f.resolve(i)) for k, i in enumerate(cand.input) if i]
    theirs = [(k, v) for k, v in fin if v != _CONST]
    if len(mine) != len(theirs):
        return None
    commutative = _FAMILY.get(node.op_type, node.op_type) in _COMMUTATIVE and len(mine) <= 4
    for order in permutations(theirs) if commutative else [theirs]:
        if not commutative and [k for k, _ in mine] != [k for k, _ in order]:
            continue
        found, ops = [], []
        for (_, v), (_, fv) in zip(mine, order, strict=True):
            if v in pairs:
                if pairs[v] != fv:
                    break
                continue
            a = _region(q, v, pairs, set())
            if a is None:
                break
            if fv in paired_f:  # ops of the quantized graph only: they must keep the values
                if {pairs[x] for x in a[0]} != {fv} or any(
                    o.op_type not in _KEEPS_VALUES for o in a[1]
                ):
                    break
            else:
                b = _region(f, fv, paired_f, used)
                if b is None or {pairs[x] for x in a[0]} != b[0]:
                    break
                ops += b[1]
            found.append((v, fv))
        else:
            return ops, found
    return None


def _pair_values(q: _Graph, f: _Graph) -> tuple[dict[str, str], dict[str, str]]:
    """Quantized value -> float tensor, and the rule that paired it."""
    pairs: dict[str, str] = {}
    how: dict[str, str] = {}
    for k, name in enumerate(q.inputs):
        if name in f.inputs:
            pairs[name], how[name] = name, "input name"
        elif k < len(f.inputs):
            pairs[name], how[name] = f.inputs[k], "input position"
    index: dict[tuple, list[onnx.NodeProto]] = defaultdict(list)
    by_type: dict[str, list[onnx.NodeProto]] = defaultdict(list)
    for n in f.compute:
        index[f.signature(n.op_type, [f.resolve(i) if i else "" for i in n.input])].append(n)
        by_type[_FAMILY.get(n.op_type, n.op_type)].append(n)
    used: set[int] = set()
    for node in q.compute:
        ins = [v if v in ("", _CONST) else pairs.get(v) for v in map(q.resolve, node.input)]
        found, rule, regions, region_ops = None, "structure", [], []
        if None not in ins:
            free = [c for c in index.get(f.signature(node.op_type, ins), []) if id(c) not in used]
            found = _pick(q, node, f, free)
        else:
            paired_f = set(pairs.values())
            fits = {}
            for c in by_type.get(_FAMILY.get(node.op_type, node.op_type), []):
                if id(c) not in used:
                    fit = _region_inputs(q, node, f, c, pairs, paired_f, used)
                    if fit is not None:
                        fits[id(c)] = (c, fit)
            if fits:  # the fewest float ops in regions: a nearer op, not one further down
                least = min(len(ops) for _, (ops, _) in fits.values())
                near = [c for c, (ops, _) in fits.values() if len(ops) == least]
                found = _pick(q, node, f, near)
                region_ops, regions = fits[id(found)][1]
        if found is None:
            found = _by_weight(q, node, f, [c for c in f.compute if id(c) not in used])
            rule = "weight"
            if found is not None:
                paired_f = set(pairs.values())
                fit = _region_inputs(q, node, f, found, pairs, paired_f, used)
                region_ops, regions = fit if fit is not None else ([], [])
        if found is None:
            continue
        used.update(id(o) for o in [found, *region_ops])
        for v, fv in regions:
            pairs[v], how[v] = fv, "region"
        for out, fo in zip(node.output, found.output, strict=False):
            if out and fo:
                pairs[out], extra = _follow(q, node, out, f, found, fo)
                how[out] = rule + extra
    return pairs, how


def match_float_file(
    quantized: onnx.ModelProto, sites: list[Site], float_model: onnx.ModelProto
) -> dict[str, tuple[str, str]]:
    """Site name -> (float tensor of ``float_model``, the rule that paired them), for every site
    of ``quantized`` (a QDQ file) with a pair; see the module docstring."""
    q, f = _Graph(quantized.graph), _Graph(float_model.graph)
    pairs, how = _pair_values(q, f)
    found: dict[str, tuple[str, str]] = {}
    for s in sites:
        tensor = s.source or s.name
        value = q.resolve(tensor)
        named = tensor if tensor in f.names else None
        paired = pairs.get(value)
        if paired is not None:
            rule = how[value]
            if paired == named and not rule.startswith("input"):
                rule = "name, " + rule
            found[s.name] = (paired, rule)
        elif named is not None:
            found[s.name] = (named, "name")
    return found
