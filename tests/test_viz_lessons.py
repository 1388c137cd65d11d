"""The plots of notebooks 09 and 10 read at notebook width (text >= 9 pt, nothing drawn
outside the data range, legends outside the data, horizontal labels), and the source
call-outs the notebooks assert on find the lines they name."""

import inspect

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
    assert f"{want:4d}  " in viz.lesson_lines(_sample, ["the lesson line"]).data
    with pytest.raises(ValueError, match="not there"):
        viz.lesson_lines(_sample, ["not there"])
