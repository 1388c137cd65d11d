#!/usr/bin/env bash
# One prepared run for a lent GPU machine (the device tool), under 8 minutes in all:
#   1. the backend line and nvidia-smi;
#   2. the kernel tests, compiled (PAGEDKV_BACKEND=gpu);
#   3. the full conformance grid, compiled;
#   4. notebooks 06, 07 and 10 through nbval on the GPU backend (cells whose output
#      differs by backend are tagged nbval-ignore-output in their sources);
#   5. the benchmarks (write, decode, prefill, quantized), JSON and PNG;
# everything under $OUT (the device tool brings that folder back). That machine has
# torch and Triton but reaches no registry, so this runs from the source tree
# (PYTHONPATH: the checkout and its kernels/, absolute, so that notebook kernels started in
# notebooks/ see them too) and skips a step, saying so, when pytest, hypothesis or nbval are missing.
#   run: bash scripts/device_check.sh      (a timeout of ~540 s leaves room for a rerun)
set -uo pipefail
OUT=${OUT:-build/device}
mkdir -p "$OUT"
export PYTHONPATH="$PWD:$PWD/kernels" PAGEDKV_BACKEND=gpu MPLBACKEND=Agg
step() { echo "== $1 ($(date +%T))" | tee -a "$OUT/summary.txt"; }

step backend
python -c "from pagedkv_lib import runtime; print(runtime.backend_line())" | tee "$OUT/backend.txt" | tee -a "$OUT/summary.txt"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true

step "kernel tests (compiled)"
if python -c "import pytest, hypothesis" 2>/dev/null; then
  timeout 150 python -m pytest tests/test_kernel_*.py tests/test_quant_kernels.py tests/test_mla_kernels.py \
    tests/test_mla_latent.py tests/test_quant_conventions.py tests/test_rotary_positions.py tests/test_lse_merge.py \
    tests/test_noncausal_prefill.py tests/test_checks_parity.py -q -p no:cacheprovider -x --durations=15 \
    > "$OUT/kernel_tests.txt" 2>&1
  echo "pytest rc=$?" >> "$OUT/kernel_tests.txt"
  tail -3 "$OUT/kernel_tests.txt" | tee -a "$OUT/summary.txt"
else
  echo "pytest or hypothesis missing: kernel tests skipped" | tee "$OUT/kernel_tests.txt" | tee -a "$OUT/summary.txt"
fi

step "verify --full (compiled)"
timeout 90 python -m pagedkv_kernels.tools.verify --full --hypothesis 0 --no-isolate --json "$OUT/verify.json" > "$OUT/verify.txt" 2>&1
echo "verify rc=$?" >> "$OUT/verify.txt"
tail -2 "$OUT/verify.txt" | tee -a "$OUT/summary.txt"

step "notebooks 06, 07, 10 (nbval, compiled)"
if python -c "import pytest, nbval" 2>/dev/null; then
  timeout 90 python -m pytest -p no:cacheprovider --nbval --nbval-current-env \
    --nbval-sanitize-with notebooks/nbval_sanitize.cfg notebooks/06_triton_write.ipynb \
    notebooks/07_triton_read.ipynb notebooks/10_chunked_prefill.ipynb -q > "$OUT/notebooks.txt" 2>&1
  echo "nbval rc=$?" >> "$OUT/notebooks.txt"
  tail -3 "$OUT/notebooks.txt" | tee -a "$OUT/summary.txt"
else
  echo "pytest or nbval missing: notebooks skipped" | tee "$OUT/notebooks.txt" | tee -a "$OUT/summary.txt"
fi

step benchmarks
for b in write decode prefill quant; do
  timeout 30 python "benchmarks/bench_$b.py" --out "$OUT" > "$OUT/bench_$b.txt" 2>&1
  echo "bench_$b rc=$?" | tee -a "$OUT/bench_$b.txt" | tee -a "$OUT/summary.txt"
done
step done
