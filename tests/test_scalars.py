"""The scalar rules of :mod:`pagedkv_lib.checks.scalars`: an int that is not a bool, a
number that is not a bool, and the ValueError of a count below its least value.

The expected answers are the expressions every caller wrote out before the rule had one
home (``isinstance(x, bool) or not isinstance(x, int)`` refuses), so a NumPy or torch
integer stays refused and a NumPy float64 (a ``float`` subclass) stays a number. The
messages are pinned to the letter: tests and notebooks match them. Pure Python, well
under a second.
"""

import numpy as np
import pytest
import torch

from pagedkv_lib import KVCacheManager, PagedKVPool, RingWindow, checks
from pagedkv_lib.allocator import BlockAllocator
from pagedkv_lib.memory import ModelSpec, max_tokens

VALUES = [0, 3, -1, 2**70, True, False, 3.0, 2.5, float("nan"), np.int64(3), np.int32(3), np.float64(1.5),
          np.float32(1.5), np.bool_(True), torch.tensor(3), "3", None, [3]]  # fmt: skip


def _old_int_rule_refuses(x) -> bool:
    return isinstance(x, bool) or not isinstance(x, int)


def _old_number_rule_refuses(x) -> bool:
    return isinstance(x, bool) or not isinstance(x, (int, float))


@pytest.mark.parametrize("value", VALUES, ids=repr)
def test_is_int_and_is_number_answer_as_the_written_out_rules_did(value):
    assert checks.is_int(value) is not _old_int_rule_refuses(value)
    assert checks.is_number(value) is not _old_number_rule_refuses(value)


def test_bools_and_numpy_and_torch_integers_are_not_ints():
    ints = [checks.is_int(x) for x in (7, True, np.int64(7), torch.tensor(7), 7.0)]
    assert ints == [True, False, False, False, False]
    assert [checks.is_number(x) for x in (7, 7.5, False, np.float64(7.5), np.float32(7.5))] == [
        True, True, False, True, False,
    ]  # fmt: skip


def test_check_int_returns_the_value_or_names_the_argument():
    assert checks.check_int("n", 0) == 0
    assert checks.check_int("n", 5, low=5) == 5
    for bad in (-1, True, 2.0, np.int64(2)):
        with pytest.raises(ValueError) as e:
            checks.check_int("n", bad)
        assert str(e.value) == f"n={bad!r} must be an int >= 0"
    with pytest.raises(ValueError) as e:
        checks.check_int("num_blocks", 0, low=1, owner="SecondaryPool")
    assert str(e.value) == "SecondaryPool: num_blocks=0 must be an int >= 1"


def test_check_positive_int_returns_the_value_or_names_the_argument():
    assert checks.check_positive_int("page_size", 16) == 16
    for bad in (0, -3, False, 1.0, np.int64(1)):
        with pytest.raises(ValueError) as e:
            checks.check_positive_int("page_size", bad, owner="PagedKVPool")
        assert str(e.value) == f"PagedKVPool: page_size={bad!r} must be a positive int"


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: BlockAllocator(True), "num_blocks=True must be a positive int"),
        (lambda: BlockAllocator(4).refcount(True), "block=True is not a block id (0..3)"),
        (lambda: PagedKVPool(4, 0, 2, 8), "PagedKVPool: page_size=0 must be a positive int"),
        (lambda: PagedKVPool(np.int64(4), 16, 2, 8), "PagedKVPool: num_pages=np.int64(4) must be a positive int"),
        (lambda: RingWindow(8, True, 4), "RingWindow: sink_tokens=True must be an int >= 0"),
        (lambda: RingWindow(8, 2, 0), "RingWindow: tokens_per_block=0 must be a positive int"),
        (lambda: ModelSpec("m", 1, 2, 2, 8, kv_lora_rank=-1), "ModelSpec 'm': kv_lora_rank=-1 must be an int >= 0"),
        (lambda: max_tokens(ModelSpec("m", 1, 2, 2, 8), 1.0), "budget_bytes=1.0 must be an int >= 0"),
        (lambda: KVCacheManager(4, 16, secondary_blocks=-1), "secondary_blocks=-1 must be an int >= 0"),
    ],
)
def test_callers_keep_their_messages(make, message):
    with pytest.raises(ValueError) as e:
        make()
    assert str(e.value) == message
