"""The reference-counted block allocator: ids, reuse order, sharing and errors."""

import pytest

import pagedkv_lib as P
from pagedkv_lib import BlockAllocator, OutOfBlocksError


def state(a: BlockAllocator):
    """Everything observable about an allocator (refcounts, free count, reuse order)."""
    return [a.refcount(b) for b in range(a.num_blocks)], a.num_free, list(a._free)


def test_fresh_allocator_hands_out_ids_in_order_with_refcount_one():
    a = BlockAllocator(4)
    assert a.num_free == 4
    assert [a.allocate(), a.allocate()] == [0, 1]
    assert a.refcount(0) == a.refcount(1) == 1
    assert a.refcount(2) == 0
    assert a.num_free == 2
    a.check_integrity()


def test_freed_block_goes_to_the_back_of_the_free_list():
    # Allocate 0, 1, 2; free 1. Free list is now [3, 1]: the stale id 1 comes back last.
    a = BlockAllocator(4)
    a.allocate_many(3)
    a.free(1)
    assert a.refcount(1) == 0 and a.num_free == 2
    assert a.allocate() == 3
    assert a.allocate() == 1
    a.check_integrity()


def test_allocate_many_returns_distinct_blocks_all_at_refcount_one():
    a = BlockAllocator(5)
    assert a.allocate_many(3) == [0, 1, 2]
    assert a.allocate_many(0) == []
    assert [a.refcount(b) for b in range(5)] == [1, 1, 1, 0, 0]
    assert a.can_allocate(2) and not a.can_allocate(3)


def test_exhaustion_raises_out_of_blocks_error_with_requested_and_free():
    a = BlockAllocator(3)
    a.allocate_many(2)
    with pytest.raises(OutOfBlocksError, match="asked for 2 blocks but only 1 are free") as info:
        a.allocate_many(2)
    assert isinstance(info.value, MemoryError)
    assert (info.value.requested, info.value.free) == (2, 1)
    a.allocate()
    with pytest.raises(P.OutOfBlocksError, match="asked for 1 blocks but only 0 are free"):
        a.allocate()


def test_failed_multi_block_request_leaves_allocator_exactly_as_it_was():
    # 6 blocks, hold 0..3, free 1 so the free list is [4, 5, 1]; asking for 4 must fail
    # without taking any of the three.
    a = BlockAllocator(6)
    a.allocate_many(4)
    a.free(1)
    a.incref(2)
    before = state(a)
    with pytest.raises(OutOfBlocksError):
        a.allocate_many(4)
    assert state(a) == before
    assert a.allocate_many(3) == [4, 5, 1]  # the reuse order survived too
    a.check_integrity()


def test_incref_and_decref_count_owners_and_free_at_zero():
    a = BlockAllocator(2)
    b = a.allocate()
    assert a.incref(b) == 2
    assert a.incref(b) == 3
    assert a.decref(b) == 2
    assert a.num_free == 1  # still held
    assert a.decref(b) == 1
    assert a.decref(b) == 0
    assert a.num_free == 2 and a.refcount(b) == 0
    a.check_integrity()


def test_free_of_a_shared_block_is_refused_without_changing_it():
    a = BlockAllocator(2)
    b = a.allocate()
    a.incref(b)
    with pytest.raises(ValueError, match="has 2 references; use decref"):
        a.free(b)
    assert a.refcount(b) == 2


def test_double_free_raises_value_error():
    a = BlockAllocator(2)
    b = a.allocate()
    a.free(b)
    with pytest.raises(ValueError, match=f"free of block {b}, which is not allocated"):
        a.free(b)
    with pytest.raises(ValueError, match="already free"):
        a.decref(b)
    assert a.num_free == 2
    a.check_integrity()


def test_free_of_never_allocated_block_raises_value_error():
    a = BlockAllocator(3)
    with pytest.raises(ValueError, match="free of block 2, which is not allocated"):
        a.free(2)
    with pytest.raises(ValueError, match="incref of block 2, which is free"):
        a.incref(2)
    assert a.num_free == 3


@pytest.mark.parametrize("bad", [-1, 3, 100, 1.0, True, "0"])
def test_out_of_range_or_non_int_block_id_raises_value_error(bad):
    a = BlockAllocator(3)
    a.allocate_many(3)
    for op in (a.free, a.incref, a.decref, a.refcount):
        with pytest.raises(ValueError, match="is not a block id"):
            op(bad)
    assert [a.refcount(b) for b in range(3)] == [1, 1, 1]


@pytest.mark.parametrize("bad", [0, -4, 2.0, True])
def test_allocator_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="num_blocks="):
        BlockAllocator(bad)


def test_negative_request_is_rejected():
    with pytest.raises(ValueError, match="n=-1"):
        BlockAllocator(2).allocate_many(-1)


def test_check_integrity_catches_a_corrupted_free_list():
    a = BlockAllocator(3)
    a.allocate()
    a._free.append(0)  # block 0 is held but also listed free
    with pytest.raises(AssertionError):
        a.check_integrity()
