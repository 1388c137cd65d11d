"""The oracle: transformers' own greedy ``generate``, compared token by token and logit by logit.

For every sequence the engine served, transformers generates from the same prompt,
one prompt at a time, without padding (``do_sample=False``, ``output_logits=True``).
Per generated token, in order:

1. the engine's logits must agree with transformers' within ``tol`` (max absolute
   difference over the vocabulary), else **mismatch**;
2. if transformers' top two logits are closer than ``tol``, two correct fp32
   implementations may pick different tokens: the comparison of this sequence ends
   here and is reported as a **tie** (as vLLM's tests do), never silently skipped;
3. the tokens must be equal, else **mismatch**.

A forked sample ``r.i`` (``i > 0``) starts with the ``i``-th most likely first token; it
is compared with ``generate`` from the prompt plus that token, and its first token
must be transformers' ``i``-th choice.

Tolerance (:data:`TOLERANCE` = ``1e-3``, absolute, on fp32 logits that span about
-30..+40): measured over the standard batch (:func:`standard_batch`), the largest
difference between the engine's logits and transformers' is 9e-5 on the torch path
(8 sequences x 16 tokens) and 6e-5 on the Triton path (8 x 3 tokens). The two differ
in attention arithmetic (paged torch, references or kernels vs SDPA over a contiguous cache),
in the number of rows of each matrix product (a batch of sequences vs one), and on the
Triton path in RoPE's last bits (angle reduced in fp64 vs formed in fp32). ``1e-3``
leaves a margin of 10x, the tests hold the observed maximum below ``tol / 5``, and the
planted bugs of :data:`pagedkv_lab.faults.ENGINE_FAULTS` move logits by 2 to 9.
Transformers' top-2 gaps in that batch: smallest 0.037, 5th percentile 0.11, so no
step is a tie; a tie would need a gap 37x smaller than the smallest seen.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pagedkv_engine.engine import Engine
from pagedkv_engine.scheduler import SamplingParams

__all__ = [
    "TOLERANCE",
    "Reference",
    "Verdict",
    "CheckReport",
    "hf_greedy",
    "compare_sequence",
    "check_engine",
    "SYSTEM_PROMPT",
    "standard_batch",
    "REPETITIVE_REQUESTS",
    "repetitive_batch",
    "chat_ids",
]

TOLERANCE = 1e-3


@dataclass
class Reference:
    """transformers' greedy continuation of at most ``max_new_tokens``: ``tokens`` and
    ``logits [steps, vocab]`` (fp32, raw, before any logits processor)."""

    tokens: list[int]
    logits: torch.Tensor
    seconds: float
    max_new_tokens: int


@torch.inference_mode()
def hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int, eos_token_id: int | None) -> Reference:
    """``hf_model.generate(prompt, do_sample=False)`` for one prompt, with raw per-step logits."""
    ids = torch.tensor([prompt_ids], dtype=torch.long)
    start = time.perf_counter()
    out = hf_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        temperature=None,
        top_p=None,
        top_k=None,
        eos_token_id=eos_token_id,
        pad_token_id=eos_token_id,
        output_logits=True,
        return_dict_in_generate=True,
    )
    seconds = time.perf_counter() - start
    return Reference(out.sequences[0, ids.shape[1] :].tolist(), torch.cat(out.logits).float(), seconds, max_new_tokens)


@dataclass
class Verdict:
    """The comparison of one sequence. ``status``: ``"equal"``, ``"tie"`` or ``"mismatch"``;
    ``step`` (index of the generated token), ``engine_step`` (the engine step that
    produced it) and the two tokens locate a tie or a mismatch."""

    seq_id: str
    status: str
    compared: int
    max_diff: float
    step: int | None = None
    engine_step: int | None = None
    engine_token: int | None = None
    hf_token: int | None = None
    gap: float | None = None
    reason: str = ""
    diffs: list[float] = field(default_factory=list)  # max |dlogit| of every compared token

    def line(self, tokenizer=None) -> str:
        def tok(t):
            if t is None:
                return "-"
            return f"{t} {tokenizer.decode([t])!r}" if tokenizer is not None else str(t)

        head = f"{self.seq_id}: {self.status.upper()}"
        if self.status == "equal":
            return f"{head}, {self.compared} tokens, max |dlogit| {self.max_diff:.1e}"
        return (
            f"{head} at step {self.step} (engine step {self.engine_step}): engine token {tok(self.engine_token)}, "
            f"transformers {tok(self.hf_token)}; {self.reason}"
        )


@dataclass
class CheckReport:
    """Verdicts of every sequence, the tolerance, and the top-2 gaps seen."""

    verdicts: list[Verdict]
    tol: float
    gaps: list[float] = field(default_factory=list)
    hf_seconds: float = 0.0
    hf_tokens: int = 0

    @property
    def ok(self) -> bool:
        return all(v.status != "mismatch" for v in self.verdicts)

    @property
    def max_diff(self) -> float:
        return max((v.max_diff for v in self.verdicts), default=0.0)

    @property
    def diffs(self) -> list[float]:
        """Max |logit difference| of every compared token, all sequences."""
        return [d for v in self.verdicts for d in v.diffs]

    @property
    def first_failure(self) -> Verdict | None:
        """The mismatch that happened first in the run (lowest engine step)."""
        bad = [v for v in self.verdicts if v.status == "mismatch"]
        return min(bad, key=lambda v: v.engine_step if v.engine_step is not None else 1 << 30) if bad else None

    def lines(self, tokenizer=None) -> list[str]:
        out = [v.line(tokenizer) for v in self.verdicts]
        ties = sum(v.status == "tie" for v in self.verdicts)
        verdict = "PASS" if self.ok else "FAIL"
        out.append(
            f"{verdict}: {len(self.verdicts)} sequences, {sum(v.compared for v in self.verdicts)} tokens compared, "
            f"max |dlogit| {self.max_diff:.1e} (tol {self.tol:g}), {ties} ties"
        )
        if not self.ok:
            out.append("first diverging: " + self.first_failure.line(tokenizer))
        return out


def compare_sequence(seq_id, engine_tokens, engine_logits, engine_steps, ref: Reference, tol: float) -> Verdict:
    """Compare one sequence's generated tokens and logits with transformers' (see the module docstring)."""
    steps = min(len(engine_tokens), len(ref.tokens))
    max_diff, diffs = 0.0, []
    for t in range(steps):
        d = float((engine_logits[t] - ref.logits[t]).abs().max())
        top2 = torch.topk(ref.logits[t], 2).values
        gap = float(top2[0] - top2[1])
        max_diff = max(max_diff, d)
        diffs.append(d)
        mine, theirs = engine_tokens[t], ref.tokens[t]
        status, reason = None, ""
        if d > tol:
            status, reason = "mismatch", f"max |dlogit| {d:.3g} > tol {tol:g}" + (" (same token)" * (mine == theirs))
        elif gap < tol:
            status, reason = "tie", f"transformers' top-2 logits differ by {gap:.2g} < tol {tol:g}: comparison ends"
        elif mine != theirs:
            status, reason = "mismatch", f"different tokens, max |dlogit| {d:.3g} <= tol, top-2 gap {gap:.3g}"
        if status:
            return Verdict(seq_id, status, t, max_diff, t, engine_steps[t], mine, theirs, gap, reason, diffs)
    if len(engine_tokens) != len(ref.tokens):

        def at(xs):
            return xs[steps] if steps < len(xs) else None

        reason = f"engine generated {len(engine_tokens)} tokens, transformers {len(ref.tokens)}"
        return Verdict(
            seq_id,
            "mismatch",
            steps,
            max_diff,
            steps,
            at(engine_steps),
            at(engine_tokens),
            at(ref.tokens),
            None,
            reason,
            diffs,
        )
    return Verdict(seq_id, "equal", steps, max_diff, diffs=diffs)


def _gaps(logits: torch.Tensor) -> list[float]:
    top2 = torch.topk(logits, 2, dim=-1).values
    return (top2[:, 0] - top2[:, 1]).tolist()


def check_engine(engine: Engine, hf_model, tol: float = TOLERANCE, references: dict | None = None) -> CheckReport:
    """Compare every sequence ``engine`` served (it must have ``record_logits=True``) with
    transformers' greedy ``generate`` on the same weights; return the report.

    ``references`` (``{prompt tuple: Reference}``) is consulted and filled, so several
    engine runs over the same prompts pay for the oracle once: a greedy reference of
    ``m`` tokens is also the reference of any ``k < m`` (its first ``k`` steps)."""
    if not engine.record_logits:
        raise ValueError("check_engine needs an Engine built with record_logits=True")
    references = {} if references is None else references
    verdicts, gaps = [], []
    hf_seconds, hf_tokens = 0.0, 0

    def oracle(prompt: list[int], max_new: int) -> Reference:
        nonlocal hf_seconds, hf_tokens
        key = tuple(prompt)
        ref = references.get(key)
        if ref is None or (ref.max_new_tokens < max_new and len(ref.tokens) == ref.max_new_tokens):
            ref = references[key] = hf_greedy(hf_model, prompt, max_new, engine.eos_token_id)
            hf_seconds += ref.seconds
            hf_tokens += len(ref.tokens)
        return Reference(ref.tokens[:max_new], ref.logits[:max_new], ref.seconds, max_new)

    for seq in engine.sequences.values():
        if seq.params.temperature != 0 or seq.params.ignore_eos:
            raise ValueError(f"{seq.seq_id}: only greedy sequences that stop at EOS are checked ({seq.params})")
        prompt, out = seq.token_ids[: seq.prompt_len], seq.output_ids
        sample = int(seq.seq_id.rpartition(".")[2]) if seq.params.n > 1 else 0
        if sample == 0:
            ref = oracle(prompt, seq.params.max_new_tokens)
            verdict = compare_sequence(seq.seq_id, out, seq.logits, seq.token_steps, ref, tol)
        else:
            # Sample i was forced to the i-th most likely first token: check that, then
            # compare the rest with generate() from the prompt plus that token.
            first = oracle(prompt, seq.params.max_new_tokens)
            want = torch.topk(first.logits[0], seq.params.n).indices.tolist()[sample]
            if out[0] != want:
                verdict = Verdict(
                    seq.seq_id,
                    "mismatch",
                    0,
                    0.0,
                    step=0,
                    engine_step=seq.token_steps[0],
                    engine_token=out[0],
                    hf_token=want,
                    reason=f"the forced first token is not transformers' choice number {sample + 1}",
                )
            else:
                ref = oracle([*prompt, out[0]], seq.params.max_new_tokens - 1)
                verdict = compare_sequence(seq.seq_id, out[1:], seq.logits[1:], seq.token_steps[1:], ref, tol)
                if verdict.step is not None:
                    verdict.step += 1
                verdict.compared += 1
        gaps += _gaps(torch.stack(seq.logits)) if seq.logits else []
        verdicts.append(verdict)
    return CheckReport(verdicts, tol, gaps, hf_seconds, hf_tokens)


# --------------------------------------------------------------------------- the standard batch

SYSTEM_PROMPT = (
    "You are a patient teaching assistant for a course on serving language models: attention, "
    "the key-value cache, paged memory with block tables, copy-on-write sharing and prefix caching. "
    "Answer in plain English, in one or two short sentences."
)

_LONG_PASSAGE = (
    "Read this and answer the question after it. A language model writes one token at a time and, "
    "for every new token, looks back at the keys and values of all earlier tokens. Engines keep them "
    "in a cache. Early systems reserved one large buffer per request, mostly never used. Paged caches "
    "split memory into small pages and give each request a table of its pages, like virtual memory. "
    "Question: why do paged caches waste less memory?"
)

#: (arrival step, user message, system prompt or None, n) of the standard batch.
STANDARD_REQUESTS = (
    (0, "What is a KV cache?", SYSTEM_PROMPT, 1),
    (0, "Name three primary colours, then say what you get when you mix red and blue.", None, 1),
    (1, _LONG_PASSAGE, None, 1),
    (2, "Tell me a very short story about a cat.", None, 2),
    (5, "Why does paging reduce memory waste?", SYSTEM_PROMPT, 1),
    (7, "Write a haiku about memory.", None, 1),
    (9, "Count from one to five.", None, 1),
)


#: (arrival step, user message) of the repetitive batch: answers that copy their prompt,
#: where prompt lookup's drafts are accepted often (speculative decoding's best case).
REPETITIVE_REQUESTS = (
    (
        0,
        "Copy this text exactly: A paged cache splits memory into pages of sixteen tokens. Each request gets a "
        "table of its pages. Freed pages go back to a shared pool, so no memory is reserved for tokens that never "
        "come.",
    ),
    (
        0,
        "Repeat exactly: one page, two pages, three pages, four pages, five pages, six pages, seven pages, "
        "eight pages.",
    ),
)


def repetitive_batch(tokenizer, max_new_tokens: int) -> dict[int, list[tuple[list[int], SamplingParams]]]:
    """The :data:`REPETITIVE_REQUESTS` as ``Engine.run`` arrivals (greedy, ``max_new_tokens``
    each): SmolLM2-135M-Instruct copies both texts, so with ``speculative=4`` nearly every
    draft is accepted (measured, 32 new tokens each: 46 of 47 drafts, 0.27 forwards per
    generated token)."""
    params = SamplingParams(max_new_tokens=max_new_tokens)
    arrivals: dict[int, list] = {}
    for step, user in REPETITIVE_REQUESTS:
        arrivals.setdefault(step, []).append((chat_ids(tokenizer, user), params))
    return arrivals


def chat_ids(tokenizer, user: str, system: str | None = None) -> list[int]:
    """Token ids of a one-turn chat, ending with the assistant's generation prompt."""
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
    out = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
    return list(out["input_ids"])


