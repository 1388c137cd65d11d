"""Serve SmolLM2-135M-Instruct on the paged cache from the command line.

    python -m pagedkv_engine --prompt "What is a KV cache?" --max-new-tokens 32
    python -m pagedkv_engine --prompt "..." --attention triton --check
    python -m pagedkv_engine --standard-batch --check       # the batch the tests check
    python -m pagedkv_engine --standard-batch --check --fault decode_rope_off_by_one  # exits 1
    python -m pagedkv_engine --standard-batch --speculative 4 --check   # prompt-lookup drafts
    python -m pagedkv_engine --repetitive --speculative 4 --check       # drafts accepted often
    python -m pagedkv_engine --clear-cache

Prompts go through the model's chat template (``--raw`` sends them as they are).
Prints each answer, then pages used, prefix hits, page copies, preemptions and
tokens per second (with ``--speculative``: drafts proposed and accepted, forwards per
generated token). ``--check`` compares every generated token and its logits with
transformers' ``generate`` on the same weights and exits with status 1 on any
mismatch. Converted weights are cached on disk (see ``--help``).
"""

from __future__ import annotations

import argparse
import sys
import time

from pagedkv_engine import weights
from pagedkv_engine.attention import ATTENTION_PATHS
from pagedkv_engine.scheduler import SamplingParams, pages_needed
from pagedkv_lab.faults import ENGINE_FAULTS, engine_parts
from pagedkv_lib import runtime  # noqa: F401  (chooses the Triton backend before anything imports triton)

DEFAULTS = dict(page_size=16, num_pages=256, max_batched_tokens=256)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"{value} must be a positive integer")
    return value


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m pagedkv_engine",
        description="Serve SmolLM2-135M-Instruct on pagedkv's paged KV cache.",
        epilog=(
            f"Converted weights are cached in {weights.cache_root()}/smollm2-135m-instruct-* "
            f"(set ${weights.CACHE_ENV} to move it; --clear-cache or rm -rf deletes it)."
        ),
    )
    p.add_argument("--prompt", action="append", default=[], help="a prompt (repeat for a batch)")
    p.add_argument("--system", help="a system message for every prompt (chat template)")
    p.add_argument("--raw", action="store_true", help="send prompts as they are, without the chat template")
    p.add_argument(
        "--standard-batch",
        action="store_true",
        help="serve the checked batch: 7 requests, shared system prompt, chunked prefill, a fork, preemption",
    )
    p.add_argument(
        "--repetitive",
        action="store_true",
        help="serve the repetitive batch: 2 requests that copy their prompt (speculative decoding's best case)",
    )
    p.add_argument("--max-new-tokens", type=_positive, default=32, metavar="N")
    p.add_argument("--n", type=_positive, default=1, metavar="N", help="samples per prompt (forked)")
    p.add_argument("--temperature", type=_non_negative_float, default=0.0, help="0 (default) is greedy")
    p.add_argument(
        "--attention",
        choices=ATTENTION_PATHS,
        default="torch",
        help="torch (fast CPU path), triton (kernels) or reference (the Python references)",
    )
    p.add_argument(
        "--page-size", type=_positive, metavar="N", help=f"tokens per page (default {DEFAULTS['page_size']})"
    )
    p.add_argument(
        "--num-pages", type=_positive, metavar="N", help=f"pages in the pool (default {DEFAULTS['num_pages']})"
    )
    p.add_argument(
        "--max-batched-tokens",
        type=_positive,
        metavar="N",
        help=f"token budget per step (default {DEFAULTS['max_batched_tokens']})",
    )
    p.add_argument(
        "--offload-blocks",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="secondary pool of N blocks: evicted cached pages are offloaded there and restored on a hit (default 0)",
    )
    p.add_argument(
        "--speculative",
        type=_non_negative_int,
        default=0,
        metavar="N",
        help="speculative decoding: up to N prompt-lookup drafts per step, verified in one forward (greedy only)",
    )
    p.add_argument("--check", action="store_true", help="compare with transformers; exit 1 on any mismatch")
    p.add_argument(
        "--fault",
        action="append",
        default=[],
        choices=sorted(ENGINE_FAULTS),
        help="plant a bug (see pagedkv_lab.faults.ENGINE_FAULTS); --check should then fail",
    )
    p.add_argument("--threads", type=_positive, metavar="N", help="torch CPU threads (default: torch's choice)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--clear-cache", action="store_true", help="delete the converted weights and exit")
    return p


