"""One rule for every read entry point (decode on its three routes, prefill, quantized
decode, MLA decode, and their references): huge softmax scales, tensors on the ``meta`` device, windows of other
pages and int64 junk in unused table entries are refused with a ValueError that names
what is wrong, before anything is launched.

Inputs come from the harness's own case builders (small shapes: the whole module runs
in about a second, since nothing reaches a kernel launch).
"""

import pytest
import torch
from no_launch import NoLaunch

import pagedkv_lib  # noqa: F401  (before triton)
from pagedkv_lab.verify.decode_checks import decode_inputs
from pagedkv_lab.verify.mla_checks import mla_decode_inputs
from pagedkv_lab.verify.prefill_checks import prefill_inputs
from pagedkv_lab.verify.quant_checks import quant_decode_inputs
from pagedkv_lib import RingWindow, mla, quant_reference, reference, runtime
from pagedkv_lib.checks import MAX_SCALE

# isort: split
import pagedkv_kernels as kernels
from pagedkv_kernels import decode, decode_descriptors, decode_page_pointers, mla_decode, prefill, quant_decode

DEV = runtime.device()
SHAPE = {"layout": "NHD", "dtype": "fp32", "head_dim": 64, "page_size": 8, "group": 2, "num_kv_heads": 1}


@pytest.fixture(autouse=True)
def no_launch(monkeypatch):
    """Any launch fails the test: every case here must be refused before one."""
    for module, name in (
        (decode, "decode_split_kernel"),
        (decode_page_pointers, "decode_page_pointers_kernel"),
        (decode_descriptors, "decode_descriptors_kernel"),
        (prefill, "prefill_kernel"),
        (prefill, "prefill_any_layout_kernel"),
        (quant_decode, "quant_decode_split_kernel"),
        (mla_decode, "head_matvec_kernel"),
        (mla_decode, "mla_split_kernel"),
    ):
        monkeypatch.setattr(module, name, NoLaunch())


def _dev(a: dict) -> dict:
    """The tensors on the kernels' device; a meta tensor stays there (it has no data to move)."""
    return {k: v.to(DEV) if isinstance(v, torch.Tensor) and v.device.type != "meta" else v for k, v in a.items()}


def decode_args():
    q, cache, tables, lens, _ = decode_inputs({**SHAPE, "seq_lens": [20, 5]})
    return {"q": q, "cache": cache, "block_tables": tables, "seq_lens": lens}


def prefill_args():
    q, cache, qo, tables, lens, _ = prefill_inputs({**SHAPE, "requests": ((20, 6), (5, 3))})
    return {"q": q, "cache": cache, "qo_indptr": qo, "block_tables": tables, "seq_lens": lens}


def quant_args():
    q, pool, tables, lens, _ = quant_decode_inputs({**SHAPE, "format": "fp8", "seq_lens": [20, 5]})
    return {"q": q, "pool": pool, "block_tables": tables, "seq_lens": lens}


def mla_args():
    a = mla_decode_inputs(
        {"dtype": "fp32", "page_size": 8, "num_heads": 2, "dims": (32, 16, 16, 16), "seq_lens": [20, 5]}
    )
    return {k: v for k, v in a.items() if k not in ("buffer", "scale")}


def _quant_kernel(pool, **a):
    return kernels.paged_decode_attention_quant_pool(pool=pool.to(DEV), **_dev(a))


# (name, arguments, kernel call, reference call): the references take host tensors.
ENTRY_POINTS = {
    "decode": (decode_args, lambda a: kernels.paged_decode_attention(**_dev(a)), reference.paged_decode_attention),
    "decode, page pointers": (
        decode_args,
        lambda a: kernels.paged_decode_attention_page_pointers(**_dev(a)),
        reference.paged_decode_attention,
    ),
    "decode, descriptors": (
        decode_args,
        lambda a: kernels.paged_decode_attention_descriptors(**_dev(a)),
        reference.paged_decode_attention,
    ),
    "prefill": (prefill_args, lambda a: kernels.paged_prefill_attention(**_dev(a)), reference.paged_prefill_attention),
    "quant decode": (quant_args, lambda a: _quant_kernel(**a), quant_reference.paged_decode_attention_quant),
    "mla decode": (mla_args, lambda a: kernels.mla_decode_attention(**_dev(a)), mla.mla_decode_naive),
}


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("scale", [1e38, -2 * MAX_SCALE])
def test_a_softmax_scale_that_overflows_fp32_scores_is_refused_by_kernel_and_reference(entry, scale):
    """A finite scale of 1e38 used to reach the kernels, whose fp32 scores overflowed to
    NaN where the float64 reference stayed finite."""
    args, kernel, ref = ENTRY_POINTS[entry]
    for call in (kernel, lambda a: ref(**a)):
        with pytest.raises(ValueError, match=r"scale=.* is beyond \+-10000"):
            call({**args(), "scale": scale})
    assert torch.isfinite(ref(**{**args(), "scale": MAX_SCALE})).all()  # the bound itself is accepted


@pytest.mark.parametrize("entry", ENTRY_POINTS)
@pytest.mark.parametrize("name", ["block_tables", "seq_lens"])
def test_an_index_tensor_on_the_meta_device_is_refused_by_name(entry, name):
    """The kernels copied index tensors to the host before any device check, and torch
    raised NotImplementedError ("Cannot copy out of meta tensor")."""
    args, kernel, _ = ENTRY_POINTS[entry]
    a = args()
    a[name] = a[name].to("meta")
    with pytest.raises(ValueError, match=f"{name} is on the meta device"):
        kernel(a)


def test_a_quantized_pool_whose_global_scale_is_on_the_meta_device_is_refused_by_name():
    a = quant_args()
    pool = a.pop("pool")
    pool.global_scale = pool.global_scale.to("meta")
    with pytest.raises(ValueError, match="pool.global_scale is on the meta device"):
        kernels.paged_decode_attention_quant_pool(pool=pool, **_dev(a))
    with pytest.raises(ValueError, match="pool.global_scale is on the meta device"):
        quant_reference.paged_decode_attention_quant(pool=pool, **a)


def test_a_prefill_window_of_other_pages_is_refused_for_its_page_size():
    """It used to be refused for its chunk length ("a chunk of 6 tokens overwrites ring
    slots"), which sent the reader to the wrong knob."""
    a = {**prefill_args(), "window": RingWindow(64, 4, 4)}  # the pool has pages of 8
    for call in (ENTRY_POINTS["prefill"][1], lambda b: reference.paged_prefill_attention(**b)):
        with pytest.raises(ValueError, match=r"window.tokens_per_block=4 != page_size=8"):
            call(a)


@pytest.mark.parametrize("entry", ENTRY_POINTS)
def test_every_read_kernel_refuses_int64_junk_past_int32_in_unused_table_entries(entry):
    """One rule for all read kernels: they index the table in int32, so an int64 table
    must fit int32 everywhere, used entries or not (in-range junk in unused entries is
    accepted and never read)."""
    args, kernel, _ = ENTRY_POINTS[entry]
    a = args()
    table = a["block_tables"].long()
    table[1, -1] = 2**40  # sequence 1 (5 tokens, 1 page) never reads its last entry
    a["block_tables"] = table
    with pytest.raises(ValueError, match=r"block_tables has values outside int32"):
        kernel(a)
