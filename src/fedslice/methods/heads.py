"""``heads``: FedPETuning with per-client attention-head pruning ("Assortment of Attention Heads").

Runs on every architecture of the table. A head is a query head of one attention family (encoder
self, decoder self, decoder cross) of one layer: the keep-mask is (R, H) with one row per
(family, layer) (:func:`fedslice.slicing.heads.mask_rows`). Under grouped-query attention query
heads are scored and pruned one by one and a key/value head stays while any query head of its
group does; GPT-2's fused q|k|v is sliced in each of its sections.

Each round, a selected client (Algorithm 1 of the paper, with the importance computed *before*
local training, since it decides what the client trains):

1. loads the global LoRA state into the full model and scores every head on its local data
   (Eq. 6: mean max attention probability, :func:`fedslice.slicing.heads.head_importance`);
2. keeps its top ``1 - sparsity`` heads (Eq. 7; or random ones, or all) and trains
   - ``prune='parameters'`` (default, the paper's §3.1): the full model, in which the pruned
     heads' trainable tensors are frozen (:func:`fedslice.slicing.partial.partial_model`): they
     still run forward; their weight gradients and optimizer state are saved;
   - ``prune='forward'``: a really smaller model: q/k/v rows and o columns of the pruned heads
     are sliced away (:func:`fedslice.slicing.spec.extract_model`), so forward and backward
     FLOPs fall; a layer left without heads outputs o's bias only. At 90% sparsity every
     client trains a different network whose updates FedAvg cannot reconcile (README, "Head
     pruning": 0.64 vs 0.82 test accuracy on a 4-class topic task);
3. uploads the LoRA tensors of its sub-model only (q/k/v ``lora_B`` rows and o ``lora_A``
   columns of the kept heads, the head-free LoRA tensors of layers that kept a head, the
   classifier), its keep-mask and its importance vector α_c (counted in the upload bytes).

The server (:class:`HeadsStrategy`, pure functions over state dicts) applies Eq. 8 per head and
Eq. 5 to the rest (:func:`fedslice.slicing.heads.aggregate_heads`). Client selection is the
engine's ``federation.selection`` ('loss_gap' = Eq. 9). Baselines of the paper's Table 1:
B1 = ``pruning='none', aggregation='fedavg'`` (FedPETuning), B2 = ``pruning='random',
aggregation='fedavg'``.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn as nn

from pydantic import Field

from fedslice.config import ExperimentConfig, MethodOptions
from fedslice.data.batching import TokenizedSplit
from fedslice.data.partition import sample_rows
from fedslice.errors import ConfigError, ModelError
from fedslice import measure
from fedslice.fl.client import LocalResult, train_local
from fedslice.fl.strategy import Payload, Reply, State, Strategy
from fedslice.measure import ClientCost
from fedslice.tasks import Task
from fedslice.fl.validation import check_num_examples, check_update
from fedslice.methods.base import Role
from fedslice.methods.fedpetuning import FedPETuning
from fedslice.models.loading import LoadedModel
from fedslice.registry import register_method
from fedslice.report import figure, rounds_of, save_figure
from fedslice.slicing.heads import (HeadUpdate, combine_heads, ensure_eager_attention, head_axes,
                                    head_deltas, head_importance, heads_state, keep_mask,
                                    mask_rows, mask_spec, num_rows, position_cuts)
from fedslice.slicing.partial import freeze_parameters, partial_model
from fedslice.slicing.spec import HEAD_PARTS, HeadPositions, extract_model, key_info

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Options ([method] with name = "heads")
# --------------------------------------------------------------------------------------------

class HeadsMethod(MethodOptions):
    """FedPETuning + per-client attention-head pruning, head-weighted aggregation ("Assortment of
    Attention Heads": Eq. 6-8). Client selection is ``federation.selection`` ('loss_gap' = Eq. 9)."""

    name: Literal["heads"] = "heads"
    sparsity: float = Field(0.9, ge=0, lt=1, description="Fraction s of attention heads each client "
                            "prunes (Eq. 7): it keeps round((1-s)*heads), in [0, 1).")
    pruning: Literal["importance", "random", "none"] = Field(
        "importance", description="Which heads a client keeps: its most important ones (Eq. 6), "
        "random ones (baseline B2), or all (baseline B1).")
    scope: Literal["global", "per_layer"] = Field(
        "global", description="Rank heads over all layers (a layer may keep none) or per layer.")
    prune: Literal["parameters", "forward"] = Field(
        "parameters", description="'parameters' (the paper's §3.1): a pruned head's trainable "
        "tensors are neither trained nor sent, the frozen head stays in the forward pass (saves "
        "their backward/optimizer work); 'forward': pruned heads leave the sub-model (saves "
        "forward and backward, but at high sparsity each client trains a different network and "
        "accuracy falls far behind: README, 'Head pruning').")
    aggregation: Literal["head_weighted", "fedavg"] = Field(
        "head_weighted", description="Head-tied LoRA slices: importance-weighted mean (Eq. 8) or "
        "example-weighted mean over the clients that kept the head (Eq. 5).")
    eps: float = Field(1e-8, ge=0, description="epsilon of Eq. 8.")
    importance_batch_size: int = Field(64, gt=0)
    sink_keys: int = Field(
        0, ge=0, description="Causal self-attention: the first N real tokens of an example are "
        "not counted as keys of Eq. 6 (decoder heads park attention on the first token, an "
        "attention sink, and look confident; README, 'Head pruning'). 0: the paper's rule.")
    importance_max_examples: int | None = Field(
        None, gt=0, description="Score heads on at most this many local examples (seeded sample); "
        "default: all of them, as in the paper.")
    plot_rounds: int = Field(10, ge=0, description="Rounds drawn in head_importance.png.")

#: Reserved reply keys (not model tensors): the client's keep-mask and importance, both (R, H):
#: one row per (attention family, layer), stack by stack (:func:`mask_rows`).
KEPT = "heads.kept"
ALPHA = "heads.alpha"


def kept_count(num_rows: int, num_heads: int, sparsity: float, scope: str) -> int:
    """Heads kept per pool (every (family, layer) row for 'global', one row for 'per_layer')."""
    pool = num_rows * num_heads if scope == "global" else num_heads
    return int(np.round((1 - sparsity) * pool))


def max_sparsity(pool: int) -> float:
    """The largest sparsity, at 4 decimals, that keeps a head of a pool of ``pool`` (1 - 1/pool,
    rounded down so that the value printed in messages is valid as written)."""
    return math.floor((1 - 1 / pool) * 1e4) / 1e4


# --------------------------------------------------------------------------------------------
# Server
# --------------------------------------------------------------------------------------------

def bounded_importance(alpha: torch.Tensor | None, kept: torch.Tensor) -> torch.Tensor | None:
    """α of one client divided by its mean over the client's kept heads: every client's Eq. 8
    weights average 1 on the heads it kept, so its total weight is its number of kept heads
    whatever it reports. Eq. 8 is a ratio per head, so this changes only how clients compare,
    not how one client ranks its heads: a client claiming α = 1 everywhere weighs as much on a
    head as an honest one of average confidence there, instead of taking every head."""
    if alpha is None:
        return None
    mean = alpha[kept].float().mean() if bool(kept.any()) else torch.tensor(1.0)
    return alpha.float() / mean


class HeadsStrategy(Strategy):
    """Validates head-pruned replies and aggregates them with Eq. 8 (or FedAvg per head)."""

    def __init__(self, fed, opts: HeadsMethod, arch, dims: list[dict[str, int]],
                 client_sizes: Mapping[int, int] | None = None,
                 positions: Mapping[str, HeadPositions] | None = None):
        super().__init__(fed, client_sizes)
        self.opts, self.arch, self.dims = opts, arch, dims  # dims: one dict per stack
        #: adapter tensors outside the blocks that map to heads (a prefix), by name
        self.positions = dict(positions or {})

    @property
    def mask_shape(self) -> tuple[int, int]:
        return num_rows(self.dims), self.dims[0]["num_heads"]

    def _kept(self, reply: Reply) -> torch.Tensor:
        if KEPT in reply.arrays:
            return reply.arrays[KEPT].bool()
        return torch.ones(self.mask_shape, dtype=torch.bool)

    def expected_update(self, state: State, payload: Payload, reply: Reply) -> State:
        """The adapter slices of the heads the client kept (it reports which, in ``KEPT``): every
        non-empty one, except the attention adapter of a (family, layer) that kept no head (it
        gets no gradient, and is not sent: :meth:`Heads.local_params`)."""
        kept = self._kept(reply)
        rows = mask_rows(self.dims)
        out = {}
        for k, t in heads_state(state, kept, self.arch, self.dims, self.positions).items():
            info = key_info(self.arch, k)
            if t.numel() == 0 or (info is not None and info.part in HEAD_PARTS and
                                  not bool(kept[rows[(info.stack, info.family)] + info.layer].any())):
                continue
            out[k] = t
        return out

    def check_reply(self, state: State, payload: Payload, reply: Reply) -> str | None:
        """The generic checks, plus the client's head reports: the keep-mask (bool, (R, H), as
        many heads as the sparsity keeps, and present exactly when the method prunes), the
        importance α of Eq. 8 (in (0, 1] on every kept head, 0 on the pruned ones) and the head
        metrics the run's summary reads (equal to the mask)."""
        size = self.client_sizes.get(payload.config.get("client"))
        if reason := check_num_examples(reply.num_examples, size):
            return reason
        if reason := self.check_heads(reply):
            return reason
        model = {k: t for k, t in reply.arrays.items() if k not in (KEPT, ALPHA)}
        return check_update(self.expected_update(state, payload, reply), model, reply.num_examples,
                            reply.metrics, size)

    def check_heads(self, reply: Reply) -> str | None:
        shape, o = self.mask_shape, self.opts
        for key in (KEPT, ALPHA):
            t = reply.arrays.get(key)
            if t is not None and not isinstance(t, torch.Tensor):
                return f"{key} is a {type(t).__name__}, not a tensor"
            if t is not None and tuple(t.shape) != shape:
                return f"{key} has shape {tuple(t.shape)}, expected {shape}"
        if (KEPT in reply.arrays) != (o.pruning != "none"):
            return (f"a keep-mask ({KEPT}) with method.pruning = 'none'" if KEPT in reply.arrays
                    else f"no keep-mask ({KEPT}) with method.pruning = {o.pruning!r}")
        kept = self._kept(reply) if KEPT not in reply.arrays else reply.arrays[KEPT]
        if kept.dtype != torch.bool:
            return f"{KEPT} has dtype {kept.dtype}, expected torch.bool"
        want = keep_mask(torch.zeros(shape), o.sparsity, scope=o.scope,  # the count, not the draw
                         mode="none" if o.pruning == "none" else "importance")
        got = kept.sum(1) if o.scope == "per_layer" else kept.sum()
        if not torch.equal(got, want.sum(1) if o.scope == "per_layer" else want.sum()):
            return (f"{KEPT} keeps {got.tolist()} heads, sparsity {o.sparsity} ({o.scope}) "
                    f"keeps {(want.sum(1) if o.scope == 'per_layer' else want.sum()).tolist()}")
        alpha = reply.arrays.get(ALPHA)
        if o.aggregation == "head_weighted":
            if alpha is None:
                return f"no importance vector ({ALPHA}) for head-weighted aggregation"
            if not alpha.is_floating_point() or not bool(torch.isfinite(alpha).all()):
                return f"importance {ALPHA} is not finite floating point"
            if bool((alpha[~kept] != 0).any()):
                return f"importance {ALPHA} is not 0 on a pruned head"
            if bool(((alpha[kept] <= 0) | (alpha[kept] > 1)).any()):
                return (f"importance {ALPHA} is outside (0, 1] on a kept head (a mean attention "
                        "probability)")
        elif alpha is not None:
            return f"an importance vector ({ALPHA}) with method.aggregation = {o.aggregation!r}"
        if "head_kept" in reply.metrics and reply.metrics["head_kept"] != kept.flatten().int().tolist():
            return "metric head_kept differs from the keep-mask"
        if "head_importance" in reply.metrics and \
                len(reply.metrics["head_importance"] or []) != kept.numel():
            return f"metric head_importance does not hold {kept.numel()} values"
        return None

    def client_updates(self, server_round: int, state: State, payloads: dict[int, Payload],
                       replies: dict[int, Reply]) -> tuple[list[State], list]:
        """Head-pruned updates scattered to full shape; weights α_hc (Eq. 8) or |D_c| on the
        kept heads, |D_c| elsewhere."""
        updates = [HeadUpdate({k: t for k, t in r.arrays.items() if k not in (KEPT, ALPHA)},
                              self._kept(r), bounded_importance(r.arrays.get(ALPHA), self._kept(r)),
                              r.num_examples)
                   for _, r in sorted(replies.items())]
        return head_deltas(state, updates, self.arch, self.dims, self.opts.aggregation, self.positions)

    def mean(self, server_round: int, state: State, deltas: list[State], weights: list) -> State:
        return combine_heads(state, deltas, weights, self.arch, self.dims, eta=self.fed.server_lr,
                             eps=self.opts.eps, positions=self.positions)


# --------------------------------------------------------------------------------------------
# Method (client side)
# --------------------------------------------------------------------------------------------

def special_token_ids(tokenizer, config=None) -> list[int]:
    """[CLS]/[SEP], BOS/EOS, padding and the decoder start token (of ``config``): excluded as keys
    of the importance score (Eq. 6, Voita et al.)."""
    ids = [getattr(tokenizer, f"{t}_token_id", None) for t in ("sep", "cls", "eos", "bos", "pad")]
    ids.append(getattr(config, "decoder_start_token_id", None))
    return sorted({int(i) for i in ids if isinstance(i, int)})


class Heads(FedPETuning):
    name = "heads"
    batched_clients = False  # each client trains its own kept heads' slices
    sends_slices = True
    # any adapter with tensors of its own. Head-tied tensors: LoRA B rows of q/k/v and A columns
    # of o (DoRA: also q/k/v magnitudes), IA3's vector entries of each head, a prefix's key/value
    # columns of each head; prompt tuning and P-tuning have none (nothing of them is pruned)
    adapters = None
    lora_aggregations = ("fedit", "ffa", "fedex", "flora", "svd")
    lora_aggregation_hint = ("a client keeps no B of its own: the heads it prunes change every "
                             "round, and Eq. 8 weighs the head-tied B rows it sends")
    lora_ranks_per_client = False

    @classmethod
    def check_config(cls, cfg: ExperimentConfig) -> None:
        super().check_config(cfg)
        adapter = cls.adapter_class(cfg)
        name = adapter.name
        if cfg.method.prune == "forward" and not (adapter.head_tied and adapter.in_modules):
            why = ("has no per-head parameters: every client would train the whole adapter "
                   "through a different pruned network, and FedAvg cannot reconcile them"
                   if not adapter.head_tied else
                   "keeps its per-head tensors outside the attention modules, sized by peft for "
                   "every head of every layer, so a sub-model keeping different heads per layer "
                   "cannot use it")
            raise ValueError(f"method.prune='forward' with peft.method={name!r}: the {name} "
                             f"adapter {why}; use method.prune='parameters' or lora, dora, ia3")
        opts = cfg.adapter_options(name)
        targets = getattr(opts, "targets", None)
        if targets is not None and getattr(opts, "target_modules", None) is None \
                and not set(targets) & {"q", "k", "v", "o", "all-linear"}:
            raise ValueError(f"{name}.targets {targets}: method heads needs the {name} adapter "
                             "on at least one attention projection (q, k, v or o)")

    def __init__(self, cfg: ExperimentConfig, loaded: LoadedModel, task: Task,
                 role: Role = "both", client_sizes: Mapping[int, int] | None = None):
        self.opts: HeadsMethod = cfg.method
        self.special_ids = special_token_ids(loaded.tokenizer, loaded.model.config)
        self.all_dims = loaded.arch.all_dims(loaded.model.config)
        super().__init__(cfg, loaded, task, role, client_sizes)
        self._check_heads()

    @property
    def mask_shape(self) -> tuple[int, int]:
        """(R, H): one row per (attention family, layer), one column per query head."""
        return num_rows(self.all_dims), self.all_dims[0]["num_heads"]

    # -- construction ------------------------------------------------------------------------
    @property
    def needs_importance(self) -> bool:
        return self.opts.pruning == "importance" or self.opts.aggregation == "head_weighted"

    def _check_heads(self) -> None:
        """Fail early, naming the problem: no separable heads, no head-tied LoRA tensor, a
        sparsity that keeps no head, no eager attention for the importance scores."""
        d, (rows, heads) = self.dims, self.mask_shape
        if self.arch.head_dim_attr is None and d["hidden"] != d["num_heads"] * d["head_dim"]:
            raise ModelError(f"method heads needs separable attention heads (q/k/v/o projections "
                             f"of num_heads x head_dim); {self.arch.model_type} with hidden "
                             f"{d['hidden']} and {d['num_heads']} heads has none")
        if len({x["num_heads"] for x in self.all_dims}) > 1:
            raise ModelError(f"method heads ranks heads over every stack: {self.arch.model_type} "
                             f"with {[x['num_heads'] for x in self.all_dims]} heads per stack differs")
        if self.adapter.head_tied and not head_axes(self.trainable(), self.arch) \
                and not self.positions:
            name = self.adapter.name
            targets = getattr(self.adapter.options, "target_modules", None) or \
                getattr(self.adapter.options, "targets", None)
            raise ConfigError(f"{name}.targets {targets}: method heads needs the {name} adapter "
                              "on at least one attention projection (q, k, v or o)")
        if not self.adapter.head_tied:
            log.info("heads: the %s adapter has no per-head parameters: pruning leaves nothing of "
                     "it untrained or unsent (the importance pass still runs for Eq. 8 and "
                     "loss-gap selection)", self.adapter.name)
        o = self.opts
        if kept_count(rows, heads, o.sparsity, o.scope) < 1 and o.pruning != "none":
            pool = rows * heads if o.scope == "global" else heads
            raise ConfigError(f"method.sparsity={o.sparsity} keeps no head (round((1 - s) * {pool}) "
                              f"= 0 with scope={o.scope!r}): the largest valid method.sparsity is "
                              f"{max_sparsity(pool)} (keeps 1 of {pool} heads)")
        if self.needs_importance:
            previous = ensure_eager_attention(self.model)  # raises ModelError when unavailable
            if previous != "eager":
                self.arch_base().set_attn_implementation(previous)

    def arch_base(self) -> nn.Module:
        get = getattr(self.model, "get_base_model", None)
        return get() if callable(get) else self.model

    def make_strategy(self) -> Strategy:
        #: trainable tensors outside the blocks that map to heads (a prefix's key/value columns)
        self.positions = {n: pos for n, p in self.trainable().items()
                          if (pos := self.adapter.head_positions(n, p.shape, self.all_dims)) is not None}
        return HeadsStrategy(self.cfg.federation, self.cfg.method, self.arch, self.all_dims,
                             self.client_sizes, self.positions)

    # -- client ------------------------------------------------------------------------------
    def importance(self, data: TokenizedSplit, seed: int) -> tuple[torch.Tensor, float]:
        """(R, H) head importance on (a sample of) the local data, and its measured FLOPs."""
        n = self.opts.importance_max_examples
        if n is not None and n < len(data):
            data = data.subset(sample_rows(len(data), n, seed))
        with measure.count_flops() as fc:
            scores = head_importance(self.model, data, self.special_ids, self.opts.importance_batch_size,
                                     sink_keys=self.opts.sink_keys)
        names = [f.name for f in self.arch.attention_outputs]
        if missing := [n for n in names if n not in scores]:
            raise ModelError(f"no attention scores for {missing} (got {sorted(scores)})")
        return torch.cat([scores[n].float() for n in names]), float(fc.total)  # (R, H)

    def keep(self, alpha: torch.Tensor | None, seed: int) -> torch.Tensor:
        """The (R, H) keep-mask of this client for this round (Eq. 7)."""
        scores = alpha if alpha is not None else torch.zeros(self.mask_shape)
        return keep_mask(scores, self.opts.sparsity, mode=self.opts.pruning, scope=self.opts.scope,
                         generator=torch.Generator().manual_seed(seed % (2**63)))

    def local_model(self, kept: torch.Tensor) -> nn.Module:
        """The model the client trains: the full model with the pruned heads' trainable tensors
        frozen (``prune='parameters'``), or the sub-model without them (``'forward'``)."""
        if bool(kept.all()):
            return self.model
        spec = mask_spec(kept, self.all_dims)
        if self.opts.prune == "forward":
            # a headless layer's sliced o keeps its adapter (LoRA B: hidden x r): frozen, so the
            # backward does not run down to it for a zero gradient
            sub = extract_model(self.model, spec, self.arch)
            return freeze_parameters(sub, self.headless_tensors(sub, kept))
        return partial_model(self.model, spec, self.arch,
                             extra=position_cuts(self.positions, kept, self.all_dims))

    def headless_tensors(self, sub: nn.Module, kept: torch.Tensor) -> set[str]:
        """The trainable attention tensors of ``sub`` in a (family, layer) that keeps no head."""
        rows = mask_rows(self.all_dims)
        out = set()
        for n, p in sub.named_parameters():
            info = key_info(self.arch, n) if p.requires_grad else None
            if info is not None and info.part in HEAD_PARTS and \
                    not bool(kept[rows[(info.stack, info.family)] + info.layer].any()):
                out.add(n)
        return out

    def local_params(self, sub: nn.Module, kept: torch.Tensor) -> dict[str, nn.Parameter]:
        """Trainable tensors of the sub-model that the client really trains and uploads: not the
        empty slices, nor the attention tensors of a (family, layer) without heads."""
        headless = self.headless_tensors(sub, kept)
        return {n: p for n, p in sub.named_parameters()
                if p.requires_grad and p.numel() and n not in headless}

    def fit(self, payload: Payload, data: TokenizedSplit, seed: int) -> Reply:
        if len(data) == 0:
            log.warning("client %s has no training data: skipped", payload.config.get("client"))
            return Reply(arrays={}, num_examples=0, metrics=self._skipped_metrics(payload))
        self.client_model(payload)  # the global state, loaded into the full model in place
        alpha, imp_flops = self.importance(data, seed) if self.needs_importance else (None, 0.0)
        kept = self.keep(alpha, seed)
        sub = self.local_model(kept)
        params = self.local_params(sub, kept)
        result = train_local(sub, params, data, payload.config, seed, loss_fn=self.task.loss,
                             virtual_tokens=self.adapter.virtual_tokens)
        for p in sub.parameters():
            p.grad = None  # tensors outside the optimizer (empty slices) may hold a gradient
        arrays = {n: p.detach().clone() for n, p in params.items()}
        if self.opts.pruning != "none":
            arrays[KEPT] = kept.clone()
        if self.opts.aggregation == "head_weighted":
            arrays[ALPHA] = alpha * kept  # Eq. 7: pruned heads have importance 0
        metrics = self.client_metrics(sub, params, payload, arrays, result)
        metrics.update(self.head_metrics(kept, alpha, result, imp_flops))
        return Reply(arrays=arrays, num_examples=len(data), metrics=metrics)

    # -- metrics -----------------------------------------------------------------------------
    def client_metrics(self, model, params, payload, arrays, result: LocalResult) -> dict[str, float]:
        metrics = super().client_metrics(model, params, payload, arrays, result)
        kept = self._kept_of(arrays)
        if self.opts.prune == "parameters":  # every head runs forward (and passes gradients back)
            kept = torch.ones_like(kept)
        metrics["flops_analytic"] = self.analytic_flops(model, result, kept)
        return metrics

    def _kept_of(self, arrays: State) -> torch.Tensor:
        if KEPT in arrays:
            return arrays[KEPT].bool()
        return torch.ones(self.mask_shape, dtype=torch.bool)

    def analytic_flops(self, model: nn.Module, result: LocalResult, kept: torch.Tensor) -> float:
        """:func:`measure.analytic_train_flops` of the sub-model, with the attention term (one per
        (family, layer) row, each at the mean sequence length; backward only above the frozen
        bottom rows) and the skipped input-gradient of the lowest trained row's q/k/v over the
        kept heads only."""
        d = self.dims
        seq = result.tokens / max(result.examples, 1)
        bottom = self.frozen_bottom(model)
        base = self.analytic_train_flops(model, result, embedding_backward=False, frozen=bottom,
                                         num_layers=sum(x["num_layers"] for x in self.all_dims))
        frozen = bottom[0]  # one stack, one family: row r is layer r
        rows = kept.shape[0]
        T, hd, width = float(result.tokens), d["head_dim"], d["hidden"]
        kept_width = float(kept.sum()) * hd                                  # sum_r kept_r * head_dim
        trained_width = float(kept[frozen:].sum()) * hd                      # rows the backward reaches
        attention = 4.0 * seq * T * (kept_width - rows * width) \
            + 8.0 * seq * T * (trained_width - (rows - frozen) * width)      # fwd 4 + bwd 8
        first_qkv = 6.0 * T * width * (width - float(kept[frozen].sum()) * hd) if frozen < rows else 0.0
        return base["total"] + attention + first_qkv

    def head_metrics(self, kept: torch.Tensor, alpha: torch.Tensor | None, result: LocalResult,
                     importance_flops: float) -> dict[str, Any]:
        d = self.dims
        per_layer = (kept.float().sum(1) / d["num_heads"]).tolist()
        seq = result.tokens / max(result.examples, 1)
        rows = kept.shape[0]  # the paper counts T5-small as 18 = 6 + 2 x 6 attention layers
        ops = paper_ops(rows, d["hidden"], seq, kept=per_layer, **self.paper_peft())
        dense = paper_ops(rows, d["hidden"], seq, **self.paper_peft())
        out: dict[str, Any] = {
            "sparsity": 1.0 - float(kept.float().mean()), "heads_kept": int(kept.sum()),
            "headless_layers": int((~kept.any(1)).sum()), "flops_importance": importance_flops,
            "paper_ops": ops["total"] * result.examples, "paper_ops_dense": dense["total"] * result.examples,
            "head_kept": kept.flatten().int().tolist(), "num_heads": d["num_heads"],
        }
        if alpha is not None:  # diagnostics for the plots (the server gets α via ALPHA)
            out["head_importance"] = [round(float(a), 6) for a in alpha.flatten()]
        return out

    def paper_peft(self) -> dict[str, Any]:
        """The adapter as Table 6 counts it (its row, rank and prompt length)."""
        about = self.adapter.describe()
        return {"peft": about.get("table6", "none"), "rank": about.get("rank", 0),
                "prompt_tokens": about.get("virtual_tokens", 0)}

    def _skipped_metrics(self, payload: Payload) -> dict[str, float]:
        cost = ClientCost(bytes_down=measure.tensor_bytes(payload.arrays),
                          params_down=measure.num_params(payload.arrays), flops_measured=0.0,
                          flops_analytic=0.0, peak_rss_mb=0.0, activation_mb=0.0)
        return {"loss": math.nan, "steps": 0, **cost.to_metrics(), "flops_importance": 0.0,
                "paper_ops": 0.0, "paper_ops_dense": 0.0}

    @classmethod
    def report_views(cls, folder, config, metrics, summary) -> list:
        """Eq. 6 importance per head (mean over every client-round that scored heads) and how
        often each head was kept."""
        from fedslice.viz import heatmap_view
        imp, kept = [], []
        for r in metrics:
            for c in r.get("client_metrics") or []:
                if c.get("head_importance") and c.get("num_heads"):
                    imp.append(np.reshape(c["head_importance"], (-1, int(c["num_heads"]))))
                if c.get("head_kept") and c.get("num_heads"):
                    kept.append(np.reshape(c["head_kept"], (-1, int(c["num_heads"]))))
        views = []
        if imp:
            m = np.mean(imp, axis=0)
            names = [f"row {i}" for i in range(m.shape[0])]
            views.append(heatmap_view(
                "Head importance (heads method)", m, xlabel="head", ylabel="attention layer",
                row_names=names, value="mean importance (Eq. 6)",
                caption=f"Mean over {len(imp)} client-rounds; rows: one per (attention family, "
                        "layer), stack by stack."))
        if kept:
            m = np.mean(kept, axis=0)
            views.append(heatmap_view(
                "Heads kept (heads method)", m, xlabel="head", ylabel="attention layer",
                row_names=[f"row {i}" for i in range(m.shape[0])], value="share of client-rounds kept",
                caption=f"Share of {len(kept)} client-rounds that trained each head."))
        return views

    # -- after training ----------------------------------------------------------------------
    def final_metrics(self, state: State, data: Any, records: list[dict[str, Any]],
                      batch_size: int) -> dict[str, Any]:
        """Means over client-rounds of the head metrics, and Table 6 at the paper's T = 512."""
        ms = [m for r in records for m in r["client_metrics"] if m.get("num_examples", 0) > 0]
        out: dict[str, Any] = {}
        for k in ("sparsity", "heads_kept", "headless_layers", "flops_importance", "paper_ops",
                  "paper_ops_dense"):
            vals = [m[k] for m in ms if k in m]
            out[f"{k}_mean"] = float(np.mean(vals)) if vals else None
        d = self.dims
        rows, heads = self.mask_shape
        kept = [np.reshape(m["head_kept"], (rows, heads)).mean(1) for m in ms if "head_kept" in m]
        per_layer = np.mean(kept, 0).tolist() if kept else 1.0
        peft = self.paper_peft()
        out["paper_ops_T512_dense"] = paper_ops(rows, d["hidden"], 512, **peft)["total"]
        out["paper_ops_T512"] = paper_ops(rows, d["hidden"], 512, kept=per_layer, **peft)["total"]
        return out

    @classmethod
    def plots(cls, run_dir: Path, config: dict[str, Any], metrics: list[dict[str, Any]],
              summary: dict[str, Any], title: str) -> list[Path]:
        """``head_importance.png`` and ``head_distance.png`` (:func:`plot_head_importance`)."""
        rounds = (config.get("method") or {}).get("plot_rounds", 10)
        return plot_head_importance(metrics, run_dir, rounds, title)


register_method(name="heads", options_cls=HeadsMethod, method_cls=Heads)


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------

def _importance_by_round(metrics: Sequence[Mapping[str, Any]]) -> list[tuple[int, list[tuple[int, Any]]]]:
    """[(round, [(client, (L, H) importance array), ...]), ...] for rounds whose clients report a
    ``head_importance`` (the ``heads`` method); clients in id order."""
    import numpy as np

    out = []
    for r, m in zip(rounds_of(metrics), metrics):
        clients = [(int(c["client"]), np.reshape(c["head_importance"], (-1, int(c["num_heads"]))))
                   for c in m.get("client_metrics") or [] if c.get("head_importance")]
        if clients:
            out.append((r, sorted(clients, key=lambda x: x[0])))
    return out


def plot_head_importance(metrics: Sequence[Mapping[str, Any]], run_dir: str | os.PathLike,
                         rounds: int = 10, title: str = "", max_clients: int = 4) -> list[Path]:
    """``head_importance.png``: a heatmap (rows: layers per attention family; columns: heads)
    of each selected client's importance in the first ``rounds`` rounds (at most ``max_clients`` per round; kept heads dotted), and
    ``head_distance.png``: the Euclidean distance between two clients' importance vectors per
    round (the heads paper's Fig. 5), with the mean pairwise distance when more clients train.
    Returns the paths written ([] when no client reported head importance)."""
    import numpy as np

    data = _importance_by_round(metrics)
    if not data or rounds <= 0:
        return []
    run_dir = Path(run_dir)
    shown = data[:rounds]
    ncols = min(max_clients, max(len(cs) for _, cs in shown))
    vmin = min(float(a.min()) for _, cs in shown for _, a in cs[:ncols])
    vmax = max(float(a.max()) for _, cs in shown for _, a in cs[:ncols])
    L, H = shown[0][1][0][1].shape
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(1.2 + 0.35 * H * ncols, 0.6 + 0.28 * L * len(shown) + 0.5), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(shown), ncols, squeeze=False)
    kept_of = {(r, int(c["client"])): c.get("head_kept") for r, m in zip(rounds_of(metrics), metrics)
               for c in m.get("client_metrics") or []}
    image = None
    for i, (r, clients) in enumerate(shown):
        for j in range(ncols):
            ax = axes[i][j]
            ax.set_xticks([])
            ax.set_yticks([])
            if j >= len(clients):
                ax.axis("off")
                continue
            c, imp = clients[j]
            image = ax.imshow(imp, vmin=vmin, vmax=vmax, cmap="viridis", aspect="auto")
            kept = kept_of.get((r, c))
            if kept is not None:
                ys, xs = np.nonzero(np.reshape(kept, (L, H)))
                ax.scatter(xs, ys, s=4, c="white", marker="o")
            ax.set_title(f"r{r} c{c}", fontsize=7)
    fig.colorbar(image, ax=axes, shrink=0.6, label="importance (rows: layers, per attention family; • kept)")
    fig.suptitle(f"{title}: head importance" if title else "head importance", fontsize=9)
    heat = save_figure(fig, run_dir / "head_importance.png")

    fig, (ax,) = figure()
    xs, two, mean = [], [], []
    for r, clients in data:
        if len(clients) < 2:
            continue
        vecs = [a.flatten() for _, a in clients]
        pairs = [float(np.linalg.norm(vecs[a] - vecs[b]))
                 for a in range(len(vecs)) for b in range(a + 1, len(vecs))]
        xs.append(r)
        two.append(pairs[0])
        mean.append(float(np.mean(pairs)))
    ax.plot(xs, two, marker="o", markersize=3, label="first two clients")
    if any(abs(a - b) > 1e-12 for a, b in zip(two, mean)):
        ax.plot(xs, mean, linestyle="--", label="mean over client pairs")
    ax.set_xlabel("round")
    ax.set_ylabel("Euclidean distance of importance vectors")
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    if xs:
        ax.legend(loc="upper right")
    return [heat, save_figure(fig, run_dir / "head_distance.png")]


