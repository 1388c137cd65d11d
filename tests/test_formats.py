"""Batch page-table formats: padded tables, CSR, slot mappings, append positions.

The running example is a batch of four requests in pages of 4 rows:

    request  seq_len  pages      rows in last page
       0        6     [3, 1]     2
       1        0     []         0   (empty request)
       2        4     [5]        4   (exactly one full page)
       3        9     [2, 4, 6]  1
"""

import pytest
import torch

import pagedkv_lib
from pagedkv_lib import (
    PAD,
    RingWindow,
    block_table_to_csr,
    csr_seq_lens,
    csr_to_block_table,
    get_batch_indices_positions,
    pad_block_tables,
    slot_mapping,
)
from pagedkv_lib.formats import check_csr, check_csr_lengths, csr_slot_mapping, index_tensor

TABLES = [[3, 1], [], [5], [2, 4, 6]]
SEQ_LENS = [6, 0, 4, 9]
PADDED = [[3, 1, -1], [-1, -1, -1], [5, -1, -1], [2, 4, 6]]
INDPTR = [0, 2, 2, 3, 6]
INDICES = [3, 1, 5, 2, 4, 6]
LAST = [2, 0, 4, 1]


def test_format_functions_are_exported_at_top_level():
    from pagedkv_lib import formats

    for name in ("csr_seq_lens", "block_table_to_csr", "csr_to_block_table", "slot_mapping"):
        assert getattr(pagedkv_lib, name) is getattr(formats, name)
    assert pagedkv_lib.get_batch_indices_positions is formats.get_batch_indices_positions
    assert PAD == -1


def test_pad_block_tables_pads_with_minus_one():
    t = pad_block_tables(TABLES)
    assert t.dtype == torch.int32
    assert t.tolist() == PADDED
    assert pad_block_tables(TABLES, max_blocks=4).tolist() == [r + [-1] for r in PADDED]
    assert pad_block_tables([]).shape == (0, 0)
    with pytest.raises(ValueError, match=r"tables\[3\] has 3 pages, more than max_blocks=2"):
        pad_block_tables(TABLES, max_blocks=2)


def test_block_table_to_csr_of_the_running_example():
    indptr, indices, last = block_table_to_csr(PADDED, SEQ_LENS, 4)
    assert [x.dtype for x in (indptr, indices, last)] == [torch.int32] * 3
    assert indptr.tolist() == INDPTR
    assert indices.tolist() == INDICES
    assert last.tolist() == LAST


def test_csr_seq_lens_formula_by_hand():
    # (pages - 1) * 4 + last: (2-1)*4+2 = 6; empty -> 0; 0*4+4 = 4; (3-1)*4+1 = 9
    lens = csr_seq_lens(INDPTR, LAST, 4)
    assert lens.dtype == torch.int32 and lens.tolist() == SEQ_LENS
    # page size 5: two pages, last has 5 rows -> 10; one page with 1 row -> 1
    assert csr_seq_lens([0, 2, 3], [5, 1], 5).tolist() == [10, 1]


def test_csr_to_block_table_of_the_running_example():
    table, lens = csr_to_block_table(INDPTR, INDICES, LAST, 4)
    assert table.dtype == lens.dtype == torch.int32
    assert table.tolist() == PADDED and lens.tolist() == SEQ_LENS
    wide, _ = csr_to_block_table(INDPTR, INDICES, LAST, 4, max_blocks=5)
    assert wide.tolist() == [r + [-1, -1] for r in PADDED]


def test_round_trips_in_both_directions():
    indptr, indices, last = block_table_to_csr(PADDED, SEQ_LENS, 4)
    table, lens = csr_to_block_table(indptr, indices, last, 4)
    assert table.tolist() == PADDED and lens.tolist() == SEQ_LENS
    again = block_table_to_csr(table, lens, 4)
    assert [x.tolist() for x in again] == [INDPTR, INDICES, LAST]


