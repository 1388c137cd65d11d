"""Which tokens run in the next step: continuous batching under a token budget.

Every step the scheduler fills a budget of ``max_num_batched_tokens`` tokens, in this
order (running sequences before new ones, oldest first, as vLLM does):

1. every decoding sequence gets one token (its last sampled one); when the pool has
   no page left for it, the newest decoding sequence is **preempted by recompute**:
   its pages are freed and it goes back to the front of the queue, to be prefilled
   again later from all its tokens (prompt and generated so far). With
   ``speculative > 0`` a greedy sequence also gets up to that many **drafts**
   (:func:`pagedkv_engine.speculative.propose_ngram`) after its token, as far as the
   budget allows once every later decoding sequence has its one token, and only if
   the pool keeps a page for each of those: drafts never cause a preemption;
2. a sequence whose prompt is partly computed gets its next **chunk** (chunked
   prefill), as much as the budget allows;
3. waiting requests are **admitted** while the budget lasts: the manager reuses the
   longest run of cached full pages (**prefix caching**, e.g. a shared system prompt)
   and reserves pages for the rest of the prompt.

Because an admission happens only when no earlier prompt is left half computed, a
prefix hit only ever names pages that were written in an earlier step or are written
earlier in the same step's layer-by-layer forward (writes precede attention in every
layer). Pages enter the prefix cache only when the engine commits them after the
forward that wrote them (:meth:`KVCacheManager.commit`), so a page is never shared
before it holds its K/V. Only decoding sequences are preempted (the newest first); a
prompt that is half computed keeps its pages until its prefill is done.

The scheduler only does bookkeeping: the engine runs the model and samples.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from enum import Enum

from pagedkv_engine.speculative import propose_ngram
from pagedkv_lib import KVCacheManager, OutOfBlocksError, checks

__all__ = ["SamplingParams", "Status", "Sequence", "Chunk", "Scheduler", "pages_needed"]


@dataclass(frozen=True)
class SamplingParams:
    """How to continue one prompt.

    * ``max_new_tokens``: tokens to generate (fewer if EOS comes first, unless ``ignore_eos``);
    * ``n``: parallel samples. The prompt is computed once and forked; the children
      share its pages (copy-on-write);
    * ``temperature``: 0 is greedy. With ``n > 1`` and temperature 0, child ``i`` starts
      with the ``i``-th most likely first token and continues greedily (a deterministic
      form of parallel sampling); with temperature > 0 each child samples with its own
      generator seeded from ``seed``.
    """

    max_new_tokens: int = 32
    n: int = 1
    temperature: float = 0.0
    seed: int = 0
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        for name in ("max_new_tokens", "n"):
            checks.check_positive_int(f"SamplingParams.{name}", getattr(self, name))
        if not (isinstance(self.temperature, int | float) and self.temperature >= 0):
            raise ValueError(f"SamplingParams.temperature={self.temperature!r} must be a number >= 0")


def pages_needed(prompt_len: int, max_new_tokens: int, n: int, page_size: int) -> int:
    """Pages one request may hold at its peak: the prompt's full pages once, and for each
    of ``n`` samples its partial prompt page plus room for ``max_new_tokens`` tokens."""
    full, tail = divmod(prompt_len, page_size)
    return full + n * -(-(tail + max_new_tokens) // page_size)


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """One sequence: a request's prompt and what it has generated.

    ``num_computed`` tokens have K/V in the pool; the rest of ``token_ids`` are still to
    run (the whole prompt after admission, one sampled token while decoding).
    ``pending_slots`` are the reserved slots of the prompt tokens not yet computed.
    """

    seq_id: str
    request_id: str
    token_ids: list[int]
    prompt_len: int
    params: SamplingParams
    arrival: int = 0
    status: Status = Status.WAITING
    num_computed: int = 0
    pending_slots: list[int] = field(default_factory=list)
    prefilling: bool = False
    # Filled by the engine, one entry per generated token.
    token_steps: list[int] = field(default_factory=list)
    logits: list = field(default_factory=list)
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prefix-cache hits over all admissions
    finish_reason: str | None = None

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]


@dataclass
class Chunk:
    """Tokens of one sequence in one step: ``token_ids`` at positions ``start ..`` written
    to ``slots``. ``is_prefill``: part of a prompt (or of a recompute); ``wants_logits``:
    the chunk ends the sequence's uncomputed tokens, so its last row is sampled.
    ``num_drafts``: a decode chunk's last sampled token is followed by that many draft
    tokens (speculative decoding); its last ``1 + num_drafts`` rows are sampled."""

    seq: Sequence
    start: int
    token_ids: list[int]
    slots: list[int]
    is_prefill: bool
    wants_logits: bool
    num_drafts: int = 0

    @property
    def num_logits(self) -> int:
        """Rows of this chunk whose next-token logits are wanted."""
        return 1 + self.num_drafts if self.wants_logits else 0


@dataclass
class Schedule:
    """One step's work: prefill chunks, verify chunks (a decode with drafts: several
    causal queries, attended like a prefill chunk), decode chunks (one query each), and
    what happened on the way."""

    prefills: list[Chunk] = field(default_factory=list)
    decodes: list[Chunk] = field(default_factory=list)
    verifies: list[Chunk] = field(default_factory=list)
    admitted: dict[str, int] = field(default_factory=dict)  # seq_id -> tokens served by the prefix cache
    preempted: list[str] = field(default_factory=list)

    @property
    def chunks(self) -> list[Chunk]:
        """Every chunk, in the order of the step's rows: prefills, verifies, decodes."""
        return self.prefills + self.verifies + self.decodes

    @property
    def num_tokens(self) -> int:
        return sum(len(c.token_ids) for c in self.chunks)


