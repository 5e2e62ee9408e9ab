#!/usr/bin/env bash
# Every GPU target of the performance issues on one GPU, in at most 8 minutes; the table goes into
# BENCHMARKS.md ("GPU check"). Run it first whenever a GPU is at hand (bench/gpu_check.py says
# what each step measures).
#
#   bash bench/gpu_check.sh           # on a GPU
#   bash bench/gpu_check.sh --dry     # the CPU rehearsal of every step but the CUDA checks (CI runs
#                                     # it: tests/test_gpu_check.py), tiny workloads
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
[ -x "$PY" ] || PY=python3
exec "$PY" bench/gpu_check.py "$@"
