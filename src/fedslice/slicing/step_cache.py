"""The planner's measured steps kept in a folder across runs (``budgets.step_cache``).

A measured step (:class:`fedslice.slicing.planner.StepMeasure`: FLOPs, the peak of tensors saved
for backward, the training state) depends on what the step runs, not on the weights' values:
the planned model's structure (every module's class and plain attributes, every parameter's and
buffer's name, shape, dtype and whether it trains: :func:`fedslice.slicing.block_steps.block_kind`
over the whole model, so a rank, precision, adapter depth or checkpointing is part of it), the
HF config (attention implementation included), the measured rows (values digested), the task's
loss (its settings), whether FLOPs are counted and which head modules apart, packed training,
how the step was measured (whole or extrapolated from cut models), and the code that measures:
torch's and transformers' versions, a digest of fedslice's own sources, the threads. A key is a
digest of all of these; an entry is one small JSON file, written whole (a rename), so runs of a
benchmark (its rows, reruns, processes side by side) share their measurements safely.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch
from torch import nn

from fedslice.slicing.planner import StepMeasure


@functools.cache
def source_digest() -> str:
    """A digest of fedslice's own Python sources (what measures a step may change with them)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.blake2b(digest_size=16)
    for path in sorted(root.rglob("*.py")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def _digest(value) -> str:
    return hashlib.blake2b(repr(value).encode(), digest_size=20).hexdigest()


def config_settings(config) -> str:
    """A HF config's fields as JSON, but ``use_cache`` (a checkpointed forward turns it off for
    good; the key/value cache it returns changes neither the FLOPs nor what autograd saves)."""
    fields = config.to_dict() if hasattr(config, "to_dict") else {}
    fields.pop("use_cache", None)
    fields["_attn_implementation"] = getattr(config, "_attn_implementation", None)
    return json.dumps(fields, sort_keys=True, default=str)


class StepCache:
    """Measured steps in ``folder`` by what determines them; ``context``: what a run's steps
    share (the task's loss settings, the model's config section and its HF config as the planner
    starts: :func:`config_settings`; read once, as a forward may write to it)."""

    def __init__(self, folder: str | os.PathLike, context) -> None:
        import transformers

        self.folder = Path(folder).expanduser()
        self._context = _digest((context, torch.__version__, transformers.__version__, source_digest(),
                                 torch.get_num_threads()))

    def key(self, model: nn.Module, rows_key: tuple, flops: bool, head, packed: bool, how: str) -> str:
        """The key of a step of ``model`` (as planned now) on rows of ``rows_key``
        (:func:`fedslice.slicing.planner.batch_key`)."""
        from fedslice.slicing.block_steps import block_kind

        return _digest((self._context, block_kind(model), rows_key, flops, tuple(head), packed, how))

    def get(self, key: str) -> StepMeasure | None:
        path = self.folder / f"{key}.json"
        try:
            return StepMeasure(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None  # none kept (or unreadable: measured again and rewritten)

    def put(self, key: str, step: StepMeasure) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.folder, prefix=".", suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(step), f)
        os.replace(tmp, self.folder / f"{key}.json")
