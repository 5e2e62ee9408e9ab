"""A model folder's architecture with random weights (seed 0) and its tokenizer, for a machine
that cannot receive the weights (the GPU machine takes 64 MiB per call: MiniLM's weights are
91 MB, SmolLM2's 538 MB). Speed and device agreement do not depend on the weights' values;
accuracy does, so a run on such a folder reports no accuracy.

    python bench/random_weights.py SRC DST     # SRC: config.json + tokenizer files (weights not read)
"""

from __future__ import annotations

import sys
from pathlib import Path


def random_weights(src: Path, dst: Path) -> Path:
    import torch
    import transformers
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(src)
    cls = getattr(transformers, (config.architectures or ["AutoModel"])[0])
    torch.manual_seed(0)
    model = cls._from_config(config) if hasattr(cls, "_from_config") else cls.from_config(config)
    model.save_pretrained(dst)
    AutoTokenizer.from_pretrained(src).save_pretrained(dst)
    return dst


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(random_weights(Path(sys.argv[1]), Path(sys.argv[2])))