def test_entries_past_a_sequence_are_ignored_by_the_csr():
    # Request 0 has 6 tokens; its third entry (9) is unused and must not appear.
    indptr, indices, last = block_table_to_csr([[3, 1, 9]], [6], 4)
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == ([0, 2], [3, 1], [2])


def test_all_empty_batch_works_with_plain_python_lists():
    indptr, indices, last = block_table_to_csr([[-1], [-1]], [0, 0], 4)
    assert (indptr.tolist(), indices.tolist(), last.tolist()) == ([0, 0, 0], [], [0, 0])
    table, lens = csr_to_block_table([0, 0, 0], [], [0, 0], 4)
    assert table.shape == (2, 0) and lens.tolist() == [0, 0]
    assert slot_mapping([[0]], [], [], 4).tolist() == []


@pytest.mark.parametrize(
    "indptr, indices, last, message",
    [
        ([1, 2], [0], [1], r"kv_indptr\[0\]=1 must be 0"),
        ([0, 2, 1], [0, 1], [1, 1], "kv_indptr decreases at 1"),
        ([0, 2], [0, 1, 2], [1], r"kv_indptr\[-1\]=2 but kv_indices has 3"),
        ([0, 1], [0], [0], r"kv_last_page_len\[0\]=0 must be in \[1, page_size=4\]"),
        ([0, 1], [0], [5], r"kv_last_page_len\[0\]=5 must be in \[1, page_size=4\]"),
        ([0, 0], [], [2], r"kv_last_page_len\[0\]=2 for a request with no pages"),
        ([0, 1], [-1], [1], r"kv_indices\[0\]=-1 is not a page id"),
        ([0, 1, 2], [0, 1], [1], "kv_indptr has 3 entries; kv_last_page_len has 1"),
        ([[0, 1]], [0], [1], "kv_indptr must be 1-D"),
        ([0.0, 1.0], [0], [1], "kv_indptr must hold integers"),
    ],
)
def test_invalid_csr_is_rejected_naming_the_argument(indptr, indices, last, message):
    with pytest.raises(ValueError, match=message):
        check_csr(indptr, indices, last, 4)
    with pytest.raises(ValueError, match=message):
        csr_to_block_table(indptr, indices, last, 4)


def test_csr_seq_lens_rejects_mismatched_lengths_instead_of_broadcasting():
    with pytest.raises(ValueError, match="kv_indptr has 3 entries; kv_last_page_len has 1"):
        csr_seq_lens([0, 1, 2], [3], 4)
    with pytest.raises(ValueError, match="page_size=0"):
        csr_seq_lens([0, 1], [3], 0)


@pytest.mark.parametrize(
    "table, lens, message",
    [
        ([[3, -1]], [5], r"block_tables\[0, 1\]=-1 lies inside seq_lens\[0\]=5"),
        ([[3, 1]], [9], r"seq_lens\[0\]=9 needs 3 pages but block_tables has 2 columns"),
        ([[3, 1]], [4, 4], "seq_lens has 2 entries for 1 block_tables rows"),
        ([[3, 1]], [-1], "seq_lens must be >= 0"),
        ([3, 1], [4], "block_tables must be 2-D"),
        ([[3.0, 1.0]], [4], "block_tables must hold integers"),
    ],
)
def test_invalid_block_table_is_rejected_naming_the_argument(table, lens, message):
    with pytest.raises(ValueError, match=message):
        block_table_to_csr(table, lens, 4)


# ----------------------------------------------------------------------------- slot mapping


def test_slot_mapping_is_page_times_page_size_plus_offset_with_padding():
    # request 0 = pages [3, 1], request 1 = pages [5]
    table = [[3, 1], [5, -1]]
    batch = [0, 0, 1, -1, 1]
    pos = [0, 5, 2, -1, -1]
    # pos 0 -> page 3 row 0 = 12; pos 5 -> block 1 (page 1) row 1 = 5; pos 2 of req 1 ->
    # page 5 row 2 = 22; the last two tokens are padding.
    slots = slot_mapping(table, batch, pos, 4)
    assert slots.dtype == torch.int64
    assert slots.tolist() == [12, 5, 22, -1, -1]


