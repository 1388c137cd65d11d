"""The plots of notebooks 09 and 10 read at notebook width (text >= 9 pt, nothing drawn
outside the data range, legends outside the data, horizontal labels), the source
call-outs the notebooks assert on find the lines they name, and the kernel notebook 10
shows whole is no longer than the one notebook 07 shows."""

import ast
import inspect
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from pagedkv_lab import viz  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _texts(fig):
    return [t for t in fig.findobj(matplotlib.text.Text) if t.get_text().strip()]


def test_e2m1_grid_text_is_at_least_9pt_and_samples_lie_inside_the_axis_range():
    fig = viz.plot_e2m1_grid({"x[0]": 2.95, "big": 9.0, "tiny": 0.05})
    small = [(t.get_text(), t.get_fontsize()) for t in _texts(fig) if t.get_fontsize() < 9]
    assert not small, f"text below 9 pt: {small}"
    ax = fig.axes[0]
    lo, hi = ax.get_xlim()
    outside = [t.get_text() for t in ax.texts if not lo <= t.get_position()[0] <= hi]
    assert not outside, f"labels outside the axis range {lo, hi}: {outside}"
    assert [t.get_text() for t in ax.get_yticklabels()] == ["grid", "x[0]", "big", "tiny"]


def test_error_histograms_are_step_outlines_side_by_side_with_the_legend_outside():
    errors = {p: {"fp8": torch.rand(200) * 1e-2, "nvfp4": torch.rand(200)} for p in ("K", "V")}
    fig = viz.plot_error_histograms(errors, "t")
    panels = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in panels] == ["K", "V"], "one panel per tensor, side by side"
    for ax in panels:
        assert ax.get_legend() is None, "the legend must not sit on the data"
        filled = [p for p in ax.patches if p.get_fill()]
        assert ax.patches and not filled, f"histograms must be step outlines, {len(filled)} are filled"
    assert fig.legends, "one legend for the figure, outside the panels"


def test_error_bars_write_values_at_9pt_and_keep_the_legend_outside():
    fig = viz.plot_error_bars(["a", "b"], {"x": [0.1, 0.2], "y": [0.01, 0.02]}, "t", "err")
    ax = fig.axes[0]
    values = [t for t in ax.texts if t.get_text()]
    assert len(values) == 4 and min(t.get_fontsize() for t in values) >= 9, "one 9-pt value per bar"
    legend = ax.get_legend()
    assert legend is not None and legend.get_bbox_to_anchor().x0 > ax.get_window_extent().x1 - 1


def test_margins_are_horizontal_bars_with_horizontal_labels_red_past_the_rule():
    fig = viz.plot_margins(["a long label one", "label two"], [0.01, 30.0], "t")
    ax = fig.axes[0]
    assert all(t.get_rotation() == 0 for t in ax.get_yticklabels() + ax.get_xticklabels())
    assert [t.get_text() for t in ax.get_yticklabels()] == ["a long label one", "label two"]
    colours = [matplotlib.colors.to_hex(p.get_facecolor()) for p in ax.patches]
    assert colours == [viz.OK_GREEN.lower(), viz.FAIL_RED.lower()], f"pass green, fail red: {colours}"


def _sample():
    x = 1
    y = x + 1  # the lesson line
    return y


def test_find_lines_gives_file_line_numbers_and_lesson_lines_refuses_a_missing_needle():
    lines, start = inspect.getsourcelines(_sample)
    want = start + next(i for i, line in enumerate(lines) if "the lesson line" in line)
    assert viz.find_lines(_sample, "the lesson line") == [want]
    assert viz.find_lines(_sample, "not there") == []
    assert f"{want:4d}> " in str(viz.lesson_lines(_sample, ["the lesson line"]))
    with pytest.raises(ValueError, match="not there"):
        viz.lesson_lines(_sample, ["not there"])


NOTEBOOK_SOURCES = Path(__file__).resolve().parents[1] / "notebooks" / "src"


def _shown_whole(name: str) -> dict[str, int]:
    """The line count of every block notebook ``name`` shows whole (``viz.source_code(x)``),
    by the expression ``x`` as written, resolved through the notebook's own imports of
    ``pagedkv_kernels``. Reads the notebook's source; runs no cell."""
    tree = ast.parse((NOTEBOOK_SOURCES / name).read_text())
    namespace = {}
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)) and "pagedkv_kernels" in ast.unparse(node):
            exec(ast.unparse(node), namespace)
    shown = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "viz.source_code":
            expr = ast.unparse(node.args[0])
            shown[expr] = viz.source_code(eval(expr, namespace)).shown_lines
    return shown


def test_the_kernel_notebook_10_shows_is_no_longer_than_the_one_notebook_07_shows():
    """Notebook 10 shows the plain prefill kernel, as notebook 07 shows the decode kernel;
    its variants (other layouts, new tokens apart, trees) layer on it elsewhere. The plain
    kernel is no longer than 07's decode kernel, and no display takes over 40 lines."""
    from pagedkv_kernels import decode, prefill

    shown = _shown_whole("10_chunked_prefill.py")
    assert "production.prefill_kernel" in shown, f"notebook 10 no longer shows the plain prefill kernel: {shown}"
    assert max(shown.values()) <= viz.MAX_SHOWN_LINES, f"notebook 10 shows {shown} lines, over 40"
    plain, decode_kernel = (len(viz.source_code(k).full) for k in (prefill.prefill_kernel, decode.decode_split_kernel))
    assert plain <= decode_kernel, f"the plain prefill kernel is {plain} lines, 07's decode kernel {decode_kernel}"


def _kernel_like(x, k):
    # fmt: off
    a = x + k  # noqa: E225
    b = a * 2  # the lesson
    # fmt: on
    return b  # fmt: skip


def test_a_listing_shows_the_lesson_with_context_folds_the_rest_and_hides_tooling_comments():
    shown = viz.kernel_listing(_kernel_like, ["the lesson"], context=1)
    text = str(shown)
    assert "the lesson" in text and "a = x + k" in text and "fmt:" not in text and "noqa" not in text
    assert "return b" in text and shown.shown_lines <= viz.MAX_SHOWN_LINES
    assert "<details>" in shown._repr_html_() and "fmt:" not in shown._repr_html_()
    with pytest.raises(ValueError, match="not there"):
        viz.kernel_listing(_kernel_like, ["not there"])
    with pytest.raises(ValueError, match="context"):
        viz.kernel_listing(_kernel_like, ["the lesson"], context=-1)


def test_a_long_kernel_shown_whole_is_folded_to_its_signature_and_docstring():
    from pagedkv_kernels import decode

    shown = viz.source_code(decode.decode_split_kernel)
    assert shown.shown_lines <= 5 and "parameters, in the full source below" in str(shown)
    assert len(shown.full) > viz.MAX_SHOWN_LINES  # the whole kernel is one click away
