"""pagedkv_engine serving SmolLM2-135M-Instruct, held token for token to transformers.

The standard batch (:func:`pagedkv_engine.check.standard_batch`: seven requests at
different steps, a shared system prompt, a prompt prefilled in several chunks, a fork
into two samples, a pool small enough to force preemption) is served on both
attention paths and compared with ``generate``; planted bugs must be caught and named.
Everything shares one model load and one set of transformers references.

CI cost (2 cores): the torch path generates 16 tokens per sequence; the Triton path,
in the interpreter, 3 (each decoded token costs about 0.9 s of interpreted decode
kernel over 30 layers). Speculative decoding (``speculative=4``) serves the standard
batch on the torch path and the two-request repetitive batch
(:func:`pagedkv_engine.check.repetitive_batch`, 12 tokens, about 20 s) on the Triton
one. The GGUF conversion check is marked ``slow`` and not run by ``make test``
(``pytest -m slow tests/test_engine.py`` runs it).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers", reason="the engine extra is not installed (make setup)")

from pagedkv_engine import Engine, weights  # noqa: E402
from pagedkv_engine import check as oracle  # noqa: E402
from pagedkv_engine.__main__ import main  # noqa: E402
from pagedkv_engine.attention import HFRope  # noqa: E402
from pagedkv_engine.memory import compare_caches, paged_waste_bound, summary_rows  # noqa: E402
from pagedkv_lab.faults import engine_parts  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
TORCH_TOKENS, TRITON_TOKENS, FAULT_TOKENS = 16, 3, 4
TRITON_SPEC_TOKENS = 12  # the repetitive batch: 2 requests, a few verify steps
FORK_PROMPT_LEN = 40  # "Tell me a very short story about a cat." in the chat template

try:
    weights.gguf_path()
except FileNotFoundError as exc:  # pragma: no cover - only without `make setup`
    pytest.skip(str(exc), allow_module_level=True)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One torch thread while these tests run (restored after): measured on a busy 2-core
    machine, two OpenMP threads made the standard batch 20x slower (110 s vs 5.3 s)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def loaded():
    return weights.load()


@pytest.fixture(scope="module")
def references():
    """transformers' greedy references, shared by every run over the same prompts."""
    return {}


def serve(loaded, attention: str, tokens: int, faults=(), speculative=0, batch=oracle.standard_batch):
    settings = oracle.standard_engine_args(tokens) if batch is oracle.standard_batch else {}
    engine = Engine(
        loaded.model, attention, record_logits=True, parts=engine_parts(faults), speculative=speculative, **settings
    )
    engine.run(batch(loaded.tokenizer, tokens))
    return engine


@pytest.fixture(scope="module")
def torch_run(loaded, references):
    engine = serve(loaded, "torch", TORCH_TOKENS)
    return engine, oracle.check_engine(engine, loaded.model, references=references)


def assert_standard_batch_was_served_in_full(engine, report, tokens):
    """The batch exercised everything it is meant to, and transformers agrees."""
    assert report.ok, "\n".join(report.lines(None))
    seqs = engine.sequences
    assert len(seqs) == 8 and all(len(s.output_ids) == tokens for s in seqs.values())
    # r4 shares r0's system prompt (3 full pages); in the tightest pool LRU eviction may take one.
    assert seqs["r4"].num_cached_tokens >= 32, "r4 should reuse the pages of the shared system prompt"
    chunks = [r for r in engine.history if "r2" in r.computed and r.computed["r2"] < seqs["r2"].prompt_len]
    assert len(chunks) >= 1, "the 123-token prompt r2 takes several steps under the 64-token budget"
    assert engine.stats.preemptions >= 1 and engine.stats.copies == 1
    preempted = {s for r in engine.history for s in r.preempted}
    assert all(v.compared == tokens for v in report.verdicts if v.seq_id in preempted and v.status == "equal")
    assert max(r.num_prefill_tokens + r.num_decode_tokens for r in engine.history) <= 64
    assert report.max_diff < oracle.TOLERANCE / 5, f"max |dlogit| {report.max_diff:.2e}: the tolerance's margin shrank"


def test_engine_reads_transformers_own_tensors_and_rope(loaded):
    model = loaded.model
    engine = Engine(model, "torch", num_pages=4)
    assert engine.model.embed.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # The projections are row-major [in, out] copies of transformers' [out, in] tensors.
    assert torch.equal(engine.model.layers[7]["q"].t(), model.model.layers[7].self_attn.q_proj.weight)
    assert engine.model.layers[7]["q"].is_contiguous()
    assert torch.equal(engine.model.lm_head.t(), model.model.embed_tokens.weight)  # tied
    assert HFRope(64, 100000.0).inv_freq.equal(model.model.rotary_emb.inv_freq)


def test_standard_batch_on_the_torch_path_is_token_identical_to_transformers(torch_run):
    engine, report = torch_run
    print("\n".join(report.lines()))
    assert_standard_batch_was_served_in_full(engine, report, TORCH_TOKENS)


