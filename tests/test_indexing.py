"""Address arithmetic: position -> (block, offset) -> slot -> element offset."""

import pytest
import torch

from pagedkv_lib import element_offset, locate, locate_pow2
from pagedkv_lib.indexing import is_power_of_two, slot_of, split_slot


def test_locate_is_divmod_for_page_size_sixteen():
    assert locate(0, 16) == (0, 0)
    assert locate(15, 16) == (0, 15)
    assert locate(16, 16) == (1, 0)
    assert locate(37, 16) == (2, 5)


def test_locate_supports_page_size_five():
    # 13 = 2 * 5 + 3
    assert locate(13, 5) == (2, 3)
    block, offset = locate(torch.tensor([0, 4, 5, 9, 10, 13]), 5)
    assert block.tolist() == [0, 0, 1, 1, 2, 2]
    assert offset.tolist() == [0, 4, 0, 4, 0, 3]


@pytest.mark.parametrize("page_size", [1, 2, 4, 16, 64, 256])
def test_locate_pow2_equals_locate_for_power_of_two_pages(page_size):
    pos = torch.arange(0, 5000)
    b1, o1 = locate(pos, page_size)
    b2, o2 = locate_pow2(pos, page_size)
    assert torch.equal(b1, b2) and torch.equal(o1, o2)
    # and against Python's own divmod, independently of either
    expected = [divmod(p, page_size) for p in range(5000)]
    assert list(zip(b2.tolist(), o2.tolist())) == expected
    for p in (0, page_size - 1, page_size, 10**9 + 7):
        assert locate_pow2(p, page_size) == locate(p, page_size) == divmod(p, page_size)


@pytest.mark.parametrize("page_size", [3, 5, 12, 80])
def test_locate_pow2_rejects_other_page_sizes(page_size):
    with pytest.raises(ValueError, match=f"page_size={page_size} is not a power of two"):
        locate_pow2(7, page_size)


@pytest.mark.parametrize("bad", [0, -4, 2.0, True])
def test_page_size_must_be_a_positive_int(bad):
    with pytest.raises(ValueError, match="page_size="):
        locate(3, bad)
    with pytest.raises(ValueError, match="page_size="):
        locate_pow2(3, bad)


def test_is_power_of_two():
    assert [n for n in range(-2, 70) if is_power_of_two(n)] == [1, 2, 4, 8, 16, 32, 64]


def test_slot_of_and_split_slot_are_inverse():
    # page 7, row 3 of pages of 5 -> slot 38
    assert slot_of(7, 3, 5) == 38
    assert split_slot(38, 5) == (7, 3)
    slots = torch.arange(200)
    page, off = split_slot(slots, 16)
    assert torch.equal(slot_of(page, off, 16), slots)


def test_element_offset_by_hand():
    # strides (page, kv, row, head, feat) = (1000, 500, 20, 4, 1):
    # page 2, V, head 3, row 7, feat 1 -> 2000 + 500 + 140 + 12 + 1
    assert element_offset((1000, 500, 20, 4, 1), 2, 1, 3, 7, 1) == 2653
    # a non-unit feature stride is honoured too
    assert element_offset((0, 0, 0, 0, 3), 0, 0, 0, 0, 5) == 15
    t = element_offset((1000, 500, 20, 4, 1), torch.tensor([0, 1]), 0, 0, torch.tensor([1, 2]), 0)
    assert t.tolist() == [20, 1040]
