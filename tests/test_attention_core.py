"""The four paged read kernels share one attention core (kernels/pagedkv_kernels/device/attention_core.py):
each kernel's source calls the core's helpers for the span, the split range, the online
softmax state and step and the store, and none keeps a copy of the steps the core
owns (the ``-inf`` guard, the ``exp2`` rescaling, the CSR length rule, the split
arithmetic). Reads source text only: no kernel runs (well under 0.1 s)."""

import inspect

import pytest

import pagedkv_lib  # noqa: F401  (before triton)

# isort: split
from pagedkv_kernels import decode, mla_decode, prefill, quant_decode
from pagedkv_kernels.device import attention_core, prefill_tile

READ_KERNELS = {
    "decode": decode.decode_split_kernel,
    "quantized decode": quant_decode.quant_decode_split_kernel,
    "prefill": prefill.prefill_kernel,
    "prefill (any layout)": prefill.prefill_any_layout_kernel,
    "MLA decode": mla_decode.mla_split_kernel,
}
# Helpers every read kernel calls; the split-KV kernels also split and store through the
# core (the prefill has no splits, and its own store: bf16 rounded to nearest). Both
# prefill kernels take their per-tile steps through pagedkv_kernels.device.prefill_tile,
# whose source counts as theirs here (its attend_keys calls the online softmax step).
CORE_CALLS = ("sequence_span(", "softmax_state(", "online_softmax_step(")
SPLIT_KV_CALLS = ("split_tiles(", "store_partial(")
# Text that only the core may hold: the guard of a row with no key yet, the rescaling,
# FlashInfer's last-page-length rule, the split arithmetic, the lse formula, the test of
# an empty row (l == 0; never l > 0, which NaN fails too: issue 36).
CORE_ONLY = (
    'm_new == float("-inf")',
    "m_safe",
    "tl.exp2(",
    "num_pages - 1",
    "tiles_per_split",
    "tl.log2(",
    "l_i == 0",
    "l_i > 0",
)


def _source(kernel) -> str:
    return inspect.getsource(kernel.fn)


def _read_source(family: str) -> str:
    """The family's kernel source, with the prefill steps' module for the prefill kernels."""
    source = _source(READ_KERNELS[family])
    return source + inspect.getsource(prefill_tile) if family.startswith("prefill") else source


@pytest.mark.parametrize("family", READ_KERNELS)
def test_read_kernel_calls_the_shared_core(family):
    source = _read_source(family)
    calls = CORE_CALLS + (() if family.startswith("prefill") else SPLIT_KV_CALLS)
    if "decode_split_start(" in source:  # the MHA and quantized decodes' one-call prologue
        calls = tuple(c for c in calls if c not in ("sequence_span(", "split_tiles(")) + ("decode_split_start(",)
    missing = [call for call in calls if call not in source]
    assert not missing, f"the {family} kernel does not call {missing} of pagedkv_kernels.device.attention_core"


@pytest.mark.parametrize("family", READ_KERNELS)
def test_read_kernel_keeps_no_copy_of_the_core(family):
    source = _read_source(family)
    copies = [text for text in CORE_ONLY if text in source]
    assert not copies, f"the {family} kernel repeats {copies}: call pagedkv_kernels.device.attention_core instead"


def test_the_core_holds_each_step_once():
    """The steps the kernels no longer hold are in the core, each in one helper."""
    jitted = {name: getattr(attention_core, name) for name in attention_core.__all__}
    helpers = {name: _source(obj) for name, obj in jitted.items() if hasattr(obj, "fn")}
    assert len(helpers) >= 8, sorted(helpers)
    for text in ('m_new == float("-inf")', "num_pages - 1", "tiles_per_split = ", "tl.log2("):
        holders = [name for name, src in helpers.items() if text in src]
        assert len(holders) == 1, f"{text!r} is in {holders}"


# The plain prefill and its variants (pagedkv_kernels.prefill_any_layout) are one loop: each
# takes the same steps from pagedkv_kernels.device.prefill_tile and keeps no copy of them
# (the products, the causal and window masks, the key range, the stores).
PREFILL_STEPS = ("tile_rows(", "tile_key_range(", "load_rows(", "key_mask(", "attend_keys(", "store_rows(")
PREFILL_TILE_ONLY = ("tl.dot(", "<= qpos", "qpos[:, None] - window_recent", "p_hi = ", "tl.store(", "round_to(")


@pytest.mark.parametrize("kernel", ["prefill", "prefill (any layout)"])
def test_both_prefill_kernels_take_the_same_steps_and_keep_no_copy_of_them(kernel):
    source = _source(READ_KERNELS[kernel])
    missing = [call for call in PREFILL_STEPS if call not in source]
    assert not missing, f"the {kernel} kernel does not call {missing} of pagedkv_kernels.device.prefill_tile"
    copies = [text for text in PREFILL_TILE_ONLY if text in source]
    assert not copies, f"the {kernel} kernel repeats {copies}: call pagedkv_kernels.device.prefill_tile instead"
    steps = inspect.getsource(prefill_tile)
    assert all(text in steps for text in PREFILL_TILE_ONLY), "prefill_tile no longer holds what this test names"
