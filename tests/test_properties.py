"""Property tests (hypothesis): random interleavings of add / append / fork / free /
prefix-admit against an independent model, plus loop-vs-vectorized references and
format round trips on random inputs.

The model keeps every live sequence's token ids. A token's K/V is a function of its
whole prefix (like a real model's), so a page served from the prefix cache or shared
by a fork must hold exactly the values the model expects. Sequences commit all, some
or none of what they wrote, and some admissions are freed before anything is written:
a page the cache serves must have been written all the same. All runs are derandomized.
"""

import math

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from pagedkv_lib import (
    KVCacheManager,
    OutOfBlocksError,
    PagedKVPool,
    RingWindow,
    block_table_to_csr,
    csr_seq_lens,
    csr_to_block_table,
    locate,
    locate_pow2,
    pad_block_tables,
)
from pagedkv_lib.formats import scatter_pages
from pagedkv_lib.reference import (
    append_paged_kv,
    append_paged_kv_loop,
    gather_paged_kv,
    gather_paged_kv_loop,
    paged_decode_attention,
    paged_decode_attention_loop,
    paged_prefill_attention,
    paged_prefill_attention_loop,
)

PAGE_SIZES = [1, 2, 5, 16, 64]
HEAD_DIMS = [4, 8, 80]
MAX_LIVE = 6


def rolling(prev: int, token: int) -> int:
    """A prefix fingerprint: equal prefixes <=> (almost surely) equal values."""
    return (prev * 1_000_003 + token + 1) % (2**31 - 1)


