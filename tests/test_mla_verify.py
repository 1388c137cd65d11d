"""The harness's MLA checks: they pass on correct code, and each broken implementation
below (a mutant that keeps a promise the checks guard) fails them.

The kernels themselves run through the same grids in tests/test_mla_kernels.py; here the
correct side is the Python references, which are fast."""

import pytest
import torch

from pagedkv_lab import verify
from pagedkv_lib import mla

MLA_CHECKS = ("mla_append", "mla_decode")


def run_mla(append_fn=None, decode_fn=None, check=None):
    checks = (check,) if check else MLA_CHECKS
    return verify.run(mla_append_fn=append_fn, mla_decode_fn=decode_fn, checks=checks)


# ----------------------------------------------------------------------------- mutants


def append_ignoring_rope(ckv, kpe, ckv_cache, kpe_cache, slot_mapping, rope=None, positions=None):
    """Stores the RoPE key unrotated."""
    mla.append_paged_mla_kv(ckv, kpe, ckv_cache, kpe_cache, slot_mapping)


def append_padding_into_the_last_row(ckv, kpe, ckv_cache, kpe_cache, slot_mapping, **kwargs):
    """Uses a padding slot -1 as an index: the padding tokens land in the pool's last row."""
    mla.append_paged_mla_kv(ckv, kpe, ckv_cache, kpe_cache, slot_mapping, **kwargs)
    pad = slot_mapping < 0
    if pad.any():
        ckv_cache[-1, -1], kpe_cache[-1, -1] = ckv[pad][-1], kpe[pad][-1]


def append_that_consumes_its_input(ckv, kpe, ckv_cache, kpe_cache, slot_mapping, **kwargs):
    """Writes the right rows, then zeroes ``kpe`` (an in-place rotation buffer reused)."""
    mla.append_paged_mla_kv(ckv, kpe, ckv_cache, kpe_cache, slot_mapping, **kwargs)
    kpe.zero_()


def decode_without_the_rope_key(q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, w_uk, w_uv, scale):
    """Scores the latent part only: ``q_pe . k_pe`` is dropped."""
    args = (ckv_cache, kpe_cache, block_tables, seq_lens, w_uk, w_uv, scale)
    return mla.mla_decode_naive(q_nope, torch.zeros_like(q_pe), *args)


def decode_with_w_uk_read_the_wrong_way(q_nope, q_pe, ckv_cache, kpe_cache, tables, lens, w_uk, w_uv, scale):
    """Reads each head's ``w_uk [nope, rank]`` as if it were stored ``[rank, nope]``
    (the other convention of the issue, mixed up)."""
    w = w_uk.transpose(1, 2).reshape(w_uk.shape)
    return mla.mla_decode_absorbed(q_nope, q_pe, ckv_cache, kpe_cache, tables, lens, w, w_uv, scale)


