#!/usr/bin/env bash
# The GPU check on a lent GPU machine, after bench/gpu_prepare.sh here: the device tool's run
# with carry [".whl", ".gpu"] and the command `bash bench/gpu_remote.sh [gpu_check.py options]`.
# Installs the carried wheels over the machine's own packages (its torch stays), builds MiniLM's
# and SmolLM2's shapes with random weights, runs bench/gpu_check.py (all steps but `flower`
# unless --only says otherwise) and leaves the log and BENCHMARKS.md with the table in $OUT.
set -uo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 3
export PYTHONPATH="/tmp/site:$PWD/src:$PWD/bench/perf" FEDSLICE_DATA_DIR="$PWD/.gpu/data" PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
OUT="${OUT:-/tmp/gpu-check-out}"; mkdir -p "$OUT"
python3 -c "import torch, transformers, peft; print('torch', torch.__version__, 'transformers', transformers.__version__, 'peft', peft.__version__, torch.cuda.get_device_name())"
python3 bench/random_weights.py .gpu/minilm /tmp/minilm >/dev/null 2>&1 || exit 4
python3 bench/random_weights.py .gpu/smollm2 /tmp/smollm2 >/dev/null 2>&1 || exit 4
cp BENCHMARKS.md "$OUT/"
args=("$@"); [[ " $* " == *" --only "* ]] || args+=(--only device,batched,llama1b,decoder)
timeout 480 python3 bench/gpu_check.py --model /tmp/minilm --decoder /tmp/smollm2 \
  --benchmarks "$OUT/BENCHMARKS.md" "${args[@]}" 2>&1 | grep -v -i "warn" | tee "$OUT/log"
