"""ipywidgets explorers for JupyterLab.

Each explorer only wires sliders to a pure function that returns a figure (from
:mod:`pagedkv_lib.viz` or a notebook-facing helper); the notebook calls that function
directly in a checked cell first, so the static result exists even where no widget
renders (nbval, nbconvert, a web viewer). Widget cells are marked
``# NBVAL_IGNORE_OUTPUT`` because widget views are not reproducible text.
"""

from __future__ import annotations

from collections.abc import Callable

import matplotlib.pyplot as plt

from . import memory, viz

__all__ = ["memory_explorer", "scrubber", "memory_explorer_figure"]


def _show(fig) -> None:
    plt.show()
    plt.close(fig)


def _display(draw: Callable, **controls) -> None:
    """Show ``draw`` with its controls; returns nothing, so no repr lands in the cell output."""
    import ipywidgets as w
    from IPython.display import display

    display(w.interactive(draw, **controls))


def memory_explorer_figure(
    num_layers: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    dtype: str = "fp16",
    seq_len: int = 4096,
    batch: int = 8,
):
    """Bytes of KV cache for a custom model against the presets, at one length and batch.
    Returns ``(figure, bytes_of_custom_model)``."""
    custom = memory.ModelSpec("custom", num_layers, max(num_kv_heads, 1), num_kv_heads, head_dim)
    specs = {"custom": custom, **memory.PRESETS}
    gib = {name: memory.kv_cache_bytes(spec, [seq_len] * batch, dtype) / 2**30 for name, spec in specs.items()}
    fig = viz.bar_plot(
        list(gib), list(gib.values()), f"KV cache for {batch} x {seq_len} tokens, {dtype}", "GiB", "{:.1f}"
    )
    return fig, memory.kv_cache_bytes(custom, [seq_len] * batch, dtype)


def memory_explorer():
    """Sliders for layers, KV heads, head dim, dtype, length and batch over
    :func:`memory_explorer_figure`."""
    import ipywidgets as w

    def draw(num_layers, num_kv_heads, head_dim, dtype, seq_len, batch):
        fig, nbytes = memory_explorer_figure(num_layers, num_kv_heads, head_dim, dtype, seq_len, batch)
        print(f"custom model: {nbytes / 2**30:.2f} GiB")
        _show(fig)

    style = {"continuous_update": False}
    _display(
        draw,
        num_layers=w.IntSlider(32, 1, 128, **style),
        num_kv_heads=w.IntSlider(8, 1, 128, **style),
        head_dim=w.IntSlider(128, 32, 256, 16, **style),
        dtype=w.Dropdown(options=["fp32", "fp16", "bf16", "fp8", "fp4"], value="fp16"),
        seq_len=w.IntSlider(4096, 256, 131072, 256, **style),
        batch=w.IntSlider(8, 1, 256, **style),
    )


def scrubber(figure_at: Callable[[int], object], num_steps: int, description: str = "step", start: int = 0):
    """A slider over ``0 .. num_steps-1`` that redraws ``figure_at(step)``."""
    import ipywidgets as w

    def draw(step):
        _show(figure_at(step))

    slider = w.IntSlider(start, 0, max(num_steps - 1, 0), description=description, continuous_update=False)
    _display(draw, step=slider)
