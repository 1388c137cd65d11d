"""Compile one recorded launch for one NVIDIA GPU target, on a machine without a GPU.

Runs under ``PAGEDKV_BACKEND=compile-only`` (:mod:`pagedkv_lib.runtime`), where
``@triton.jit`` makes compilable kernels instead of interpreted ones. A record of
:mod:`pagedkv_kernels.tools.launch_record` is turned back into arguments Triton specializes the same
way (a small CPU tensor of the recorded dtype and alignment for each pointer, a
representative int of each int class, the constexprs by value); Triton's own binder
then derives the signature, constants and attributes, and ``triton.compile`` builds
PTX and a cubin for ``GPUTarget("cuda", arch, 32)``. The resource figures are those
of ``ptxas -v`` (Triton's bundled ptxas, the same run that makes the cubin):
registers per thread, spill stores and loads (bytes), and the kernel's shared memory
(Triton's allocation, bytes). From the PTX, :func:`ptx_counts` counts the instructions
that say how a kernel reaches memory: TMA copies (``cp.async.bulk.tensor``), ordinary
global loads, and the 64-bit integer arithmetic that computes addresses (the compile
check asserts that the descriptor decode's sm_90 build holds TMA copies; notebook 07
compares the three read routes by these counts).

Kernels outside ``kernels/`` (notebooks', exercises') are rebuilt from the recorded text
of their file: its imports, ``@triton.jit`` functions and constant assignments, nothing
that runs.
"""

from __future__ import annotations

import ast
import contextlib
import hashlib
import importlib
import importlib.util
import io
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedkv_lib import runtime

# isort: split
import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource, make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

__all__ = ["CompileResult", "compile_launch", "parse_ptxas", "ptx_counts", "PTX_COUNTED", "kernel_function"]

REPRESENTATIVE_INT = {"1": 1, "i32": 17, "i32D": 16, "i64": 2**33 + 1, "i64D": 2**33}
_PTXAS_USED = re.compile(r"Used (\d+) registers")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
# PTX instruction classes, by opcode (the text before the first space of a line):
PTX_COUNTED = {
    "tma_loads": re.compile(r"cp\.async\.bulk\.tensor\."),  # one box copied by the TMA unit
    "global_loads": re.compile(r"ld\.global\."),  # ordinary loads, each of its own addresses
    "address_ops": re.compile(r"(mul|mad|add|sub|shl|cvt)\.(\S*[su]64|wide\.[su]32)"),  # 64-bit integer arithmetic
}


@dataclass
class CompileResult:
    """One launch compiled for one arch: ``registers`` per thread, ``spill_stores`` and
    ``spill_loads`` (bytes per thread), ``shared`` (bytes per program), ``ptx`` the
    :func:`ptx_counts` of its PTX, ``seconds`` of compilation; ``error`` is the
    compiler's message when it failed (figures are then None)."""

    arch: int
    registers: int | None = None
    spill_stores: int | None = None
    spill_loads: int | None = None
    shared: int | None = None
    ptx: dict[str, int] | None = None
    seconds: float = 0.0
    error: str | None = None

    def to_json(self) -> dict:
        return asdict(self)


def parse_ptxas(log: str, kernel: str) -> tuple[int, int, int]:
    """``(registers, spill_stores, spill_loads)`` of ``kernel`` from a ``ptxas -v`` log.
    Raises ValueError when the log has no "Used N registers" line for it."""
    lines = log.splitlines()
    start = next((i for i, line in enumerate(lines) if "Compiling entry function" in line and kernel in line), 0)
    regs = spill_st = spill_ld = None
    for line in lines[start:]:
        if (m := _PTXAS_SPILL.search(line)) and spill_st is None:
            spill_st, spill_ld = int(m.group(1)), int(m.group(2))
        if m := _PTXAS_USED.search(line):
            regs = int(m.group(1))
            break
    if regs is None:
        raise ValueError(f"no 'Used N registers' line for {kernel} in the ptxas log:\n{log[-2000:]}")
    return regs, spill_st or 0, spill_ld or 0


def ptx_counts(ptx: str) -> dict[str, int]:
    """Instructions of each :data:`PTX_COUNTED` class in ``ptx`` (a whole kernel, static
    counts: a loop body counts once), and ``"instructions"``, every instruction line."""
    lines = [line.split() for line in ptx.splitlines() if line.startswith("\t") and line.rstrip().endswith(";")]
    ops = [words[1] if words[0].startswith("@") else words[0] for words in lines]  # "@%p1 ld.global ...": predicated
    ops = [op for op in ops if not op.startswith(("//", "."))]
    counts = {name: sum(bool(rx.match(op)) for op in ops) for name, rx in PTX_COUNTED.items()}
    return counts | {"instructions": len(ops)}


