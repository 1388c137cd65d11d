"""The positions pictures (notebook 13) draw what their data functions say: every row of a
CSR append with its cache and rotary position, an inactive rank's reserved rows, and one
speculative step's rows before and after the rollback. CPU only, no kernel, no model:
well under a second."""

import ast
import inspect

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from pagedkv_lab import viz  # noqa: E402
from pagedkv_lab.viz import positions  # noqa: E402
from pagedkv_lib.manager import KVCacheManager  # noqa: E402
from pagedkv_lib.rotary_positions import draft_tree_offsets, inactive_tokens, rotary_positions  # noqa: E402


@pytest.fixture(autouse=True)
def _close_figures():
    yield
    plt.close("all")


def _tree_rows():
    """One request with 5 cached tokens verifying the tree (-1, 0, 0, 1, 1, 2) through
    pages [4, 1, 6] of an 8-page pool of 4 rows."""
    depth = draft_tree_offsets([-1, 0, 0, 1, 1, 2])
    rope = rotary_positions([0, 6], [5], spec_decoding_position_offsets=depth[None, :])
    return viz.rotary_rows(8, 4, [4, 1, 6], [0, 3], [0, 6], [5], rope)


def test_rotary_rows_place_each_token_at_its_cache_row_with_its_rotary_position():
    rows = _tree_rows()
    assert rows.codes.shape == (8, 4)
    assert rows.codes[4].tolist() == [1, 1, 1, 1] and rows.cache[4].tolist() == [0, 1, 2, 3], "past on page 4"
    # Page 1: position 4 (past), then the root and the two siblings (cache 5, 6, 7 -> rotary 5, 6, 6).
    assert rows.cache[1].tolist() == [4, 5, 6, 7] and rows.rope[1].tolist() == [-1, 5, 6, 6]
    assert rows.codes[1].tolist() == [1, 2, 2, 3], "the second sibling is rotated away from its cache position"
    assert rows.rope[6].tolist() == [7, 7, 7, -1] and rows.codes[6].tolist() == [3, 3, 3, 0]
    assert (rows.codes[[0, 2, 3, 5, 7]] == 0).all(), "pages no request names are free"


def test_rotary_rows_draw_an_inactive_ranks_rows_as_reserved_not_written():
    helix = [4 * p + 1 for p in (3, 4, 5, 2, 3, 4)]
    rope = rotary_positions([0, 3, 6], [3, 2], helix_position_offsets=helix)
    skip = inactive_tokens([0, 3, 6], torch.tensor([False, True]))
    rows = viz.rotary_rows(8, 4, [3, 5, 1, 7], [0, 2, 4], [0, 3, 6], [3, 2], rope, skip)
    assert rows.codes[1].tolist() == [1, 1, 4, 4] and rows.codes[7].tolist() == [4, 0, 0, 0]
    assert rows.rope[1, 2:].tolist() == [9, 13] and rows.cache[7, 0] == 4
    assert rows.codes[3].tolist() == [1, 1, 1, 3] and rows.rope[5, :2].tolist() == [17, 21]


def test_rotary_rows_refuse_a_position_outside_its_pages_or_the_pool():
    with pytest.raises(ValueError, match="cache position 8 is outside its 2 pages"):
        viz.rotary_rows(8, 4, [4, 1], [0, 2], [0, 4], [5], torch.arange(5, 9))
    with pytest.raises(ValueError, match="page 9 is outside the pool"):
        viz.rotary_rows(8, 4, [9], [0, 1], [0, 1], [0], [0])
    with pytest.raises(ValueError, match="rope_positions has 2 entries for 1"):
        viz.rotary_rows(8, 4, [0], [0, 1], [0, 1], [0], [0, 1])