def _requests(args, parser, tokenizer) -> tuple[dict[int, list], dict]:
    """``(arrivals, engine settings)`` for the command line's prompts or the standard batch."""
    from pagedkv_engine import check

    if args.standard_batch and args.repetitive:
        parser.error("give --standard-batch or --repetitive, not both")
    if args.repetitive:
        if args.prompt or args.n != 1 or args.temperature or args.raw or args.system:
            parser.error("--repetitive brings its own prompts: drop --prompt/--system/--raw/--n/--temperature")
        arrivals = check.repetitive_batch(tokenizer, args.max_new_tokens)
        settings = dict(DEFAULTS)
    elif args.standard_batch:
        if args.prompt or args.n != 1 or args.temperature or args.raw or args.system:
            parser.error("--standard-batch brings its own prompts: drop --prompt/--system/--raw/--n/--temperature")
        arrivals = check.standard_batch(tokenizer, args.max_new_tokens)
        settings = check.standard_engine_args(args.max_new_tokens)
        settings = {
            "page_size": settings["page_size"],
            "num_pages": settings["num_pages"],
            "max_batched_tokens": settings["max_num_batched_tokens"],
        }
    else:
        params = SamplingParams(max_new_tokens=args.max_new_tokens, n=args.n, temperature=args.temperature)
        ids = [
            tokenizer(p, add_special_tokens=False)["input_ids"]
            if args.raw
            else check.chat_ids(tokenizer, p, args.system)
            for p in args.prompt
        ]
        arrivals = {0: [(i, params) for i in ids]}
        settings = dict(DEFAULTS)
    for key in settings:
        if getattr(args, key) is not None:
            settings[key] = getattr(args, key)
    context = weights.max_positions()
    for k, (prompt, params) in enumerate(r for reqs in arrivals.values() for r in reqs):
        if not prompt:
            parser.error(f"prompt {k + 1} is empty after tokenizing")
        if len(prompt) + params.max_new_tokens > context:
            parser.error(
                f"prompt {k + 1} ({len(prompt)} tokens) with --max-new-tokens {params.max_new_tokens} exceeds the "
                f"model's {context} positions"
            )
        need = pages_needed(len(prompt), params.max_new_tokens, params.n, settings["page_size"])
        if need > settings["num_pages"]:
            parser.error(
                f"--num-pages {settings['num_pages']} is too small: prompt {k + 1} ({len(prompt)} tokens) with "
                f"--max-new-tokens {params.max_new_tokens} and --n {params.n} needs up to {need} pages of "
                f"{settings['page_size']} tokens"
            )
    return arrivals, settings


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.clear_cache:
        removed = weights.clear_cache()
        print(f"removed {len(removed)} cached model(s) under {weights.cache_root()}" if removed else "nothing cached")
        return 0
    if not args.prompt and not args.standard_batch and not args.repetitive:
        parser.error("give at least one --prompt (or --standard-batch, --repetitive)")
    if args.check and args.temperature:
        parser.error("--check compares greedy generation: drop --temperature")
    if args.speculative and args.temperature:
        parser.error("--speculative verifies drafts against greedy tokens: drop --temperature")
    page_size = args.page_size or DEFAULTS["page_size"]
    num_pages = args.num_pages or DEFAULTS["num_pages"]
    if num_pages * page_size <= args.max_new_tokens:
        parser.error(f"--num-pages {num_pages} x --page-size {page_size} cannot hold {args.max_new_tokens} new tokens")

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    from pagedkv_engine import check
    from pagedkv_engine.engine import Engine, default_stats_lines

    tokenizer = weights.load_tokenizer()
    arrivals, settings = _requests(args, parser, tokenizer)
    loaded = weights.load()
    how = "converted from the GGUF file now" if loaded.converted else "from the cache"
    print(f"weights: {loaded.path} ({how}, {loaded.seconds:.1f} s wall)")
    engine = Engine(
        loaded.model,
        args.attention,
        num_pages=settings["num_pages"],
        page_size=settings["page_size"],
        max_num_batched_tokens=settings["max_batched_tokens"],
        max_num_seqs=min(16, settings["max_batched_tokens"]),
        record_logits=args.check,
        offload_blocks=args.offload_blocks,
        speculative=args.speculative,
        parts=engine_parts(args.fault),
    )
    engine.run(arrivals, progress=not args.no_progress)
    for seq in engine.sequences.values():
        print(f"\n[{seq.seq_id}] {tokenizer.decode(seq.output_ids, skip_special_tokens=True).strip()}")
    print()
    for line in default_stats_lines(engine):
        print(line)
    if not args.check:
        return 0
    start = time.perf_counter()
    report = check.check_engine(engine, loaded.model)
    print(f"\ncheck against transformers generate ({time.perf_counter() - start:.1f} s wall):")
    for line in report.lines(tokenizer):
        print("  " + line)
    if report.hf_seconds:
        print(f"transformers generate, one prompt at a time: {report.hf_tokens / report.hf_seconds:.1f} tokens/s")
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