def test_standard_batch_on_the_triton_kernels_is_token_identical_to_transformers(loaded, references):
    engine = serve(loaded, "triton", TRITON_TOKENS)
    report = oracle.check_engine(engine, loaded.model, references=references)
    print("\n".join(report.lines()))
    assert_standard_batch_was_served_in_full(engine, report, TRITON_TOKENS)


def test_fork_samples_equal_generate_from_their_forced_token_and_copy_once(torch_run, loaded):
    # r3 asks for two samples: the prompt is computed once, then r3.0 continues with
    # transformers' first choice and r3.1 with its second; each must equal generate()
    # from the prompt plus its first token (check_engine does exactly that).
    engine, report = torch_run
    verdicts = {v.seq_id: v for v in report.verdicts}
    assert verdicts["r3.0"].status != "mismatch" and verdicts["r3.1"].status != "mismatch"
    first = [engine.sequences[s].output_ids[0] for s in ("r3.0", "r3.1")]
    assert first[0] != first[1]
    # Pages: the prompt's three pages (2 full + 8 rows of the third) are shared by the
    # fork at the end of the step that computed the prompt (r3.1 has no table before).
    after = next(r for r in engine.history if "r3.1" in r.tables)
    shared = engine.history[after.step - 1].tables["r3.0"]
    assert len(shared) == 3
    # The first decode after the fork writes position 40 of both samples: the first
    # writer (r3.0) gets a private copy of the 8 written rows of the third page, the
    # second writes the original in place. The full pages are never written, never copied.
    assert after.copies == [(shared[2], after.tables["r3.0"][2], FORK_PROMPT_LEN % 16)]
    assert after.tables["r3.1"] == shared and after.tables["r3.0"][:2] == shared[:2]
    copies = [(r.step, c) for r in engine.history for c in r.copies]
    assert copies == [(after.step, after.copies[0])], "a page was copied other than at the first divergent write"


@pytest.mark.parametrize(
    ("fault", "first_seq", "first_step"),
    [
        # Decode steps pass position seq_len to RoPE: the first sequence to decode (r0,
        # its second token) already attends with a wrong relative distance.
        ("decode_rope_off_by_one", "r0", 1),
        # Both samples write position 40 into the shared page: the later one's K/V win,
        # so r3.0's next step attends to r3.1's token.
        ("no_copy_on_write", "r3.0", 1),
    ],
)
def test_planted_bug_fails_the_check_naming_request_step_and_token(loaded, references, fault, first_seq, first_step):
    engine = serve(loaded, "torch", FAULT_TOKENS, faults={fault})
    report = oracle.check_engine(engine, loaded.model, references=references)
    lines = report.lines(loaded.tokenizer)
    print(f"\n[{fault}]\n" + "\n".join(lines))
    assert not report.ok
    first = report.first_failure
    assert (first.seq_id, first.step) == (first_seq, first_step)
    assert lines[-1].startswith(f"first diverging: {first_seq}: MISMATCH at step {first_step} (engine step ")
    assert "engine token" in lines[-1] and "transformers" in lines[-1]


# --------------------------------------------------------------------------- speculative decoding


def test_standard_batch_with_prompt_lookup_drafts_is_token_identical_to_transformers(loaded, references):
    # Up to 4 drafts per step: some accepted, some rolled back, on top of the batch's
    # chunks, prefix hits, fork and preemptions; check_integrity ran after every step.
    engine = serve(loaded, "torch", TORCH_TOKENS, speculative=4)
    report = oracle.check_engine(engine, loaded.model, references=references)
    s = engine.stats
    print("\n".join(report.lines()), f"\n{s.drafts_accepted}/{s.drafts_proposed} drafts, {s.forwards_per_token:.3f}")
    assert_standard_batch_was_served_in_full(engine, report, TORCH_TOKENS)
    runs = [pa for r in engine.history for pa in r.drafts.values()]
    assert any(a < p for p, a in runs) and any(a > 0 for p, a in runs)
    assert 0.1 < s.acceptance_rate < 0.6 and s.forwards_per_token < 0.97  # measured: 7 of 23, 0.938


def test_prompts_that_are_copied_accept_nearly_every_draft(loaded, references):
    engine = serve(loaded, "torch", 32, speculative=4, batch=oracle.repetitive_batch)
    report = oracle.check_engine(engine, loaded.model, references=references)
    s = engine.stats
    print("\n".join(report.lines()), f"\n{s.drafts_accepted}/{s.drafts_proposed} drafts, {s.forwards_per_token:.3f}")
    assert report.ok and report.max_diff < oracle.TOLERANCE / 5
    assert s.acceptance_rate > 0.9 and s.forwards_per_token < 0.35  # measured: 46 of 47, 0.27


