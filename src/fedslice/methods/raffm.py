"""``raffm``: resource-aware sub-models of a salience-ordered foundation model (Yu et al. 2023).

1. Salience (L1/L2) of every head and FFN neuron; the global model is permuted so the most salient
   come first (function-preserving, re-applied every R rounds, tracked for un-permuting on export).
2. Each client's budget (device tier: FLOPs fraction or memory limit) is mapped by the planner to a
   leading-slice :class:`SliceSpec`, checked by measuring the real sub-model. A client whose budget
   is below the smallest sub-model sits out (recorded in the round's ``excluded``).
3. The client trains the leading slice (full fine-tuning or LoRA on the sub-model).
4. Slice aggregation: every element is the example-weighted mean over the clients whose slice
   holds it; an element nobody held keeps its value (exactly FedAvg when all hold the full model).
   ``size_weight = p`` multiplies a client's weight by f^p, f its sub-model's FLOPs fraction (the
   per-configuration step of RaFFM Eq. 7), so shared leading elements lean toward larger models.
   Unlike the public code, we do not divide by all clients, and heads are sliced whole.
5. Elastic inference: the global model is evaluated at several sizes after training.

The server state holds the trainable tensors plus the frozen q/k/v/o/ffn tensors (with LoRA), so
that permutations and slices are pure functions over it; the shared model is a scratch buffer.
"""

from __future__ import annotations

import json
import logging
import math
import os
import re
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn as nn

from pydantic import Field, field_validator, model_validator

from fedslice.config import (DeviceTier, ExperimentConfig, FederationConfig, MethodOptions,
                             Section, check_tier_shares)
from fedslice.compute import model_device, to_device
from fedslice.errors import ConfigError
from fedslice import measure
from fedslice.fl.client import LocalResult
from fedslice.fl.strategy import Payload, Reply, State, Strategy
from fedslice.measure import ClientCost
from fedslice.tasks import Task
from fedslice.tasks.base import batch_rows
from fedslice.methods.base import Method, Role
from fedslice.models.arch import ArchSpec
from fedslice.models.loading import LoadedModel
from fedslice.registry import register_method
from fedslice.report import figure, save_figure
from fedslice.slicing.permute import (Permutation, in_original_order, permute_state,
                                      unpermute_state)
from fedslice.slicing.planner import (Budget, Plan, Planner, SpecCost, assign_budgets,
                                      choose_rank, measure_training_step, width_candidates)
from fedslice.slicing.salience import model_salience, salience_order, scale_tensors
from fedslice.slicing.spec import (Spec, extract_model, extract_state, scatter, sliceable_keys,
                                   spec_from_dict, spec_sizes, stack_list)

log = logging.getLogger(__name__)

#: The run-folder file with the elastic sizes' sub-models (``fedslice export --size``).
ELASTIC = "raffm_elastic.json"


# --------------------------------------------------------------------------------------------
# Options ([method] with name = "raffm")
# --------------------------------------------------------------------------------------------

RaFFMTier = DeviceTier  # the older name


class BudgetDistribution(Section):
    """Per-client FLOPs budgets drawn uniformly from [low, high] (fractions of the full model)."""

    kind: Literal["uniform"] = "uniform"
    low: float
    high: float

    @field_validator("low", "high")
    @classmethod
    def _fraction(cls, v):
        if not 0 < v <= 1:
            raise ValueError("budget must be a fraction of the full model's FLOPs in (0, 1]")
        return v

    @model_validator(mode="after")
    def _ordered(self) -> "BudgetDistribution":
        if self.low > self.high:
            raise ValueError(f"low={self.low} is larger than high={self.high}")
        return self


def _default_tiers() -> list[RaFFMTier]:
    return [RaFFMTier(share=0.25, flops=f) for f in (0.25, 0.5, 0.75, 1.0)]


