#!/usr/bin/env bash
# Proves that a wheelhouse (make wheelhouse) installs the whole suite with no network:
#   scripts/check_wheelhouse.sh [WHEELHOUSE]      (default: wheelhouse)
# `make setup OFFLINE=WHEELHOUSE` into a fresh venv, inside a network namespace with no
# interface (unshare -n; root) and with pip's own configuration files ignored, so neither
# an index nor a machine-wide find-links folder can help; then imports the suite, runs the
# pre-class check and two exercise checks (one kernel) in that venv. Prints the install
# time and the wheelhouse's size. Not part of the test command: it installs ~1.5 GB.
set -euo pipefail
WH=$(cd "${1:-wheelhouse}" && pwd)
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=$(mktemp -d)/venv
if unshare -n true 2>/dev/null; then
  NONET=(unshare -n)
else
  NONET=()
  echo "note: unshare -n is not available (it needs root): only --no-index keeps pip off the network"
fi
export PIP_CONFIG_FILE=/dev/null  # no extra index, find-links or constraints from this machine
echo "wheelhouse: $WH, $(du -sh "$WH" | cut -f1), $(ls "$WH" | wc -l) files"
start=$(date +%s)
"${NONET[@]}" make -C "$ROOT" --no-print-directory setup VENV="$VENV" OFFLINE="$WH"
echo "installed with no network in $(( $(date +%s) - start )) s into $VENV"
cd "$ROOT"
"${NONET[@]}" "$VENV/bin/python" -c "import pagedkv_lib, pagedkv_kernels, pagedkv_engine, nbgrader, nbval, jupyterlab; print('imports ok')"
"${NONET[@]}" "$VENV/bin/python" scripts/doctor.py
"${NONET[@]}" "$VENV/bin/python" -m pagedkv_lab.exercises check --solutions 01 06
rm -rf "$(dirname "$VENV")"
