"""Plot helpers for the notebooks: the one home of every figure the suite draws.

Every function returns a matplotlib ``Figure`` (and draws nothing else), so a
notebook cell can assert on the data and end with ``plt.show()``.

One style for all of them (:func:`use_style`): text of 11-12 px at 100 dpi, legible in a
1400 px browser window; the Okabe-Ito palette (:data:`PALETTE`), which stays distinct
under the common colour-vision deficiencies; discrete colours with a legend for
categories and booleans, a colour bar only for continuous quantities; integer ticks on
integer axes. A sequence keeps its colour in every view that is given the same
``order`` (:func:`sequence_colors`).

Notebooks call the package (``viz.line_plot(...)``); its modules, by what they show:

- :mod:`.style`: the palette, the figure style, colours per sequence, integer ticks.
- :mod:`.charts`: generic charts: lines, bars, grouped bars, histograms, heatmaps,
  category grids.
- :mod:`.bookkeeping`: pages and their owners, block tables, address maps, ring windows.
- :mod:`.kernels`: what kernels do: exact matches, rows a program touches, rows a wrong
  write got wrong, prefill masks, margins by the pass rule.
- :mod:`.listing`: code shown to a learner: a kernel's lesson lines with context, the
  signature folded, the whole source collapsed; never a listing of more than 40 lines.
- :mod:`.quant`: quantized KV: the E2M1 grid, error histograms and bars.
- :mod:`.conformance`: a conformance report's margins by the pass rule.
- :mod:`.source`: a fault's wrong line, as a diff of the correct and the faulty part.
- :mod:`.write_path`: the write path's extras: the bytes an indexer-K scatter wrote in a
  segmented arena, the rows a block copy moved, a two-level pool over an engine run.
- :mod:`.positions`: positions in the pool: the rotary position of every row written
  against its cache position, a speculative step before and after its rollback.
"""

from __future__ import annotations

from pagedkv_lab.viz.bookkeeping import (
    occupancy,
    plot_address_map,
    plot_block_table,
    plot_occupancy,
    plot_occupancy_steps,
    plot_ring_slots,
)
from pagedkv_lab.viz.charts import bar_plot, line_plot, plot_categories, plot_grouped_bars, plot_heatmap, plot_histogram
from pagedkv_lab.viz.conformance import conformance_margins, plot_conformance
from pagedkv_lab.viz.kernels import (
    find_lines,
    plot_access_pattern,
    plot_chunk_masks,
    plot_exact_match,
    plot_margins,
    plot_wrong_rows,
    row_status,
)
from pagedkv_lab.viz.listing import MAX_SHOWN_LINES, Listing, kernel_listing, lesson_lines, source_code
from pagedkv_lab.viz.positions import (
    ROTARY_ROWS,
    SPECULATIVE_ROWS,
    PoolRows,
    plot_rotary_rows,
    plot_speculative_rows,
    rotary_rows,
    speculative_rows,
)
from pagedkv_lab.viz.quant import plot_e2m1_grid, plot_error_bars, plot_error_histograms
from pagedkv_lab.viz.source import SourceDiff, fault_branch, fault_diff, marked_source, show_fault, source_diff
from pagedkv_lab.viz.style import (
    FAIL_RED,
    FREE,
    OK_GREEN,
    PALETTE,
    SHARED,
    as_array,
    integer_ticks,
    is_integer,
    sequence_colors,
    use_style,
)
from pagedkv_lab.viz.write_path import (
    COPY_ROWS,
    INDEXER_BYTES,
    IndexerByteMap,
    PoolLevels,
    block_copy_rows,
    indexer_byte_map,
    plot_block_copy,
    plot_indexer_bytes,
    plot_offload_cost,
    plot_pool_levels,
    pool_levels,
)

__all__ = [
    # style
    "PALETTE",
    "FREE",
    "SHARED",
    "OK_GREEN",
    "FAIL_RED",
    "use_style",
    "sequence_colors",
    "is_integer",
    "integer_ticks",
    "as_array",
    # generic charts
    "line_plot",
    "bar_plot",
    "plot_grouped_bars",
    "plot_histogram",
    "plot_heatmap",
    "plot_categories",
    # bookkeeping
    "occupancy",
    "plot_occupancy",
    "plot_occupancy_steps",
    "plot_block_table",
    "plot_address_map",
    "plot_ring_slots",
    # kernels
    "plot_exact_match",
    "plot_access_pattern",
    "row_status",
    "plot_wrong_rows",
    "plot_chunk_masks",
    "find_lines",
    "plot_margins",
    # code shown to a learner: the lesson lines, the rest collapsed
    "MAX_SHOWN_LINES",
    "Listing",
    "kernel_listing",
    "source_code",
    "lesson_lines",
    # quantized KV
    "plot_e2m1_grid",
    "plot_error_histograms",
    "plot_error_bars",
    # conformance reports
    "conformance_margins",
    "plot_conformance",
    # faults as diffs
    "SourceDiff",
    "source_diff",
    "fault_diff",
    "marked_source",
    "fault_branch",
    "show_fault",
    # the write path's extras: indexer-K bytes, block copies, a two-level pool
    "INDEXER_BYTES",
    "IndexerByteMap",
    "indexer_byte_map",
    "plot_indexer_bytes",
    "COPY_ROWS",
    "block_copy_rows",
    "plot_block_copy",
    "PoolLevels",
    "pool_levels",
    "plot_pool_levels",
    "plot_offload_cost",
    # positions in the pool: rotary vs cache position, a speculative step's rollback
    "PoolRows",
    "ROTARY_ROWS",
    "rotary_rows",
    "plot_rotary_rows",
    "SPECULATIVE_ROWS",
    "speculative_rows",
    "plot_speculative_rows",
]