def test_slot_mapping_with_page_size_five():
    # position 13 -> block 2, row 3 -> page 7: 7 * 5 + 3 = 38
    assert slot_mapping([[0, 4, 7]], [0, 0], [13, 4], 5).tolist() == [38, 4]


def test_slot_mapping_through_a_ring_window():
    # window 8, 2 sinks, pages of 4: rows 0-1 sinks, 2-3 bubble, ring rows 4..9.
    # position 7 -> row 4 + 5 = 9 (page 2 row 1); position 8 wraps to row 4 (page 1 row 0).
    w = RingWindow(8, 2, 4)
    slots = slot_mapping([[10, 11, 12]], [0, 0, 0, 0], [0, 2, 7, 8], 4, window=w)
    assert slots.tolist() == [40, 44, 49, 44]
    with pytest.raises(ValueError, match="window.tokens_per_block=4 != page_size=8"):
        slot_mapping([[0]], [0], [0], 8, window=w)


@pytest.mark.parametrize(
    "batch, pos, message",
    [
        ([1], [4], r"positions\[0\]=4 of request 1 falls in logical block 1, whose block_tables entry is -1"),
        ([0], [8], r"positions\[0\]=8 falls in logical block 2 but block_tables has 2 columns"),
        ([2], [0], r"batch_indices\[0\]=2 but block_tables has 2 rows"),
        ([0, 0], [1], "batch_indices has 2 entries but positions has 1"),
    ],
)
def test_slot_mapping_rejects_tokens_without_a_page(batch, pos, message):
    with pytest.raises(ValueError, match=message):
        slot_mapping([[3, 1], [5, -1]], batch, pos, 4)


# ----------------------------------------------------------------------------- append positions


def test_batch_indices_and_positions_of_a_ragged_append():
    # Four requests of length 5 append 1, 2, 3, 4 tokens: each takes its last positions.
    batch, pos = get_batch_indices_positions([0, 1, 3, 6, 10], [5, 5, 5, 5])
    assert batch.dtype == pos.dtype == torch.int32
    assert batch.tolist() == [0, 1, 1, 2, 2, 2, 3, 3, 3, 3]
    assert pos.tolist() == [4, 3, 4, 2, 3, 4, 1, 2, 3, 4]


def test_batch_indices_and_positions_with_an_idle_request():
    # request 1 appends nothing; request 2 is a fresh prefill of 3 tokens
    batch, pos = get_batch_indices_positions([0, 1, 1, 4], [8, 2, 3])
    assert batch.tolist() == [0, 2, 2, 2] and pos.tolist() == [7, 0, 1, 2]


def test_append_positions_feed_slot_mapping():
    # Request 0 (pages [3, 1]) grows from 3 to 6 tokens: positions 3, 4, 5 ->
    # slots 15, 4, 5.
    batch, pos = get_batch_indices_positions([0, 3], [6])
    assert slot_mapping([[3, 1]], batch, pos, 4).tolist() == [15, 4, 5]


@pytest.mark.parametrize(
    "indptr, lens, message",
    [
        ([0, 1], [1, 1], "append_indptr needs 3 entries for 2 seq_lens"),
        ([0, 3], [2], "request 0 appends 3 tokens but seq_lens\\[0\\]=2"),
        ([0, 2, 1], [5, 5], "request 1 appends -1 tokens"),
        ([0.0, 1.0], [1], "append_indptr must hold integers"),
    ],
)
def test_batch_indices_positions_rejects_bad_arguments(indptr, lens, message):
    with pytest.raises(ValueError, match=message):
        get_batch_indices_positions(indptr, lens)


# ----------------------------------------------------------------------------- regressions (hardening)