def _package_of(path: Path) -> str | None:
    root = Path(__file__).resolve().parents[2]  # kernels/, the folder above the package
    try:
        rel = path.resolve().parent.relative_to(root)
    except ValueError:
        return None
    return ".".join(rel.parts) if rel.parts and (path.parent / "__init__.py").exists() else None


def _synthetic_module(path: str, text: str):
    """A module of ``text``'s imports, constants and ``@triton.jit`` functions."""
    tree = ast.parse(text)
    package = _package_of(Path(path))
    keep = []
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and node.level:  # a kernels/ file's relative import
            if package is None:
                raise ValueError(f"{path}: relative import outside a package")
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            node = ast.ImportFrom(module=f"{base}.{node.module}" if node.module else base, names=node.names, level=0)
            keep.append(node)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            keep.append(node)
        elif isinstance(node, ast.FunctionDef) and any("jit" in ast.unparse(d) for d in node.decorator_list):
            keep.append(node)
        elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            keep.append(node)
    source = "\n\n".join(ast.unparse(n) for n in keep) + "\n"
    digest = hashlib.sha1(text.encode()).hexdigest()[:12]
    folder = Path(tempfile.gettempdir()) / "pagedkv-compile-check"
    folder.mkdir(exist_ok=True)
    file = folder / f"{Path(path).stem.replace('-', '_')}_{digest}.py"
    if file.stem in sys.modules:
        return sys.modules[file.stem]
    if not file.exists():  # triton reads kernels' source through inspect: it must be a file
        part = file.with_suffix(f".{os.getpid()}.part")
        part.write_text(source)
        part.replace(file)  # atomic: another worker may be importing it
    spec = importlib.util.spec_from_file_location(file.stem, file)
    module = importlib.util.module_from_spec(spec)
    sys.modules[file.stem] = module
    with contextlib.redirect_stdout(io.StringIO()):
        spec.loader.exec_module(module)
    return module


def kernel_function(record: dict, files: dict[str, str]) -> JITFunction:
    """The compilable ``@triton.jit`` function a record names."""
    if record["module"]:
        module = importlib.import_module(record["module"])
    else:
        module = _synthetic_module(record["file"], files[record["file"]])
    fn = getattr(module, record["kernel"])
    if not isinstance(fn, JITFunction):
        raise RuntimeError(f"{record['kernel']} is a {type(fn).__name__}: run under PAGEDKV_BACKEND=compile-only")
    return fn


def _argument(desc):
    kind = desc[0]
    if kind == "t":
        dtype = getattr(torch, desc[1])
        base = torch.empty(64, dtype=dtype)
        return base if desc[2] else base[1:]  # one element in: not 16-byte aligned
    if kind == "i":
        return REPRESENTATIVE_INT[desc[1]]
    if kind == "f":
        return 0.5
    if kind == "b":
        return desc[1]
    if kind == "n":
        return None
    if kind == "dtype":  # recorded as str(dtype): Triton's short name ("fp16"), not the attribute's
        return getattr(tl, desc[1], None) or tl.str_to_ty(desc[1], None)
    return desc[1]  # a constexpr by value


def compile_launch(record: dict, files: dict[str, str], arch: int) -> CompileResult:
    """Compile ``record`` for ``sm_<arch>``; never raises for a compiler error (it is
    returned in ``error``)."""
    if runtime.BACKEND.name != "compile-only":
        raise RuntimeError("compile_launch needs PAGEDKV_BACKEND=compile-only (kernels decorated for compilation)")
    start = time.perf_counter()
    result = CompileResult(arch=arch)
    try:
        fn = kernel_function(record, files)
        backend = make_backend(GPUTarget("cuda", arch, 32))
        binder = create_function_from_signature(fn.signature, fn.params, backend)
        args = {name: _argument(desc) for name, desc in record["args"].items()}
        kwargs = dict(record["options"])
        bound, specialization, options = binder(**args, **kwargs)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, options)
        log = io.StringIO()
        triton.knobs.nvidia.dump_ptxas_log = True  # make_cubin prints ptxas -v's log ...
        triton.knobs.compilation.always_compile = True  # ... which a cache hit would skip
        with contextlib.redirect_stdout(log):
            kernel = triton.compile(ASTSource(fn, signature, constexprs, attrs), target=backend.target,
                                    options=options.__dict__)  # fmt: skip
        regs, spill_st, spill_ld = parse_ptxas(log.getvalue(), record["kernel"])
        result.registers, result.spill_stores, result.spill_loads = regs, spill_st, spill_ld
        result.shared = int(kernel.metadata.shared)
        result.ptx = ptx_counts(kernel.asm["ptx"])
    except Exception as err:  # a compiler error is this check's finding, not a crash
        result.error = f"{type(err).__name__}: {err}"[:4000]
    result.seconds = time.perf_counter() - start
    return result