class Scheduler:
    """Waiting queue, running list and the step policy described in the module docstring."""

    def __init__(
        self, manager: KVCacheManager, max_num_batched_tokens: int, max_num_seqs: int, speculative: int = 0
    ) -> None:
        if max_num_seqs > max_num_batched_tokens:
            raise ValueError(
                f"max_num_seqs={max_num_seqs} > max_num_batched_tokens={max_num_batched_tokens}: "
                "every running sequence must be able to decode in one step"
            )
        self.manager = manager
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.speculative = speculative
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ------------------------------------------------------------------ one step

    def schedule(self) -> Schedule:
        """Plan the next step (allocating its slots); see the module docstring."""
        out = Schedule()
        budget = self.max_num_batched_tokens
        # 1. Decodes, oldest first; victims are taken from the newest end of the queue.
        queue = [s for s in self.running if not s.prefilling]
        while queue:
            seq = queue.pop(0)
            verify = self._speculate(seq, budget - len(queue), len(queue))
            if verify is not None:
                out.verifies.append(verify)
                budget -= len(verify.token_ids)
                continue
            slot = self._append_or_preempt(seq, queue, out)
            if slot is not None:
                pos = seq.num_computed
                out.decodes.append(Chunk(seq, pos, [seq.token_ids[pos]], [slot], False, True))
                budget -= 1
        # 2. Prompts already admitted and partly computed continue.
        for seq in self.running:
            if seq.prefilling and budget > 0:
                budget -= self._prefill_chunk(seq, budget, out)
        # 3. Admissions, first come first served, only while no prompt is left half done.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            if any(s.prefilling and s.pending_slots for s in self.running):
                break
            seq = self.waiting[0]
            try:
                cached, slots = self._admit(seq)
            except OutOfBlocksError:
                break  # wait for pages to be freed; never skip ahead of the queue
            self.waiting.popleft()
            seq.status, seq.prefilling = Status.RUNNING, True
            seq.num_computed = cached
            seq.num_cached_tokens += cached
            seq.pending_slots = slots
            self.running.append(seq)
            out.admitted[seq.seq_id] = cached
            budget -= self._prefill_chunk(seq, budget, out)
        return out

    def _admit(self, seq: Sequence) -> tuple[int, list[int]]:
        """Reserve pages for all of ``seq``'s tokens: ``(tokens found in the prefix cache,
        slots of the others)``. All or nothing: OutOfBlocksError leaves the manager as it was."""
        if self.manager.prefix_cache is not None:
            admission = self.manager.admit(seq.seq_id, seq.token_ids)
            return admission.num_cached_tokens, list(admission.slots)
        self.manager.add_sequence(seq.seq_id)
        try:
            return 0, self.manager.append_tokens(seq.seq_id, len(seq.token_ids), seq.token_ids)
        except OutOfBlocksError:
            self.manager.free_sequence(seq.seq_id)
            raise

    def _speculate(self, seq: Sequence, room: int, later: int) -> Chunk | None:
        """A verify chunk for ``seq``: its last sampled token and the drafts that fit in
        ``room`` tokens and in its remaining ``max_new_tokens`` (the model's token after
        the drafts comes on top), if the pool still has a page for each of the ``later``
        decoding sequences afterwards. None without speculation, for a sampling
        sequence, without drafts, or when the drafts' pages are needed elsewhere."""
        params = seq.params
        most = min(self.speculative, room - 1, params.max_new_tokens - seq.num_generated - 1)
        if most <= 0 or params.temperature != 0:
            return None
        drafts = propose_ngram(seq.token_ids, most)
        if not drafts:
            return None
        pos = seq.num_computed
        ids = [seq.token_ids[pos], *drafts]
        # Each later decode may need a block: drafts must not take it (nor preempt anyone).
        if self.manager.blocks_needed(seq.seq_id, len(ids)) + later > self.manager.num_allocatable:
            return None
        slots = self.manager.append_tokens(seq.seq_id, len(ids), ids)
        return Chunk(seq, pos, ids, slots, False, True, num_drafts=len(drafts))

    def _append_or_preempt(self, seq: Sequence, queue: list[Sequence], out: Schedule) -> int | None:
        """A slot for ``seq``'s next token, preempting the newest decoding sequences not yet
        scheduled (``queue``'s tail) until one is free; None if ``seq`` itself had to go."""
        while True:
            try:
                pos = seq.num_computed
                return self.manager.append_tokens(seq.seq_id, 1, [seq.token_ids[pos]])[0]
            except OutOfBlocksError:
                victim = queue.pop() if queue else seq
                self.preempt(victim)
                out.preempted.append(victim.seq_id)
                if victim is seq:
                    return None

    def _prefill_chunk(self, seq: Sequence, budget: int, out: Schedule) -> int:
        """Schedule up to ``budget`` of ``seq``'s pending prompt tokens; return how many."""
        n = min(budget, len(seq.pending_slots))
        if n == 0:
            return 0
        start = seq.num_computed
        slots, seq.pending_slots = seq.pending_slots[:n], seq.pending_slots[n:]
        done = not seq.pending_slots
        out.prefills.append(Chunk(seq, start, seq.token_ids[start : start + n], slots, True, done))
        return n

    # ------------------------------------------------------------------ after the step

    def advance(self, chunk: Chunk, rejected: int = 0) -> None:
        """The chunk's K/V are in the pool, all but its last ``rejected`` drafts (rolled
        back): move ``num_computed`` past the rest."""
        seq = chunk.seq
        seq.num_computed = chunk.start + len(chunk.token_ids) - rejected
        if chunk.is_prefill and not seq.pending_slots:
            seq.prefilling = False

    def preempt(self, seq: Sequence) -> None:
        """Free ``seq``'s pages and put it first in the queue; it will be prefilled again
        from all its tokens (recompute)."""
        assert not seq.prefilling, f"{seq.seq_id} is half prefilled; only decoding sequences are preempted"
        self.manager.free_sequence(seq.seq_id)
        self.running.remove(seq)
        seq.status, seq.num_computed, seq.pending_slots = Status.WAITING, 0, []
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def fork(self, parent: Sequence, children: list[Sequence]) -> None:
        """Children share every page of ``parent`` (nothing is copied until one writes)."""
        at = self.running.index(parent) + 1
        for child in children:
            self.manager.fork(parent.seq_id, child.seq_id)
            child.status = Status.RUNNING
        self.running[at:at] = children

    def finish(self, seq: Sequence, reason: str) -> None:
        self.manager.free_sequence(seq.seq_id)
        self.running.remove(seq)
        seq.status, seq.finish_reason = Status.FINISHED, reason
