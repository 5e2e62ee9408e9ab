"""lm-evaluation-harness tasks that read local files (``fedslice evaluate --harness``).

Each ``*_local.yaml`` here is one of lm_eval's own tasks (same prompt, choices and metrics) whose
data are JSONL files under :func:`data_root`: ``$FEDSLICE_HARNESS_DATA``, or
``~/.cache/fedslice/harness`` when it is unset (``bench/data/build_harness_tasks.py`` writes
them there). The YAMLs name their files relative to that folder (``dataset_kwargs.data_files``)
and load them through :func:`load` (``custom_dataset: !function local_data.load``), so the same
folder works with ``lm_eval --include_path`` as with fedslice. A missing file is a
:class:`HarnessDataMissing` naming it and how to build it.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

#: the folder of the shipped task YAMLs (an ``--include_path`` of lm_eval)
TASKS_DIR = Path(__file__).resolve().parent
DATA_ENV = "FEDSLICE_HARNESS_DATA"
BUILDER = "bench/data/build_harness_tasks.py"


class HarnessDataMissing(FileNotFoundError):
    """A local harness task's data file is not there."""


def data_root() -> Path:
    """Where the local tasks' data files are: ``$FEDSLICE_HARNESS_DATA`` or the user cache."""
    env = os.environ.get(DATA_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "fedslice" / "harness"


def load(data_files: dict[str, str] | None = None, **_: Any):
    """The ``datasets.DatasetDict`` of ``data_files`` (split -> JSONL file; a relative path is
    under :func:`data_root`). lm_eval passes the task's metadata as further keywords."""
    import datasets

    if not data_files:
        raise HarnessDataMissing("the task YAML names no dataset_kwargs.data_files")
    root = data_root()
    files = {split: Path(f).expanduser() if Path(f).expanduser().is_absolute() else root / f
             for split, f in data_files.items()}
    missing = [str(p) for p in files.values() if not p.is_file()]
    if missing:
        how = (f"build it with `python {BUILDER}` (from the fedslice repository) or point "
               f"${DATA_ENV} at the folder that holds it")
        raise HarnessDataMissing(f"data file {missing[0]} is missing: {how}")
    return datasets.load_dataset("json", data_files={s: str(p) for s, p in files.items()})
