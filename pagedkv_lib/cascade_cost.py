"""What cascade attention saves: the K/V rows a prefill reads from the pool, flat and in
cascade.

Requests that share a prefix (a system prompt) can read it once for all of them
(:func:`pagedkv_kernels.cascade.cascade_attention`): one non-causal pass of *all* requests'
queries over the prefix, one causal pass of each request over its own suffix, merged.
The arithmetic is the same either way (every query still scores every key it sees);
what changes is how often the prefix's K/V rows are read. The prefill kernel
(:mod:`pagedkv_kernels.prefill`) runs one program per tile of ``block_m`` (query, head) rows
of one request and reads, for one KV head, every key up to the tile's last query:

* flat: request ``b`` (``q_len`` queries, ``shared_len + suffix_len`` keys) has
  ``ceil(q_len * group / block_m)`` tiles, each reading the prefix and its suffix;
* cascade: the prefix pass packs all ``total_q`` queries into ``ceil(total_q * group /
  block_m)`` tiles, each reading the prefix; the suffix pass reads only suffixes.

With one query per request (decode) and ``group`` query heads per KV head, flat reads
the prefix once per request, cascade once per ``block_m / group`` requests.
"""

from __future__ import annotations

from typing import NamedTuple

__all__ = ["CascadeReads", "cascade_kv_reads"]


class CascadeReads(NamedTuple):
    """K/V rows (tokens, per KV head) read from the pool, and the programs (tiles) that read
    them: ``flat_*`` for one prefill over each request's whole table, ``prefix_*`` and
    ``suffix_*`` for the two passes of cascade attention."""

    flat_rows: int
    flat_tiles: int
    prefix_rows: int
    prefix_tiles: int
    suffix_rows: int
    suffix_tiles: int

    @property
    def cascade_rows(self) -> int:
        return self.prefix_rows + self.suffix_rows


def _tile_keys(q_len: int, keys: int, group: int, block_m: int) -> list[int]:
    """Keys each causal tile of one request reads: up to its last query's position."""
    tiles = -(-q_len * group // block_m)
    return [keys - q_len + min(((t + 1) * block_m - 1) // group, q_len - 1) + 1 for t in range(tiles)]


def cascade_kv_reads(
    shared_len: int, suffix_lens, q_lens, group: int, block_m: int, prefix_block_m: int | None = None
) -> CascadeReads:
    """K/V rows read per KV head by a flat prefill and by cascade attention.

    ``shared_len``: tokens of the shared prefix; ``suffix_lens[b]`` and ``q_lens[b]``:
    each request's own tokens (its queries included, so ``q_lens[b] <= suffix_lens[b]``)
    and queries; ``group``: query heads per KV head; ``block_m``: (query, head) rows per
    prefill tile (``PrefillPlan.block_m``) of the flat prefill and the suffix pass,
    ``prefix_block_m`` that of the prefix pass (its own plan may choose taller tiles for
    its ``total_q`` queries; default ``block_m``). Raises ValueError for negative sizes, a
    suffix shorter than its queries, lists of different lengths or a tile height that is
    not a multiple of ``group``.
    """
    suffix_lens, q_lens = [int(x) for x in suffix_lens], [int(x) for x in q_lens]
    if len(suffix_lens) != len(q_lens):
        raise ValueError(f"suffix_lens has {len(suffix_lens)} entries but q_lens has {len(q_lens)}")
    prefix_block_m = block_m if prefix_block_m is None else prefix_block_m
    for name, rows in (("block_m", block_m), ("prefix_block_m", prefix_block_m)):
        if group < 1 or rows < group or rows % group:
            raise ValueError(f"{name}={rows} must be a positive multiple of group={group}")
    if shared_len < 0:
        raise ValueError(f"shared_len={shared_len} must be >= 0")
    bad = [b for b, (s, q) in enumerate(zip(suffix_lens, q_lens)) if q < 0 or s < q]
    if bad:
        b = bad[0]
        raise ValueError(f"request {b}: q_lens[{b}]={q_lens[b]} must be in [0, suffix_lens[{b}]={suffix_lens[b]}]")
    flat = [_tile_keys(q, shared_len + s, group, block_m) for s, q in zip(suffix_lens, q_lens)]
    suffix = [_tile_keys(q, s, group, block_m) for s, q in zip(suffix_lens, q_lens)]
    prefix_tiles = -(-sum(q_lens) * group // prefix_block_m)
    return CascadeReads(
        flat_rows=sum(map(sum, flat)),
        flat_tiles=sum(map(len, flat)),
        prefix_rows=prefix_tiles * shared_len,
        prefix_tiles=prefix_tiles,
        suffix_rows=sum(map(sum, suffix)),
        suffix_tiles=sum(map(len, suffix)),
    )
