"""Post-training accuracy methods on the captured model, one module per method; each is switched
on by a ``Recipe`` field and wired into ``quantize`` by ``torch._quantize``: ``_equalize``
(``Recipe.equalize``), ``_smoothquant`` (``Recipe.smoothquant``), ``_bias_correction``
(``Recipe.bias_correction``), ``_adaround`` (``Recipe.adaround``: each weight's rounding, floor or
ceil, learned layer by layer on a calibrated ``QuantModel``); ``_graph`` and ``_data`` are their
shared helpers."""

from ._adaround import LayerResult, adaround

__all__ = ["LayerResult", "adaround"]
