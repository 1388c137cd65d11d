"""The harness's comparisons: :mod:`pagedkv_lib.compare`, under the name notebooks 06,
07, 09 and 11 and the kernel tests import it by (``pagedkv_lab.verify.compare``). No
code lives here; the harness's own modules import :mod:`pagedkv_lib.compare`."""

from __future__ import annotations

from pagedkv_lib.compare import *  # noqa: F403  (exactly pagedkv_lib.compare.__all__)