@pytest.mark.parametrize("bad", ["batch_indices", "positions"])
def test_only_minus_one_marks_padding_in_slot_mappings(bad):
    """-2 (or any negative but -1) is an index computed wrong, not padding: both slot
    mappings refuse it by name instead of silently dropping the token."""
    table = torch.tensor([[3, 1]], dtype=torch.int32)
    args = {"batch_indices": torch.tensor([0, 0]), "positions": torch.tensor([0, 1])}
    args[bad][1] = -2
    with pytest.raises(ValueError, match=rf"{bad}\[1\]=-2 is negative; only -1 marks a padding token"):
        slot_mapping(table, args["batch_indices"], args["positions"], 4)
    with pytest.raises(ValueError, match=rf"{bad}\[1\]=-2 is negative"):
        csr_slot_mapping(args["batch_indices"], args["positions"], torch.tensor([3, 1]), torch.tensor([0, 2]), 4)
    args[bad][1] = -1  # the one padding value
    assert slot_mapping(table, args["batch_indices"], args["positions"], 4).tolist() == [12, -1]


def test_csr_seq_lens_refuses_a_length_for_a_request_without_pages():
    """One CSR length rule for every reader: a request without pages has length 0 and
    kv_last_page_len 0; anything else is refused (it used to come out as length 1)."""
    with pytest.raises(ValueError, match=r"kv_last_page_len\[1\]=1 for a request with no pages"):
        csr_seq_lens([0, 2, 2, 5], [5, 1, 16], 16)
    assert csr_seq_lens([0, 2, 2, 5], [5, 0, 16], 16).tolist() == [21, 0, 48]
    for reader in (
        lambda: check_csr([0, 2, 2, 5], [1, 2, 3, 4, 5], [5, 1, 16], 16),
        lambda: csr_to_block_table([0, 2, 2, 5], [1, 2, 3, 4, 5], [5, 1, 16], 16),
        lambda: check_csr_lengths([0, 2, 2, 5], [5, 1, 16], 16),
    ):
        with pytest.raises(ValueError, match=r"kv_last_page_len\[1\]=1 for a request with no pages"):
            reader()


@pytest.mark.parametrize(
    "value, message",
    [
        (None, "slot_mapping is None"),
        (torch.empty(3, dtype=torch.long, device="meta"), "slot_mapping is on the meta device"),
        ("0, 1, 2", "slot_mapping must be a 1-D integer tensor, got str"),
        ([0.5, 1.0], "slot_mapping must hold integers, got dtype torch.float32"),
        (torch.tensor([1 + 2j]), "slot_mapping must hold integers"),
    ],
)
def test_index_arguments_that_are_not_integer_tensors_are_refused_by_name(value, message):
    with pytest.raises(ValueError, match=message):
        index_tensor("slot_mapping", value, 1)


def test_csr_slot_mapping_names_the_kv_indices_entry_of_a_page_outside_the_pool():
    with pytest.raises(ValueError, match=r"kv_indices\[1\]=25 is not a page id of the pool \(6 pages\); token 0"):
        csr_slot_mapping(
            torch.tensor([0]), torch.tensor([5]), torch.tensor([2, 25]), torch.tensor([0, 2]), 4, num_pages=6
        )


def test_batch_indices_positions_pads_to_nnz_like_flashinfer():
    """FlashInfer sizes the output by ``nnz`` (a padded batch): the tail is padding,
    request -1 at position 0, which the CSR append skips."""
    batch, pos = get_batch_indices_positions([0, 2, 3], [5, 1], nnz=6)
    assert batch.tolist() == [0, 0, 1, -1, -1, -1]
    assert pos.tolist() == [3, 4, 0, 0, 0, 0]
    with pytest.raises(ValueError, match=r"nnz=2 must be an int >= the 3 appended tokens"):
        get_batch_indices_positions([0, 2, 3], [5, 1], nnz=2)
