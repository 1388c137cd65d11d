"""The access map (issue 40): the loads and stores a kernel made in Triton's interpreter,
per program (:mod:`pagedkv_kernels.interpreter.access`), placed in a paged pool
(:func:`pagedkv_lab.viz.access_map`) and drawn at a readable size; the exercise checker
attaches it to addressing failures only, and a correct solution prints only PASS.
Tiny kernels of 8 lanes; the module runs in about 15 s on 2 cores, most of it the three
checks of exercise 08."""

import subprocess
import sys

import pytest
import torch
from matplotlib.text import Text

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lab.exercises import EXERCISES, check
from pagedkv_lab.exercises.files import load_solution
from pagedkv_lab.exercises.mistakes import MISTAKES, load_with_mistake
from pagedkv_lab.exercises.result import code_place
from pagedkv_lab.poisoning import accesses_recorded
from pagedkv_lab.viz import MIN_FIGSIZE, access_map, plot_access_map, use_style
from pagedkv_lib import runtime
from pagedkv_lib.pool import PagedKVPool

# isort: split
import triton
import triton.language as tl

import pagedkv_kernels as kernels  # noqa: F401
from pagedkv_kernels.interpreter import access

pytestmark = pytest.mark.skipif(not runtime.BACKEND.interpreted, reason="records Triton's interpreter only")

PAGE_SIZE, HEADS, DIM = 4, 1, 8


