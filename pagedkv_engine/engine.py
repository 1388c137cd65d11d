"""The engine: requests in, tokens out, one scheduled step at a time.

Each :meth:`Engine.step`:

1. the scheduler plans the step (:mod:`pagedkv_engine.scheduler`) and the manager
   reserves its slots;
2. the manager has already made its block copies (copy-on-write of a partly filled
   shared page, offload of an evicted cached page, restore of a secondary hit) while
   planning, through :meth:`Engine._copy`: the attention path's block copy (the Triton
   kernel ``kernels.copy_paged_blocks`` or its torch reference), every layer of the one
   ``[layers, pages, ...]`` tensor behind the per-layer pools in one call, before
   anything is written;
3. the model runs the step's tokens; each layer writes its K/V into its pool, then
   attends (:mod:`pagedkv_engine.model`);
4. speculative decoding (``speculative > 0``, :mod:`pagedkv_engine.speculative`): a
   verify chunk's drafts are checked against the model's greedy tokens, and the
   rejected ones are rolled back (:meth:`KVCacheManager.rollback`): their slots are
   released before anything commits, reads or shares them;
5. :meth:`Engine._mark_written`: the written (and accepted) tokens become shareable;
6. sampling; forks for ``n > 1``; finished sequences free their pages. With
   speculation the manager's :meth:`~KVCacheManager.check_integrity` runs after every step.

Everything the notebook and the tests look at afterwards is recorded: per-step block
tables (:attr:`Engine.history`), counters (:attr:`Engine.stats`), and per generated
token the step it came from and, with ``record_logits=True``, its logits.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pagedkv_engine.attention import make_attention
from pagedkv_engine.model import LlamaModel, StepInput
from pagedkv_engine.parts import EngineParts
from pagedkv_engine.scheduler import Chunk, SamplingParams, Schedule, Scheduler, Sequence, Status, pages_needed
from pagedkv_engine.speculative import num_accepted, stats_line
from pagedkv_lib import PagedKVPool, checks, runtime
from pagedkv_lib.block_copy import copy_blocks
from pagedkv_lib.formats import pad_block_tables
from pagedkv_lib.indexing import check_page_size

__all__ = ["Engine", "EngineStats", "StepRecord"]


@dataclass
class StepRecord:
    """What one step did: the live sequences' block tables (after scheduling), ``lens``
    (tokens each table spans: a prompt's pages are reserved at admission) and
    ``computed`` (tokens with K/V in the pool once the step ran), tokens by kind, page
    copies, admissions with their prefix-cache hits (tokens) and preemptions.
    ``num_decode_tokens`` counts every decode-side token, drafts included;
    ``drafts`` maps each verified sequence to ``(proposed, accepted)`` drafts."""

    step: int
    tables: dict[str, list[int]]
    lens: dict[str, int]
    computed: dict[str, int]
    num_prefill_tokens: int
    num_decode_tokens: int
    copies: list[tuple[int, int, int]]
    admitted: dict[str, int]
    preempted: list[str]
    drafts: dict[str, tuple[int, int]] = field(default_factory=dict)


@dataclass
class EngineStats:
    """Counters over the run; ``seconds`` is wall time inside :meth:`Engine.step`."""

    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens submitted
    computed_prefill_tokens: int = 0  # prompt (and recompute) tokens actually run
    prefix_hit_tokens: int = 0
    prefix_hit_sequences: int = 0
    generated_tokens: int = 0
    copies: int = 0
    preemptions: int = 0
    peak_pages: int = 0
    seconds: float = 0.0
    drafts_proposed: int = 0  # speculative decoding
    drafts_accepted: int = 0
    sampled_chunks: int = 0  # (sequence, forward) pairs that produced tokens

    @property
    def tokens_per_second(self) -> float:
        return self.generated_tokens / self.seconds if self.seconds else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted drafts over proposed drafts (0 without drafts)."""
        return self.drafts_accepted / self.drafts_proposed if self.drafts_proposed else 0.0

    @property
    def forwards_per_token(self) -> float:
        """Forwards a sequence took per token it generated, over all sequences: 1 for
        plain decoding (a fork's first tokens share one), below 1 with accepted drafts."""
        return self.sampled_chunks / self.generated_tokens if self.generated_tokens else 0.0


class Engine:
    """A small paged-KV inference engine for transformers' ``LlamaForCausalLM`` weights.

    Args:
        hf_model: a transformers Llama model (fp32); its weights are read from it (the
            projections as row-major copies, :func:`pagedkv_engine.model.transposed`).
        attention: ``"torch"`` (batched torch on the CPU), ``"reference"`` (the suite's
            Python references) or ``"triton"`` (the suite's kernels), or a backend
            object with ``write``/``prefill``/``decode``.
        num_pages, page_size: the paged pool (one ``PagedKVPool`` per layer, all indexed
            by the same page ids of one ``KVCacheManager``).
        max_num_batched_tokens: token budget of one step (chunked prefill fills it).
        max_num_seqs: most sequences running at once.
        prefix_cache: share full prompt pages across requests.
        offload_blocks: blocks of a secondary pool under the prefix cache (0: none):
            a cached page evicted from the pool is copied there and restored on a hit
            (:mod:`pagedkv_lib.offload`); counters in ``manager.secondary.stats``.
        record_logits: keep every generated token's logits (``[vocab]`` fp32 each).
        speculative: drafts per step and greedy sequence, proposed by prompt lookup
            (:mod:`pagedkv_engine.speculative`) and verified in the step's one forward;
            0 (default) decodes one token per step.
        eos_token_id: ends a sequence (default: the model's generation config).
        parts: the engine's replaceable parts (:class:`~pagedkv_engine.parts.EngineParts`:
            position builder, manager, attention wrapper); the correct ones by default.
            A planted bug is a replacement part: ``parts=pagedkv_lab.faults.engine_parts({...})``.

    Raises ValueError naming the argument before anything is allocated.
    """

    def __init__(
        self,
        hf_model,
        attention="torch",
        *,
        num_pages: int = 256,
        page_size: int = 16,
        max_num_batched_tokens: int = 256,
        max_num_seqs: int = 16,
        prefix_cache: bool = True,
        offload_blocks: int = 0,
        record_logits: bool = False,
        speculative: int = 0,
        eos_token_id: int | None = None,
        parts: EngineParts | None = None,
    ) -> None:
        check_page_size(page_size, owner="Engine")
        for name, value in (
            ("num_pages", num_pages),
            ("max_num_batched_tokens", max_num_batched_tokens),
            ("max_num_seqs", max_num_seqs),
        ):
            checks.check_positive_int(name, value, "Engine")
        if not checks.is_int(speculative) or speculative < 0:
            raise ValueError(f"Engine: speculative={speculative!r} must be an int >= 0 (drafts per step)")
        if max_num_seqs > max_num_batched_tokens:
            raise ValueError(
                f"Engine: max_num_seqs={max_num_seqs} > max_num_batched_tokens={max_num_batched_tokens}: "
                "every running sequence must be able to decode in one step"
            )
        self.parts = EngineParts() if parts is None else parts
        cfg = hf_model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        if isinstance(attention, str):
            rope = getattr(cfg, "rope_parameters", None) or {"rope_theta": cfg.rope_theta}
            attention = make_attention(attention, head_dim, rope["rope_theta"])
        attention = self.parts.attention(attention)
        device = runtime.device() if attention.name == "triton" else "cpu"
        self.model = LlamaModel(hf_model, attention, device)
        self.device = self.model.device
        self.page_size = page_size
        checks.check_int("offload_blocks", offload_blocks, owner="Engine")
        self.pools = [
            PagedKVPool(num_pages, page_size, self.model.num_kv_heads, head_dim, self.model.dtype, device=device)
            for _ in range(self.model.num_layers)
        ]
        # One [layers, pages, 2, page_size, heads, head_dim] tensor behind the per-layer
        # pools, so a block copy moves a block of every layer in one launch.
        self.kv = torch.stack([pool.cache for pool in self.pools])
        for i, pool in enumerate(self.pools):
            pool.cache = self.kv[i]
        self.secondary_kv = self.kv.new_zeros((self.kv.shape[0], offload_blocks, *self.kv.shape[2:]))
        self._copy_blocks = getattr(attention, "copy_blocks", copy_blocks)
        self.manager = self.parts.manager(
            num_pages,
            page_size,
            prefix_cache=prefix_cache,
            copy_fn=self._copy,
            secondary_blocks=offload_blocks,
            block_bytes=self.kv[:, 0].nbytes,
        )
        self.speculative = speculative
        self.scheduler = Scheduler(self.manager, max_num_batched_tokens, max_num_seqs, speculative)
        self.record_logits = record_logits
        gen_eos = getattr(getattr(hf_model, "generation_config", None), "eos_token_id", None)
        self.eos_token_id = eos_token_id if eos_token_id is not None else (gen_eos or cfg.eos_token_id)
        self.max_len = cfg.max_position_embeddings
        self.sequences: dict[str, Sequence] = {}
        self.history: list[StepRecord] = []
        self.stats = EngineStats()
        self._num_requests = 0
        self._step = 0

    # ------------------------------------------------------------------ requests

    @property
    def page_bytes(self) -> int:
        """Bytes of one page over all layers (K and V)."""
        return sum(pool.cache[0].nbytes for pool in self.pools)

    def add_request(self, prompt_ids, params: SamplingParams | None = None, request_id: str | None = None) -> str:
        """Queue a prompt (token ids); return its request id (``r0``, ``r1``, ...).

        Sequences are named ``<request_id>`` (``n == 1``) or ``<request_id>.<i>``. Raises
        ValueError when the request can never fit the pool or the model."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("prompt_ids is empty")
        if max(prompt) >= self.model.vocab_size or min(prompt) < 0:
            raise ValueError(f"prompt_ids must be token ids in [0, {self.model.vocab_size})")
        if len(prompt) + params.max_new_tokens > self.max_len:
            raise ValueError(
                f"prompt of {len(prompt)} tokens + max_new_tokens={params.max_new_tokens} exceeds the model's "
                f"{self.max_len} positions"
            )
        need = pages_needed(len(prompt), params.max_new_tokens, params.n, self.page_size)
        if need > self.manager.num_blocks:
            raise ValueError(
                f"this request needs up to {need} pages (prompt {len(prompt)} tokens + {params.max_new_tokens} new, "
                f"n={params.n}, page_size={self.page_size}) but the pool has num_pages={self.manager.num_blocks}"
            )
        request_id = request_id or f"r{self._num_requests}"
        if "." in request_id:
            raise ValueError(f"request_id={request_id!r} must not contain '.' (samples are named <request_id>.<i>)")
        if request_id in self.sequences or any(s.request_id == request_id for s in self.sequences.values()):
            raise ValueError(f"request_id={request_id!r} is already used")
        self._num_requests += 1
        seq_id = request_id if params.n == 1 else f"{request_id}.0"
        seq = Sequence(seq_id, request_id, prompt, len(prompt), params, arrival=self._step)
        self.sequences[seq_id] = seq
        self.stats.prompt_tokens += len(prompt)
        self.scheduler.add(seq)
        return request_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ------------------------------------------------------------------ one step

    def step(self) -> Schedule:
        """Run one scheduled step (see the module docstring); return its schedule."""
        start = time.perf_counter()
        plan = self.scheduler.schedule()
        copies = self.manager.pop_copies()  # made already, through _copy, while planning
        rows = self._forward(plan)
        accepted = [self._verify(c, r) if c.num_drafts else 0 for c, r in zip(plan.chunks, rows)]
        for chunk, n in zip(plan.chunks, accepted):
            self.scheduler.advance(chunk, rejected=chunk.num_drafts - n)
            self._mark_written(chunk.seq)
        self._record(plan, copies)
        for chunk, chunk_rows, n in zip(plan.chunks, rows, accepted):
            if chunk.num_drafts:
                self._emit(chunk.seq, chunk_rows[: n + 1])
            elif chunk.wants_logits:
                self._sample(chunk.seq, chunk_rows[0])
        if self.speculative:
            self.manager.check_integrity()
        self._step += 1
        self.stats.steps += 1
        self.stats.seconds += time.perf_counter() - start
        return plan

    def _forward(self, plan: Schedule) -> list[torch.Tensor]:
        """Run the step's tokens; return each chunk's logits rows (``[num_logits, vocab]``
        fp32 on the CPU, empty for a chunk that is not sampled), in chunk order."""
        if not plan.chunks:
            return []
        logits = self.model.forward(self._prepare(plan), [pool.cache for pool in self.pools])
        return list(logits.float().cpu().split([c.num_logits for c in plan.chunks]))

    def _verify(self, chunk: Chunk, rows: torch.Tensor) -> int:
        """Accept the leading drafts of ``chunk`` that equal the model's greedy tokens
        (``rows`` are the logits after its last sampled token and after each draft) and
        roll the others back; return how many were accepted. The table then spans exactly
        the accepted tokens, before anything is committed."""
        accepted = num_accepted(chunk.token_ids[1:], rows.argmax(dim=-1).tolist())
        self.manager.rollback(chunk.seq.seq_id, chunk.num_drafts - accepted)
        self.stats.drafts_proposed += chunk.num_drafts
        self.stats.drafts_accepted += accepted
        return accepted

    def _emit(self, seq: Sequence, rows: torch.Tensor) -> None:
        """Append a verified chunk's tokens: its accepted drafts, then the model's token
        after them (each the greedy pick of its row), until the sequence finishes."""
        self.stats.sampled_chunks += 1
        for row in rows:
            self._append_token(seq, int(torch.argmax(row)), row)
            if seq.status is Status.FINISHED:
                return

    def _copy(self, kind: str, src: list[int], dst: list[int], num_tokens: list[int]) -> None:
        """The manager's copy function (:data:`pagedkv_lib.offload.COPY_KINDS`): the
        attention path's block copy, every layer at once, before the step writes."""
        pools = {
            "cow": (self.kv, None),
            "offload": (self.kv, self.secondary_kv),
            "restore": (self.secondary_kv, self.kv),
        }
        cache, dst_cache = pools[kind]
        ids = [torch.tensor(x, dtype=torch.int64, device=self.kv.device) for x in (src, dst, num_tokens)]
        self._copy_blocks(cache, *ids, dst_cache=dst_cache)

    def _mark_written(self, seq: Sequence) -> None:
        """The one place where ``seq``'s tokens become shareable: every layer's K/V of its
        first ``seq.num_computed`` tokens are in the pools now."""
        self.manager.commit(seq.seq_id, num_tokens=seq.num_computed)

    def _prepare(self, plan: Schedule) -> StepInput:
        """Flatten the schedule into the model's tensors (prefill rows first)."""
        ids, positions, slots, logit_rows = [], [], [], []
        for chunk in plan.chunks:
            ids += chunk.token_ids
            positions += self.parts.positions(chunk)
            slots += chunk.slots
            logit_rows += range(len(ids) - chunk.num_logits, len(ids))
        ragged = plan.prefills + plan.verifies  # several queries per sequence: the prefill path
        qo = [0]
        for chunk in ragged:
            qo.append(qo[-1] + len(chunk.token_ids))

        def tables(chunks):
            return pad_block_tables([self.manager.block_table(c.seq.seq_id) for c in chunks]).to(self.device)

        def lens(chunks):
            return torch.tensor([c.start + len(c.token_ids) for c in chunks], dtype=torch.int64, device=self.device)

        def long(x):
            return torch.tensor(x, dtype=torch.int64, device=self.device)

        return StepInput(
            input_ids=long(ids),
            positions=long(positions),
            slot_mapping=long(slots),
            num_prefill_tokens=qo[-1],
            qo_indptr=long(qo),
            prefill_block_tables=tables(ragged),
            prefill_seq_lens=lens(ragged),
            decode_block_tables=tables(plan.decodes),
            decode_seq_lens=lens(plan.decodes),
            logit_rows=long(logit_rows),
        )

    def _record(self, plan: Schedule, copies) -> None:
        live = self.manager.sequences
        record = StepRecord(
            step=self._step,
            tables={s: self.manager.block_table(s) for s in live},
            lens={s: self.manager.seq_len(s) for s in live},
            computed={s: self.sequences[s].num_computed for s in live},
            num_prefill_tokens=sum(len(c.token_ids) for c in plan.prefills),
            num_decode_tokens=sum(len(c.token_ids) for c in plan.verifies + plan.decodes),
            copies=list(copies),
            admitted=dict(plan.admitted),
            preempted=list(plan.preempted),
            drafts={c.seq.seq_id: (c.num_drafts, c.seq.num_computed - c.start - 1) for c in plan.verifies},
        )
        self.history.append(record)
        s = self.stats
        s.computed_prefill_tokens += record.num_prefill_tokens
        s.prefix_hit_tokens += sum(plan.admitted.values())
        s.prefix_hit_sequences += sum(1 for v in plan.admitted.values() if v)
        s.copies += len(copies)
        s.preemptions += len(plan.preempted)
        held = {p for t in record.tables.values() for p in t}
        s.peak_pages = max(s.peak_pages, len(held))

    # ------------------------------------------------------------------ sampling

    def _sample(self, seq: Sequence, row: torch.Tensor) -> None:
        params = seq.params
        self.stats.sampled_chunks += 1
        if params.n > 1 and seq.num_generated == 0:  # only the parent has generated nothing
            self._fork(seq, row)
            return
        self._append_token(seq, self._pick(seq, row), row)

    def _pick(self, seq: Sequence, row: torch.Tensor) -> int:
        if seq.params.temperature == 0:
            return int(torch.argmax(row))
        sample = int(seq.seq_id.rpartition(".")[2]) if "." in seq.seq_id else 0
        gen = torch.Generator().manual_seed(seq.params.seed * 1_000_003 + sample * 10_007 + seq.num_generated)
        probs = torch.softmax(row / seq.params.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=gen))

    def _fork(self, parent: Sequence, row: torch.Tensor) -> None:
        """The prompt is computed: fork ``n - 1`` children that share its pages, then give
        each sample its first token (the ``i``-th most likely one when greedy)."""
        n = parent.params.n
        children = []
        for i in range(1, n):
            child = Sequence(
                f"{parent.request_id}.{i}",
                parent.request_id,
                list(parent.token_ids),
                parent.prompt_len,
                parent.params,
                arrival=parent.arrival,
                num_computed=parent.num_computed,
                num_cached_tokens=parent.num_cached_tokens,
            )
            self.sequences[child.seq_id] = child
            children.append(child)
        self.scheduler.fork(parent, children)
        greedy_firsts = torch.topk(row, n).indices.tolist()
        for i, seq in enumerate([parent, *children]):
            token = greedy_firsts[i] if parent.params.temperature == 0 else self._pick(seq, row)
            self._append_token(seq, token, row)

    def _append_token(self, seq: Sequence, token: int, row: torch.Tensor) -> None:
        seq.token_ids.append(token)
        seq.token_steps.append(self._step)
        if self.record_logits:
            seq.logits.append(row)
        self.stats.generated_tokens += 1
        if token == self.eos_token_id and not seq.params.ignore_eos:
            self.scheduler.finish(seq, "eos")
        elif seq.num_generated >= seq.params.max_new_tokens:
            self.scheduler.finish(seq, "length")

    # ------------------------------------------------------------------ driving

    def run(self, arrivals: dict[int, list] | None = None, progress: bool = False) -> dict[str, Sequence]:
        """Step until every request (and every one in ``arrivals``, ``{step: [(prompt_ids,
        params), ...]}``, added when the engine reaches that step) has finished; return
        the sequences by id. ``progress`` shows a tqdm bar of generated tokens."""
        arrivals = {k: list(v) for k, v in (arrivals or {}).items()}
        bar = None
        if progress:
            from tqdm.auto import tqdm

            total = sum(s.params.max_new_tokens * s.params.n for s in self.sequences.values())
            total += sum(p.max_new_tokens * p.n for reqs in arrivals.values() for _, p in reqs)
            bar = tqdm(total=total, unit="tok", desc="generating")
        while self.has_unfinished() or any(k >= self._step for k in arrivals):
            for prompt, params in arrivals.pop(self._step, []):
                self.add_request(prompt, params)
            before = self.stats.generated_tokens
            self.step()
            if bar is not None:
                bar.update(self.stats.generated_tokens - before)
        if bar is not None:
            bar.close()
        self.manager.check_integrity()
        return self.sequences

    def outputs(self) -> dict[str, list[int]]:
        """Generated token ids per sequence id."""
        return {s: seq.output_ids for s, seq in self.sequences.items()}

    def finished(self) -> bool:
        return all(s.status is Status.FINISHED for s in self.sequences.values())

    def request_ids_in_order(self) -> list[str]:
        return list(dict.fromkeys(s.request_id for s in self.sequences.values()))