class RaFFMMethod(MethodOptions):
    """Resource-aware sub-models: salience-ordered heads/neurons, leading slices per budget,
    slice aggregation (RaFFM, Yu et al. 2023)."""

    name: Literal["raffm"] = "raffm"
    tuning: Literal["full", "lora"] = Field("lora", description="Full fine-tuning of the "
                                            "sub-model, or LoRA (settings in [lora]) on it.")
    tiers: list[RaFFMTier] = Field(default_factory=_default_tiers, min_length=1)
    budget_distribution: BudgetDistribution | None = Field(
        None, description="If set, each client's FLOPs budget is drawn from it (tiers unused).")
    salience: Literal["l1", "l2"] = "l1"
    size_weight: float = Field(0.0, ge=0, description="Slice aggregation weighs a client by "
                               "examples x f^p, f = its sub-model's planned FLOPs fraction, p = "
                               "this (RaFFM Eq. 7's per-configuration step eta_c); 0: examples only.")
    reorder: bool = Field(True, description="Salience-order heads/neurons before round 1 "
                          "(false: leading slices of the checkpoint's order, an ablation).")
    reorder_every: int = Field(0, ge=0, description="Re-order every R rounds (0: only once).")
    width_steps: int = Field(48, gt=0, description="Width grid of the planner: sub-models keep "
                             "round(w*H) heads and round(w*F) neurons, w = 1/steps .. 1.")
    elastic_depth: bool = Field(False, description="The planner may also drop layers.")
    elastic_sizes: list[float] = Field(default_factory=lambda: [0.25, 0.5, 0.75, 1.0],
                                       description="FLOPs fractions evaluated after training.")
    on_infeasible: Literal["sit_out", "error"] = Field(
        "sit_out", description="A client whose budget is below the smallest sub-model sits out "
        "(recorded), or the run fails naming the tier and clients.")
    profile_batch_size: int | None = Field(None, gt=0, description="Batch the planner measures "
                                           "(default: federation.batch_size).")
    profile_seq_len: int | None = Field(None, gt=1, description="Sequence length the planner "
                                        "measures (default: data.max_length, the worst case).")

    @field_validator("elastic_sizes")
    @classmethod
    def _sizes(cls, v):
        for x in v:
            if not 0 < x <= 1:
                raise ValueError(f"size {x} is not a fraction of the full model's FLOPs in (0, 1]")
        return v

    @field_validator("tiers")
    @classmethod
    def _shares(cls, v):
        return check_tier_shares(v)


@dataclass(frozen=True)
class ClientPlan:
    tier: int | None
    budget: Budget
    plan: Plan
    #: the client's LoRA rank (``lora.ranks``; None: lora.r) and the measured cost at that rank
    rank: int | None = None
    rank_cost: SpecCost | None = None


