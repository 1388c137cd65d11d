#!/usr/bin/env bash
# One prepared run for a lent GPU machine (the device tool): kernel tests compiled, the
# conformance harness on the full grid, and both benchmarks, all written under $OUT.
# That machine has torch and Triton installed and reaches no registry, so this runs from
# the source tree (PYTHONPATH=.) and skips pytest if pytest/hypothesis are missing.
#   run: bash scripts/device_check.sh      (timeout ~420 s leaves room for a rerun)
set -uo pipefail
OUT=${OUT:-build/device}
mkdir -p "$OUT"
export PYTHONPATH=. PAGEDKV_BACKEND=gpu
python -c "from pagedkv_lib import runtime; print(runtime.backend_line())" | tee "$OUT/backend.txt"
if python -c "import pytest, hypothesis" 2>/dev/null; then
  timeout 240 python -m pytest tests/test_kernel_*.py tests/test_checks_parity.py tests/test_verify.py -q \
    -p no:cacheprovider > "$OUT/kernel_tests.txt" 2>&1
  echo "pytest rc=$?" >> "$OUT/kernel_tests.txt"
  tail -5 "$OUT/kernel_tests.txt"
else
  echo "pytest or hypothesis missing: kernel tests skipped" | tee "$OUT/kernel_tests.txt"
fi
timeout 120 python -m kernels.verify --full --hypothesis 0 > "$OUT/verify.txt" 2>&1
echo "verify rc=$?" | tee -a "$OUT/verify.txt"
timeout 90 python benchmarks/bench_write.py --out "$OUT" | tail -12
timeout 90 python benchmarks/bench_decode.py --out "$OUT" | tail -12
