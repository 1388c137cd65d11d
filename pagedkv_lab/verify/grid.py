"""Building case grids (every value of every parameter occurs, without the full product)
and drawing their inputs."""

from __future__ import annotations

import inspect
import itertools

import torch

__all__ = ["cover", "accepts", "rand"]


def cover(values: dict[str, list], extra: list[dict] = (), outer: int = 2) -> list[dict]:
    """Cases in which every value of every parameter occurs: the product of the first
    ``outer`` parameters, the others cycling through their values; then ``extra``.

    Parameter ``j`` of the rest takes value ``(i + r * (j + 1)) % len`` in case ``i``,
    where ``r`` counts the rounds of the innermost crossed parameter: each round shifts
    every cycle by a different step, so a cycled parameter is not locked to the values
    of a crossed one (or of another cycled one) with as many values."""
    items = list(values.items())
    crossed, rest = items[:outer], items[outer:]
    inner = len(crossed[-1][1]) if crossed else 1
    cases = []
    for i, combo in enumerate(itertools.product(*(vs for _, vs in crossed))):
        case = {k: v for (k, _), v in zip(crossed, combo)}
        for j, (k, vs) in enumerate(rest):
            case[k] = vs[(i + (i // inner) * (j + 1)) % len(vs)]
        cases.append(case)
    return cases + [dict(c) for c in extra]


def accepts(fn, name: str, named: bool = False) -> bool:
    """Whether callable ``fn`` takes a keyword argument ``name`` (or ``**kwargs``; with
    ``named``, only a parameter of that name: a wrapper's ``**kwargs`` is not a buffer
    to write into)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # builtins without a signature: assume not
        return False
    if named:
        return name in params
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def rand(shape, dtype, gen: torch.Generator) -> torch.Tensor:
    """Standard normal values drawn in fp32 from ``gen``, then cast to ``dtype`` (so every
    dtype draws the same stream)."""
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)
