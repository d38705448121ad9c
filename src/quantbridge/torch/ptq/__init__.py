"""Post-training accuracy methods that run on a calibrated ``QuantModel`` (issue 14):
AdaRound (``_adaround``) learns each weight's rounding, floor or ceil, layer by layer."""

from ._adaround import LayerResult, adaround

__all__ = ["LayerResult", "adaround"]
