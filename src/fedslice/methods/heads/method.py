"""The ``heads`` method: model preparation, a client's local training and the server's round
end. See :mod:`fedslice.methods.heads`.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from fedslice import measure
from fedslice.compute import model_device, to_device
from fedslice.config import ExperimentConfig
from fedslice.data.batching import TokenizedSplit, iter_batches
from fedslice.data.partition import sample_rows
from fedslice.errors import ConfigError, ModelError
from fedslice.fl.client import LocalResult, train_local
from fedslice.fl.orders import order_fields
from fedslice.fl.strategy import Payload, Reply, State, Strategy
from fedslice.measure import ClientCost
from fedslice.methods.client_costs import analytic_train_flops, frozen_bottom
from fedslice.methods.facts import Facts
from fedslice.methods.stage import Composition, Stage
from fedslice.methods.fedpetuning import FedPETuning
from fedslice.methods.heads.capture import CapturingLoss, fit_first_step, fit_training
from fedslice.methods.heads.options import HeadsMethod, kept_count, max_sparsity
from fedslice.methods.heads.report import head_views, importance_views, paper_ops
from fedslice.report import run_label
from fedslice.methods.heads.strategy import ALPHA, HeadsStrategy, KEPT
from fedslice.methods.plan_records import PlannedModel
from fedslice.models.loading import LoadedModel
from fedslice.slicing.heads import (ensure_eager_attention, head_axes, head_importance, keep_mask,
                                    mask_rows, mask_spec, num_rows, restrict, sub_dims, to_full)
from fedslice.slicing.head_fill import fill_pruned_heads, output_means
from fedslice.slicing.head_aggregate import position_cuts
from fedslice.slicing.keys import key_info
from fedslice.slicing.partial import PartialLinear, freeze_parameters, partial_model
from fedslice.slicing.spec import HEAD_PARTS
from fedslice.slicing.state import extract_state
from fedslice.slicing.surgery import extract_model
from fedslice.tasks import Task

log = logging.getLogger(__name__)


def special_token_ids(tokenizer, config=None) -> list[int]:
    """[CLS]/[SEP], BOS/EOS, padding and the decoder start token (of ``config``): excluded as keys
    of the importance score (Eq. 6, Voita et al.)."""
    ids = [getattr(tokenizer, f"{t}_token_id", None) for t in ("sep", "cls", "eos", "bos", "pad")]
    ids.append(getattr(config, "decoder_start_token_id", None))
    return sorted({int(i) for i in ids if isinstance(i, int)})


class HeadStage(Stage):
    """The head stage: each client scores the heads of the model the stage below gives it (the
    full model: ``heads``; its RaFFM sub-model: ``raffm+heads``), keeps the top ``1 - sparsity``
    and trains and sends only their tensors; the server weighs them with Eq. 8
    (:class:`HeadsStrategy` around the stage below's strategy). A stage over a method
    (:class:`~fedslice.methods.stage.Composition`: ``heads`` is it over FedPETuning);
    keep-masks and importances travel in the full model's (R, H) layout whatever model the
    client trains."""

    batched_clients = False  # each client trains its own kept heads' slices
    sends_slices = True
    # any adapter with tensors of its own. Head-tied tensors: LoRA B rows of q/k/v and A columns
    # of o (DoRA: also q/k/v magnitudes), IA3's vector entries of each head, a prefix's key/value
    # columns of each head; prompt tuning and P-tuning have none (nothing of them is pruned)
    adapters = None
    lora_aggregations = ("fedit", "ffa", "fedex", "flora", "svd")
    lora_aggregation_hint = ("a client keeps no B of its own: the heads it prunes change every "
                             "round, and Eq. 8 weighs the head-tied B rows it sends")
    # per-client LoRA ranks (lora.ranks: tiers or the planner) as the stage below trains them:
    # the rank axis of a head-tied tensor is not its head axis (B: rows by head, columns by
    # rank), so a client's kept heads are cut from its rank's tensors

    @classmethod
    def facts(cls, cfg: ExperimentConfig, below: Facts) -> Facts:
        """The stage below's, but a plan cannot pick the precision of a sub-model cut by pruning."""
        if cfg.method.prune == "forward":
            return below.but(precision_refusal="method.prune = 'forward' cuts each client's "
                             "sub-model from the fp32 model; use method.prune = 'parameters'")
        return below

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, below) -> None:
        adapter = below.adapter_class(cfg)
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
        if cfg.method.prune == "forward" and adapter.name == "lora" and cfg.lora.ranks is not None:
            raise ValueError(f"lora.ranks={cfg.lora.ranks} with method.prune='forward': a forward-mode "
                             "client's sub-model is cut from the full-rank adapter; use "
                             "method.prune='parameters' for per-client ranks")
        source = getattr(cfg.method, "importance_source", "pass")
        if source in ("first_step", "training"):
            why = ("method.prune='forward' (a forward-mode client's sub-model needs its keep-mask "
                   "before its first forward; use importance_source='pass' with a small "
                   "method.importance_max_examples)" if cfg.method.prune == "forward" else
                   f"federation.weight_decay = {cfg.federation.weight_decay} (AdamW's decay would "
                   "move the pruned heads' rows, which must keep their values)"
                   if cfg.federation.weight_decay and source == "first_step" else None)
            if why is not None:
                raise ValueError(f"method.importance_source={source!r} cannot run with {why}")
        opts = cfg.adapter_options(name)
        targets = getattr(opts, "targets", None)
        if targets is not None and getattr(opts, "target_modules", None) is None \
                and not set(targets) & {"q", "k", "v", "o", "all-linear"}:
            raise ValueError(f"{name}.targets {targets}: method heads needs the {name} adapter "
                             "on at least one attention projection (q, k, v or o)")

    @classmethod
    def check_supported(cls, arch, task: Task, below) -> None:
        if below.sub_models and task.cfg.method.prune == "forward" and arch.head_bias is not None:
            raise ConfigError(f"method.prune='forward' with method.name={task.cfg.method.name!r} on "
                              f"{arch.model_type}: its stack-wide position-bias table is cut to "
                              "the client's sub-model, and heads pruned inside that would each "
                              "need columns of the sub-model's table (not built): use "
                              "method.prune='parameters'")

    def __init__(self, below, cfg: ExperimentConfig, loaded: LoadedModel, task: Task):
        super().__init__(below, cfg, loaded, task)
        self.special_ids = special_token_ids(loaded.tokenizer, loaded.model.config)
        self.all_dims = loaded.arch.all_dims(loaded.model.config)
        self.opts: HeadsMethod = cfg.method  # before the strategy: the budget planner reads it
        # a pass of its own before training (else scored from training's forwards)
        self.importance_cap = self.opts.importance_max_examples \
            if self.needs_pass and self.opts.importance_source == "pass" else 0

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
        strategy = HeadsStrategy(self.below.make_strategy(), self.cfg.method, self.arch, self.all_dims,
                                 self.positions, self.knob_defaults)
        self._check_heads()  # the model prepared, the positions known
        return strategy

    # -- client ------------------------------------------------------------------------------
    def importance(self, data: TokenizedSplit, seed: int, model: nn.Module | None = None
                   ) -> tuple[torch.Tensor, float]:
        """(R, H) head importance of ``model`` (the full model or a client's sub-model: its own
        rows and heads) on (a sample of) the local data, and its measured FLOPs."""
        n = self.opts.importance_max_examples
        if n is not None and n < len(data):
            data = data.subset(sample_rows(len(data), n, seed))
        with measure.count_flops() as fc:
            scores = head_importance(self.model if model is None else model, data, self.special_ids, self.opts.importance_batch_size,
                                     sink_keys=self.opts.sink_keys)
        names = [f.name for f in self.arch.attention_outputs]
        if missing := [n for n in names if n not in scores]:
            raise ModelError(f"no attention scores for {missing} (got {sorted(scores)})")
        return torch.cat([scores[n].float() for n in names]), float(fc.total)  # (R, H)

    def keep(self, alpha: torch.Tensor | None, seed: int, sparsity: float, dims=None) -> torch.Tensor:
        """The (R, H) keep-mask of this client for this round (Eq. 7) at ``sparsity`` (its
        orders', :meth:`orders`), over the heads of its model (``dims``: a sub-model's,
        :func:`fedslice.slicing.heads.sub_dims`, where at least one head is kept; None: the
        full model's)."""
        shape = (num_rows(dims or self.all_dims), (dims or self.all_dims)[0]["num_heads"])
        scores = alpha if alpha is not None else torch.zeros(shape)
        return keep_mask(scores, sparsity, mode=self.opts.pruning, scope=self.opts.scope,
                         generator=torch.Generator().manual_seed(seed % (2**63)),
                         min_keep=0 if dims is None else 1)

    def local_model(self, model: nn.Module, kept: torch.Tensor, payload: Payload,
                    dims=None, means: Mapping | None = None) -> nn.Module:
        """The model the client trains: ``model`` (the stage below's, ``dims`` its heads) with
        the pruned heads' trainable tensors frozen (``prune='parameters'``), or without them
        (``'forward'``: a sub-model cut from the full model, the payload loaded into it; with
        ``means`` (:func:`fedslice.slicing.head_fill.output_means` of ``model``, ``method.fill =
        'mean'``) the pruned heads' mean outputs are added back as constants)."""
        dims = self.all_dims if dims is None else dims
        if bool(kept.all()):
            return model
        # the slice the client trains, in full-model indices (the server's expected update:
        # HeadsStrategy), read inside the stage below's sub-model (``outer``) where there is one
        outer = self.client_spec(payload)
        spec = mask_spec(kept, dims) if outer is None else \
            restrict(outer, to_full(kept, outer, self.all_dims), self.all_dims)
        if self.opts.prune == "forward":
            sub = extract_model(self.model, spec, self.arch)
            if outer is not None:  # the payload is the stage below's slice
                self.load_state(dict(sub.named_parameters()),
                                extract_state(payload.arrays, spec, self.arch, within=outer))
            if means is not None:
                fill_pruned_heads(sub, model, kept, dims, means, self.arch,
                                  rank=self.opts.fill_rank if self.opts.fill == "linear" else None,
                                  ridge=self.opts.fill_ridge)
            # a headless layer's sliced o keeps its adapter (LoRA B: hidden x r): frozen, so the
            # backward does not run down to it for a zero gradient
            # and the tensors below the client's adapter depth (its plan's)
            return freeze_parameters(sub, self.headless_tensors(sub, kept, dims)
                                     | set(payload.orders.frozen_tensors))
        return partial_model(model, spec, self.arch, within=outer,
                             extra=position_cuts(self.positions, kept, dims))

    def headless_tensors(self, sub: nn.Module, kept: torch.Tensor, dims=None) -> set[str]:
        """The trainable attention tensors of ``sub`` in a (family, layer) that keeps no head."""
        rows = mask_rows(self.all_dims if dims is None else dims)
        out = set()
        for n, p in sub.named_parameters():
            info = key_info(self.arch, n) if p.requires_grad else None
            if info is not None and info.part in HEAD_PARTS and \
                    not bool(kept[rows[(info.stack, info.family)] + info.layer].any()):
                out.add(n)
        return out

    def local_params(self, sub: nn.Module, kept: torch.Tensor, dims=None) -> dict[str, nn.Parameter]:
        """Trainable tensors of the sub-model that the client really trains and uploads: not the
        empty slices, nor the attention tensors of a (family, layer) without heads."""
        headless = self.headless_tensors(sub, kept, dims)
        return {n: p for n, p in sub.named_parameters()
                if p.requires_grad and p.numel() and n not in headless}

    def count_mask(self, dims, sparsity: float, sub_model: bool) -> torch.Tensor:
        """A keep-mask of the right size over ``dims``' heads: which heads a client keeps
        depends on its data, how many does not. They are spread over as many (family, layer)
        rows as they can be (head 0 of every row first, then head 1, ...): a row that keeps a
        head sends its adapter's shared tensors too (LoRA A of q/v), so this is the most a
        client of this sparsity can send (the budget planner's upload)."""
        rows, heads = num_rows(dims), dims[0]["num_heads"]
        spread = -(torch.arange(heads)[None, :] * rows + torch.arange(rows)[:, None]).float()  # (R, H)
        return keep_mask(spread, sparsity, mode=self.opts.count_mode, scope=self.opts.scope,
                         min_keep=1 if sub_model else 0)

    def upload_of(self, params: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """What a client sends: its kept heads' tensors, its mask and importance vector."""
        out = dict(params)
        if self.opts.pruning != "none":
            out[KEPT] = torch.zeros(self.mask_shape, dtype=torch.bool)
        if self.opts.aggregation == "head_weighted":
            out[ALPHA] = torch.zeros(self.mask_shape)
        return out

    # -- budgets -----------------------------------------------------------------------------
    def plan_axes(self, budgets) -> dict[str, list]:
        """The stage below's knobs and the head sparsity (``budgets.sparsities`` that keep a
        head; method.sparsity alone when the method does not prune)."""
        axes = dict(self.below.plan_axes(budgets))
        if "specs" in axes:  # sub-models whose heads the stage can prune (whole key/value groups)
            axes["specs"] = [(s, w) for s, w in axes["specs"] if self._prunable(s)]
        if self.opts.pruning == "none":
            return axes
        if self.needs_importance and self.opts.importance_source == "pass" and \
                self.opts.prune == "parameters" and not self.cfg.federation.weight_decay:
            axes["importances"] = list(budgets.importance_sources)  # the pass, then the first step
        rows, heads = self.mask_shape
        pool = rows * heads if self.opts.scope == "global" else heads
        axes["sparsities"] = [s for s in budgets.sparsities if kept_count(rows, heads, s, self.opts.scope) >= 1] \
            or [max_sparsity(pool)]
        return axes

    def _prunable(self, spec) -> bool:
        try:
            sub_dims(self.all_dims, spec)
        except ModelError:
            return False
        return True

    @contextmanager
    def planned_model(self, knobs) -> Iterator[PlannedModel]:
        """The stage below's planned model with ``knobs.sparsity`` of its heads pruned (leading
        heads kept); the importance pass runs on the stage below's model."""
        with self.below.planned_model(knobs) as lower:
            outer = knobs.spec
            dims = self.all_dims if outer is None else sub_dims(self.all_dims, outer)
            payload = Payload({}, {**knobs.payload_config(), **order_fields(
                spec=None if outer is None else outer.to_dict(),
                frozen_tensors=self.depth_frozen(knobs.depth))})
            orders = self.orders(payload)
            kept = self.count_mask(dims, orders.sparsity, outer is not None)
            sub = self.local_model(lower.model, kept, payload, dims)
            params = self.local_params(sub, kept, dims)
            yield PlannedModel(sub, self.upload_of(params), lower.model
                               if self.needs_pass and orders.importance_source == "pass" else None)

    @torch.no_grad()
    def forward_pass(self, data: TokenizedSplit, seed: int, model: nn.Module) -> float:
        """An inference forward of ``model`` over the importance examples (those of
        :meth:`importance`); returns its measured FLOPs."""
        n = self.opts.importance_max_examples
        if n is not None and n < len(data):
            data = data.subset(sample_rows(len(data), n, seed))
        was = model.training
        model.eval()
        device = model_device(model)
        with measure.count_flops() as fc:
            for batch in iter_batches(data, torch.argsort(data.lengths, stable=True),
                                      self.opts.importance_batch_size, shuffle=False, generator=None):
                batch.pop("labels", None)
                model(**to_device(batch, device))
        model.train(was)
        return float(fc.total)

    @property
    def needs_pass(self) -> bool:
        """A forward over the importance examples before training: Eq. 6's scores, or the
        pruned heads' means of ``fill = 'mean'`` (random pruning has no scores to compute)."""
        return self.needs_importance or self.fills_means

    @property
    def fills_means(self) -> bool:
        """``fill = 'mean'`` or ``'linear'`` in ``'forward'`` mode: pruned heads' mean outputs (or
        a linear map of the attention input fitted to them) added back."""
        return self.opts.prune == "forward" and self.opts.fill in ("mean", "linear")

    def fit(self, payload: Payload, data: TokenizedSplit, seed: int) -> Reply:
        if len(data) == 0:
            log.warning("client %s has no training data: skipped", payload.orders.client)
            return Reply(arrays={}, num_examples=0, metrics=self._skipped_metrics(payload))
        # the stage below's model (the full one, or the client's sub-model), the payload loaded
        model, _ = self.client_model(payload)
        outer = self.client_spec(payload)
        dims = self.all_dims if outer is None else sub_dims(self.all_dims, outer)
        orders = self.orders(payload)
        source = orders.importance_source
        if self.needs_importance and source == "first_step":
            alpha, kept, sub, params, result = fit_first_step(self, model, payload, data, seed, dims,
                                                               outer)
            imp_flops = 0.0  # no forward of its own: the scores come from training's first step
        elif self.needs_importance and source == "training":
            alpha, kept, sub, params, result = fit_training(self, model, payload, data, seed, dims,
                                                             outer)
            imp_flops = 0.0  # no forward of its own: the scores come from training's forwards
        else:
            with output_means(model, self.arch, regression=self.opts.fill == "linear") \
                    if self.fills_means else nullcontext() as means:
                alpha, imp_flops = self.importance(data, seed, model) if self.needs_importance else (None, 0.0)
                if self.fills_means and not self.needs_importance:  # random pruning: a forward for the means
                    imp_flops = self.forward_pass(data, seed, model)
            kept = self.keep(alpha, seed, orders.sparsity, None if outer is None else dims)
            sub = self.local_model(model, kept, payload, dims, means=means)
            params = self.local_params(sub, kept, dims)
            result = train_local(sub, params, data, orders, seed, loss_fn=self.task.loss,
                                 compute=self.compute, virtual_tokens=self.adapter.virtual_tokens,
                                 by_parts=self.adapter.in_modules, pack=self.packs(orders),
                                 flops_spent=imp_flops)
        for p in sub.parameters():
            p.grad = None  # tensors outside the optimizer (empty slices) may hold a gradient
        if outer is not None:  # the server reads masks in the full model's layout
            kept = to_full(kept, outer, self.all_dims)
            alpha = None if alpha is None else to_full(alpha, outer, self.all_dims)
        arrays = {n: p.detach().clone() for n, p in params.items()}
        if self.opts.pruning != "none":
            arrays[KEPT] = kept.clone()
        if self.opts.aggregation == "head_weighted":
            arrays[ALPHA] = alpha * kept  # Eq. 7: pruned heads have importance 0
        metrics = self.client_metrics(sub, params, payload, arrays, result)
        metrics.update(self.head_metrics(kept, alpha, result, imp_flops))
        return Reply(arrays=arrays, num_examples=len(data), metrics=metrics)

    def _train_capturing(self, model: nn.Module, params, data: TokenizedSplit, payload: Payload,
                         seed: int, loss_fn, handles=()):
        """:func:`train_local` with a capturing ``loss_fn`` (:meth:`first_step_loss`); its attention
        restored and the gradient-mask ``handles`` removed afterwards, whatever happens."""
        try:
            orders = self.orders(payload)
            return train_local(model, params, data, orders, seed, loss_fn=loss_fn,
                               compute=self.compute, virtual_tokens=self.adapter.virtual_tokens,
                               by_parts=self.adapter.in_modules, pack=self.packs(orders))
        finally:
            loss_fn.restore()
            for h in handles:
                h.remove()

    def first_step_loss(self, on_scores: Callable[..., None], every_step: bool = False) -> CapturingLoss:
        """The task's loss, scoring the heads from the first (or every) training step's own
        attention (:class:`~fedslice.methods.heads.capture.CapturingLoss`); call its
        ``restore()`` after training."""
        return CapturingLoss(self.task.loss, [f.name for f in self.arch.attention_outputs],
                             self.special_ids, self.opts.sink_keys, on_scores, every_step)

    def gradient_masks(self, model: nn.Module, kept: torch.Tensor, payload: Payload, dims,
                       full: Mapping[str, nn.Parameter]) -> dict[str, torch.Tensor]:
        """{name: 0/1 mask} for each tensor of ``full`` (``model``'s trainable tensors) that the
        parameter-pruned model of ``kept`` (:meth:`local_model`) does not train whole: zeros where
        it is frozen, along the pruned rows or columns of a partly trained tensor. The masks are
        read off that model (its :class:`PartialLinear` kept indices, its partly trained
        modules' kept entries, its frozen modules)."""
        sub = self.local_model(model, kept, payload, dims)
        trained = {n: p for n, p in sub.named_parameters() if p.requires_grad}
        kept_idx: dict[str, tuple[torch.Tensor, int]] = {}
        for mname, mod in sub.named_modules():
            prefix = f"{mname}." if mname else ""
            if isinstance(mod, PartialLinear):
                kept_idx[f"{prefix}weight"] = (mod.idx, mod.axis)
            for leaf, (_, inverse, axis) in mod.__dict__.get("_partial", {}).items():
                size = mod._parameters[leaf].shape[axis]
                kept_idx[f"{prefix}{leaf}"] = (torch.argsort(inverse)[:size], axis)
        masks = {}
        for name, p in full.items():
            if name not in trained:
                masks[name] = torch.zeros_like(p, dtype=torch.bool)
            elif trained[name].shape != p.shape:
                idx, axis = kept_idx[name]
                m = torch.zeros(p.shape[axis], dtype=torch.bool)
                m[idx.cpu()] = True
                view = [1] * p.dim()
                view[axis] = -1
                masks[name] = m.view(view).expand_as(p).to(p.device)
        return masks

    # -- metrics -----------------------------------------------------------------------------
    def client_spec(self, payload: Payload, arrays: State | None = None):
        """The stage below's slice; once trained, restricted to the kept heads when they leave
        the forward."""
        outer = self.below.client_spec(payload, arrays)
        if arrays is None or outer is None or self.opts.prune != "forward":
            return outer
        return restrict(outer, self._kept_of(arrays), self.all_dims)

    def client_metrics(self, model, params, payload, arrays, result: LocalResult) -> dict[str, float]:
        metrics = self.below.client_metrics(model, params, payload, arrays, result)
        if self.client_spec(payload) is not None:
            return metrics  # the sub-model's own count (:meth:`client_spec` of the reply)
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
        # the row length attention's FLOPs go with (packed rows: sum(rows x length²) / tokens)
        seq = result.attention_length or result.tokens / max(result.rows or result.examples, 1)
        bottom = frozen_bottom(self, model)
        base = analytic_train_flops(self, model, result, embedding_backward=False, frozen=bottom,
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
        """The heads' views (:func:`~fedslice.methods.heads.report.head_views`), and each client's importance in the first ``method.plot_rounds`` rounds with the
        distance between clients' (``head_importance.png``, ``head_distance.png``:
        :func:`~fedslice.methods.heads.report.importance_views`)."""
        rounds = (config.get("method") or {}).get("plot_rounds", 10)
        return head_views(metrics) + importance_views(metrics, rounds, run_label(summary, Path(folder)))

    # -- after training ----------------------------------------------------------------------
    def final_metrics(self, state: State, data: Any, records: list[dict[str, Any]],
                      batch_size: int) -> dict[str, Any]:
        """The stage below's, then the means over client-rounds of the head metrics, and
        Table 6 at the paper's T = 512."""
        ms = [m for r in records for m in r["client_metrics"] if m.get("num_examples", 0) > 0]
        out: dict[str, Any] = self.below.final_metrics(state, data, records, batch_size)
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


#: ``heads``: the head stage over FedPETuning's full model
Heads = Composition("heads", FedPETuning, (HeadStage,))


