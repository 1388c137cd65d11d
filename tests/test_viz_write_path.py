"""The write path's pictures (notebook 14) draw what their data functions say: the bytes of
a segmented indexer-K arena a scatter writes (and where a contiguous-pool kernel would
write them), the rows a block copy moved, kept or got wrong, and a two-level pool's
blocks per step. CPU only, no kernel: well under a second."""

import ast
import inspect

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from matplotlib.colors import to_rgba  # noqa: E402

from pagedkv_lab import viz  # noqa: E402
from pagedkv_lab.viz import write_path  # noqa: E402
from pagedkv_lab.viz.write_path import INDEXER_STRAY_LABEL  # noqa: E402
from pagedkv_lib.block_copy import copy_blocks  # noqa: E402
from pagedkv_lib.indexer_cache import IndexerKPool, indexer_slots, quantize_indexer_k, scatter_indexer_k  # noqa: E402
from pagedkv_lib.manager import KVCacheManager  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _scatter_case():
    """7 tokens of one request through block table [2, 0] and a padding token, into layer 1
    of a 3-layer arena of 4 blocks (block_size 4, head_dim 16, 8 bytes of padding)."""
    pool = IndexerKPool(4, 4, 16, num_layers=3, pad=8, generator=torch.Generator().manual_seed(0))
    batch = torch.tensor([0] * 7 + [-1])
    positions = torch.tensor(list(range(7)) + [-1])
    fp8, scale = indexer_slots(torch.tensor([[2, 0]]), batch, positions, 4, 16)
    return pool, fp8, scale


def test_indexer_byte_map_marks_exactly_the_bytes_the_reference_scatter_changes():
    pool, fp8, scale = _scatter_case()
    byte_map = viz.indexer_byte_map(pool, 1, fp8, scale)
    before = pool.arena.clone()
    codes, scales = quantize_indexer_k(torch.randn(8, 16, generator=torch.Generator().manual_seed(1)) * 3)
    scatter_indexer_k(pool.cache(1), codes, scales, fp8, scale)
    changed = (pool.arena != before).reshape(4, -1).numpy()
    assert byte_map.codes.shape == (4, 3 * 88) and byte_map.segment == 88 and byte_map.layer == 1
    assert not (changed & (byte_map.codes < 4)).any(), "a byte the scatter changed is not marked as written"
    assert (byte_map.codes == 4).sum() == 7 * 16 and (byte_map.codes == 5).sum() == 7 * 4
    assert set(np.nonzero(byte_map.codes >= 4)[0].tolist()) == {0, 2}, "only blocks 2 and 0 are written"
    # The regions: the other layers' segments, padding after each block, codes then scales.
    row = byte_map.codes[3]
    assert (row[:80] == 0).all() and (row[80:88] == 1).all()
    assert (row[88 : 88 + 64] == 2).all() and (row[88 + 64 : 88 + 80] == 3).all() and (row[168:176] == 1).all()


