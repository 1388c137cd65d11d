"""Shared test setup for the library tests.

``pagedkv_lib`` is imported first so that its runtime sets ``TRITON_INTERPRET``
before any test module (or plugin) imports triton.
"""

import pagedkv_lib  # noqa: F401  (must come before anything that imports triton)
