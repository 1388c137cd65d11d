"""The grader's parts that need no learner process (a few milliseconds each): what crosses
between the checker and a learner's process (:mod:`pagedkv_lab.grading.wire`), how a
learner's answer is written back into the checker's objects and its exceptions raised
there (:mod:`pagedkv_lab.grading.remote`), what the sandbox's root holds
(:mod:`pagedkv_lab.grading.sandbox`) and what the learner wheel holds
(``scripts/learner_wheel.py``). The grader against learners, attacks included:
``tests/test_nbgrader.py``."""

import json
import os
import struct
import sys
from collections import deque
from pathlib import Path

import numpy as np
import pytest
import torch

import pagedkv_lab
from pagedkv_lab.exercises.files import default_dir
from pagedkv_lab.exercises.result import where_in_learner_code
from pagedkv_lab.grading import sandbox
from pagedkv_lab.grading.remote import LearnerException, _reseat, _restore, remote_exception
from pagedkv_lab.grading.wire import HEAD, Opaque, WireError, pack, unpack
from pagedkv_lib.allocator import BlockAllocator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "scripts"))

from learner_wheel import problems, stage  # noqa: E402


def _round_trip(message, devices: bool = False):
    frame = pack(message)
    (n,) = HEAD.unpack_from(frame)
    assert n == len(frame) - HEAD.size
    return unpack(frame[HEAD.size :], devices)


