"""Helpers shared by the methods whose clients train a smaller copy of the model (``fedpft``'s
proxy, ``fedot``'s emulator + adapter): parameter counts, the distillation corpus, the cache, and
:class:`ClientBase`, the frozen tensors of that smaller model which the server sends a client at
first contact (so that a client never reads the full model: see :mod:`fedslice.methods.base`)."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from fedslice.config import DistillConfig, ExperimentConfig
from fedslice.registry import adapter_owning
from fedslice.data.batching import TokenizedSplit
from fedslice.distill import cache
from fedslice.distill.corpus import (HOLDOUT, fingerprint, image_folder_corpus, iter_passages,
                                     pack_chunks, resolve_checked)
from fedslice.errors import ConfigError
from fedslice.distill.loop import DistillLog
from fedslice.fl.strategy import State
from fedslice.tasks import Task
from fedslice.models.arch import ArchSpec

#: Keys of the client model's frozen tensors in the state a client keeps between participations.
BASE_PREFIX = "base."


def transformer_params(model: nn.Module, arch: ArchSpec) -> int:
    """Parameters of the transformer blocks of every stack (adapters' tensors excluded), each
    tensor counted once."""
    seen: dict[int, int] = {}
    for k in range(len(arch.stacks)):
        for name, p in arch.blocks(model, k).named_parameters(remove_duplicate=False):
            if adapter_owning(name) is None:
                seen[id(p)] = p.numel()
    return sum(seen.values())


def named_params(model: nn.Module, modules: list[nn.Module]) -> dict[str, nn.Parameter]:
    """Name (in ``model``) -> parameter, for every parameter of ``modules``."""
    ids = {id(p) for m in modules for p in m.parameters()}
    return {n: p for n, p in model.named_parameters() if id(p) in ids}


def frozen_tensors(model: nn.Module, exclude) -> State:
    """Every frozen parameter and every buffer of ``model`` (non-persistent ones too: a model
    built on the meta device has no values for them) by name, except the names in ``exclude``:
    the tensors no per-round payload carries. Each tensor once, under its first name."""
    out: State = {n: p.detach() for n, p in model.named_parameters()
                  if not p.requires_grad and n not in exclude}
    out.update({n: b for n, b in model.named_buffers() if n not in exclude})
    return out


class ClientBase:
    """The frozen part of a client's model (embeddings, attention and LayerNorm weights, whole
    layers, buffers): what a client needs besides the trainable tensors of every payload and a
    method's own first-contact tensors (FedPFT's compressed FFNs, FedOT's distilled emulator).

    On the server these are the live tensors of the client model (never copied); the strategy
    sends them in a client's first payload as ``Payload.model`` (counted in ``bytes_down``). A
    client built from the model's config (weights on the meta device, then zeros) holds none
    until :meth:`receive` loads them; it keeps them between participations with
    :meth:`state`/:meth:`load_state`. ``from_server=False`` (a process that loaded the full
    model: the in-process engine) always holds them and keeps no state."""

    def __init__(self, model: nn.Module, exclude, from_server: bool):
        self.tensors = frozen_tensors(model, exclude)
        self.from_server = from_server
        self.held = not from_server

    def payload(self) -> State:
        """What the server sends at first contact (the live tensors, not copies)."""
        return dict(self.tensors)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    @torch.no_grad()
    def receive(self, got: State, who: str) -> None:
        """Load a payload's ``model`` tensors (every one, exact shapes and dtypes); with none,
        the client must hold them from an earlier payload."""
        if not got:
            if not self.held:
                raise RuntimeError(f"{who}: the weights of its model are not on this node and not "
                                   "in the payload (its copy was lost)")
            return
        if set(got) != set(self.tensors):
            extra, missing = sorted(set(got) - set(self.tensors)), sorted(set(self.tensors) - set(got))
            raise RuntimeError(f"{who}: the model weights received do not fit the model built from "
                               f"the config (unexpected {extra[:3]}, missing {missing[:3]})")
        for k, t in got.items():
            dst = self.tensors[k]
            if dst.shape != t.shape or dst.dtype != t.dtype:
                raise RuntimeError(f"{who}: received {k} as {t.dtype} {tuple(t.shape)}, the model "
                                   f"built from the config has {dst.dtype} {tuple(dst.shape)}")
            if dst.data_ptr() != t.data_ptr():  # in-process, the server's own tensors arrive
                dst.copy_(t)
        self.held = True

    def state(self) -> State:
        """What a client keeps between participations (copies), or nothing if it holds none."""
        if not (self.from_server and self.held):
            return {}
        return {BASE_PREFIX + k: t.clone() for k, t in self.tensors.items()}

    def load_state(self, state: State) -> None:
        """Restore :meth:`state` (``{}``, or a state without ``base.*``: the node holds none)."""
        if not self.from_server:
            return
        self.held = False
        kept = {k[len(BASE_PREFIX):]: t for k, t in state.items() if k.startswith(BASE_PREFIX)}
        if kept:
            self.receive(kept, "kept state")


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


class ImageCorpus:
    """An image task's distillation corpus: the training images the server keeps apart
    (``distill.corpus = 'server_holdout'``, ``data.server_holdout``: as FedPFT distils ViT on
    ImageNet, images no client holds), or every image under a folder. Labels are not used.
    Preprocessed like the task's images, on first use."""

    def __init__(self, cfg: ExperimentConfig, distill: DistillConfig, task: Task, loaded, field: str):
        self.cfg, self.distill, self.task, self.loaded, self.field = cfg, distill, task, loaded, field
        self.source: Path | None = None
        if distill.corpus.strip() == HOLDOUT:
            if cfg.data.server_holdout <= 0:
                raise ConfigError(f"{field} = {HOLDOUT!r} needs data.server_holdout > 0 (the fraction "
                                  "of training images the server keeps apart)")
        else:
            self.source = resolve_checked(distill, field=field, data_path=cfg.data.path, text=False)
        self._split = None

    @property
    def split(self):
        if self._split is None:
            if self.source is None:
                self._split = self.task.holdout(self.loaded)
            else:
                self._split = image_folder_corpus(self.source, self.task.preprocessor(self.loaded),
                                                  self.task.tokens_for(self.loaded), self.field)
        return self._split

    def cache_inputs(self) -> dict[str, Any]:
        """What a distilled result depends on, on the corpus side: the images themselves."""
        d, split = self.distill, self.split
        h = hashlib.sha256(split.pixels[split.rows].numpy().tobytes())
        return {"corpus": self.distill.corpus.strip(), "images": h.hexdigest()[:24],
                "image_shape": list(split.pixels.shape[1:]), "n": len(split), "lr": d.lr,
                "warmup": d.warmup, "batch_size": d.batch_size}


def make_corpus(cfg: ExperimentConfig, distill: DistillConfig, task: Task, loaded, steps: int,
                field: str):
    """The distillation corpus of a method: text (:class:`Corpus`) for a text model, images
    (:class:`ImageCorpus`) for an image backbone; a corpus of the other kind is a ConfigError."""
    if loaded.arch.inputs == "image":
        return ImageCorpus(cfg, distill, task, loaded, field)
    if distill.corpus.strip() == HOLDOUT:
        task.holdout(loaded)  # raises: text tasks distil on text
    return Corpus(cfg, distill, loaded.tokenizer, steps, field)


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