# --------------------------------------------------------------------------------------------
# The paper's analytic OPs count (Appendix A, Table 6)
# --------------------------------------------------------------------------------------------
#
# The heads paper's analytic OPs count (Appendix A, Table 6), implemented as printed.
#
# Table 6 of "Assortment of Attention Heads" gives, per layer, the operations (MACs, "OPs") of one
# training step on a sequence of ``T`` tokens with hidden size ``d``; the totals are ``L`` times
# the per-layer terms. As printed (forward + backward rows):
#
# =============  ===========================================  ===================================
# QKV            fwd ``T d^3``                                bwd ``T d^3 + T d^2``
# Attention      fwd ``T^2 d^2 + T^3 d``                      bwd ``T^2 d^2 + 3 T^3 d``
# FC             fwd ``T d^3``                                bwd ``T d^3 + T d^2``
# LoRA           fwd ``T d^2 r + T r^2 d``                    bwd ``T d^2 r + T r d + T d r + T r^2 d + T d^3``
# IA3            fwd ``T d``                                  bwd ``2 T d``
# Prompt tuning  fwd ``Tp d^3 + (Tp+T)^2 d^2 + (Tp+T)^3 d``   bwd ``Tp d^3 + (Tp+T)^2 d^2 + 3 (Tp+T)^3 d`` (no ``L``)
# P-tuning       the prompt-tuning rows times ``L``
# =============  ===========================================  ===================================
#
# The odd terms are kept as printed, on purpose (this function documents the paper, it is not a
# cost model): a ``T x d`` by ``d x d`` product costs ``T d^2`` MACs, not ``T d^3``; the scores
# ``Q K^T`` and ``A V`` cost ``T^2 d`` each, not ``T^2 d^2 + T^3 d``; LoRA's backward through the
# frozen weight is ``T d^2``, not ``T d^3``. With T5-small's ``L=18, d=512`` (Table 7) and
# ``T=512`` every such term is ``512^4 ~ 6.9e10``, so the formulas give ~13.7 T-OPs for LoRA
# r=16, not the 33.07 G-OPs of Tables 1-4: the tables were not computed with these formulas as
# printed (or with other ``T``/``d``). Use :func:`fedslice.measure.analytic_train_flops` and the
# measured FLOPs for real costs; this is reported next to them for comparison with the paper.
#
# Head pruning is not in Table 6. Our reading: the per-head rows (QKV, Attention and the PEFT
# rows, which adapt the attention projections) scale with the fraction ``k_l`` of heads a layer
# keeps, FC does not: ``total = sum_l k_l (QKV + Attention + PEFT) + FC``. At 90% sparsity this
# gives 3.8x fewer OPs for T5-small at T=512 (the paper reports 3.9x).

