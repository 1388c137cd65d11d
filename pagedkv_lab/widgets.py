"""ipywidgets explorers for JupyterLab.

Each explorer only wires controls to a pure function that returns a figure (from
:mod:`pagedkv_lab.viz` or a notebook-facing helper); the notebook calls that function
directly in a checked cell first, so the static result exists even where no widget
runs (nbval, a web viewer). The notebook builder stores widget state, so a notebook
opened in JupyterLab, or its HTML export, shows each explorer at its last values before
any kernel runs. Widget cells carry the cell tag ``nbval-ignore-output``: widget views
are not reproducible text.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import matplotlib.pyplot as plt

from pagedkv_lab import viz
from pagedkv_lib import memory

__all__ = ["memory_explorer", "scrubber", "memory_explorer_figure"]


def _show(fig) -> None:
    plt.show()
    plt.close(fig)


def _display(draw: Callable, title: str, **controls) -> None:
    """Show ``draw`` with its controls; returns nothing, so no repr lands in the cell output.

    Where the widget cannot render (an untrusted notebook, a plain-text viewer) the
    output's text says what it is instead of ``interactive(children=(IntSlider(...``."""
    import ipywidgets as w
    from IPython.display import display

    class Explorer(w.interactive):
        def __repr__(self) -> str:  # ipywidgets cuts this text at 110 characters
            return f"[{title}: run this cell in JupyterLab to use it]"

    display(Explorer(draw, **controls))


def memory_explorer_figure(
    num_layers: int = 32,
    num_kv_heads: int = 8,
    head_dim: int = 128,
    dtype: str = "fp16",
    seq_len: int = 4096,
    batch: int = 8,
):
    """Bytes of KV cache for a custom model against the presets, at one length and batch.
    Returns ``(figure, bytes_of_custom_model)``; the custom model's bar is the orange one."""
    custom = memory.ModelSpec("custom", num_layers, max(num_kv_heads, 1), num_kv_heads, head_dim)
    specs = {"custom": custom, **memory.PRESETS}
    gib = {name: memory.kv_cache_bytes(spec, [seq_len] * batch, dtype) / 2**30 for name, spec in specs.items()}
    fig = viz.bar_plot(
        list(gib),
        list(gib.values()),
        f"KV cache for {batch} x {seq_len} tokens, {dtype}",
        "GiB",
        "{:.1f}",
        colors=[viz.PALETTE[1]] + [viz.PALETTE[0]] * len(memory.PRESETS),
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
        "memory explorer",
        num_layers=w.IntSlider(32, 1, 128, description="layers", **style),
        num_kv_heads=w.IntSlider(8, 1, 128, description="KV heads", **style),
        head_dim=w.IntSlider(128, 32, 256, 16, description="head dim", **style),
        dtype=w.Dropdown(options=["fp32", "fp16", "bf16", "fp8", "fp4"], value="fp16", description="dtype"),
        seq_len=w.IntSlider(4096, 256, 131072, 256, description="tokens", **style),
        batch=w.IntSlider(8, 1, 256, description="batch", **style),
    )


def scrubber(
    figure_at: Callable[[int], object],
    steps: int | Sequence[int],
    description: str = "step",
    start: int | None = None,
):
    """A slider over ``steps`` that redraws ``figure_at(step)``. ``steps`` is a range of
    the values the slider shows (``range(1, 8)`` for "after step 1" .. "after step 7"),
    or a count ``n`` for ``range(n)``; the slider's value is what ``figure_at`` gets."""
    import ipywidgets as w

    values = range(steps) if isinstance(steps, int) else steps
    if len(values) == 0 or list(values) != list(range(values[0], values[0] + len(values))):
        raise ValueError(f"steps must be consecutive integers, got {list(values)[:5]}...")

    def draw(step):
        _show(figure_at(step))

    first, last = values[0], values[-1]
    slider = w.IntSlider(
        first if start is None else start, first, last, description=description, continuous_update=False
    )
    _display(draw, f"slider over {description} {first}..{last}", step=slider)
