"""The plot package keeps its one promise to notebooks: every plot function returns the
figure it drew (so a cell can assert on it and end with ``plt.show()``), and the package
re-exports every name its modules define."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from pagedkv_lab import viz  # noqa: E402


def test_chunk_masks_and_e2m1_grid_return_their_figure():
    causal = torch.ones(3, 5, dtype=torch.bool).tril(2)
    figs = [viz.plot_chunk_masks({"causal": causal}, past_len=2, title="t"), viz.plot_e2m1_grid({"x": 2.6})]
    try:
        for fig in figs:
            assert isinstance(fig, matplotlib.figure.Figure), f"returned {type(fig).__name__}, not its Figure"
    finally:
        plt.close("all")


def test_package_reexports_every_public_name_of_its_modules():
    import ast
    import importlib
    import inspect

    for name in ("style", "charts", "bookkeeping", "kernels", "quant", "conformance"):
        module = importlib.import_module(f"pagedkv_lab.viz.{name}")
        tree = ast.parse(inspect.getsource(module))
        defined = []
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                defined.append(node.name)
            elif isinstance(node, ast.Assign):
                targets = [e for t in node.targets for e in (t.elts if isinstance(t, ast.Tuple) else [t])]
                defined += [t.id for t in targets if isinstance(t, ast.Name)]
        own = [n for n in defined if not n.startswith("_")]
        assert own, f".{name} defines nothing public"
        missing = [n for n in own if n not in viz.__all__ or getattr(viz, n) is not getattr(module, n)]
        assert not missing, f"pagedkv_lab.viz does not re-export {missing} of .{name}"


def test_bar_plot_takes_an_x_label():
    import matplotlib.pyplot as plt

    from pagedkv_lab import viz

    fig = viz.bar_plot(["0", "1"], [1.0, 2.0], "t", "y", xlabel="position (token)")
    assert fig.axes[0].get_xlabel() == "position (token)"
    assert viz.bar_plot(["0"], [1.0], "t", "y").axes[0].get_xlabel() == ""
    plt.close("all")


def test_plot_categories_writes_labels_in_cells_and_refuses_a_wrong_shape():
    import matplotlib.pyplot as plt
    import pytest

    from pagedkv_lab import viz

    fig = viz.plot_categories([[0, 1]], {0: "a", 1: "b"}, "t", "x", "y", labels=[["7", ""]], figsize=(9, 3))
    assert [t.get_text() for t in fig.axes[0].texts] == ["7"]
    assert tuple(fig.get_size_inches()) == (9, 3)
    with pytest.raises(ValueError, match="labels has shape"):
        viz.plot_categories([[0, 1]], {0: "a", 1: "b"}, "t", "x", "y", labels=[["7"]])
    plt.close("all")


def test_tree_mask_legend_names_context_and_drafts_not_chunks():
    """Notebook 13's tree-mask picture names what its cells are: cached context and a
    draft's own branch, never a chunk's keys (which is what notebook 10's picture shows)."""
    from pagedkv_lib.draft_tree import tree_mask

    tree = tree_mask([-1, 0, 0, 1, 1, 2])
    full = torch.cat([torch.ones(6, 3, dtype=torch.bool), tree], 1)
    causal = torch.cat([torch.ones(6, 3, dtype=torch.bool), torch.ones(6, 6, dtype=torch.bool).tril()], 1)
    try:
        fig = viz.plot_chunk_masks({"c": causal, "t": full}, 3, correct=full, key_labels=viz.TREE_KEY_LABELS)
        labels = [t.get_text() for t in fig.legends[0].get_texts()]
        assert labels == ["hidden", "cached context", "draft: itself or an ancestor", "seen, should not be"]
        assert all(t.get_fontsize() >= 9 for t in fig.legends[0].get_texts()), "legend under 9 pt"
        chunk = viz.plot_chunk_masks({"c": causal}, 3)
        assert [t.get_text() for t in chunk.legends[0].get_texts()][1:] == list(viz.CHUNK_KEY_LABELS)
        with pytest.raises(ValueError, match="key_labels"):
            viz.plot_chunk_masks({"c": causal}, 3, key_labels=("only one",))
    finally:
        plt.close("all")


def test_grouped_bar_values_and_legend_are_at_least_9_pt():
    try:
        fig = viz.plot_grouped_bars(["a", "b"], {"x": [1, 22], "y": [3, 0]}, "t", "count")
        values = fig.axes[0].texts
        assert [t.get_text() for t in values] == ["1", "22", "3", "0"], "one value written per bar"
        assert min(t.get_fontsize() for t in values) >= 9, "bar values under 9 pt"
        assert min(t.get_fontsize() for t in fig.axes[0].get_legend().get_texts()) >= 9, "legend under 9 pt"
    finally:
        plt.close("all")


def test_block_table_draws_a_shared_page_in_its_own_colour_with_a_legend():
    """Notebook 10's prefix hit: page 0 named by A and B is drawn as shared (grey,
    hatched, both names, a legend entry), not in the last sequence's colour."""
    from matplotlib.colors import to_rgba

    from pagedkv_lab.viz.style import SHARED, sequence_colors

    try:
        fig = viz.plot_block_table({"A": [0, 1], "B": [0, 3]}, 4, "t")
        ax = fig.axes[0]
        pages = {t.get_text(): t for t in ax.texts if t.get_text().startswith("page ")}
        assert set(pages) == {"page 0 (A, B)", "page 1", "page 2", "page 3"}
        boxes = {round(p.get_y() + 0.38): p for p in ax.patches if p.get_x() == 3.4}
        assert boxes[0].get_facecolor() == to_rgba(SHARED) and boxes[0].get_hatch() == "//"
        a, b = (to_rgba(sequence_colors(["A", "B"])[s][0]) for s in "AB")
        assert (boxes[1].get_facecolor(), boxes[3].get_facecolor()) == (a, b), "own pages keep their owner's colour"
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["shared: named by several sequences"]
        assert viz.plot_block_table({"A": [0], "B": [1]}, 2).axes[0].get_legend() is None, "no sharing, no legend"
    finally:
        plt.close("all")