class RaFFMStrategy(Strategy):
    """Per-client leading-slice payloads and slice aggregation over state dicts; owns the
    permutation of the global state (relative to the checkpoint's order)."""

    def __init__(self, fed: FederationConfig, opts: RaFFMMethod, arch: ArchSpec,
                 dims: list[Mapping[str, int]], plans: dict[int, ClientPlan],
                 adapter_scale: float | None, trainable: set[str] | None = None,
                 client_sizes: Mapping[int, int] | None = None, scales: State | None = None):
        super().__init__(fed, client_sizes)
        self.opts, self.arch, self.dims, self.plans = opts, arch, dims, plans
        #: frozen layer scales salience reads (DINOv2); the state's own values win
        self.scales = dict(scales or {})
        #: trainable tensor names with the layer index replaced by '#' (None: every tensor)
        self.trainable = None if trainable is None else {_generic(k) for k in trainable}
        self.adapter_scale = adapter_scale  # the adapter's scale in salience (LoRA: alpha / r)
        self.perm = Permutation.identity(dims)

    # -- ordering ----------------------------------------------------------------------------
    def reorder(self, state: State) -> State:
        """Salience-order heads and neurons of ``state``; tracks the cumulative permutation."""
        sal = model_salience({**self.scales, **state}, self.arch, self.dims, self.opts.salience,
                             self.adapter_scale)
        rel = salience_order(sal, self.dims, self.arch)
        self.perm = self.perm.then(rel)
        return permute_state(state, rel, self.arch)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "perm": self.perm.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.perm = Permutation.from_dict(state["perm"])

    # -- configure ---------------------------------------------------------------------------
    def payload_for(self, server_round: int, state: State, client: int, config: dict) -> Payload:
        cp = self.plans[client]
        cfg = {**config, "client": client, "tier": cp.tier, "budget": cp.budget.describe()}
        if cp.plan.spec is None:
            return Payload(arrays={}, config={**cfg, "sit_out": cp.plan.reason})
        return Payload(arrays=extract_state(state, cp.plan.spec, self.arch),
                       config={**cfg, "spec": cp.plan.spec.to_dict()})

    def client_rank(self, client: int) -> int | None:
        return self.plans[client].rank

    def frozen_state_keys(self, trainable, frozen) -> list[str]:
        """The frozen q/k/v/o/FFN tensors: the global state holds them (permuted and sliced on
        the server, sent as frozen slices)."""
        return sliceable_keys(self.arch, list(frozen))

    def absent(self, payload: Payload) -> str | None:
        if payload.config.get("sit_out"):
            return f"sat out: {payload.config['sit_out']}"
        return None

    def expected_update(self, state: State, payload: Payload, reply: Reply) -> State:
        """The trainable tensors of the client's slice (the frozen slices are sent, not returned)."""
        if self.trainable is None:
            return payload.arrays
        return {k: t for k, t in payload.arrays.items() if _generic(k) in self.trainable}

    # -- aggregate ---------------------------------------------------------------------------
    def size_factor(self, client: int) -> float:
        """f^p: the client's planned FLOPs fraction to the power ``size_weight`` (1 when p = 0)."""
        p = self.opts.size_weight
        return 1.0 if p == 0 else self.plans[client].plan.cost.flops_ratio ** p

    def client_updates(self, server_round: int, state: State, payloads: dict[int, Payload],
                       replies: dict[int, Reply]) -> tuple[list[State], list]:
        """Slice aggregation: each client's delta scattered into full shape, weighted by its
        examples (x f^p) times its held-mask."""
        shapes = {k: t.shape for k, t in state.items()}
        deltas, weights = [], []
        for c in sorted(replies):
            sent, reply = payloads[c], replies[c]
            spec = spec_from_dict(sent.config["spec"])
            delta = {k: t.float() - sent.arrays[k].float() for k, t in reply.arrays.items()}
            full, masks = scatter(delta, spec, self.arch, shapes)
            deltas.append(full)
            w = float(reply.num_examples) * self.size_factor(c)
            weights.append({k: w * m for k, m in masks.items()})
        return deltas, weights

    def after_aggregate(self, server_round: int, state: State) -> State:
        """Re-order every ``reorder_every`` rounds (after whatever rule combined the updates)."""
        every = self.opts.reorder_every
        if self.opts.reorder and every and server_round % every == 0:
            return self.reorder(state)
        return state