def _frame(header: dict, *blobs: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack(">I", len(raw)) + raw + b"".join(blobs)


# --------------------------------------------------------------------------- the wire


def test_views_of_one_storage_cross_as_views_of_one_storage():
    # a pool between guard bytes: the view and its storage's other bytes arrive together
    buffer = torch.arange(40, dtype=torch.float32)
    pool, tail = buffer[4:20].view(4, 4).t(), buffer[30:]
    got_pool, got_tail = _round_trip([pool, tail])
    assert torch.equal(got_pool, pool) and got_pool.stride() == (1, 4) and got_pool.storage_offset() == 4
    assert got_pool.untyped_storage().data_ptr() == got_tail.untyped_storage().data_ptr()
    assert got_pool.untyped_storage().nbytes() == buffer.untyped_storage().nbytes()


def test_every_kind_of_value_an_exercise_passes_crosses_as_itself():
    allocator = BlockAllocator(6)
    allocator.allocate_many(2)
    message = {
        (1, 2): {3, 4},
        "deque": deque([5, 6]),
        "ints": [1, -2, 2**70],
        "floats": [0.5, float("-inf")],
        "bytes": b"\x00\xff",
        "dtype": torch.bfloat16,
        "ndarray": np.arange(6, dtype=np.int32).reshape(2, 3),
        "scalar": np.float32(1.5),
        "allocator": allocator,
        "none": None,
    }
    got = _round_trip(message)
    assert {k: v for k, v in got.items() if k not in ("ndarray", "allocator")} == {
        k: v for k, v in message.items() if k not in ("ndarray", "allocator")
    }
    assert np.array_equal(got["ndarray"], message["ndarray"]) and got["ndarray"].dtype == np.int32
    books = lambda a: {k: v for k, v in vars(a).items() if k != "_lock"}  # noqa: E731
    assert type(got["allocator"]) is BlockAllocator and books(got["allocator"]) == books(allocator)
    # the copy has a lock of its own, and it works
    assert got["allocator"]._lock is not allocator._lock and got["allocator"].allocate() == 2
    assert np.isnan(_round_trip(float("nan")))


def test_what_cannot_cross_as_data_arrives_as_its_description():
    got = _round_trip([lambda: 1, object()])
    assert all(isinstance(x, Opaque) for x in got) and got[0].type_name == "function"


@pytest.mark.parametrize(
    "header, blobs, refused",
    [
        ({"msg": {"$": "object", "class": "os.system", "state": {"$": "dict", "v": []}}}, [], "do not cross"),
        (
            {"msg": {"$": "tensor", "storage": 0, "dtype": "object", "shape": [1], "stride": [1], "offset": 0}},
            [],
            "dtype",
        ),
        (
            {
                "msg": {"$": "tensor", "storage": 0, "dtype": "float32", "shape": [4], "stride": [1], "offset": 2},
                "storages": [{"blob": 0, "device": "cpu"}],
                "blobs": [16],
            },
            [bytes(16)],
            "ending at byte 24 of a storage of 16",
        ),
        ({"msg": {"$": "ndarray", "dtype": "|O", "shape": [1], "blob": 0}, "blobs": [8]}, [bytes(8)], "ndarray"),
        ({"msg": [], "blobs": [4]}, [b"ab"], "parts add up"),
        ({"msg": {"$": "pickle", "v": "cos\nsystem"}}, [], "unknown tag"),
    ],
)
def test_a_frame_that_is_not_a_message_is_refused(header, blobs, refused):
    with pytest.raises(WireError, match=refused):
        unpack(_frame(header, *blobs))


# --------------------------------------------------------------------------- the answer, written back


def test_an_answer_is_written_back_into_the_checkers_own_objects():
    buffer = torch.zeros(12)
    pool = buffer[2:10]
    table, allocator = [0, 1], BlockAllocator(4)
    theirs_buffer = torch.arange(12.0)  # the learner's kernel also wrote a guard byte (index 11)
    theirs = [theirs_buffer[2:10], [0, 1, 3], BlockAllocator(4)]
    theirs[2].allocate_many(3)
    done: dict = {}
    for mine, answer in zip([pool, table, allocator], theirs):
        _restore(mine, answer, done)
    assert torch.equal(buffer, theirs_buffer) and table == [0, 1, 3] and allocator.num_free == 1


def test_a_returned_view_of_an_argument_comes_back_as_a_view_of_the_checkers_argument():
    # GQA's read (exercise 10) returns a broadcast of its argument: judged by storage pointer
    pool = torch.arange(24.0).view(4, 2, 3)
    kv = pool[1:3]  # an offset into the pool's storage
    theirs = torch.arange(24.0).view(4, 2, 3)[1:3]  # the argument as it came back, its own storage
    done: dict = {}
    _restore(kv, theirs, done)
    view, copy = _reseat((theirs.unsqueeze(2).expand(2, 2, 4, 3), theirs.clone()), done)
    at = pool.untyped_storage().data_ptr()
    assert view.untyped_storage().data_ptr() == at and view.stride(2) == 0 and torch.equal(view[:, 1, 3], kv[:, 1])
    assert copy.untyped_storage().data_ptr() != at  # a copy stays a copy


def test_an_answer_of_another_kind_is_refused():
    with pytest.raises(WireError, match="came back as"):
        _restore([1, 2], (1, 2), {})
    with pytest.raises(WireError, match="another dtype, shape or stride"):
        _restore(torch.zeros(4), torch.zeros(2, 2), {})


def test_a_learners_exception_keeps_its_name_kind_message_and_place():
    err = remote_exception(
        {"type": "IndexError", "bases": ["IndexError", "LookupError"], "message": "list index out of range"}
        | {"where": "cell_03.py, line 7: return table[page]"}
    )
    assert isinstance(err, IndexError) and isinstance(err, LearnerException)
    assert type(err).__name__ == "IndexError" and str(err) == "list index out of range"
    assert where_in_learner_code(err) == "cell_03.py, line 7: return table[page]"
    odd = remote_exception({"type": "not a name!", "bases": ["os.system"], "message": "x"})
    assert type(odd).__name__ == "Exception" and isinstance(odd, LearnerException)


# --------------------------------------------------------------------------- what a learner can see


def test_the_sandboxs_root_holds_the_suite_but_not_the_checkout_or_the_course():
    binds = sandbox._binds()
    checkout = str(ROOT)
    inside = [b for b in binds if b == checkout or b.startswith(checkout + os.sep)]
    packages = {str(Path(p).resolve()) for p in sandbox._package_dirs()}
    environment = {os.path.realpath(sys.prefix)}  # a venv made inside the checkout (make setup's .venv)
    assert set(inside) <= packages | environment, inside  # never the checkout itself (exercises/, .git)
    assert not any(str(default_dir()).startswith(b.rstrip("/") + "/") for b in binds), binds
    hidden = sandbox._hidden()
    assert str(Path(pagedkv_lab.__file__).parent / "exercises" / "mistakes.py") in hidden
    env = sandbox.learner_env("full", "/nowhere")
    assert not {"SSH_AUTH_SOCK", "GITHUB_TOKEN", "AWS_SECRET_ACCESS_KEY"} & env.keys()


def test_the_learner_wheel_holds_the_packages_and_no_solution(tmp_path):
    files = [p.as_posix() for p in stage(tmp_path)]
    assert not problems(files) and not any(f.startswith("exercises/") for f in files)
    assert {f.split("/")[0] for f in files} == {
        "pyproject.toml",
        "README.md",
        "pagedkv_lib",
        "kernels",
        "pagedkv_lab",
        "pagedkv_engine",
    }
    assert "pagedkv_lab/exercises/mistakes.py" not in files and "pagedkv_lab/exercises/catalog.py" in files
    assert problems(["exercises/solutions/01_kv_bytes.py", "pagedkv_lab/exercises/mistakes.py"]) != []