def standard_batch(tokenizer, max_new_tokens: int) -> dict[int, list[tuple[list[int], SamplingParams]]]:
    """The batch ``--check`` serves, as ``Engine.run`` arrivals: seven requests of
    different lengths arriving at different steps; two share a long system prompt
    (a prefix-cache hit), one is long enough to be prefilled in several chunks, one
    asks for two samples (a fork). Served with :data:`STANDARD_ENGINE` settings, the
    pool runs out while they decode, so at least one request is preempted and
    recomputed."""
    arrivals: dict[int, list] = {}
    for step, user, system, n in STANDARD_REQUESTS:
        params = SamplingParams(max_new_tokens=max_new_tokens, n=n)
        arrivals.setdefault(step, []).append((chat_ids(tokenizer, user, system), params))
    return arrivals


def standard_engine_args(max_new_tokens: int) -> dict:
    """Engine settings of the standard batch: page size 16, a 64-token step budget, and a
    pool just small enough that decoding runs out of pages (scaled to ``max_new_tokens``).
    One page more would spare every preemption at some lengths; one page fewer preempts
    a forked sample before its first divergent write, so the fork's copy-on-write never
    happens (measured for 3, 16 and 32 new tokens: preemptions and exactly one copy)."""
    return dict(page_size=16, max_num_batched_tokens=64, max_num_seqs=8, num_pages=15 + max_new_tokens // 3)