def test_speculative_rows_before_verification_after_it_and_after_the_rollback():
    # Positions 0-5 on pages [2, 0], the last sampled token at 6, drafts 7-10 reaching page 3.
    table = [2, 0, 3]
    before = viz.speculative_rows(5, 4, table, 6, 4)
    assert before.codes[2].tolist() == [1, 1, 1, 1] and before.codes[0].tolist() == [1, 1, 2, 3]
    assert before.codes[3].tolist() == [3, 3, 3, 0] and before.cache[3].tolist() == [8, 9, 10, -1]
    verified = viz.speculative_rows(5, 4, table, 6, 4, accepted=1)
    assert verified.codes[0].tolist() == [1, 1, 2, 4] and verified.codes[3].tolist() == [5, 5, 5, 0]
    rolled = viz.speculative_rows(5, 4, [2, 0], 6, 4, accepted=1, released=[3])
    assert rolled.codes[3].tolist() == [6, 6, 6, 0], "the released page still holds the stale drafts"
    kept = viz.speculative_rows(5, 4, [2, 0, 3], 6, 4, accepted=3, released=[])
    assert kept.codes[3].tolist() == [4, 4, 6, 0], "a rejected draft on a kept page is rolled back too"
    assert (before.codes[[1, 4]] == 0).all()


def test_speculative_rows_refuse_what_cannot_be_drawn():
    with pytest.raises(ValueError, match=r"accepted=5 must lie in \[0, num_drafts=4\]"):
        viz.speculative_rows(5, 4, [2, 0, 3], 6, 4, accepted=5)
    with pytest.raises(ValueError, match="needs accepted="):
        viz.speculative_rows(5, 4, [2, 0], 6, 4, released=[3])
    with pytest.raises(ValueError, match="cache position 8 is outside its 2 pages"):
        viz.speculative_rows(5, 4, [2, 0], 6, 4, accepted=1)


def test_speculative_rows_agree_with_a_managers_rollback():
    mgr = KVCacheManager(6, 4)
    mgr.add_sequence("s")
    mgr.append_tokens("s", 7)
    mgr.commit("s", num_tokens=6)  # position 6 is the last sampled token; append it and 4 drafts
    mgr.append_tokens("s", 4)
    table = mgr.block_table("s")
    released = mgr.rollback("s", 3)  # one draft accepted
    rows = viz.speculative_rows(6, 4, mgr.block_table("s"), 6, 4, accepted=1, released=released)
    drawn = {int(p) for p in np.nonzero((rows.codes >= 1) & (rows.codes <= 4))[0]}
    assert drawn == set(mgr.block_table("s")), "the rows drawn as the sequence's are on the pages it still holds"
    assert released == table[2:] and set(np.nonzero(rows.codes == 6)[0].tolist()) == set(released)


def test_plot_rotary_rows_draws_each_panel_its_codes_and_labels():
    rows = _tree_rows()
    fig = viz.plot_rotary_rows({"tree": rows, "again": rows})
    assert [ax.get_title() for ax in fig.axes] == ["tree", "again"]
    ax = fig.axes[0]
    assert np.array_equal(ax.images[0].get_array(), rows.codes.T), "the panel does not show its codes"
    texts = {(round(t.get_position()[0]), round(t.get_position()[1])): t.get_text() for t in ax.texts}
    assert texts[(1, 3)] == "7→6" and texts[(4, 2)] == "2" and (0, 0) not in texts
    assert ax.get_xlabel() == "page id" and ax.get_ylabel() == "row in page"
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == [viz.ROTARY_ROWS[k] for k in (0, 1, 2, 3)], "the legend names only the categories drawn"


def test_plot_speculative_rows_writes_the_cache_position_of_every_token_row():
    rows = viz.speculative_rows(5, 4, [2, 0], 6, 4, accepted=1, released=[3])
    fig = viz.plot_speculative_rows({"rolled back": rows})
    (ax,) = fig.axes
    assert np.array_equal(ax.images[0].get_array(), rows.codes.T)
    assert len(ax.texts) == 11 and sorted(int(t.get_text()) for t in ax.texts) == list(range(11))
    labels = [t.get_text() for t in fig.legends[0].get_texts()]
    assert labels == [viz.SPECULATIVE_ROWS[k] for k in (0, 1, 2, 4, 6)]


def test_package_reexports_every_public_name_of_positions():
    tree = ast.parse(inspect.getsource(positions))
    defined = []
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            defined.append(node.name)
        elif isinstance(node, ast.Assign):
            defined += [t.id for t in node.targets if isinstance(t, ast.Name)]
    own = [n for n in defined if not n.startswith("_")]
    missing = [n for n in own if n not in viz.__all__ or getattr(viz, n) is not getattr(positions, n)]
    assert not missing, f"pagedkv_lab.viz does not re-export {missing} of .positions"
