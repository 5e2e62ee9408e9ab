"""Helpers shared by the methods whose clients train a smaller copy of the model (``fedpft``'s
proxy, ``fedot``'s emulator + adapter): parameter counts, the distillation corpus, the cache."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from fedslice.config import DistillConfig, ExperimentConfig
from fedslice.data.batching import TokenizedSplit
from fedslice.distill import cache
from fedslice.distill.corpus import fingerprint, iter_passages, pack_chunks, resolve_checked
from fedslice.distill.loop import DistillLog
from fedslice.tasks import Task
from fedslice.models.arch import ArchSpec


def transformer_params(model: nn.Module, arch: ArchSpec) -> int:
    """Parameters of the transformer blocks of every stack (LoRA adapters excluded), each tensor
    counted once."""
    seen: dict[int, int] = {}
    for k in range(len(arch.stacks)):
        for name, p in arch.blocks(model, k).named_parameters(remove_duplicate=False):
            if "lora_" not in name:
                seen[id(p)] = p.numel()
    return sum(seen.values())


def named_params(model: nn.Module, modules: list[nn.Module]) -> dict[str, nn.Parameter]:
    """Name (in ``model``) -> parameter, for every parameter of ``modules``."""
    ids = {id(p) for m in modules for p in m.parameters()}
    return {n: p for n, p in model.named_parameters() if id(p) in ids}


def sub_seed(seed: int, *keys: int) -> int:
    """A reproducible seed derived from the run seed and ``keys``."""
    return int(np.random.SeedSequence([seed, *keys]).generate_state(1)[0])


class Corpus:
    """The distillation corpus of a method: resolved and checked at once, packed on first use."""

    def __init__(self, cfg: ExperimentConfig, distill: DistillConfig, tokenizer, steps: int,
                 field: str):
        self.distill, self.tokenizer, self.field = distill, tokenizer, field
        self.max_chunks = max(1, steps) * distill.batch_size
        self.source = resolve_checked(distill, field=field, data_path=cfg.data.path)
        self._split: TokenizedSplit | None = None

    @property
    def split(self) -> TokenizedSplit:
        if self._split is None:
            self._split = pack_chunks(iter_passages(self.source, self.distill), self.tokenizer,
                                      self.distill.max_length, self.max_chunks, self.field)
        return self._split

    def cache_inputs(self) -> dict[str, Any]:
        """What a distilled result depends on, on the corpus side (without packing it)."""
        d = self.distill
        return {"corpus": str(self.source), "corpus_files": fingerprint(self.source),
                "text_column": d.text_column, "hub_split": d.hub_split, "lr": d.lr,
                "warmup": d.warmup, "batch_size": d.batch_size, "max_length": d.max_length,
                "max_chunks": self.max_chunks}


def cached_distill(root, inputs: dict[str, Any], params: dict[str, nn.Parameter],
                   run) -> tuple[DistillLog, bool]:
    """Load the distilled ``params`` from the cache, or ``run()`` the distillation and store them.
    Returns (the loss log, whether it came from the cache)."""
    key = cache.cache_key(inputs)
    hit = cache.load(root, key)
    if hit is not None and set(hit[0]) == set(params) and \
            all(hit[0][k].shape == params[k].shape for k in params):
        with torch.no_grad():
            for k, p in params.items():
                p.copy_(hit[0][k])
        return DistillLog.from_dict(hit[1]["log"]), True
    log = run()
    cache.save(root, key, {k: p.detach() for k, p in params.items()}, {"inputs": inputs, "log": log.to_dict()})
    return log, False


def sub_accuracy(task: Task, model: nn.Module, data: Any, batch_size: int) -> dict[str, float]:
    """Dev and test score of a client-side model (proxy / emulator) in the task's primary metric:
    ``proxy_{dev,test}_<metric>`` (``..._accuracy`` for classification, ``..._rougeL`` for
    generation)."""
    out, metric = {}, task.primary_metric
    for split in ("dev", "test"):
        ev = task.evaluate(model, getattr(data, split), batch_size)
        out[f"proxy_{split}_{metric}"] = ev[metric]
    return out


def concat_logs(logs: list[DistillLog]) -> DistillLog | None:
    """One log of several distillations run one after another (for a single curve)."""
    if not logs:
        return None
    return DistillLog(losses=[s for lg in logs for s in lg.losses], steps=sum(lg.steps for lg in logs),
                      tokens=sum(lg.tokens for lg in logs), flops=sum(lg.flops for lg in logs),
                      time_s=sum(lg.time_s for lg in logs))


def nan_to_none(d: dict[str, Any]) -> dict[str, Any]:
    return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in d.items()}
