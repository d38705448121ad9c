"""The debug layer: where, by how much and why two forms of a quantized model disagree, and which
layers to keep wider.

* ``compare``   the same inputs through every engine, per-tensor error in LSBs, bisection;
* ``_subject``  the models and inputs ``compare`` was given, checked and normalised;
* ``_engines``  the engines in a registry keyed by name, each capturing intermediate tensors;
* ``_match``    the quantized tensors ("sites") and each form's names for them (recorded);
* ``_metrics``  SQNR, cosine, absolute and LSB errors; ``_classify`` the class of a difference;
* ``_result``   ``CompareResult`` (JSON ``quantbridge.compare/1``, dataframe, worst, table);
* ``_cli``      the ``quantbridge compare`` command;
* ``_sensitivity`` ranks layers and writes the recipe that meets a budget (``_sens_*`` helpers,
  ``quantbridge sensitivity``);
* ``_report_html`` draws the self-contained HTML report of both.

Sits above ``engine``: it may use every layer below it.
"""

from ._engines import ENGINES
from ._report_html import render_html
from ._result import CompareResult
from ._sensitivity import SensitivityResult, sensitivity
from .compare import compare

__all__ = ["ENGINES", "CompareResult", "SensitivityResult", "compare", "render_html", "sensitivity"]