class ManagerMachine(RuleBasedStateMachine):
    """Drive a KVCacheManager with a real pool; check it against a plain model."""

    @initialize(
        ps=st.sampled_from(PAGE_SIZES),
        layout=st.sampled_from(["NHD", "HND"]),
        heads=st.sampled_from([1, 2]),
        dim=st.sampled_from(HEAD_DIMS),
        num_blocks=st.integers(3, 24),
        prefix_cache=st.sampled_from([True, True, False]),
    )
    def setup(self, ps, layout, heads, dim, num_blocks, prefix_cache):
        self.ps, self.layout, self.num_blocks = ps, layout, num_blocks
        self.m = KVCacheManager(num_blocks, ps, prefix_cache=prefix_cache)
        self.pool = PagedKVPool(num_blocks, ps, heads, dim, dtype=torch.float32, layout=layout)
        self.pool_loop = PagedKVPool(num_blocks, ps, heads, dim, dtype=torch.float32, layout=layout)
        self.pattern = torch.arange(heads * dim, dtype=torch.float32).view(heads, dim) / 64
        self.tokens: dict[int, list[int]] = {}  # the model: token ids of every live sequence
        self.prints: dict[int, list[int]] = {}  # rolling fingerprint of every prefix
        self.history: list[list[int]] = [[0, 1, 2, 0, 1, 2, 0, 1]]  # token lists to draw prompts from
        self.next_id = 0

    # -------------------------------------------------------------- model helpers

    def kv_of(self, prints):
        base = (torch.tensor(prints, dtype=torch.int64) % 9973).to(torch.float32)
        k = base[:, None, None] + self.pattern
        return k, -0.5 * k - 1.0

    def extend_model(self, seq, tokens):
        prints = self.prints[seq]
        for t in tokens:
            prints.append(rolling(prints[-1] if prints else 0, t))
        self.tokens[seq].extend(tokens)

    def observable(self):
        """Everything a failed call must leave as it was (LRU order and lookup counters too)."""
        m, cache = self.m, self.m.prefix_cache
        cached = [b for b in range(self.num_blocks) if cache is not None and b in cache]
        return (
            {s: (m.seq_len(s), m.committed_len(s), m.block_table(s)) for s in m.sequences},
            [m.refcount(b) for b in range(self.num_blocks)],
            m.num_free,
            cached,
            (cache.evictable_blocks(), cache.queries, cache.hits) if cache else None,
        )

    def tables_naming(self, page):
        return [s for s in self.m.sequences if page in self.m.block_table(s)]

    def shared_pages(self):
        """Pages with refcount > 1 and their current contents in both pools."""
        return {
            b: (self.pool.cache[b].clone(), self.pool_loop.cache[b].clone())
            for b in range(self.num_blocks)
            if self.m.refcount(b) > 1
        }

    def write(self, seq, slots, start, shared_before, data):
        """Apply pending copies, write the model's K/V of positions start.. to slots, then
        commit all, some or none of the sequence (all of it is written by now)."""
        # Every slot handed out must lie in a page only this sequence's table names.
        for slot in slots:
            assert self.tables_naming(slot // self.ps) == [seq], (slot, self.tables_naming(slot // self.ps))
        copies = self.m.pop_copies()
        for _src, dst, rows in copies:
            assert 0 < rows <= self.ps and dst in self.m.block_table(seq)
        self.pool.copy_blocks(copies)
        self.pool_loop.copy_blocks(copies)
        k, v = self.kv_of(self.prints[seq][start:])
        append_paged_kv(k, v, self.pool.cache, slots, self.layout)
        append_paged_kv_loop(k, v, self.pool_loop.cache, slots, self.layout)
        # No write (or copy) changed a page that was shared before the call.
        for b, (page, page_loop) in shared_before.items():
            assert torch.equal(self.pool.cache[b], page), f"shared page {b} was written"
            assert torch.equal(self.pool_loop.cache[b], page_loop)
        n = self.m.seq_len(seq)
        commit = data.draw(st.sampled_from(["all", "some", "none"]))
        if commit == "all":
            self.m.commit(seq)
        elif commit == "some":
            self.m.commit(seq, data.draw(st.integers(0, n)))

    # -------------------------------------------------------------- rules

    @precondition(lambda self: len(self.tokens) < MAX_LIVE)
    @rule()
    def add(self):
        seq, self.next_id = self.next_id, self.next_id + 1
        self.m.add_sequence(seq)
        self.tokens[seq], self.prints[seq] = [], []

    @precondition(lambda self: self.tokens)
    @rule(data=st.data(), tracked=st.booleans())
    def append(self, data, tracked):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self._append(seq, data, tracked)

    def _append(self, seq, data, tracked):
        n = data.draw(st.one_of(st.integers(0, self.ps + 1), st.integers(0, 3 * self.ps)))
        tokens = data.draw(st.lists(st.integers(0, 2), min_size=n, max_size=n))
        before, shared = self.observable(), self.shared_pages()
        start = self.m.seq_len(seq)
        try:
            slots = self.m.append_tokens(seq, n, tokens if tracked else None)
        except OutOfBlocksError:
            assert self.observable() == before and self.m.pop_copies() == []
            return
        assert len(slots) == n and len(set(slots)) == n
        self.extend_model(seq, tokens)
        self.write(seq, slots, start, shared, data)
        self.history.append(list(self.tokens[seq]))

    @precondition(lambda self: self.tokens and len(self.tokens) < MAX_LIVE)
    @rule(data=st.data())
    def fork(self, data):
        self._fork(data)

    def _fork(self, data):
        parent = data.draw(st.sampled_from(sorted(self.tokens)))
        child, self.next_id = self.next_id, self.next_id + 1
        free_before = self.m.num_free
        self.m.fork(parent, child)
        assert self.m.num_free == free_before and self.m.block_table(child) == self.m.block_table(parent)
        self.tokens[child], self.prints[child] = list(self.tokens[parent]), list(self.prints[parent])
        return parent, child

    @precondition(lambda self: self.tokens and len(self.tokens) < MAX_LIVE)
    @rule(data=st.data(), child_writes=st.booleans(), tracked=st.booleans())
    def fork_then_write(self, data, child_writes, tracked):
        # The case copy-on-write exists for: a fork, then a write into the shared tail.
        parent, child = self._fork(data)
        self._append(child if child_writes else parent, data, tracked)

    @precondition(lambda self: self.tokens)
    @rule(data=st.data())
    def free(self, data):
        seq = data.draw(st.sampled_from(sorted(self.tokens)))
        self.m.free_sequence(seq)
        del self.tokens[seq], self.prints[seq]

    @precondition(lambda self: self.m.prefix_cache is not None and len(self.tokens) < MAX_LIVE)
    @rule(data=st.data())
    def admit(self, data):
        self._admit(data)

    @precondition(lambda self: self.m.prefix_cache is not None and self.tokens)
    @rule(data=st.data())
    def recycle(self, data):
        # Free a sequence (its cached blocks become evictable), then admit a new prompt:
        # under pressure this is where LRU eviction happens.
        self.free(data)
        self._admit(data)

    @precondition(lambda self: self.m.prefix_cache is not None and len(self.tokens) < MAX_LIVE)
    @rule(data=st.data())
    def abandon(self, data):
        # Admitted, then freed before its K/V is written (cancelled, preempted): its pages
        # hold stale values, so none of them may enter the cache.
        prompt = self._prompt(data)
        if not prompt:
            return
        seq, self.next_id = self.next_id, self.next_id + 1
        entries = len(self.m.prefix_cache)
        try:
            self.m.admit(seq, prompt)
        except OutOfBlocksError:
            return
        self.m.free_sequence(seq)
        assert len(self.m.prefix_cache) <= entries  # evictions only, nothing new

    def _prompt(self, data):
        """A prompt that often shares a prefix with something seen before."""
        base = data.draw(st.sampled_from(self.history[-8:]))
        whole_blocks = len(base) // self.ps * self.ps
        cut = data.draw(
            st.sampled_from([len(base), whole_blocks, max(whole_blocks - self.ps, 0)]) | st.integers(0, len(base))
        )
        tail = data.draw(st.lists(st.integers(0, 2), max_size=self.ps + 1))
        return base[:cut] + tail

    def _admit(self, data):
        prompt = self._prompt(data)
        if not prompt:
            return
        seq, self.next_id = self.next_id, self.next_id + 1
        before, shared = self.observable(), self.shared_pages()
        try:
            adm = self.m.admit(seq, prompt)
        except OutOfBlocksError:
            assert self.observable() == before and seq not in self.m.sequences
            return
        c = adm.num_cached_tokens
        assert c % self.ps == 0 and 0 <= c <= len(prompt) - 1
        assert len(adm.slots) == len(prompt) - c and self.m.seq_len(seq) == len(prompt)
        assert self.m.committed_len(seq) == c  # the hit blocks were written by whoever committed them
        self.tokens[seq], self.prints[seq] = [], []
        self.extend_model(seq, prompt)
        self.write(seq, adm.slots, c, shared, data)
        self.history.append(prompt)

    # -------------------------------------------------------------- invariants

    @invariant()
    def refcounts_match_tables_and_cache(self):
        m, cache = self.m, self.m.prefix_cache
        named = [0] * self.num_blocks
        for s in m.sequences:
            table = m.block_table(s)
            assert len(set(table)) == len(table), f"{s} names a page twice: {table}"
            assert len(table) == -(-m.seq_len(s) // self.ps)
            for b in table:
                named[b] += 1
        cached = [cache is not None and b in cache for b in range(self.num_blocks)]
        for b in range(self.num_blocks):
            assert m.refcount(b) == named[b] + cached[b], (b, m.refcount(b), named[b], cached[b])
        referenced = sum(1 for c in named if c)
        cached_only = sum(1 for b in range(self.num_blocks) if cached[b] and not named[b])
        assert m.num_free + referenced + cached_only == self.num_blocks
        assert m.num_free == sum(1 for b in range(self.num_blocks) if m.refcount(b) == 0)
        if cache is not None:
            assert sorted(cache.evictable_blocks()) == [b for b in range(self.num_blocks) if cached[b] and not named[b]]

    @invariant()
    def manager_invariants_hold(self):
        self.m.check_integrity()

    @invariant()
    def csr_lengths_equal_manager_and_model_lengths(self):
        seqs = sorted(self.tokens)
        assert sorted(self.m.sequences) == seqs
        lens = [self.m.seq_len(s) for s in seqs]
        assert lens == [len(self.tokens[s]) for s in seqs]
        tables = [self.m.block_table(s) for s in seqs]
        padded = pad_block_tables(tables)
        indptr, indices, last = block_table_to_csr(padded, lens, self.ps)
        assert csr_seq_lens(indptr, last, self.ps).tolist() == lens
        assert (indptr[1:] - indptr[:-1]).tolist() == [len(t) for t in tables]
        assert indices.tolist() == [b for t in tables for b in t]
        back, back_lens = csr_to_block_table(indptr, indices, last, self.ps, max_blocks=padded.shape[1])
        assert torch.equal(back, padded) and back_lens.tolist() == lens

    @invariant()
    def every_sequence_reads_back_what_the_model_says(self):
        assert torch.equal(self.pool.cache, self.pool_loop.cache)
        for s in self.tokens:
            n, table = self.m.seq_len(s), self.m.block_table(s)
            k, v = gather_paged_kv(self.pool.cache, table, n, self.layout)
            kl, vl = gather_paged_kv_loop(self.pool.cache, table, n, self.layout)
            assert torch.equal(k, kl) and torch.equal(v, vl)
            ek, ev = self.kv_of(self.prints[s])
            assert torch.equal(k, ek) and torch.equal(v, ev), f"sequence {s} reads back wrong K/V"

    def teardown(self):
        if not hasattr(self, "m"):
            return
        for s in list(self.tokens):
            self.m.free_sequence(s)
        cache = self.m.prefix_cache
        evictable = cache.num_evictable if cache else 0
        assert self.m.num_free + evictable == self.num_blocks
        self.m.check_integrity()


ManagerMachine.TestCase.settings = settings(
    max_examples=100,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestManagerInterleavings = ManagerMachine.TestCase


# ----------------------------------------------------------------------------- references on random batches

FAST = settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def batches(draw, window=False):
    """A random pool filled with noise and a batch of sequences on shuffled pages."""
    ps = draw(st.sampled_from(PAGE_SIZES[:4]))
    heads_kv = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2, 3]))
    dim = draw(st.sampled_from(HEAD_DIMS))
    layout = draw(st.sampled_from(["NHD", "HND"]))
    w = None
    if window:
        sinks = draw(st.integers(0, 4))
        w = RingWindow(sinks + draw(st.integers(1, 12)), sinks, ps, draw(st.booleans()))
    lens = draw(st.lists(st.integers(0, 40), min_size=1, max_size=4))
    rows = [n if w is None else w.cache_len(n) for n in lens]
    need = [-(-r // ps) for r in rows]
    num_pages = sum(need) + draw(st.integers(1, 3))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    cache = torch.randn(PagedKVPool(num_pages, ps, heads_kv, dim, layout=layout).cache.shape, generator=g)
    table = pad_block_tables(scatter_pages(need, num_pages, g), max(need + [1])).to(torch.int64)
    return dict(cache=cache, table=table, lens=lens, layout=layout, window=w, heads_q=heads_kv * group, g=g)


@FAST
@given(batches())
def test_append_and_gather_loop_equal_vectorized(b):
    cache, layout, g = b["cache"], b["layout"], b["g"]
    num_slots = cache.shape[0] * (cache.shape[2] if layout == "NHD" else cache.shape[3])
    n = int(torch.randint(0, num_slots + 1, (1,), generator=g))
    slots = torch.randperm(num_slots, generator=g)[:n]
    slots[torch.rand(n, generator=g) < 0.2] = -1
    heads, dim = (cache.shape[3], cache.shape[4]) if layout == "NHD" else (cache.shape[2], cache.shape[4])
    k, v = torch.randn(n, heads, dim, generator=g), torch.randn(n, heads, dim, generator=g)
    a, lo = cache.clone(), cache.clone()
    append_paged_kv(k, v, a, slots, layout)
    append_paged_kv_loop(k, v, lo, slots, layout)
    assert torch.equal(a, lo)
    for row, n_tok in zip(b["table"], b["lens"]):
        x, y = gather_paged_kv(a, row, n_tok, layout), gather_paged_kv_loop(a, row, n_tok, layout)
        assert torch.equal(x[0], y[0]) and torch.equal(x[1], y[1])


@FAST
@given(batches(window=False))
def test_decode_attention_loop_equals_vectorized_and_naive(b):
    _check_decode(b)


@FAST
@given(batches(window=True))
def test_window_decode_attention_loop_equals_vectorized_and_naive(b):
    _check_decode(b)


def _naive(q, cache, layout, row, n, w, scale):
    """Float64 softmax over the positions a query at n - 1 may see, read through the
    ring with plain Python indexing."""
    out = torch.zeros(q.shape, dtype=torch.float64)
    if n == 0:
        return out
    ps = cache.shape[2] if layout == "NHD" else cache.shape[3]
    heads_kv = cache.shape[3] if layout == "NHD" else cache.shape[2]
    group = q.shape[0] // heads_kv
    t = n - 1
    visible = [
        j for j in range(n) if w is None or j < w.sink_tokens or j > t - (w.max_attention_window - w.sink_tokens)
    ]
    for h in range(q.shape[0]):
        scores, values = [], []
        for j in visible:
            r = j if w is None else w.kv_token_idx(j)
            page, off = int(row[r // ps]), r % ps
            kh = h // group
            key = cache[page, 0, off, kh] if layout == "NHD" else cache[page, 0, kh, off]
            val = cache[page, 1, off, kh] if layout == "NHD" else cache[page, 1, kh, off]
            scores.append(float(q[h].double() @ key.double()) * scale)
            values.append(val.double())
        mx = max(scores)
        p = torch.tensor([math.exp(s - mx) for s in scores], dtype=torch.float64)
        out[h] = (p / p.sum()) @ torch.stack(values)
    return out


def _check_decode(b):
    cache, table, lens, layout, w, g = b["cache"], b["table"], b["lens"], b["layout"], b["window"], b["g"]
    q = torch.randn(len(lens), b["heads_q"], cache.shape[-1], generator=g)
    out = paged_decode_attention(q, cache, table, lens, layout=layout, window=w, precision="fp64")
    loop = paged_decode_attention_loop(q, cache, table, lens, layout=layout, window=w, precision="fp64")
    torch.testing.assert_close(loop, out, rtol=1e-12, atol=1e-12)
    scale = 1 / math.sqrt(cache.shape[-1])
    for i, n in enumerate(lens):
        torch.testing.assert_close(out[i], _naive(q[i], cache, layout, table[i], n, w, scale), rtol=1e-11, atol=1e-11)


@FAST
@given(batches(window=True), st.data())
def test_prefill_attention_loop_equals_vectorized(b, data):
    cache, table, lens, layout, w, g = b["cache"], b["table"], b["lens"], b["layout"], b["window"], b["g"]
    limit = w.max_chunk_len() if w is not None else 40
    q_lens = [data.draw(st.integers(0, min(n, limit))) for n in lens]
    indptr = [0]
    for ql in q_lens:
        indptr.append(indptr[-1] + ql)
    q = torch.randn(indptr[-1], b["heads_q"], cache.shape[-1], generator=g)
    out = paged_prefill_attention(q, cache, indptr, table, lens, layout=layout, window=w, precision="fp64")
    loop = paged_prefill_attention_loop(q, cache, indptr, table, lens, layout=layout, window=w, precision="fp64")
    torch.testing.assert_close(loop, out, rtol=1e-12, atol=1e-12)


# ----------------------------------------------------------------------------- formats and indexing


@settings(max_examples=100, deadline=None, derandomize=True)
@given(ps=st.sampled_from(PAGE_SIZES), lens=st.lists(st.integers(0, 200), max_size=6), extra=st.integers(0, 2))
def test_block_table_csr_round_trip(ps, lens, extra):
    need = [-(-n // ps) for n in lens]
    ids = iter(range(10**6))
    tables = [[next(ids) * 7 % 1009 for _ in range(k)] for k in need]
    width = max(need + [0]) + extra
    padded = pad_block_tables(tables, width)
    indptr, indices, last = block_table_to_csr(padded, lens, ps)
    # independent expectations: CSR by hand
    assert indptr.tolist() == [sum(need[:i]) for i in range(len(lens) + 1)]
    assert indices.tolist() == [b for t in tables for b in t]
    assert last.tolist() == [0 if n == 0 else n - (k - 1) * ps for n, k in zip(lens, need)]
    assert all(1 <= x <= ps for x, n in zip(last.tolist(), lens) if n)
    assert csr_seq_lens(indptr, last, ps).tolist() == lens
    back, back_lens = csr_to_block_table(indptr, indices, last, ps, max_blocks=width)
    assert torch.equal(back, padded) and back_lens.tolist() == lens


@settings(max_examples=50, deadline=None, derandomize=True)
@given(shift=st.integers(0, 10), pos=st.lists(st.integers(0, 2**40), min_size=1, max_size=50))
def test_locate_pow2_equals_locate(shift, pos):
    ps = 1 << shift
    t = torch.tensor(pos)
    assert [locate_pow2(p, ps) for p in pos] == [locate(p, ps) for p in pos] == [divmod(p, ps) for p in pos]
    assert all(torch.equal(a, b) for a, b in zip(locate_pow2(t, ps), locate(t, ps)))


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    ps=st.integers(1, 70),
    sinks=st.integers(0, 80),
    extra=st.integers(1, 100),
    one_more=st.booleans(),
    t=st.lists(st.integers(0, 10**6), min_size=1, max_size=30),
)
def test_ring_window_tensor_forms_equal_scalar_forms(ps, sinks, extra, one_more, t):
    w = RingWindow(sinks + extra, sinks, ps, one_more)
    x = torch.tensor(t)
    assert w.kv_token_idx(x).tolist() == [w.kv_token_idx(i) for i in t]
    assert w.cache_len(x).tolist() == [w.cache_len(i) for i in t]
    assert w.num_blocks(x).tolist() == [w.num_blocks(i) for i in t]
    # ring rows start on a block boundary and never exceed the capped length
    assert (w.sink_tokens + w.bubble_len) % ps == 0
    assert all(w.kv_token_idx(i) < w.max_cache_len for i in t)
