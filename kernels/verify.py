"""``python -m kernels.verify``: the conformance harness on the suite's own Triton kernels.

The harness itself (:mod:`pagedkv_lib.verify`) sits below the kernels and never imports
them; this thin command line lives on the kernels' side and hands it the suite's
append, decode, prefill, MLA and quantized kernels. Options as ``python -m pagedkv_lib.verify`` (``--full``,
``--hypothesis N``, ``--fault NAME``, ``--reference``, ``--no-poison-masked``); exits 1 when a check fails.
"""

from __future__ import annotations

import sys

from pagedkv_lib.verify import cli

from .decode import paged_decode_attention
from .mla import append_paged_mla_kv, mla_decode_attention
from .prefill import paged_prefill_attention
from .quant_decode import paged_decode_attention_quant
from .quant_write import append_paged_kv_quant
from .write import append_paged_kv

__all__ = ["main"]


def main(argv: list[str] | None = None) -> int:
    defaults = {
        "append_fn": append_paged_kv,
        "decode_fn": paged_decode_attention,
        "prefill_fn": paged_prefill_attention,
        "mla_append_fn": append_paged_mla_kv,
        "mla_decode_fn": mla_decode_attention,
        "quant_append_fn": append_paged_kv_quant,
        "quant_decode_fn": paged_decode_attention_quant,
    }
    return cli.main(argv, defaults=defaults, prog="python -m kernels.verify")


if __name__ == "__main__":
    sys.exit(main())