def default_stats_lines(engine: Engine) -> list[str]:
    """Human-readable counters for the CLI and the notebook."""
    s = engine.stats
    lines = [
        f"pages used: {s.peak_pages} of {engine.manager.num_blocks} at the peak "
        f"(page_size {engine.page_size}, {engine.page_bytes / 2**20:.2f} MiB per page over all layers)",
        f"prefix hits: {s.prefix_hit_tokens} prompt tokens from the cache in {s.prefix_hit_sequences} admissions",
        f"copy-on-write page copies: {s.copies}",
        f"preemptions (recompute): {s.preemptions}",
        f"generated {s.generated_tokens} tokens in {s.steps} steps, {s.seconds:.1f} s wall, "
        f"{s.tokens_per_second:.1f} tokens/s",
    ]
    if engine.speculative:  # only with --speculative: the stored outputs without it stay as they are
        lines.insert(-1, stats_line(s, engine.speculative))
    off = engine.manager.secondary
    if off is not None:  # only with --offload-blocks: the stored outputs without it stay as they are
        o = off.stats
        lines.insert(
            3,
            f"offload: {o.offloads} blocks offloaded, {o.restores} restored, {o.drops} dropped, "
            f"{o.bytes_moved / 2**20:.2f} MiB moved; {s.computed_prefill_tokens} prefill tokens computed",
        )
    return lines