Peft = Literal["lora", "ia3", "prompt_tuning", "p_tuning", "none"]


def table6_rows(hidden: int, tokens: float, rank: int = 0, prompt_tokens: int = 0) -> dict[str, float]:
    """Per-layer OPs of each Table 6 row, forward + backward, exactly as printed."""
    d, T, r, Tp = float(hidden), float(tokens), float(rank), float(prompt_tokens)
    S = Tp + T
    return {
        "qkv": T * d**3 + (T * d**3 + T * d**2),
        "attention": (T**2 * d**2 + T**3 * d) + (T**2 * d**2 + T**3 * d + T**3 * d + T**3 * d),
        "fc": T * d**3 + (T * d**3 + T * d**2),
        "lora": (T * d**2 * r + T * r**2 * d)
                + (T * d**2 * r + T * r * d + T * d * r + T * r**2 * d + T * d**3),
        "ia3": T * d + (T * d + T * d),
        "prompt": (Tp * d**3 + S**2 * d**2 + S**3 * d)
                  + (Tp * d**3 + S**2 * d**2 + S**3 * d + S**3 * d + S**3 * d),
    }


def paper_ops(num_layers: int, hidden: int, tokens: float, *, rank: int = 0, peft: Peft = "lora",
              kept: float | Sequence[float] = 1.0, prompt_tokens: int = 0) -> dict[str, float]:
    """OPs (MACs) of one training step on one sequence of ``tokens`` tokens (Table 6).

    ``kept`` is the fraction of heads kept, one number for every layer or one per layer. Returns
    the summed rows ``qkv``, ``attention``, ``fc``, ``peft`` and their ``total``.
    """
    ks = [float(kept)] * num_layers if isinstance(kept, (int, float)) else [float(k) for k in kept]
    if len(ks) != num_layers:
        raise ValueError(f"kept has {len(ks)} entries for {num_layers} layers")
    row = table6_rows(hidden, tokens, rank, prompt_tokens)
    per_layer_peft = {"lora": row["lora"], "ia3": row["ia3"], "p_tuning": row["prompt"],
                      "prompt_tuning": 0.0, "none": 0.0}[peft]
    out = {"qkv": row["qkv"] * sum(ks), "attention": row["attention"] * sum(ks),
           "fc": row["fc"] * num_layers, "peft": per_layer_peft * sum(ks)}
    if peft == "prompt_tuning":  # printed without the factor L: the prompt enters once
        out["peft"] = row["prompt"] * (sum(ks) / num_layers)
    out["total"] = out["qkv"] + out["attention"] + out["fc"] + out["peft"]
    return out

