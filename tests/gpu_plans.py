"""What the interpreter cannot check under GPU plans (``PAGEDKV_PLAN=gpu``): the bf16
``tl.dot`` of the prefill kernel, whose interpreted result is wrong (Triton 3.9: a
16x16x16 bf16 dot off by about 3e10; fp16 is right). Those launches are compiled by the
compile check instead (``python -m pagedkv_kernels.tools.compile_check``)."""

import pytest

from pagedkv_kernels.tools.verify import BF16_DOT_NOTE
from pagedkv_lib import runtime

INTERPRETED_GPU_PLANS = runtime.BACKEND.interpreted and runtime.gpu_plans()


def skip_interpreted_bf16_dot(dtype) -> None:
    """Skip the calling test when it would run the bf16 ``tl.dot`` in the interpreter."""
    if INTERPRETED_GPU_PLANS and str(dtype).removeprefix("torch.") in ("bf16", "bfloat16"):
        pytest.skip(BF16_DOT_NOTE)
