"""Feedback a learner can read offline: ``nbgrader generate_feedback`` with the
notebook's formulas as MathML (:mod:`pagedkv_lab.offline_math`) instead of TeX for
MathJax to fetch from a CDN. The course's ``nbgrader_config.py`` adds
:class:`MathAsMathML` to ``GenerateFeedback.preprocessors``."""

from __future__ import annotations

from nbconvert.preprocessors import Preprocessor
from nbgrader.converters import GenerateFeedback
from traitlets import Bool

from pagedkv_lab.offline_math import markdown_with_mathml

__all__ = ["MathAsMathML", "feedback_preprocessors"]


class MathAsMathML(Preprocessor):
    """Every Markdown cell's ``$...$`` and ``$$...$$`` as MathML."""

    enabled = Bool(True, help="nbconvert runs a preprocessor only when it is enabled").tag(config=True)

    def preprocess_cell(self, cell, resources, index):
        if cell.cell_type == "markdown":
            cell.source = markdown_with_mathml(cell.source)
        return cell, resources


def feedback_preprocessors() -> list:
    """nbgrader's generate_feedback preprocessors and :class:`MathAsMathML` (for
    ``c.GenerateFeedback.preprocessors``)."""
    return [*GenerateFeedback.class_traits()["preprocessors"].default(), MathAsMathML]