def test_speculation_on_the_triton_kernels_is_token_identical_to_transformers(loaded, references):
    # The verify chunks run in the Triton prefill kernel (in the interpreter: few tokens).
    engine = serve(loaded, "triton", TRITON_SPEC_TOKENS, speculative=4, batch=oracle.repetitive_batch)
    report = oracle.check_engine(engine, loaded.model, references=references)
    print("\n".join(report.lines()))
    assert report.ok and report.max_diff < oracle.TOLERANCE / 5
    assert engine.stats.drafts_accepted >= 4


def test_planted_rollback_keeps_drafts_fails_the_check_at_the_first_token_after_a_rejection(loaded, references):
    # r1's first verify step (engine step 4) accepts 3 of 4 drafts (its tokens 3-6, then
    # 7); the faulty rollback keeps the rejected one, so r1's token of engine step 5 (its
    # 8th, step 7) attends to the rejected draft's K/V where its 7th token's should be.
    engine = serve(loaded, "torch", TORCH_TOKENS, faults={"rollback_keeps_drafts"}, speculative=4)
    report = oracle.check_engine(engine, loaded.model, references=references)
    lines = report.lines(loaded.tokenizer)
    print("\n".join(lines))
    assert engine.history[4].drafts == {"r1": (4, 3)}
    first = report.first_failure
    assert not report.ok and (first.seq_id, first.engine_step, first.step) == ("r1", 5, 7)
    assert lines[-1].startswith("first diverging: r1: MISMATCH at step 7 (engine step 5): engine token")


def test_paged_waste_stays_below_one_partial_page_per_sequence(torch_run):
    engine, _ = torch_run
    series = compare_caches(engine)
    print("\n".join(summary_rows(series, sum(p.nbytes for p in engine.pools))))
    token_bytes, ps = engine.model.kv_bytes_per_token, engine.page_size
    for i, record in enumerate(engine.history):
        assert series["paged"].waste[i] <= paged_waste_bound(record, ps) * token_bytes
        assert series["paged"].used[i] <= series["cat"].used[i]  # shared prefixes are stored once
        assert series["cat"].waste[i] == 0 and series["contiguous"].reserved[i] >= series["cat"].reserved[i]
    assert series["paged"].peak_reserved < series["contiguous"].peak_reserved
    assert series["cat"].copied > 10 * series["cat"].peak_reserved  # torch.cat re-copies the history every step


# --------------------------------------------------------------------------- command line


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--prompt", "hi", "--attention", "cuda"], "invalid choice: 'cuda'"),
        (["--prompt", "hi", "--page-size", "0"], "--page-size: 0 must be a positive integer"),
        (["--prompt", "hi", "--num-pages", "two"], "--num-pages: 'two' is not an integer"),
        (["--max-new-tokens", "4"], "give at least one --prompt"),
        (["--prompt", "hi", "--num-pages", "1", "--max-new-tokens", "16"], "cannot hold 16 new tokens"),
        (["--prompt", "hi", "--num-pages", "3", "--max-new-tokens", "32"], "--num-pages 3 is too small"),
        (["--standard-batch", "--prompt", "hi"], "brings its own prompts"),
        (["--prompt", "hi", "--speculative", "-1"], "--speculative: -1 must be >= 0"),
        (["--prompt", "hi", "--speculative", "2", "--temperature", "1"], "verifies drafts against greedy tokens"),
        (["--standard-batch", "--repetitive"], "not both"),
        (["--repetitive", "--n", "2"], "--repetitive brings its own prompts"),
    ],
)
def test_cli_refuses_bad_input_naming_the_argument(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_answers_prints_the_counters_and_checks(loaded):
    # One thread, as every engine test here: with torch's default two threads on a loaded
    # machine the engine's and transformers' matrix products may split their sums
    # differently (measured once: max |dlogit| 1.35e-3 against the 1e-3 tolerance).
    cmd = [sys.executable, "-m", "pagedkv_engine", "--prompt", "What is a KV cache?", "--max-new-tokens", "3"]
    cmd += ["--threads", "1"]
    out = subprocess.run([*cmd, "--check", "--no-progress"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    for needle in (
        "[r0] A KV",
        "pages used:",
        "prefix hits:",
        "copy-on-write",
        "preemptions",
        "tokens/s",
        "PASS",
    ):
        assert needle in out.stdout, out.stdout


@pytest.mark.slow
def test_checkpoint_cache_gives_the_gguf_models_logits(tmp_path, monkeypatch):
    """The converted checkpoint and the GGUF file itself load to the same logits (slow:
    the GGUF conversion takes about 25 s on 2 cores)."""
    import torch
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv(weights.CACHE_ENV, str(tmp_path))
    fresh = weights.load()
    assert fresh.converted and fresh.path.parent == tmp_path
    gguf = weights.gguf_path()
    direct = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32).eval()
    ids = torch.tensor([oracle.chat_ids(fresh.tokenizer, "What is a KV cache?")])
    with torch.inference_mode():
        assert torch.equal(direct(ids).logits, fresh.model(ids).logits)
