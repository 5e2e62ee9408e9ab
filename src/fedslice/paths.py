"""Where fedslice keeps files between runs (distilled proxies, converted checkpoints)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root(configured: str | None = None) -> Path | None:
    """The cache folder: the configured one, else $FEDSLICE_CACHE_DIR, else ~/.cache/fedslice;
    None when disabled (configured as '')."""
    if configured == "":
        return None
    if configured is not None:
        return Path(configured).expanduser()
    env = os.environ.get("FEDSLICE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fedslice"
