"""The plot package keeps its one promise to notebooks: every plot function returns the
figure it drew (so a cell can assert on it and end with ``plt.show()``), and the package
re-exports every name its modules define."""

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
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