class RaFFM(Method):
    name = "raffm"
    sends_slices = True
    adapters = None  # any adapter whose per-head tensors sit in the modules it wraps (check_config)
    legacy_adapter_option = "tuning"
    lora_aggregations = ("fedit", "ffa", "fedex", "flora", "svd")
    lora_aggregation_hint = ("a client's slice of the salience-ordered model changes when the "
                             "server re-orders it, which a B kept on the client would not follow")
    lora_ranks_per_client = True  # the planner chooses width and rank together

    @classmethod
    def check_config(cls, cfg: ExperimentConfig) -> None:
        super().check_config(cfg)
        adapter = cls.adapter_class(cfg)
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

    def __init__(self, cfg: ExperimentConfig, loaded: LoadedModel, task: Task,
                 role: Role = "both", client_sizes: Mapping[int, int] | None = None):
        self.opts: RaFFMMethod = cfg.method
        self._submodels: dict[Spec, nn.Module] = {}
        self._rank_plans: dict = {}
        super().__init__(cfg, loaded, task, role, client_sizes)

    # -- construction ------------------------------------------------------------------------
    def make_strategy(self) -> Strategy:
        opts, fed = self.opts, self.cfg.federation
        self.all_dims = self.arch.all_dims(self.model.config)
        self.profile = self.task.profile_batch(self.model.config, opts.profile_batch_size or fed.batch_size,
                                               opts.profile_seq_len or self.cfg.data.max_length,
                                               self.cfg.seed)
        candidates = width_candidates(self.all_dims, opts.width_steps, opts.elastic_depth)
        ranks = self.cfg.lora.ranks if self.adapter.name == "lora" else None
        if ranks:
            # width and rank together: the widest sub-model at which the smallest rank fits,
            # then the largest rank that fits at that width; FLOPs are fractions of the full
            # model at lora.r
            self.planner = Planner(candidates, lambda spec: self.measure_at_rank(
                self.submodel(spec), ranks[0], self.profile), reference=lambda: self.measure_at_rank(
                self.submodel(candidates[-1]), self.cfg.lora.r, self.profile)[0])
        else:
            self.planner = Planner(candidates, lambda spec: measure_training_step(
                self.submodel(spec), self.profile, loss_fn=self.task.loss))
        budgets = assign_budgets(opts.tiers, opts.budget_distribution, fed.num_clients, self.cfg.seed)
        plans = {c: self._client_plan(tier, b, ranks) for c, (tier, b) in enumerate(budgets)}
        self._check_feasible(plans)
        return RaFFMStrategy(fed, opts, self.arch, self.all_dims, plans, self.adapter.scale,
                             set(self.trainable()), self.client_sizes,
                             scale_tensors(self.model, self.arch))

    def _client_plan(self, tier: int | None, budget: Budget, ranks: list[int] | None) -> ClientPlan:
        plan = self.planner.plan(budget)
        if not ranks or plan.spec is None:
            return ClientPlan(tier, budget, plan)
        key = (plan.spec, budget)
        if key not in self._rank_plans:
            model = self.submodel(plan.spec)
            self._rank_plans[key] = choose_rank(budget, ranks, lambda r: self.planner.cost_of(
                self.measure_at_rank(model, r, self.profile)))
        rank, cost = self._rank_plans[key]
        return ClientPlan(tier, budget, plan, rank, cost)

    def _check_feasible(self, plans: dict[int, ClientPlan]) -> None:
        out: dict[str, list[int]] = defaultdict(list)
        reasons = {}
        for c, cp in plans.items():
            if cp.plan.spec is None:
                out[cp.budget.field].append(c)
                reasons[cp.budget.field] = cp.plan.reason
        if not out:
            return
        lines = [f"{field}: {reasons[field]}: client(s) {cs[:10]}{' ...' if len(cs) > 10 else ''}"
                 for field, cs in out.items()]
        if self.opts.on_infeasible == "error" or sum(map(len, out.values())) == len(plans):
            raise ConfigError("no sub-model fits the budget of some clients:\n  " + "\n  ".join(lines)
                              + ("" if self.opts.on_infeasible == "error" else
                                 "\n  (every client would sit out)"))
        for line in lines:
            log.warning("raffm: these clients sit out: %s", line)

    # -- sub-models --------------------------------------------------------------------------
    def submodel(self, spec: Spec) -> nn.Module:
        """The sub-model of ``spec`` (built once per spec: it shares every unsliced module with the
        full model and holds its own sliced tensors; clients load their payload into it)."""
        if spec not in self._submodels:
            self._submodels[spec] = self.model if spec.is_full else extract_model(self.model, spec, self.arch)
        return self._submodels[spec]

    def state_keys(self) -> list[str]:
        names = [n for n, _ in self.model.named_parameters()]
        trainable = list(self.trainable())
        frozen = [n for n in names if n not in set(trainable)]
        keep = set(trainable) | set(sliceable_keys(self.arch, names)) | \
            set(self.strategy.frozen_state_keys(trainable, frozen))
        return [n for n in names if n in keep]

    def initial_state(self) -> State:
        params = dict(self.model.named_parameters())
        state = {n: params[n].detach().clone() for n in self.state_keys()}
        self.own_strategy.perm = Permutation.identity(self.all_dims)
        return self.own_strategy.reorder(state) if self.opts.reorder else state

    @torch.no_grad()
    def _load(self, model: nn.Module, state: State, rank: int | None = None) -> dict[str, nn.Parameter]:
        """``state`` loaded into ``model`` (a sub-model), its LoRA at ``rank`` (None: lora.r)."""
        self.adapter.resize(model, rank)
        params = dict(model.named_parameters())
        for k, t in state.items():
            params[k].copy_(t)
        return params

    # -- client ------------------------------------------------------------------------------
    def client_model(self, payload: Payload) -> tuple[nn.Module, dict[str, nn.Parameter]]:
        model = self.submodel(spec_from_dict(payload.config["spec"]))
        params = self._load(model, payload.arrays, payload.config.get("lora_rank"))
        return model, {n: p for n, p in params.items() if p.requires_grad}

    batched_clients = True  # clients of one sub-model size train together

    def batch_key(self, payload: Payload):
        """Clients training the same sub-model (same slice) share a batched pass."""
        if payload.config.get("sit_out") or not self.adapter.batched_clients:
            return None
        return json.dumps([payload.config["spec"], payload.config.get("lora_rank")], sort_keys=True)

    def fit(self, payload: Payload, data, seed: int) -> Reply:
        if payload.config.get("sit_out"):
            return Reply(arrays={}, num_examples=0, metrics=self._sit_out_metrics(payload))
        return super().fit(payload, data, seed)

    @staticmethod
    def _sit_out_metrics(payload: Payload) -> dict[str, Any]:
        cost = ClientCost(bytes_down=None, bytes_up=None, params_down=None, params_up=None,
                          trainable_params=None, train_time_s=None, peak_rss_mb=0.0,
                          activation_mb=0.0)
        return {"loss": float("nan"), "steps": 0, **cost.to_metrics(), "sat_out": 1,
                "tier": payload.config.get("tier")}

    def client_metrics(self, model: nn.Module, params: dict[str, nn.Parameter], payload: Payload,
                       arrays: State, result: LocalResult) -> dict[str, float]:
        m = super().client_metrics(model, params, payload, arrays, result)
        spec = spec_from_dict(payload.config["spec"])
        trained = {k: t for k, t in payload.arrays.items() if k in params}
        frozen = {k: t for k, t in payload.arrays.items() if k not in params}
        model_bytes = sum(p.numel() * p.element_size() for p in {id(p): p for p in model.parameters()}.values())
        m.update({
            "tier": payload.config.get("tier"), "sat_out": 0,
            # comparable with fedpetuning: the trained tensors; the frozen sub-model slices are
            # what a client without the model must also hold (counted apart)
            "bytes_down": measure.tensor_bytes(trained), "bytes_down_frozen": measure.tensor_bytes(frozen),
            "flops_analytic": self._analytic_flops(spec, model, result),
            "flops_ratio_planned": self._planned(payload, spec).flops_ratio,
            "lora_rank": payload.config.get("lora_rank"),
            "model_mb": model_bytes / 2**20, "memory_mb": model_bytes / 2**20 + result.activation_mb,
            **spec_sizes(spec),
        })
        return m

    def _planned(self, payload: Payload, spec: Spec) -> SpecCost:
        """The planned cost of the client's sub-model (at its LoRA rank)."""
        cp = self.own_strategy.plans.get(payload.config.get("client"))
        if cp is not None and cp.rank_cost is not None:
            return cp.rank_cost
        return self.planner.cost(spec)

    def _analytic_flops(self, spec: Spec, model: nn.Module, result: LocalResult) -> float:
        """:func:`measure.analytic_train_flops` of the sub-model: its linears are counted from the
        model; the attention term uses each kept layer's attention width, not the hidden size."""
        d, T = self.dims["hidden"], result.tokens
        s = T / max(result.examples, 1)
        specs = [x for x in stack_list(spec) if x is not None]
        embeddings = measure.embeddings_train(model)  # full tuning: layer 0's input-gradient too
        bottom = self.frozen_bottom(model)  # (0, 0) when the embeddings train
        base = self.analytic_train_flops(model, result, num_layers=sum(len(x.layers) for x in specs),
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
        self._load(self.model, state)
        return self.model

    def export_state(self, state: State) -> State:
        """The global state in the checkpoint's order of heads and neurons."""
        return unpermute_state(state, self.own_strategy.perm, self.arch)

    @classmethod
    def state_from_checkpoint(cls, state: State, server: dict[str, Any], arch: ArchSpec) -> State:
        return unpermute_state(state, Permutation.from_dict(server["strategy"]["perm"]), arch)

    @classmethod
    def report_views(cls, folder, config, metrics, summary) -> list:
        """Elastic inference: the primary metric of the global model at every evaluated size."""
        from fedslice.viz import line_view
        rows = [e for e in summary.get("elastic") or [] if "metric" in e]
        if not rows:
            return []
        metric = rows[0]["metric"]
        view = line_view("Elastic inference (raffm)", [e["size"] for e in rows],
                         {f"test {metric}": [e.get(f"test_{metric}") for e in rows],
                          f"dev {metric}": [e.get(f"dev_{metric}") for e in rows]},
                         xlabel="size (fraction of full-model training FLOPs)", ylabel=metric,
                         x_key="size", caption="The trained global model cut to each elastic "
                         "size (leading heads and neurons); `fedslice export --size S` writes one.")
        for row, e in zip(view.rows, rows):
            row.update({k: e.get(k) for k in ("params", "forward_gflops_per_example",
                                                "forward_flops_ratio", "heads", "ffn")})
        return [view]

    def elastic_specs(self) -> list[dict[str, Any]]:
        """Every elastic size's sub-model as a spec over the saved state (the checkpoint's order
        of heads and neurons): what ``fedslice export --size`` cuts."""
        out = []
        for size in sorted(set(self.opts.elastic_sizes) | {1.0}):
            plan = self.planner.plan(Budget(flops=size))
            if plan.spec is not None:
                out.append({"size": size, "spec": in_original_order(plan.spec, self.strategy.perm).to_dict(),
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
            plan = self.planner.plan(Budget(flops=size))
            if plan.spec is None:
                out.append({"size": size, "error": plan.reason})
                continue
            model = self.submodel(plan.spec)
            self._load(model, extract_state(state, plan.spec, self.arch))
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

    @classmethod
    def plots(cls, run_dir: Path, config: dict[str, Any], metrics: list[dict[str, Any]],
              summary: dict[str, Any], title: str) -> list[Path]:
        """``elastic.png`` (:func:`plot_elastic`) from the summary's ``elastic`` entries."""
        if not summary.get("elastic"):
            return []
        return [plot_elastic(summary["elastic"], run_dir / "elastic.png", title)]

    def final_metrics(self, state: State, data, records: list[dict[str, Any]], batch_size: int) -> dict[str, Any]:
        """Elastic sizes, per-tier costs and the plans (merged into summary.json)."""
        per_client = [m for r in records for m in r["client_metrics"]]
        tiers = []
        groups = sorted({cp.tier for cp in self.own_strategy.plans.values()}, key=lambda t: (t is None, t))
        for tier in groups:
            cps = [cp for cp in self.own_strategy.plans.values() if cp.tier == tier]
            ran = [m for m in per_client if m.get("tier") == tier and not m.get("sat_out")]
            specs = {cp.plan.spec for cp in cps if cp.plan.spec is not None}
            entry = {"tier": tier, "budget": cps[0].budget.describe() if tier is not None else "distribution",
                     "clients": len(cps), "clients_without_submodel": sum(cp.plan.spec is None for cp in cps),
                     "client_rounds": len(ran),
                     "sat_out_rounds": sum(1 for m in per_client if m.get("tier") == tier and m.get("sat_out"))}
            if len(specs) == 1:
                spec = next(iter(specs))
                entry.update({"spec": spec.describe(), "planned": self.planner.cost(spec).to_dict()})
            tier_ranks = {cp.rank for cp in cps if cp.plan.spec is not None}
            if len(tier_ranks) == 1 and None not in tier_ranks:
                cp = next(cp for cp in cps if cp.plan.spec is not None)
                entry.update({"lora_rank": cp.rank, "planned": cp.rank_cost.to_dict()})
            for k in ("flops_measured", "flops_analytic", "bytes_down", "bytes_down_frozen", "bytes_up",
                      "memory_mb", "activation_mb", "peak_rss_mb"):
                vals = [m[k] for m in ran if m.get(k) is not None]
                entry[f"{k}_mean"] = float(np.mean(vals)) if vals else None
            tiers.append(entry)
        full_cost = self.planner.cost(self.planner.candidates[-1])
        return {"elastic": self.elastic(state, data, batch_size), "tiers": tiers,
                "full_model_planned": full_cost.to_dict(),
                "sat_out_replies": sum(1 for m in per_client if m.get("sat_out")),
                "memory_mb_mean": _mean([m.get("memory_mb") for m in per_client if not m.get("sat_out")]),
                "permutation_applied": not self.own_strategy.perm.is_identity}


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------

def plot_elastic(elastic: Sequence[Mapping[str, Any]], out_path: str | os.PathLike,
                 title: str = "", series: str | None = None, fig_axes=None) -> Path:
    """``elastic.png``: test (and dev) primary metric of the global model evaluated at several sub-model
    sizes, against the size (FLOPs fraction) and against forward GFLOPs per example."""
    from matplotlib.ticker import AutoLocator

    fig, (ax_size, ax_flops) = fig_axes or figure(ncols=2, width=5.0)
    metric = next((e["metric"] for e in elastic if "metric" in e), "accuracy")
    rows = [e for e in elastic if _finite(e.get(f"test_{metric}"))]
    label = series or "test"
    for split, style in (("test", "-o"), ("dev", ":x")):
        if series and split == "dev":
            continue
        ys = [e.get(f"{split}_{metric}") for e in rows]
        lab = label if split == "test" else "dev"
        ax_size.plot([e["size"] for e in rows], ys, style, label=lab)
        ax_flops.plot([e["forward_gflops_per_example"] for e in rows], ys, style, label=lab)
    ax_size.set_xlabel("size (fraction of full-model training FLOPs)")
    ax_flops.set_xlabel("forward GFLOPs per example (profile batch)")
    for ax in (ax_size, ax_flops):
        ax.xaxis.set_major_locator(AutoLocator())  # sizes and GFLOPs are not rounds
        ax.set_ylabel(metric)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="lower right")
    ax_size.set_title(f"{title}: elastic inference" if title else "elastic inference")
    return save_figure(fig, Path(out_path))


def _finite(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


register_method(name="raffm", options_cls=RaFFMMethod, method_cls=RaFFM)


def _generic(name: str) -> str:
    """A tensor name without its layer index (a sub-model with fewer layers renumbers them)."""
    return re.sub(r"\.\d+\.", ".#.", name)


def _mean(vals):
    vals = [v for v in vals if v is not None]
    return float(np.mean(vals)) if vals else None
