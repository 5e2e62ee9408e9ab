"""The ``raffm`` method: model preparation, a client's local training and the server's round
end. See :mod:`fedslice.methods.raffm`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager, nullcontext
from functools import cached_property
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from fedslice import measure
from fedslice.compute import model_device, to_device
from fedslice.config import ExperimentConfig
from fedslice.errors import ConfigError
from fedslice.fl.client import LocalResult
from fedslice.fl.strategy import Payload, Reply, State, Strategy, find_inner
from fedslice.models.quantize import held_bytes
from fedslice.methods.client_costs import analytic_train_flops, frozen_bottom
from fedslice.methods.facts import Facts
from fedslice.methods.base import Method, Role
from fedslice.methods.raffm.options import RaFFMMethod
from fedslice.methods.raffm.report import elastic_views, tier_summary
from fedslice.report import run_label
from fedslice.methods.raffm.strategy import RaFFMStrategy
from fedslice.models.arch import ArchSpec
from fedslice.models.loading import LoadedModel
from fedslice.slicing.permute import Permutation, in_original_order, unpermute_state
from fedslice.methods.plan_records import PlannedModel
from fedslice.slicing.planner import WidthsByFlops, measure_training_step, spec_params, width_candidates
from fedslice.slicing.masks import masked_inputs
from fedslice.slicing.depth import frozen
from fedslice.slicing.replay import BlockReplay
from fedslice.slicing.salience import (model_salience, output_activations, output_modules,
                                       scale_tensors, stack_order)
from fedslice.slicing.widths import layer_rise, measured_width_candidates
from fedslice.slicing.spec import SliceSpec, Spec, spec_from_dict, spec_sizes, stack_list
from fedslice.slicing.state import extract_state
from fedslice.slicing.surgery import extract_model
from fedslice.tasks import Task
from fedslice.tasks.base import batch_rows

log = logging.getLogger(__name__)


#: The run-folder file with the elastic sizes' sub-models (``fedslice export --size``).
ELASTIC = "raffm_elastic.json"


class RaFFM(Method):
    name = "raffm"
    sends_slices = True
    adapters = None  # any adapter whose per-head tensors sit in the modules it wraps (check_config)
    legacy_adapter_option = "tuning"
    lora_aggregations = ("fedit", "ffa", "fedex", "flora", "svd")
    lora_aggregation_hint = ("a client's slice of the salience-ordered model changes when the "
                             "server re-orders it, which a B kept on the client would not follow")
    lora_ranks_per_client = True  # the planner chooses width and rank together
    plans_budgets = True
    sub_models = True
    # model.quantize: the server orders and slices the fp32 base (its global state carries the
    # frozen slices); each client trains over a quantized copy of its slice (submodel_at)
    quantizes_slices = True

    @classmethod
    def facts(cls, cfg: ExperimentConfig) -> Facts:
        """A plan may pick its base's precision: a client planned at a lower precision trains
        an int8 copy of its slice (:meth:`submodel_at`); the global state is re-ordered every
        ``reorder_every`` rounds."""
        o, reorders = cfg.method, None
        if o.reorder and o.reorder_every:
            reorders = (f"method.reorder_every={o.reorder_every} (the server salience-orders the "
                        f"global state's heads and neurons every {o.reorder_every} rounds)")
        return super().facts(cfg).but(precision_refusal=None, reorders_state=reorders)

    @classmethod
    def check_config(cls, cfg: ExperimentConfig) -> None:
        super().check_config(cfg)
        adapter = cls.adapter_class(cfg)
        if cfg.budgets is not None and cfg.budgets.adapter_depths != [1.0] and cfg.method.elastic_depth:
            raise ValueError(f"budgets.adapter_depths={cfg.budgets.adapter_depths}: with "
                             "method.elastic_depth a sub-model drops blocks and renumbers the rest, "
                             "so the top blocks' tensors are not named as the full model's: set "
                             "one of them off")
        if adapter.head_tied and not adapter.in_modules:
            raise ValueError(f"peft.method={adapter.name!r}: method raffm trains sub-models that "
                             f"keep fewer heads per layer, and the {adapter.name} adapter's "
                             "per-head tensors sit outside the modules that are sliced (peft sizes "
                             "them for the full model's heads): use lora, dora, ia3, prompt, "
                             "ptuning or none")

    @classmethod
    def check_supported(cls, arch: ArchSpec, task: Task) -> None:
        super().check_supported(arch, task)
        if task.cfg.method.elastic_depth and (len(arch.stacks) > 1 or arch.head_bias):
            raise ConfigError(f"method.elastic_depth: dropping layers is for one-stack models "
                              f"without a shared position-bias table; {arch.model_type} has "
                              f"{len(arch.stacks)} stack(s): set it to false")
        if task.cfg.method.widths == "measured" and len(arch.stacks) > 1:
            raise ConfigError(f"method.widths = 'measured' is for one-stack models; "
                              f"{arch.model_type} has {len(arch.stacks)} stacks: set it to 'uniform'")

    def __init__(self, cfg: ExperimentConfig, loaded: LoadedModel, task: Task,
                 role: Role = "both", client_sizes: Mapping[int, int] | None = None, **kw):
        self.opts: RaFFMMethod = cfg.method
        self._loaded = loaded  # salience = 'activation' reads the dev split with its tokenizer
        self._submodels: dict[Spec, nn.Module] = {}
        #: (spec, precision) -> (the base order its frozen slices were quantized in, the
        #: quantized copy of the sub-model): :meth:`submodel_at`
        self._quantized: dict[tuple[Spec, str], tuple[str | None, nn.Module]] = {}
        #: the precision of every client's base (``model.quantize``; None: fp32); a client's plan
        #: may lower it (``budgets.precisions``, with an fp32 run base)
        self.client_precision = None if cfg.model.quantize == "none" else cfg.model.quantize
        if self.opts.sandwich:  # each client's loss runs the smallest size too: trains alone
            self.batched_clients = False
        super().__init__(cfg, loaded, task, role, client_sizes, **kw)

    # -- construction ------------------------------------------------------------------------
    def make_strategy(self) -> Strategy:
        """Every client's sub-model, rank and the rest from the budget planner
        (:mod:`fedslice.methods.planner`: ``[budgets]``, or the table ``method.tiers`` and the
        default tiers spell); the elastic sizes are measured on the profile batch
        (:attr:`sizes`)."""
        opts, fed = self.opts, self.cfg.federation
        self.all_dims = self.arch.all_dims(self.model.config)
        self.profile = self.task.profile_batch(self.model.config, opts.profile_batch_size or fed.batch_size,
                                               opts.profile_seq_len or self.cfg.data.max_length,
                                               self.cfg.seed)
        #: the largest sub-model within each FLOPs fraction (``method.elastic_sizes``)
        self.sizes = WidthsByFlops(self.width_specs(opts.width_steps), lambda spec: measure_training_step(
            self.client_submodel(spec), self.profile, loss_fn=self.task.loss))
        return RaFFMStrategy(fed, opts, self.arch, self.all_dims, self.make_plans(), self.adapter.scale,
                             set(self.trainable()), self.client_sizes,
                             scale_tensors(self.model, self.arch), self.knob_defaults,
                             self.calibration_activations if opts.salience == "activation" else None)

    def plan_axes(self, budgets) -> dict[str, list]:
        """Sub-models of ``budgets.width_steps`` widths (largest first, with their share of the
        full model's linear parameters) and the LoRA ranks."""
        specs = self.width_specs(budgets.width_steps)
        full = spec_params(specs[-1], self.all_dims)
        return {**super().plan_axes(budgets),
                "specs": [(s, spec_params(s, self.all_dims) / full) for s in reversed(specs)]}

    def width_specs(self, steps: int) -> list[Spec]:
        """The planner's sub-models at widths 1/steps .. 1, smallest first: the same width in
        every layer, or (``method.widths = "measured"``) per-layer widths from each layer's
        measured loss rise (:func:`measured_width_candidates`). A Flower client (``role =
        "client"``) reads its sub-model from its payload and measures no rises: its grid is the
        uniform one."""
        if self.opts.widths == "uniform" or self.role == "client":
            return width_candidates(self.all_dims, steps, self.opts.elastic_depth)
        return measured_width_candidates(self.layer_rise, self.all_dims[0], self.width_levels, steps)

    @property
    def width_levels(self) -> list[float]:
        n = self.opts.width_levels
        return [j / n for j in range(1, n)] if isinstance(n, int) else list(n)

    @cached_property
    def loaded_salience(self) -> list:
        """``method.salience`` of the model as loaded: what the first reorder ranks by."""
        state = {n: p.detach() for n, p in self.model.named_parameters()}
        acts = (output_activations(self.model, self.arch, self.calibration_batches())
                if self.opts.salience == "activation" else None)
        return model_salience({**scale_tensors(self.model, self.arch), **state}, self.arch,
                              self.all_dims, self.opts.salience, self.adapter.scale, acts)

    @cached_property
    def layer_rise(self) -> list[list[float]]:
        """(layers, width levels) the calibration loss with one layer cut to each level in the
        order the sub-models are cut in (salience order, or the checkpoint's without reorder),
        minus the full model's (:func:`layer_rise`; measured once, on the server)."""
        dims = self.all_dims[0]
        order = (stack_order(self.loaded_salience[0], dims, self.arch.head_bias is not None)
                 if self.opts.reorder else SliceSpec.full(dims))
        batches, model = self.calibration_batches(), self.model
        replay = BlockReplay(self.arch.blocks(model))  # blocks below the cut: the uncut pass's

        @torch.no_grad()
        def loss(masks, layer: int | None) -> float:
            total = 0.0
            for i, b in enumerate(batches):
                with masked_inputs(masks), replay(i, layer):
                    total += float(self.task.loss(model, dict(b)))
            return total / len(batches)

        t0, was = time.perf_counter(), model.training
        model.eval()
        try:
            rise = layer_rise(loss, output_modules(model, self.arch), dims, order, self.width_levels)
        finally:
            model.train(was)
        log.info("raffm: measured widths: %d layers x %d levels in %.1f s", len(rise),
                 len(self.width_levels), time.perf_counter() - t0)
        return rise

    @contextmanager
    def planned_model(self, knobs) -> Iterator[PlannedModel]:
        model = self.client_submodel(knobs.spec, knobs.precision)
        with (self.adapter.at_rank(model, knobs.rank) if knobs.rank is not None else nullcontext()), \
                frozen(model, self.depth_frozen(knobs.depth)):
            yield PlannedModel(model, self.trainable(model))

    @property
    def slices(self) -> RaFFMStrategy:
        """The strategy that plans, slices and re-orders (under any rules and stages)."""
        return find_inner(self.strategy, RaFFMStrategy)

    # -- sub-models --------------------------------------------------------------------------
    def submodel(self, spec: Spec) -> nn.Module:
        """The sub-model of ``spec`` (built once per spec: it shares every unsliced module with the
        full model and holds its own sliced tensors; clients load their payload into it)."""
        if spec not in self._submodels:
            self._submodels[spec] = self.model if spec.is_full else extract_model(self.model, spec, self.arch)
        return self._submodels[spec]

    def client_submodel(self, spec: Spec, precision: str | None = None) -> nn.Module:
        """The sub-model of ``spec`` a client trains, for the planner to measure: over the base
        at ``precision`` (a plan's), else at the run's clients' (``model.quantize``)."""
        return self.submodel_at(spec, precision if precision not in (None, "none") else self.client_precision)

    def submodel_at(self, spec: Spec, precision: str | None, order: str | None = None,
                    frozen: State | None = None) -> nn.Module:
        """The sub-model of ``spec`` over a base at ``precision`` (``budgets.precisions``): the
        fp32 one (None, 'none'), or a copy of it whose frozen block linears are quantized
        (:func:`fedslice.models.quantize.quantized_copy`: slice, then quantize the slice). The
        copy is made from the frozen slices the fp32 sub-model holds and kept for the base
        ``order`` they are in (a digest of the server's permutation, ``base_order`` of the
        payload): the frozen slices change only when the server re-orders, so a process
        quantizes each slice once per order, never per client or per round. A new order drops
        every copy of an older one. ``frozen``: the slices of this order (a payload's arrays),
        loaded into the fp32 sub-model before a new copy is made."""
        if precision in (None, "none"):
            return self.submodel(spec)
        held = self._quantized.get((spec, precision))
        if held is not None and held[0] == order:
            return held[1]
        if order is not None:  # copies of another order (or the planner's) are stale
            self._quantized = {k: v for k, v in self._quantized.items() if v[0] == order}
        from fedslice.models.quantize import quantized_copy, quiet

        if frozen is not None:  # this order's frozen slices (the trained tensors load per client)
            params = dict(self.submodel(spec).named_parameters())
            with torch.no_grad():
                for k, t in frozen.items():
                    # the base's slices only: an adapter's frozen tensors (FFA-LoRA's A) come at
                    # the client's rank and load with the trained ones (_load)
                    if not params[k].requires_grad and not self.adapter.owns(k):
                        params[k].copy_(t)
        with quiet():
            model = quantized_copy(self.submodel(spec), precision, self.arch)
        self._quantized[(spec, precision)] = (order, model)
        return model

    # -- activation-aware salience -----------------------------------------------------------
    def calibration_batches(self) -> list[dict[str, torch.Tensor]]:
        """``method.calibration_examples`` examples the server has (``calibration = "dev"``: the
        first rows of the dev split, seeded; ``"profile"``, or no dev split: the planner's
        synthetic profile batch, at most its rows), in batches of ``federation.batch_size``."""
        if getattr(self, "_calibration", None) is not None:
            return self._calibration
        n, bs = self.opts.calibration_examples, self.cfg.federation.batch_size
        split = None
        if self.opts.calibration == "dev":
            splits = self.task.encode(self.task.load_raw(), self._loaded)
            dev = splits.get("dev")
            if dev is not None and len(dev):
                split = self.task.limit(dev, self.cfg.data.max_dev_examples, self.cfg.seed)
        if split is not None:
            idx = np.random.default_rng(self.cfg.seed).permutation(len(split))[:n].tolist()
            batches = [split.collate(idx[i:i + bs]) for i in range(0, len(idx), bs)]
        else:
            if self.opts.calibration == "dev":
                log.warning("raffm: salience = 'activation' without a dev split: calibrating on "
                            "the synthetic profile batch")
            rows = batch_rows(self.profile)
            batches = [{k: v[:min(n, rows)] for k, v in self.profile.items()}]
        self._calibration = batches
        return batches

    def calibration_activations(self, state: State) -> dict:
        """The output projections' mean |input| (:func:`output_activations`) of the full model
        holding ``state`` over :meth:`calibration_batches`."""
        model = self.top.eval_model(state)
        return output_activations(model, self.arch, self.calibration_batches())

    @torch.no_grad()
    def _load(self, model: nn.Module, state: State, rank: int | None = None) -> dict[str, nn.Parameter]:
        """``state`` loaded into ``model`` (a sub-model), its LoRA at ``rank`` (None: lora.r).
        A quantized weight keeps its values: it was quantized from the same frozen slice
        (:meth:`submodel_at`, for the payload's base order)."""
        from fedslice.models.quantize import is_quantized

        self.adapter.resize(model, rank)
        params = dict(model.named_parameters())
        for k, t in state.items():
            if not is_quantized(params[k]):
                params[k].copy_(t)
        return params

    # -- client ------------------------------------------------------------------------------
    def client_spec(self, payload: Payload, arrays: State | None = None) -> Spec | None:
        spec = payload.orders.spec
        return None if spec is None else spec_from_dict(spec)

    def client_model(self, payload: Payload) -> tuple[nn.Module, dict[str, nn.Parameter]]:
        """The client's sub-model (:meth:`client_base`) with its payload loaded."""
        self.thaw_plan()  # what an earlier client's plan froze (a caller outside train_client)
        model = self.client_base(payload)
        params = self._load(model, payload.arrays, payload.orders.lora_rank)
        self.freeze_plan(model, payload)  # its plan's adapter depth (after resize: same tensors)
        return model, {n: p for n, p in params.items() if p.requires_grad}

    def client_base(self, payload: Payload) -> nn.Module:
        """The sub-model the client of ``payload`` trains: its fp32 slice, or over a quantized
        base (``base_precision``, ``model.quantize``) the quantized copy of the slice
        (:meth:`submodel_at`), made from the payload's frozen slices the first time their order
        is seen."""
        o = self.orders(payload)
        spec = spec_from_dict(o.spec)
        if o.base_precision in (None, "none"):
            return self.submodel(spec)
        return self.submodel_at(spec, o.base_precision, o.base_order, payload.arrays)

    def prepare_clients(self, payloads: Mapping[int, Payload]) -> None:
        """The quantized copies of the round's slices made here, before workers fork (they
        inherit them): a worker never quantizes."""
        for payload in payloads.values():
            if not self.sits_out(payload):
                self.client_base(payload)

    batched_clients = True  # clients of one sub-model size train together (not sandwich's)

    def fit(self, payload: Payload, data, seed: int) -> Reply:
        if self.opts.sandwich:
            return self._fit_sandwich(payload, data, seed)
        return super().fit(payload, data, seed)

    # -- the sandwich rule -------------------------------------------------------------------
    def smallest_spec(self) -> Spec | None:
        """The smallest elastic size's sub-model (None: no size fits)."""
        return self.sizes.at(min(self.opts.elastic_sizes)).spec

    def _fit_sandwich(self, payload: Payload, data, seed: int) -> Reply:
        """Local training whose every step adds the loss of the smallest elastic size nested in
        the client's sub-model: its leading heads and FFN units per layer, the rest masked (their
        inputs to W_o / W_out zeroed, so the pass computes exactly that slice's function)."""
        from fedslice.fl.client import train_local
        model, params = self.top.client_model(payload)
        orders = self.orders(payload)
        own = spec_from_dict(orders.spec)
        masks = _nested_masks(model, self.arch, own, self.smallest_spec())

        def loss_fn(m, batch):
            loss = self.task.loss(m, batch)
            if masks:
                with masked_inputs(masks):
                    loss = loss + self.task.loss(m, batch)
            return loss

        result = train_local(model, params, data, orders, seed, loss_fn=loss_fn,
                             compute=self.compute, virtual_tokens=self.adapter.virtual_tokens,
                             by_parts=self.adapter.in_modules, pack=self.packs(orders))
        arrays = {n: p.detach().clone() for n, p in params.items() if n in payload.arrays}
        metrics = self.top.client_metrics(model, params, payload, arrays, result)
        return Reply(arrays=arrays, num_examples=len(data), metrics=metrics)

    def client_metrics(self, model: nn.Module, params: dict[str, nn.Parameter], payload: Payload,
                       arrays: State, result: LocalResult) -> dict[str, float]:
        m = super().client_metrics(model, params, payload, arrays, result)
        spec = self.top.client_spec(payload, arrays)
        trained = {k: t for k, t in payload.arrays.items() if k in params}
        frozen = {k: t for k, t in payload.arrays.items() if k not in params}
        model_bytes = sum(held_bytes(p) for p in {id(p): p for p in model.parameters()}.values())
        m.update({
            "tier": payload.orders.tier, "sat_out": 0,
            # comparable with fedpetuning: the trained tensors; the frozen sub-model slices are
            # what a client without the model must also hold (counted apart)
            "bytes_down": measure.tensor_bytes(trained), "bytes_down_frozen": measure.tensor_bytes(frozen),
            "flops_analytic": self._analytic_flops(spec, model, result),
            "flops_ratio_planned": self.sizes.cost(spec).flops_ratio,
            "lora_rank": payload.orders.lora_rank,
            "model_mb": model_bytes / 2**20, "memory_mb": model_bytes / 2**20 + result.activation_mb,
            **spec_sizes(spec),
        })
        return m

    def _analytic_flops(self, spec: Spec, model: nn.Module, result: LocalResult) -> float:
        """:func:`measure.analytic_train_flops` of the sub-model: its linears are counted from the
        model; the attention term uses each kept layer's attention width, not the hidden size."""
        d, T = self.dims["hidden"], result.tokens
        # the row length attention's FLOPs go with, as in the base count it is taken from
        # (packed rows: longer than an example; dividing by examples undercounts the excess)
        s = result.attention_length or T / max(result.rows or result.examples, 1)
        specs = [x for x in stack_list(spec) if x is not None]
        embeddings = measure.embeddings_train(model)  # full tuning: layer 0's input-gradient too
        bottom = frozen_bottom(self, model)  # (0, 0) when the embeddings train
        base = analytic_train_flops(self, model, result, num_layers=sum(len(x.layers) for x in specs),
                                         embedding_backward=embeddings, frozen=bottom)
        widths = [len(h) * x.head_dim for x in specs for h in x.heads]
        frozen = bottom[0]  # one stack: row r is block r
        attn_excess = 4.0 * s * T * sum(d - w for w in widths) \
            + 8.0 * s * T * sum(d - w for w in widths[frozen:])  # forward; backward above the frozen
        first = specs[0]
        first_qkv = 6.0 * d * (d - widths[frozen]) * T \
            if first.layers[0] == 0 and not embeddings and frozen < len(widths) else 0.0
        return base["total"] - attn_excess + first_qkv

    # -- server evaluation -------------------------------------------------------------------
    def eval_model(self, state: State) -> nn.Module:
        """The full model holding ``state``; under ``model.quantize``, its quantized copy (made
        once per order of the base, as a client's)."""
        self._load(self.model, state)
        return self._quantized_like_clients(self.sizes.candidates[-1], self.model, state)

    def _quantized_like_clients(self, spec: Spec, model: nn.Module, state: State) -> nn.Module:
        """``model`` (the sub-model of ``spec``, ``state`` loaded), or under ``model.quantize``
        the quantized copy of it the run's clients train (:meth:`submodel_at`) with ``state``."""
        if self.client_precision is None:
            return model
        quantized = self.submodel_at(spec, self.client_precision, self.slices.perm.digest)
        self._load(quantized, state)
        return quantized

    @classmethod
    def export_state(cls, state: State, server: dict[str, Any], arch: ArchSpec) -> State:
        """The global state in the checkpoint's order of heads and neurons."""
        return unpermute_state(state, Permutation.from_dict(server["strategy"]["perm"]), arch)

    @classmethod
    def report_views(cls, folder, config, metrics, summary) -> list:
        """Elastic inference (:func:`~fedslice.methods.raffm.report.elastic_views`: ``elastic.png``)."""
        return elastic_views(summary, run_label(summary, Path(folder)))

    def elastic_specs(self) -> list[dict[str, Any]]:
        """Every elastic size's sub-model as a spec over the saved state (the checkpoint's order
        of heads and neurons): what ``fedslice export --size`` cuts."""
        out = []
        for size in sorted(set(self.opts.elastic_sizes) | {1.0}):
            plan = self.sizes.at(size)
            if plan.spec is not None:
                out.append({"size": size, "spec": in_original_order(plan.spec, self.slices.perm).to_dict(),
                            "train_flops_ratio": plan.cost.flops_ratio})
        return out

    def write_artifacts(self, folder) -> None:
        from fedslice.output import write_json_atomic
        write_json_atomic(folder / ELASTIC, {"sizes": self.elastic_specs()})

    def elastic(self, state: State, data, batch_size: int) -> list[dict[str, Any]]:
        """The primary metric (accuracy, ROUGE-L) of the global model at every ``elastic_sizes``
        FLOPs fraction."""
        out = []
        for size in sorted(set(self.opts.elastic_sizes) | {1.0}):
            plan = self.sizes.at(size)
            if plan.spec is None:
                out.append({"size": size, "error": plan.reason})
                continue
            sliced = extract_state(state, plan.spec, self.arch)
            model = self.submodel(plan.spec)
            self._load(model, sliced)
            model = self._quantized_like_clients(plan.spec, model, sliced)
            rows = {k: v[:2] for k, v in self.profile.items() if k != "labels"}  # linear in rows
            with torch.no_grad(), measure.count_flops() as fc:
                model.eval()
                model(**to_device(rows, model_device(model)))
            res = {"dev": self.task.evaluate(model, data.dev, batch_size),
                   "test": self.task.evaluate(model, data.test, batch_size)}
            metric = self.task.primary_metric
            out.append({"size": size, **plan.spec.describe(), "params": plan.cost.params,
                        "train_flops_ratio": plan.cost.flops_ratio,
                        "forward_gflops_per_example": fc.total / 1e9 / batch_rows(rows),
                        "metric": metric, f"dev_{metric}": res["dev"][metric],
                        f"test_{metric}": res["test"][metric]})
        full = next((e for e in out if e["size"] == 1.0), None)
        for e in out:
            if full and "forward_gflops_per_example" in e:
                e["forward_flops_ratio"] = e["forward_gflops_per_example"] / full["forward_gflops_per_example"]
        return [e for e in out if e["size"] in self.opts.elastic_sizes]

    def final_metrics(self, state: State, data, records: list[dict[str, Any]], batch_size: int) -> dict[str, Any]:
        """Elastic sizes, per-tier costs and the plans (merged into summary.json)."""
        per_client = [m for r in records for m in r["client_metrics"]]
        tiers = tier_summary(self.slices.plans, per_client, self.sizes.cost)
        full_cost = self.sizes.cost(self.sizes.candidates[-1])
        return {"elastic": self.elastic(state, data, batch_size), "tiers": tiers,
                "full_model_planned": full_cost.to_dict(),
                "sat_out_replies": sum(1 for m in per_client if m.get("sat_out")),
                "memory_mb_mean": _mean([m.get("memory_mb") for m in per_client if not m.get("sat_out")]),
                "permutation_applied": not self.slices.perm.is_identity}



def _nested_masks(model: nn.Module, arch: ArchSpec, own: Spec, small: Spec | None
                  ) -> list[tuple[nn.Module, int]]:
    """(output projection module of the client's sub-model, channels the smallest size keeps)
    for every self-attention W_o and FFN W_out where the smallest size keeps fewer units than
    the client's sub-model; [] when the client's sub-model is the smallest size or the two keep
    different layers (depth: the sandwich rule here is width only)."""
    if small is None:
        return []
    out = []
    for k, (a, b) in enumerate(zip(stack_list(own), stack_list(small))):
        if a is None or b is None:
            continue
        if tuple(a.layers) != tuple(b.layers):
            return []
        for i, (ha, hb, fa, fb) in enumerate(zip(a.heads, b.heads, a.neurons, b.neurons)):
            # both leading slices of one order: the smallest's units are the first of the client's
            if tuple(hb) != tuple(ha[:len(hb)]) or tuple(fb) != tuple(fa[:len(fb)]):
                return []
    mods = output_modules(model, arch)
    for k, (a, b) in enumerate(zip(stack_list(own), stack_list(small))):
        if a is None or b is None:
            continue
        for i, (ha, hb, fa, fb) in enumerate(zip(a.heads, b.heads, a.neurons, b.neurons)):
            if len(hb) < len(ha):
                out.append((mods[(k, i, "o")], len(hb) * a.head_dim))
            if len(fb) < len(fa):
                out.append((mods[(k, i, "ffn_out")], len(fb)))
    return out


def _mean(vals):
    vals = [v for v in vals if v is not None]
    return float(np.mean(vals)) if vals else None
