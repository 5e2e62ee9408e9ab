#!/usr/bin/env bash
# Prepare the GPU check for a lent GPU machine (the `device` tool: a bare machine with its own
# torch, no network, at most 64 MiB carried per call). Here, once per session:
#
#   bash bench/gpu_prepare.sh        # wheels into .whl/, model shapes and data into .gpu/ (both git-ignored)
#
# then, through the device tool, one call with carry [".whl", ".gpu"]:
#
#   bash bench/gpu_remote.sh [--only device,batched,llama1b,decoder]
#
# What travels: the wheels the machine lacks or has at other versions (transformers 5.23, peft
# 0.21.2, pydantic, tomli-w), the configs and tokenizers of MiniLM and SmolLM2 without their
# weights (91 MB and 538 MB: over the limit; bench/random_weights.py builds each shape with
# random weights there: speed and device agreement, not accuracy), SST-2 and E2E. Not Flower's
# simulation: Ray's wheel alone is over 64 MiB, so the `flower` step is left out.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-.venv/bin/python}"
mkdir -p .git/info
for d in /.whl/ /.gpu/; do grep -qxF "$d" .git/info/exclude 2>/dev/null || echo "$d" >> .git/info/exclude; done
PLAT="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
ver() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
rm -rf .whl .gpu && mkdir -p .whl .gpu/minilm .gpu/smollm2 .gpu/data
for w in "transformers==$(ver transformers)" "peft==$(ver peft)" "pydantic==$(ver pydantic)" \
         "pydantic-core==$(ver pydantic-core)" "annotated-types==$(ver annotated-types)" \
         "typing-inspection==$(ver typing-inspection)" "tomli-w==$(ver tomli-w)"; do
  "$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $PLAT -d .whl "$w"
done
minilm=$("$PY" -c "from fedslice.models.loading import resolve_model_path as r; print(r('minilm'))")
smollm2=$("$PY" -c "from fedslice.models.loading import resolve_model_path as r; print(r('smollm2'))")
for f in config.json special_tokens_map.json tokenizer.json tokenizer_config.json vocab.txt; do cp "$minilm/$f" .gpu/minilm/; done
for f in "$smollm2"/*; do case "$(basename "$f")" in *.safetensors) ;; *) cp "$f" .gpu/smollm2/;; esac; done
data=$("$PY" -c "from fedslice.data.locate import data_search_dirs as d; print(next(str(x) for x in d() if (x / 'sst2').is_dir()))")
cp -r "$data/sst2" "$data/e2e_nlg" .gpu/data/
du -sh .whl .gpu
