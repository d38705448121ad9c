"""The debug layer: where, by how much and why two forms of a quantized model disagree.

* ``compare``   the same inputs through every engine, per-tensor error in LSBs, bisection;
* ``_subject``  the models and inputs ``compare`` was given, checked and normalised;
* ``_engines``  the engines in a registry keyed by name, each capturing intermediate tensors;
* ``_match``    the quantized tensors ("sites") and each form's names for them (recorded);
* ``_metrics``  SQNR, cosine, absolute and LSB errors; ``_classify`` the class of a difference;
* ``_result``   ``CompareResult`` (JSON ``quantbridge.compare/1``, dataframe, worst, table);
* ``_cli``      the ``quantbridge compare`` command.

Sits above ``engine``: it may use every layer below it.
"""

from ._engines import ENGINES
from ._result import CompareResult
from .compare import compare

__all__ = ["ENGINES", "CompareResult", "compare"]