def decode_reading_whole_pages(q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, w_uk, w_uv, scale):
    """Loads every row of a sequence's pages and only masks the scores past its end:
    ``0 * NaN = NaN`` from a poisoned tail row."""
    ps = ckv_cache.shape[1]
    out = torch.zeros((q_nope.shape[0], q_nope.shape[1], w_uv.shape[1]), dtype=torch.float64)
    for b, n in enumerate(seq_lens.tolist()):
        if n == 0:
            continue
        pages = block_tables[b, : -(-n // ps)].long()
        ckv, kpe = ckv_cache[pages].flatten(0, 1).double(), kpe_cache[pages].flatten(0, 1).double()
        q_latent = torch.einsum("hd,hdr->hr", q_nope[b].double(), w_uk.double())
        scores = (q_latent @ ckv.T + q_pe[b].double() @ kpe.T) * scale
        scores[:, n:] = float("-inf")
        out[b] = torch.einsum("hvr,hr->hv", w_uv.double(), torch.softmax(scores, -1) @ ckv)
    return out


def decode_that_cleans_the_pool(q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, w_uk, w_uv, scale):
    """Right answer, but it zeroes the pool's NaN slots on the way."""
    ckv_cache.nan_to_num_(0.0)
    return mla.mla_decode_naive(q_nope, q_pe, ckv_cache, kpe_cache, block_tables, seq_lens, w_uk, w_uv, scale)


# ----------------------------------------------------------------------------- tests


def test_mla_checks_pass_on_the_references_and_cover_the_promised_grid():
    report = run_mla(mla.append_paged_mla_kv, mla.mla_decode_naive)
    assert report.passed, str(report)
    cases = {r.check: [] for r in report.results}
    for r in report.results:
        cases[r.check].append(r.case)
    decode = cases["mla_decode"]
    assert {c["page_size"] for c in decode} >= {1, 16, 64}
    assert any(0 in c["seq_lens"] for c in decode) and max(max(c["seq_lens"]) for c in decode) >= 300
    assert {c.get("num_splits") for c in decode} >= {1, None, 3} and any(c.get("fused") for c in decode)
    assert {c["rope"] for c in cases["mla_append"]} == {None, "neox", "gptj"}


def test_mla_checks_are_mla_only_and_run_only_when_given():
    assert set(MLA_CHECKS) <= set(verify.CHECKS)
    report = verify.run(mla.append_paged_mla_kv, checks=("append",))
    assert report.results and {r.check for r in report.results} == {"append"}
    nothing = verify.run(checks=MLA_CHECKS)  # no MLA callable: nothing ran, and that fails
    assert [r.kind for r in nothing.results] == ["nothing"] and not nothing.passed


def test_append_mutants_fail_the_append_check():
    for mutant, hint in ((append_ignoring_rope, "RoPE key beyond tolerance"),
                         (append_padding_into_the_last_row, "elements differ"),
                         (append_that_consumes_its_input, "modified its input kpe")):  # fmt: skip
        report = run_mla(append_fn=mutant, check="mla_append")
        assert report.failures, mutant.__name__
        assert all(hint in r.detail for r in report.failures), str(report)


@pytest.mark.parametrize(
    "mutant,hint",
    [
        (decode_without_the_rope_key, "beyond tolerance"),
        (decode_with_w_uk_read_the_wrong_way, "beyond tolerance"),
        (decode_reading_whole_pages, "non-finite"),
        (decode_that_cleans_the_pool, "wrote into the pool"),
    ],
    ids=["no_rope_key", "w_uk_wrong_way", "whole_pages", "cleans_the_pool"],
)
def test_decode_mutants_fail_the_decode_check(mutant, hint):
    """Two grid cases each (one fp32, one bf16 with the one-buffer pool): every mutant
    must fail both, for its own reason."""
    for case in (verify.mla_decode_grid()[1], verify.mla_decode_grid()[7]):
        result = verify.mla_decode_case(mutant, case)
        assert result.passed is False and hint in result.detail, (case, result.detail)


def test_a_failing_mla_case_replays_from_its_repro_line():
    report = run_mla(decode_fn=decode_reading_whole_pages, check="mla_decode")
    failure = report.failures[0]
    assert "verify.run_case('mla_decode'" in failure.repro and "mla_decode_fn=" in failure.repro
    assert verify.run_case("mla_decode", failure.case, mla_decode_fn=decode_reading_whole_pages).passed is False
    assert verify.run_case("mla_decode", failure.case, mla_decode_fn="pagedkv_lib.mla:mla_decode_naive").passed
    compile(failure.repro, "<repro>", "exec")


def test_run_case_needs_the_mla_callable():
    with pytest.raises(ValueError, match="needs mla_decode_fn"):
        verify.run_case("mla_decode", verify.mla_decode_grid()[0], decode_fn=mla.mla_decode_naive)


def test_kernels_verify_hands_the_mla_kernels_to_the_harness(monkeypatch):
    import pagedkv_kernels as kernels
    import pagedkv_kernels.tools.verify  # noqa: F401

    seen = {}
    monkeypatch.setattr(verify.cli, "run", lambda **kw: seen.update(kw) or verify.Report())
    assert kernels.tools.verify.main(["--hypothesis", "0"]) == 0
    assert seen["mla_append_fn"] is kernels.append_paged_mla_kv
    assert seen["mla_decode_fn"] is kernels.mla_decode_attention
