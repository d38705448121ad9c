"""The debug layer (DESIGN.md): why two forms of a quantized model disagree and which layers to
keep wider. ``sensitivity`` ranks layers and writes the recipe that meets a budget
(``_sensitivity``); ``render_html`` draws the self-contained HTML report (``_report_html``)."""

from ._report_html import render_html
from ._sensitivity import SensitivityResult, sensitivity

__all__ = ["SensitivityResult", "render_html", "sensitivity"]
