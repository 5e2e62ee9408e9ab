"""On-disk cache of distilled tensors, so repeated runs skip the distillation.

An entry is ``<root>/<key>.safetensors`` (the distilled tensors) plus ``<key>.json`` (the loss
curve, costs and the key's inputs). The key is a hash of everything the result depends on: the
model's weights (a fingerprint), what is compressed, the corpus (file names, sizes, times) and
every distillation setting. Writes are atomic (temporary file + rename).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fedslice.paths import cache_root  # noqa: F401  (re-exported: methods ask the cache for its root)

log = logging.getLogger(__name__)

CACHE_VERSION = 1


def weights_fingerprint(model: nn.Module, skip: tuple[str, ...] = ()) -> str:
    """sha256 of every parameter's name, shape and bytes, except names containing ``skip``."""
    h = hashlib.sha256()
    for name, p in sorted(model.state_dict().items()):
        if any(s in name for s in skip):
            continue
        h.update(f"{name}:{tuple(p.shape)}:{p.dtype}".encode())
        h.update(p.detach().contiguous().cpu().numpy().tobytes())
    return h.hexdigest()[:24]


def cache_key(inputs: dict[str, Any]) -> str:
    text = json.dumps({"version": CACHE_VERSION, **inputs}, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def load(root: Path | None, key: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]] | None:
    """The cached (tensors, meta) of ``key``, or None."""
    if root is None:
        return None
    tensors, meta = root / f"{key}.safetensors", root / f"{key}.json"
    if not (tensors.is_file() and meta.is_file()):
        return None
    from safetensors.torch import load_file
    try:
        return load_file(tensors), json.loads(meta.read_text())
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable cache entry %s: %s", key, e)
        return None


def save(root: Path | None, key: str, tensors: dict[str, torch.Tensor], meta: dict[str, Any]) -> None:
    """Store an entry (no-op when the cache is disabled; a write failure only logs a warning)."""
    if root is None:
        return
    from safetensors.torch import save_file
    try:
        root.mkdir(parents=True, exist_ok=True)
        tmp = root / f".{key}.{os.getpid()}.tmp"
        save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, str(tmp))
        os.replace(tmp, root / f"{key}.safetensors")
        tmp_meta = root / f".{key}.{os.getpid()}.json.tmp"
        tmp_meta.write_text(json.dumps(meta, indent=1, default=str))
        os.replace(tmp_meta, root / f"{key}.json")
    except OSError as e:
        log.warning("cannot write the distillation cache in %s: %s", root, e)
