"""Formulas that render without the network: ``$...$`` and ``$$...$$`` in Markdown as
MathML, which browsers draw themselves (no MathJax from a CDN). Used by the offline HTML
of the notebooks (``scripts/build_notebooks.py``) and by the feedback a class gets
(:mod:`pagedkv_lab.grading.feedback`). Needs ``latex2mathml`` (the ``dev`` extra)."""

from __future__ import annotations

import re

__all__ = ["MATH", "mathml", "markdown_with_mathml"]

# $$display$$ or $inline$ (a $ not escaped, not followed or preceded by a space inside)
MATH = re.compile(r"\$\$(.+?)\$\$|(?<![\\$])\$(?!\s)(.+?)(?<![\s\\])\$", re.S)


def mathml(tex: str, display: bool) -> str:
    """The MathML of one TeX formula (``display``: a block, else inline)."""
    import latex2mathml.converter

    # latex2mathml keeps the backslash of an escaped underscore inside \text{...}
    tex = re.sub(r"\\text\{([^}]*)\}", lambda m: r"\text{" + m.group(1).replace(r"\_", "_") + "}", tex)
    return latex2mathml.converter.convert(" ".join(tex.split()), display="block" if display else "inline")


def markdown_with_mathml(source: str) -> str:
    """``source`` (Markdown) with every formula replaced by its MathML."""
    return MATH.sub(lambda m: mathml(m.group(1) or m.group(2), bool(m.group(1))), source)