@triton.jit
def _scatter_rows(k_ptr, cache_ptr, slot_ptr, page_size, stride_page, stride_kv, stride_n, D: tl.constexpr):
    """Program t writes k[t] into the K and V rows of slot_mapping[t] (nothing for -1);
    NHD, one head."""
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    d = tl.arange(0, D)
    row = (slot // page_size) * stride_page + (slot % page_size) * stride_n
    x = tl.load(k_ptr + t * D + d)
    keep = d < tl.where(slot >= 0, D, 0)
    tl.store(cache_ptr + row + d, x, mask=keep)
    tl.store(cache_ptr + stride_kv + row + d, x, mask=keep)


@triton.jit
def _read_tile(cache_ptr, tables_ptr, lens_ptr, out_ptr, page_size, stride_page, stride_n, BLOCK: tl.constexpr):
    """Program (b, h) sums the first feature of sequence b's K rows, a tile of BLOCK
    tokens whose lanes past its length are masked (their page loads as page 0)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.load(lens_ptr + b)
    t = tl.arange(0, BLOCK)
    valid = t < n
    page = tl.load(tables_ptr + b * 2 + t // page_size, mask=valid, other=0)
    k = tl.load(cache_ptr + page * stride_page + (t % page_size) * stride_n, mask=valid, other=0.0)
    tl.store(out_ptr + b * 2 + h, tl.sum(k, axis=0))


def _pool(pages: int = 3):
    return PagedKVPool(pages, PAGE_SIZE, HEADS, DIM, torch.float32, "NHD").cache


def _scatter(slots: list[int], cache):
    k = torch.arange(len(slots) * DIM, dtype=torch.float32).reshape(len(slots), DIM)
    slot_t = torch.tensor(slots)
    with accesses_recorded() as seen:
        _scatter_rows[(len(slots),)](
            k, cache, slot_t, PAGE_SIZE, cache.stride(0), cache.stride(1), cache.stride(2), D=DIM
        )
    return access_map(seen, cache, "NHD", [k, slot_t])


def _read(lens: list[int], tables: list[list[int]], cache):
    lens_t, tables_t = torch.tensor(lens), torch.tensor(tables)
    out = torch.zeros(len(lens), 2)
    with accesses_recorded() as seen:
        _read_tile[(len(lens), 2)](cache, tables_t, lens_t, out, PAGE_SIZE, cache.stride(0), cache.stride(2), BLOCK=8)
    return access_map(seen, cache, "NHD", [tables_t, lens_t, out])


def test_each_program_wrote_the_slots_of_its_tokens():
    slots = [5, 0, 9, 3]
    amap = _scatter(slots, _pool())
    assert amap.programs == [(t, 0, 0) for t in range(4)]
    for t, slot in enumerate(slots):  # the expectation: slot_mapping itself
        assert amap.slots((t, 0, 0), "written") == {slot}, t
        assert amap.slots((t, 0, 0), "read") == set()
    assert not amap.outside.any() and not amap.masked.any()


def test_masked_lanes_are_apart_and_reads_are_the_sequences_rows():
    # sequence 0: 6 tokens on pages [2, 1]; sequence 1: 3 tokens on page [1, -]; tile of 8
    amap = _read([6, 3], [[2, 1], [1, 0]], _pool())
    want = {0: {8, 9, 10, 11, 4, 5}, 1: {4, 5, 6}}  # page * 4 + row of tokens t < length
    masked = {0: {2, 3}, 1: {3, 0, 1, 2}}  # masked lanes: page 0 (other=0), row t % 4, minus rows read
    for b in (0, 1):
        for h in (0, 1):
            assert amap.slots((b, h, 0), "read") == want[b], (b, h)
            assert amap.slots((b, h, 0), "masked") == masked[b] - want[b], (b, h)
    assert not amap.written.any()  # the stores went to `out`, not the pool
    assert not amap.outside.any()


def test_a_mutant_that_records_the_wrong_program_fails_the_expectation(monkeypatch):
    # the checks above are only as good as the program id: record (x + 1) mod grid instead
    monkeypatch.setattr(access, "program_id", lambda builder: ((builder.grid_idx[0] + 1) % 4, 0, 0))
    amap = _scatter([5, 0, 9, 3], _pool())
    assert amap.slots((0, 0, 0), "written") != {5}, "the expectation would not catch a wrong program id"


def test_writes_outside_the_pool_are_counted_per_program_before_and_after():
    cache = _pool(2)
    guarded = torch.zeros(cache.numel() + 64)  # room on both sides: the kernel writes there
    pool = guarded[32 : 32 + cache.numel()].view(cache.shape)
    slot_t = torch.tensor([-1, 2, 8])  # -1: the row before page 0; 8: the row after page 1
    k = torch.ones(3, DIM)
    with accesses_recorded() as seen:
        _unguarded_scatter[(3,)](k, pool, slot_t, PAGE_SIZE, pool.stride(0), pool.stride(2), D=DIM)
    amap = access_map(seen, pool, "NHD", [k, slot_t])
    row_bytes = DIM * 4
    assert amap.outside.tolist() == [[row_bytes, 0], [0, 0], [0, row_bytes]]
    assert amap.slots((1, 0, 0), "written") == {2}


@triton.jit
def _unguarded_scatter(k_ptr, cache_ptr, slot_ptr, page_size, stride_page, stride_n, D: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    d = tl.arange(0, D)
    # no padding guard: in Triton -1 // 4 is 0 and -1 % 4 is -1, the row just before the pool
    row = (slot // page_size) * stride_page + (slot % page_size) * stride_n
    tl.store(cache_ptr + row + d, tl.load(k_ptr + t * D + d))


def _pixels(fig) -> tuple[float, float]:
    width, height = fig.get_size_inches() * fig.dpi
    return width, height


def test_the_map_is_drawn_at_a_readable_size_with_its_title_inside_whatever_the_launch():
    use_style()
    many = _scatter([1, 2, 3, 0, 5, 6], _pool(2))
    many.outside[::2] = [64, 4096]  # a long summary: every other program wrote on both sides
    for amap in (_scatter([1], _pool(1)), _read([6, 3], [[2, 1], [1, 0]], _pool()), many):
        fig = plot_access_map(amap, "a title long enough to need a second line " * 3, program_axes="(b, h)")
        fig.canvas.draw()
        width, height = _pixels(fig)
        assert width >= MIN_FIGSIZE[0] * fig.dpi >= 480 and height >= MIN_FIGSIZE[1] * fig.dpi >= 320
        renderer = fig.canvas.get_renderer()
        for text in (t for t in fig.findobj(Text) if t.get_visible() and t.get_text()):
            box = text.get_window_extent(renderer)
            assert box.x0 >= 0 and box.y0 >= 0 and box.x1 <= width and box.y1 <= height, f"cut: {text.get_text()!r}"
        box = fig.axes[0].get_window_extent(renderer)
        assert box.height >= 150 and box.width >= 300, f"axes collapsed to {box.width:.0f} x {box.height:.0f} px"


def _decode(replace=None):
    spec = EXERCISES["decode_kernel"]
    space = load_solution(spec, replace=replace)
    return check("decode_kernel", *[space[name] for name in spec.functions])


def test_exercise_08_without_other_gets_a_readable_access_map_and_says_nan():
    from matplotlib.image import imread

    result = _decode(replace=[("mask=mask, other=0.0)", "mask=mask)")])
    message = result.message
    assert not result.passed and "NaN came from the masked lanes" in message, message
    assert "max |error| NaN" in message and "inf" not in message.split("hint:")[0], message
    assert result.failure.picture is not None and "access map of your kernel" in message
    height, width = imread(result.failure.picture).shape[:2]
    assert width >= 480 and height >= 320, f"{width} x {height} px"


def test_a_numeric_decode_failure_gets_no_map():
    mistake = next(m for m in MISTAKES if m.what == "leaves out the online-softmax rescale")
    result = check(mistake.exercise, *load_with_mistake(mistake))
    assert not result.passed and mistake.message in result.message
    assert result.failure.picture is None and "access map" not in result.message


def test_exercise_08s_correct_solution_prints_only_pass():
    # as a learner runs it: a fresh process (the check's child forked from it), every
    # warning shown, stdout and stderr both read
    code = (
        "from pagedkv_lab.exercises import EXERCISES, check\n"
        "from pagedkv_lab.exercises.files import load_solution\n"
        "spec = EXERCISES['decode_kernel']\n"
        "space = load_solution(spec)\n"
        "print(check('decode_kernel', *[space[name] for name in spec.functions]))\n"
    )
    run = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0 and run.stderr == "", run.stderr
    assert run.stdout.startswith("PASS decode_kernel") and run.stdout.count("\n") == 1, run.stdout


def test_a_notebook_cell_is_named_as_jupyterlab_numbers_it(monkeypatch):
    class Compiler:
        def get_code_name(self, raw, code, number):
            return f"/tmp/ipykernel_1/{abs(hash(raw))}.py"

    class Shell:
        compile = Compiler()

        class history_manager:  # noqa: N801 - IPython's attribute name
            input_hist_raw = ["", "import torch", "@triton.jit\ndef kernel(): ...", "check()"]  # newlines cut

    import IPython

    monkeypatch.setattr(IPython, "get_ipython", lambda: Shell())
    kernel_file = Compiler().get_code_name(Shell.history_manager.input_hist_raw[2] + "\n", None, 2)
    assert code_place(kernel_file, 29) == "cell [2], line 29"
    # a check's forked child: ipykernel's folder names the child's process id, not the kernel's
    assert code_place(kernel_file.replace("ipykernel_1", "ipykernel_2"), 29) == "cell [2], line 29"
    assert code_place("/work/solution_08.py", 3) == "solution_08.py, line 3"
