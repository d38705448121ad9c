"""torch's ONNX optimizer pass (onnxscript's ``optimize_ir``), without its quadratic matching.

The optimizer's rewrite pass tries each of its rules at every node of the graph. For a rule
whose pattern has several output nodes (onnxscript 0.5: ``SlicesSplit``, two Slices of one
tensor -> one Split), its matcher first indexes every node of the graph by operator, and only
then checks the node it was given against the pattern's first output node: every node pays a
walk over the whole graph. On the PP-OCRv4 detector's export (about 2,600 nodes before
optimization) that was most of the export's time (the rewrite pass 33 of 58 s under cProfile,
3 million node visits).

``first_output_filtered`` makes those rules answer "no match" at once for a node that their
first output node does not match (its operator and domain, the check the matcher itself makes
first, ``NodePattern.matches``); for such a node every combination the matcher would try fails
at that check, so the rewrites, and the file, are the same. When onnxscript's internals are not
as expected, nothing is changed (the optimizer then runs as it is).

Single-output rules get the same filter where their matcher is onnxscript's
``SimplePatternMatcher``, whose first step for a node is that same check of the pattern's output
node (``_match_node`` on a fresh match): it is not quadratic there, but each refusal went through
the rule's and the matcher's set-up (a fresh ``MatchResult``, tracer, graph), about 40 rules at
every node. A quantized graph is mostly QuantizeLinear / DequantizeLinear, which few rules name:
on HF LeViT's export (about 1,000 nodes) the rewrite pass took 4.8 of the optimizer's 6.9 s
under cProfile, 87,000 tries.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

log = logging.getLogger(__name__)


@contextlib.contextmanager
def first_output_filtered() -> Iterator[None]:
    """Within the block, the optimizer's rules skip nodes their (first) output node cannot
    match (see the module docstring)."""
    patched = []
    try:
        from onnxscript import rewriter
        from onnxscript.rewriter import _basics, _matcher

        for rule in rewriter._DEFAULT_REWRITE_RULES:
            pattern, matcher = rule._target_pattern, rule._matcher
            if "match" in vars(matcher):
                continue
            if pattern.has_single_output_node and type(matcher) is not (
                _matcher.SimplePatternMatcher
            ):
                continue  # another matcher: its first step is not known
            matcher.match = _filtered(matcher.match, pattern.output_nodes[0], _basics)
            patched.append(matcher)
    except (ImportError, AttributeError) as e:  # another onnxscript: run it as it is
        log.debug("optimizer rule filter unavailable: %s", e)
    try:
        yield
    finally:
        for matcher in patched:
            del matcher.match


def _filtered(match, first, basics):
    def filtered_match(model, graph_or_function, node, **kwargs):
        if not first.matches(node, basics.MatchResult()):
            return basics.MatchResult().fail(f"{node.op_type}: not the pattern's first output")
        return match(model, graph_or_function, node, **kwargs)

    return filtered_match