def test_a_contiguous_pool_assumption_is_drawn_writing_other_layers():
    pool, fp8, scale = _scatter_case()
    wrong = viz.indexer_byte_map(pool, 1, fp8, scale, contiguous=True).codes
    right = viz.indexer_byte_map(pool, 1, fp8, scale).codes
    assert not np.array_equal(wrong, right)
    assert ((wrong >= 4) & (np.arange(wrong.shape[1]) // 88 != 1)).any(), "no byte drawn in another layer"
    # On a one-layer pool without padding the two rules agree: flat index == offset.
    flat = IndexerKPool(4, 4, 16, num_layers=1, fill=0)
    assert np.array_equal(
        viz.indexer_byte_map(flat, 0, fp8, scale).codes,
        viz.indexer_byte_map(flat, 0, fp8, scale, contiguous=True).codes,
    )


def test_indexer_byte_map_refuses_a_slot_outside_the_arena():
    pool, fp8, scale = _scatter_case()
    with pytest.raises(ValueError, match="outside the arena"):
        viz.indexer_byte_map(pool, 2, torch.where(fp8 >= 0, fp8 + 4 * 80, -1), scale)


def test_plot_indexer_bytes_draws_each_map_and_one_legend_entry_per_category_present():
    pool, fp8, scale = _scatter_case()
    maps = {"a": viz.indexer_byte_map(pool, 1, fp8, scale), "b": viz.indexer_byte_map(pool, 1, fp8, scale, True)}
    fig = viz.plot_indexer_bytes(maps)
    assert isinstance(fig, matplotlib.figure.Figure)
    assert [ax.get_title() for ax in fig.axes] == ["a", "b"]
    for ax, byte_map in zip(fig.axes, maps.values()):
        assert np.array_equal(ax.images[0].get_array(), byte_map.codes), "the panel does not show its byte map"
        assert [t.get_text() for t in ax.texts] == ["layer 0", "layer 1", "layer 2"]
        assert "(bytes)" in ax.get_xlabel()
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == [viz.INDEXER_BYTES[k] for k in range(6)] + [INDEXER_STRAY_LABEL]


def test_plot_indexer_bytes_rows_are_readable_and_stray_writes_outlined():
    """Each block's row is at least 14 px tall at the saved dpi (notebook 14's map had
    about 8), and only bytes written outside the meant layer's segments are outlined:
    none for the right unravelling, the two runs of the contiguous-pool kernel."""
    pool, fp8, scale = _scatter_case()
    right, wrong = viz.indexer_byte_map(pool, 1, fp8, scale), viz.indexer_byte_map(pool, 1, fp8, scale, True)
    maps = {"right": right, "wrong": wrong}
    fig = viz.plot_indexer_bytes(maps)
    fig.canvas.draw()
    dpi = matplotlib.rcParams["savefig.dpi"]
    dpi = fig.dpi if dpi == "figure" else dpi
    for ax, byte_map in zip(fig.axes, maps.values()):
        row_px = ax.get_window_extent().height / fig.dpi * dpi / byte_map.codes.shape[0]
        assert row_px >= 14, f"{ax.get_title()}: a block's row is {row_px:.1f} px tall"
    red = to_rgba(write_path.FAIL_RED)
    outlined = [[p for p in ax.patches if p.get_edgecolor() == red and not p.get_fill()] for ax in fig.axes]
    wrong = maps["wrong"].codes
    strays = (wrong >= 4) & ((np.arange(wrong.shape[1]) // maps["wrong"].segment) != 1)[None, :]
    assert len(outlined[0]) == 0, "the right scatter wrote nothing outside layer 1"
    assert sum(int(p.get_width()) for p in outlined[1]) == int(strays.sum()) > 0, "outlines miss stray bytes"


def _copy_case(layout="NHD"):
    shape = (2, 5, 2, 4, 2, 3) if layout == "NHD" else (2, 5, 2, 2, 4, 3)
    pool = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    return pool, torch.tensor([1, 3]), torch.tensor([4, 0]), torch.tensor([3, 0])


@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_block_copy_rows_tells_copied_kept_read_and_untouched_rows_apart(layout):
    before, src, dst, n = _copy_case(layout)
    after = before.clone()
    copy_blocks(after, src, dst, n, layout=layout)
    status = viz.block_copy_rows(before, after, src, dst, n, layout)
    assert status.shape == (2, 5, 8)
    k_and_v = [0, 1, 2, 4, 5, 6]
    assert (status[:, 4, k_and_v] == 2).all() and (status[:, 4, [3, 7]] == 3).all()
    assert (status[:, 0] == 2).all(), "num_tokens 0 copies the whole block"
    assert (status[:, 1, k_and_v] == 1).all() and (status[:, 1, [3, 7]] == 0).all(), "only 3 source rows are read"
    assert (status[:, 3] == 1).all() and (status[:, 2] == 0).all()


def test_block_copy_rows_flags_a_copy_that_forgets_a_layer_or_writes_past_num_tokens():
    before, src, dst, n = _copy_case()
    after = before.clone()
    copy_blocks(after, src, dst, n)
    after[1, 0] = before[1, 0]  # layer 1 of the whole-block pair never copied
    after[0, 4, :, 3] = before[0, 1, :, 3]  # row 3 of page 4 overwritten though num_tokens = 3
    status = viz.block_copy_rows(before, after, src, dst, n)
    assert (status[1, 0] == 4).all() and (status[0, 0] == 2).all()
    assert status[0, 4, 3] == 4 and status[0, 4, 7] == 4 and status[1, 4, 3] == 3


def test_block_copy_rows_into_a_second_pool_judges_the_destination():
    before, src, dst, n = _copy_case()
    second = torch.zeros_like(before)
    second_after = second.clone()
    copy_blocks(before, src, dst, n, dst_cache=second_after)
    status = viz.block_copy_rows(before, before, src, dst, n, dst_before=second, dst_after=second_after)
    assert (status[:, 0] == 2).all() and (status[:, 4, [3, 7]] == 3).all() and (status[:, 1] == 0).all()


def test_plot_block_copy_draws_one_panel_per_layer_with_its_rows():
    before, src, dst, n = _copy_case()
    after = before.clone()
    copy_blocks(after, src, dst, n)
    status = viz.block_copy_rows(before, after, src, dst, n)
    fig = viz.plot_block_copy(status)
    assert [ax.get_title() for ax in fig.axes] == ["layer 0", "layer 1"]
    for layer, ax in enumerate(fig.axes):
        assert np.array_equal(ax.images[0].get_array(), status[layer].T)
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == [viz.COPY_ROWS[k] for k in (0, 1, 2, 3)], "the legend names only the categories drawn"


def _two_level_manager():
    def copy(kind, src, dst, num_tokens):  # bookkeeping only: no bytes to move here
        pass

    return KVCacheManager(3, 2, prefix_cache=True, copy_fn=copy, secondary_blocks=2)


def test_pool_levels_counts_each_block_of_both_levels_once():
    mgr = _two_level_manager()
    assert viz.pool_levels(mgr) == viz.PoolLevels(0, 0, 3, 0, 2)
    mgr.admit("a", [1, 2, 3, 4, 5])
    mgr.commit("a")
    assert viz.pool_levels(mgr) == viz.PoolLevels(3, 0, 0, 0, 2)
    mgr.free_sequence("a")
    assert viz.pool_levels(mgr) == viz.PoolLevels(0, 2, 1, 0, 2), "a's two full blocks stay cached"
    mgr.admit("b", [9, 8, 7, 6, 5])  # needs all 3 pages: both cached blocks are offloaded
    assert viz.pool_levels(mgr) == viz.PoolLevels(3, 0, 0, 2, 0)
    assert viz.pool_levels(KVCacheManager(2, 2)) == viz.PoolLevels(0, 0, 2, 0, 0)


def test_plot_pool_levels_stacks_every_block_and_marks_the_events():
    levels = [viz.PoolLevels(3, 0, 0, 0, 2), viz.PoolLevels(1, 2, 0, 0, 2), viz.PoolLevels(3, 0, 0, 2, 0)]
    fig = viz.plot_pool_levels(levels, {"offload": [2], "restore": []})
    primary, secondary = fig.axes
    heights = np.array([p.get_height() for p in primary.patches]).reshape(3, 3)  # [category, step]
    assert heights.sum(0).tolist() == [3, 3, 3] and heights[1].tolist() == [0, 2, 0]
    sec = np.array([p.get_height() for p in secondary.patches]).reshape(2, 3)
    assert sec[0].tolist() == [0, 0, 2]
    offload = [line for line in primary.lines if line.get_label() == "offload"][0]
    assert list(offload.get_xdata()) == [2]
    assert primary.get_title() == "primary pool (3 blocks)" and secondary.get_xlabel() == "engine step"


def test_plot_offload_cost_writes_each_runs_tokens_and_mebibytes():
    fig = viz.plot_offload_cost({"none": (264, 0), "offload": (216, 11 * 737_280)})
    tokens, mib = fig.axes
    assert [p.get_height() for p in tokens.patches] == [264, 216]
    assert [t.get_text() for t in mib.texts] == ["0.00", "7.73"]
    assert "(MiB)" in mib.get_ylabel() and "(tokens)" in tokens.get_ylabel()


def test_package_reexports_every_public_name_of_write_path():
    tree = ast.parse(inspect.getsource(write_path))
    defined = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.append(node.name)
        elif isinstance(node, ast.Assign):
            defined += [t.id for t in node.targets if isinstance(t, ast.Name)]
    own = [n for n in defined if not n.startswith("_")]
    missing = [n for n in own if n not in viz.__all__ or getattr(viz, n) is not getattr(write_path, n)]
    assert not missing, f"pagedkv_lab.viz does not re-export {missing} of .write_path"
