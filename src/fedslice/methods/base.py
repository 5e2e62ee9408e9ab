"""What a federated method is: a prepared model, a Strategy (server) and a client ``fit``.

A method is built from the experiment config on the server and on every client: the in-process
engine builds it once (``role="both"``); a Flower ClientApp builds it with ``role="client"``,
which skips server-only work (distillation before FL: what it produced reaches clients in the
payload, and is counted in the bytes sent). A method whose clients train a smaller model than the
full one (``client_model_from_server``: fedpft, fedot) is built in the client role from the
model's config only, never its weights: the server sends that smaller model's tensors in a
client's first payload. Methods differ by
composition: which tensors are trainable (the adapter, ``prepare_model``), what each client
receives (``Strategy.payload_for``), which model a client trains (``client_model``) and how
replies are weighted (``Strategy.client_updates``); the aggregation rules of the config wrap the
method's strategy (:func:`fedslice.fl.rules.wrap_rules`). The default is FedAvg over the
trainable tensors of one shared model: a client's state is loaded into it in place (no copy of
the model per client).

A method is a plug-in: its module defines its options class (a
:class:`~fedslice.config.MethodOptions`) and registers both
(:func:`fedslice.registry.register_method`); what it does is declared as class attributes the
library asks (``sends_slices``, ``adapters``, ``default_adapter``, ``client_model_from_server``),
its config checks in :meth:`Method.check_config`, its report sections (and plots) in
:meth:`Method.report_views`; what it may override is :mod:`fedslice.methods.contract`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, ClassVar, Literal

import torch
import torch.nn as nn

from fedslice.config import ExperimentConfig, quantize_refusal
from fedslice.errors import ConfigError
from fedslice.data.batching import TokenizedSplit
from fedslice.data.packing import packs
from fedslice.compute import Compute
from fedslice.fl.client import LocalResult, train_local
from fedslice.fl.orders import Orders
from fedslice.fl.memory_hold import MemoryBudgetExceeded
from fedslice.fl.rules import unwrap, wrap_rules
from fedslice.fl.rules.lora import check_lora_fields
from fedslice.fl.strategy import Payload, Reply, State, Strategy
from fedslice.methods.client_costs import client_cost_metrics, sat_out_metrics
from fedslice.methods.facts import Facts
from fedslice.methods.personal import PersonalTensors
from fedslice.models.arch import ArchSpec
from fedslice.models.loading import LoadedModel
from fedslice.peft import Adapter, make_adapter
from fedslice.registry import ADAPTERS
from fedslice.slicing.depth import freeze, frozen, frozen_below
from fedslice.tasks import Task


#: who builds the method: the in-process engine ("both"), a Flower ClientApp ("client"), Flower's
#: ServerApp ("server": built as "both", but its clients train elsewhere and Flower adds DP noise)
Role = Literal["both", "client", "server"]

#: where a method's kept state lives (:meth:`Method.kept_state`)
Side = Literal["client", "server"]


def _legacy_adapter(value: str) -> str:
    """A legacy 'lora' | 'full' option as an adapter name."""
    return "none" if value == "full" else value


class Method:
    name = "base"

    #: True: a client sends slices of the trainable state (sub-models, pruned heads), so an
    #: element is held by some clients only; rules that need whole vectors refuse the method
    sends_slices: ClassVar[bool] = False

    #: the adapters (``peft.method``) the method can train (None: every registered one)
    adapters: ClassVar[tuple[str, ...] | None] = None

    #: the adapter when ``peft.method`` is not set
    default_adapter: ClassVar[str] = "lora"

    #: True: clients train a smaller model whose every tensor the server sends at first contact,
    #: so the client role is built from the model's config on the meta device (no weight file
    #: read) and materializes only that smaller model
    client_model_from_server = False

    #: True: each client trains its own slice of the model (:meth:`client_spec`: RaFFM)
    sub_models: ClassVar[bool] = False

    #: True: clients train over a quantized frozen base (``model.quantize``); else why not
    quantized_base: ClassVar[bool | str] = True

    #: True: the run's model stays fp32 and each client quantizes its own slice of it
    #: (``model.quantize``: RaFFM, whose server orders and slices the fp32 base); False: the
    #: run's model is quantized once when it is loaded (:func:`fedslice.run.setup.load_inputs`)
    quantizes_slices: ClassVar[bool] = False

    #: True: ``fit`` depends only on (payload, data, seed) and leaves nothing in this object
    #: that the server or a later client reads, so a round's clients may train in forked worker
    #: processes (``compute.workers``)
    parallel_clients = True

    #: True: ``fit_batched`` trains clients of the same shapes together in one batched pass
    #: (``compute.batched_clients``); False: they train one after another
    batched_clients = False

    #: the ``lora.aggregation`` values the method supports (:mod:`fedslice.fl.rules.lora`):
    #: fedit and ffa need no server change; fedex, flora and svd need the method's mean of the
    #: factors and a global state of full-shape factors; fedsa a client that keeps tensors
    lora_aggregations: ClassVar[tuple[str, ...]] = ("fedit", "ffa")
    #: why the others are not supported (in the ConfigError naming both fields)
    lora_aggregation_hint: ClassVar[str] = ""
    #: clients may train LoRA at their own rank (``lora.ranks``, chosen by the budget planner)
    lora_ranks_per_client: ClassVar[bool] = False

    #: True: ``[budgets]`` plans each client (:mod:`fedslice.methods.planner`); the strategy at
    #: the bottom of the method's stages puts a client's plan into its payloads
    plans_budgets: ClassVar[bool] = False

    #: keys of the saved state that the deployed model does not hold (``fedslice export``,
    #: ``predict``, ``evaluate``): FedPFT's proxy FFN tensors (the trained LoRA plugs into the
    #: full model)
    deploy_exclude: tuple[str, ...] = ()

    #: the examples of its data a client runs an importance pass over per round before it
    #: trains: 0 none, None all of them, else at most that many (the head stage's)
    importance_cap: int | None = 0

    @classmethod
    def facts(cls, cfg: ExperimentConfig) -> Facts:
        """What the config checks and the rules ask of the method under ``cfg``
        (:class:`~fedslice.methods.facts.Facts`). Default: nothing re-ordered, no client
        statistics, and a plan may pick its base's precision where the method trains over a
        quantized base (:attr:`quantized_base`); under a deadline with ``[budgets]`` the server
        reads the shapes of each client's batches (it sends no work to a client-round predicted
        past the deadline: :mod:`fedslice.run.predicted`)."""
        stats = None
        if cfg.federation.round_policy == "deadline" and cfg.budgets is not None:
            stats = ("[budgets] under federation.round_policy='deadline' (the server predicts each "
                     "client-round from the shapes of the client's batches, its examples' lengths, "
                     "and sends no work to a client predicted past the deadline, so who trains "
                     "depends on the clients' data; use round_policy='all', where a tier's "
                     "seconds_per_round still fits each plan, or drop [budgets])")
        return Facts(client_statistics=stats, precision_refusal=quantize_refusal(cls))

    @classmethod
    def check_supported(cls, arch: ArchSpec, task: Task) -> None:
        """A ConfigError, before any weight is loaded, when the method cannot run this pair, or
        the adapter cannot (:meth:`fedslice.peft.Adapter.check_supported`)."""
        name = cls.adapter_name(task.cfg)
        adapter = ADAPTERS.get(name).adapter_cls
        if task.needs_frozen_base and adapter.trains_base:
            raise ConfigError(f"task.kind = {task.kind!r} compares the model with its frozen base "
                              f"(the adapter switched off), but peft.method = {name!r} trains the "
                              "base itself: use an adapter (peft.method = 'lora')")
        adapter.check_supported(arch, task, task.cfg.adapter_options(name))

    @classmethod
    def adapter_class(cls, cfg: ExperimentConfig) -> type[Adapter]:
        """The class of the adapter this config trains."""
        return ADAPTERS.get(cls.adapter_name(cfg)).adapter_cls

    #: an option of the method that chose between LoRA and full fine-tuning before ``[peft]``
    #: existed (raffm's ``tuning``, fedot's ``adapter_tuning``: 'lora' or 'full' = 'none')
    legacy_adapter_option: ClassVar[str | None] = None

    @classmethod
    def adapter_name(cls, cfg: ExperimentConfig) -> str:
        """The adapter this config trains: ``peft.method``, else the legacy option, else the
        method's default."""
        if cfg.peft.method is not None:
            return cfg.peft.method
        if cls.legacy_adapter_option is not None:
            return _legacy_adapter(getattr(cfg.method, cls.legacy_adapter_option))
        return cls.default_adapter

    @classmethod
    def check_config(cls, cfg: ExperimentConfig) -> None:
        """A ValueError, naming the fields, when the method cannot run this config (called when
        the config is validated; model-dependent checks come in :meth:`check_supported`).
        Default: the adapter is one the method trains, and ``peft.method`` does not contradict
        the legacy option when both are given."""
        name = cls.adapter_name(cfg)
        if cfg.budgets is not None and not cls.plans_budgets:
            raise ValueError(f"budgets: method {cfg.method.name} does not plan clients by budget "
                             "(methods that do: fedpetuning, heads, raffm, raffm+heads)")
        if cls.adapters is not None and name not in cls.adapters:
            raise ValueError(f"peft.method={name!r}: method {cfg.method.name} trains "
                             f"{' or '.join(repr(a) for a in cls.adapters)}")
        check_lora_fields(cfg, name)
        if cfg.budgets is not None and cfg.budgets.adapter_depths != [1.0]:
            cls.check_adapter_depth(cfg)
        option = cls.legacy_adapter_option
        if option and cfg.peft.method is not None and option in cfg.method.model_fields_set:
            value = getattr(cfg.method, option)
            if _legacy_adapter(value) != cfg.peft.method:
                raise ValueError(f"peft.method={cfg.peft.method!r} contradicts method.{option}="
                                 f"{value!r} (its older spelling; 'full' is 'none'): set one")

    @classmethod
    def check_adapter_depth(cls, cfg: ExperimentConfig) -> None:
        """A ValueError naming the fields when clients cannot train the adapters of the top
        blocks only (``budgets.adapter_depths`` below 1): an adapter whose tensors sit at the
        input (the backward must reach them: no saving), or a LoRA rule that needs every
        client's every factor."""
        adapter = cls.adapter_class(cfg)
        depths = f"budgets.adapter_depths={cfg.budgets.adapter_depths}"
        if not adapter.in_modules:
            raise ValueError(f"{depths}: the {adapter.name} adapter's tensors sit at the input, "
                             "below every block (the backward always reaches them): use lora, "
                             "dora, ia3 or none, or adapter_depths = [1.0]")
        if cls.adapter_name(cfg) == "lora" and cfg.lora.aggregation not in ("fedit", "ffa"):
            raise ValueError(f"{depths}: lora.aggregation={cfg.lora.aggregation!r} combines every "
                             "client's every LoRA factor; a client at a lower depth sends only "
                             "its top blocks' factors (use 'fedit' or 'ffa')")

    def __init__(self, cfg: ExperimentConfig, loaded: LoadedModel, task: Task,
                 role: Role = "both", client_sizes: Mapping[int, int] | None = None,
                 compute: Compute | None = None, token_lengths: torch.Tensor | None = None,
                 head_lengths: torch.Tensor | None = None, stages: Sequence[type] = ()):
        """``client_sizes``: client -> size of its partition, when the server knows it (replies
        are checked against it); ``compute``: the device, precision and client concurrency
        (default: the config's ``[compute]``); ``token_lengths``: the training examples' token
        counts, when the server holds the data (the budget planner's batch shapes follow them);
        ``head_lengths``: their target tokens (language-model tasks: where the head runs; None:
        once per example); ``stages``: the stages over this method, bottom first
        (:class:`fedslice.methods.stage.Composition`), built before it."""
        if role not in ("both", "client", "server"):
            raise ValueError(f"role must be 'both', 'client' or 'server', got {role!r}")
        self.cfg, self.role, self.task = cfg, role, task
        self.client_sizes = dict(client_sizes or {})
        #: the top of the method's stages (itself when none is over it): every hook the library
        #: calls goes through it, so a stage's override is the one that runs
        self.top: Any = self
        for stage in stages:
            self.top = stage(self.top, cfg, loaded, task)
        #: the method's knobs where a client's plan sets none (:meth:`orders`)
        self.knob_defaults: dict[str, Any] = type(self).plan_defaults(cfg)
        self.token_lengths, self.head_lengths = token_lengths, head_lengths
        self.compute = compute or Compute.from_config(cfg.compute, cfg.federation.clients_per_round)
        self.arch: ArchSpec = loaded.arch
        self.dims = loaded.arch.dims(loaded.model.config)
        self.adapter: Adapter = make_adapter(cfg, type(self).adapter_name(cfg), self.arch)
        if self.compute.device.type != "cpu" and not _on_meta(loaded.model):
            loaded.model.to(self.compute.device)
        self.model = self.top.prepare_model(loaded.model)
        self.compute.apply_to(self.model)
        #: precision -> the quantized copy of ``model`` its planned clients train (made on first use)
        self._bases: dict[str, nn.Module] = {}
        #: client -> its plan under ``[budgets]`` (:meth:`make_plans`; empty without budgets)
        self.plans: dict[int, Any] = {}
        #: the tensors the client being trained leaves frozen (its plan's adapter depth:
        #: :meth:`freeze_plan`), thawed when it is done (:meth:`train_client`)
        self._plan_frozen: list[nn.Parameter] = []
        #: the method's own strategy, inside the aggregation rules of the config
        self.strategy = wrap_rules(self.top.make_strategy(), cfg, role, arch=self.arch,
                                   trainable=[n for n, p in self.model.named_parameters()
                                              if p.requires_grad])
        #: the tensors each client keeps for itself (the LoRA rule's: fedsa's B), by client
        trainable = self.trainable()
        self.personal = PersonalTensors(self.strategy.personal_tensors(list(trainable)), trainable)
        if self.personal.names:  # a client's kept tensors live in this process: no forked workers
            self.parallel_clients = False

    @classmethod
    def overrides(cls, hook: str) -> bool:
        """This method overrides ``hook`` (a class between it and :class:`Method` defines it)."""
        return any(hook in vars(k) for k in cls.__mro__ if k not in (Method, object))

    @classmethod
    def plan_defaults(cls, cfg: ExperimentConfig) -> dict[str, Any]:
        """The method's value of each knob a client's plan may leave unset: its options'
        (:meth:`fedslice.config.MethodOptions.knob_defaults`) and, for a method whose clients
        quantize their own slices, the run's base precision."""
        out = cfg.method.knob_defaults()
        if cls.quantizes_slices and cfg.model.quantize != "none":
            out["base_precision"] = cfg.model.quantize
        return out

    def orders(self, payload: Payload) -> Orders:
        """The client's orders (:class:`fedslice.fl.orders.Orders`), the method's knobs where
        its plan sets none: the one place "the plan's, else the method's" is decided."""
        return payload.orders.resolved(self.knob_defaults)

    @property
    def own_strategy(self) -> Strategy:
        """The method's own strategy (its payloads, weighting, server state) under the rules."""
        return unwrap(self.strategy)

    # -- construction hooks ------------------------------------------------------------------
    def prepare_model(self, model: nn.Module) -> nn.Module:
        """Set which parameters train: the adapter's (LoRA's; ``none``: every parameter)."""
        return self.adapter.apply(model)

    def make_strategy(self) -> Strategy:
        """The method's own strategy (its payloads and weighting), before the rules wrap it."""
        return Strategy(self.cfg.federation, self.client_sizes)

    # -- budgets (fedslice.methods.planner) --------------------------------------------------
    def make_plans(self, batch: dict[str, torch.Tensor] | None = None) -> dict[int, Any]:
        """Every client's plan under ``[budgets]`` (:func:`fedslice.methods.plan_batches.method_plans`:
        none in the client role), kept in :attr:`plans`."""
        from fedslice.methods.plan_batches import method_plans
        self.plans = method_plans(self.top, batch)
        return self.plans


    def plan_axes(self, budgets) -> dict[str, list]:
        """The knobs this method's stages let the planner vary, each list best first:
        ``specs`` ((sub-model spec, width) pairs), ``sparsities``, ``ranks``, ``precisions``,
        ``depths``, ``uploads``. Default: the LoRA rank (``lora.ranks``, else ``lora.r``) where
        clients may train their own, the base's precision (``budgets.precisions``), the adapter
        depth (``budgets.adapter_depths``) and the reply's dtype (``budgets.upload_dtypes``)."""
        axes: dict[str, list] = {}
        if self.lora_ranks_per_client and self.adapter.name == "lora":
            lora = self.cfg.lora
            axes["ranks"] = sorted(set(lora.ranks or [lora.r]), reverse=True)
        if budgets.precisions != ["none"]:
            axes["precisions"] = list(budgets.precisions)  # best first (checked at load)
        if budgets.adapter_depths != [1.0]:
            axes["depths"] = list(budgets.adapter_depths)  # deepest first
        if budgets.upload_dtypes is not None and budgets.upload_dtypes != [self.cfg.federation.upload_dtype]:
            axes["uploads"] = list(budgets.upload_dtypes)  # most precise first
        return axes

    def depth_frozen(self, share: float | None) -> tuple[str, ...]:
        """The trainable tensors a client at adapter depth ``share`` leaves frozen: those below
        the top ``share`` of the blocks (:mod:`fedslice.slicing.depth`); none at None or 1."""
        return frozen_below(self.model, self.arch, share)

    def freeze_plan(self, model: nn.Module, payload: Payload) -> nn.Module:
        """``model`` with the tensors its client's plan leaves frozen (``frozen_tensors`` of the
        payload: its adapter depth) frozen until the client is done (:meth:`train_client`) or
        the next client's model is asked for (:meth:`thaw_plan` first)."""
        names = payload.orders.frozen_tensors
        if names:
            self._plan_frozen.extend(freeze(model, names))
        return model

    def thaw_plan(self) -> None:
        """The tensors :meth:`freeze_plan` froze train again (the model is shared with the
        server and the other clients)."""
        for p in self._plan_frozen:
            p.requires_grad_(True)
        self._plan_frozen.clear()

    def train_client(self, payload: Payload, data: TokenizedSplit, seed: int) -> Reply:
        """:meth:`fit` of one client (none when its plan :meth:`sits_out` the round); the
        tensors its plan froze (:meth:`freeze_plan`) train again after it, whatever happens."""
        if self.sits_out(payload):
            return Reply(arrays={}, num_examples=0, metrics=sat_out_metrics(payload))
        try:
            return self.top.fit(payload, data, seed)
        except MemoryBudgetExceeded as e:  # discovered at run time: the data outgrew the plan
            # the server says so (fl.strategy.skipped_reason) and leaves the client out
            return Reply(arrays={}, num_examples=0, metrics={
                "memory_skipped": 1, "memory_budget_mb": e.budget_mb, "memory_needed_mb": e.needed_mb})
        finally:
            self.thaw_plan()

    @contextmanager
    def planned_model(self, knobs) -> Iterator[Any]:
        """The model a client with ``knobs`` trains and the tensors it sends back
        (:class:`fedslice.methods.plan_records.PlannedModel`), for measuring; put back after."""
        from fedslice.methods.plan_records import PlannedModel

        model = self.base_at(knobs.precision)
        with (self.adapter.at_rank(model, knobs.rank) if knobs.rank is not None else nullcontext()), \
                frozen(model, self.depth_frozen(knobs.depth)):
            yield PlannedModel(model, self.trainable(model))

    def importance_examples(self, n: int) -> int:
        """Examples a client of ``n`` examples runs an importance pass over per round
        (:attr:`importance_cap`)."""
        cap = self.top.importance_cap
        return n if cap is None else min(n, cap)

    def can_checkpoint(self) -> bool:
        """The model clients train supports gradient checkpointing."""
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        return bool(getattr(base, "supports_gradient_checkpointing", False))

    # -- state -------------------------------------------------------------------------------
    def trainable(self, model: nn.Module | None = None) -> dict[str, nn.Parameter]:
        model = self.model if model is None else model
        return {n: p for n, p in model.named_parameters() if p.requires_grad}

    def state_keys(self) -> list[str]:
        """The names of the global state: the trainable tensors, and the frozen ones the
        strategy changes on the server (``Strategy.frozen_state_keys``: FedEx-LoRA's and FLoRA's
        base weights), in the model's order."""
        params = dict(self.model.named_parameters())
        trainable = [n for n, p in params.items() if p.requires_grad]
        frozen = [n for n, p in params.items() if not p.requires_grad]
        keep = set(trainable) | set(self.strategy.frozen_state_keys(trainable, frozen))
        return [n for n in params if n in keep]

    def initial_state(self) -> State:
        """The global state the server starts from (a copy, detached from the model, in host
        memory): :meth:`state_keys`, as the strategy starts from them (``Strategy.initial``)."""
        params = dict(self.model.named_parameters())
        return self.strategy.initial({n: params[n].detach().cpu().clone() for n in self.state_keys()})

    @staticmethod
    @torch.no_grad()
    def load_state(params: dict[str, nn.Parameter], state: State) -> None:
        """Copy ``state`` into the parameters in place (every key must exist)."""
        for k, t in state.items():
            params[k].copy_(t)

    def load_model(self, model: nn.Module, state: State, rank: int | None = None
                   ) -> dict[str, nn.Parameter]:
        """``state`` (trainable and frozen tensors by name) copied into ``model`` in place, its
        adapter first given the client's size (``rank``: a client's LoRA rank, None: the global
        one); returns the model's trainable parameters."""
        self.adapter.resize(model, rank)
        self.load_state(dict(model.named_parameters()), state)
        return self.trainable(model)

    # -- client ------------------------------------------------------------------------------
    def kept_state(self, side: Side) -> dict[str, Any]:
        """What ``side`` keeps beyond the global state and the strategy's. ``"client"``: what a
        client keeps between its participations, as tensors by name (Flower stores it in the
        node's ``Context.state``: a deployment starts a fresh ClientApp process per message);
        ``"server"``: what a resumed run needs (e.g. FedPFT's distillation logs), as nested JSON
        with tensors. Default: the tensors clients keep for themselves (:attr:`personal`)."""
        return self.personal.state(side)

    def restore_state(self, side: Side, state: dict[str, Any]) -> None:
        """Restore :meth:`kept_state` of ``side`` (``{}``: nothing kept yet)."""
        self.personal.restore(side, state)

    def client_spec(self, payload: Payload, arrays: State | None = None):
        """The slice of the full model (a :class:`fedslice.slicing.spec.Spec`) that
        ``payload``'s client trains when it trains a sub-model (RaFFM); None: the whole model
        this method gives clients. A stage above (heads) prunes inside it. With the client's
        reply ``arrays`` in hand: the slice it really trained (for its costs), narrowed by the
        stages above."""
        return None

    @staticmethod
    def sits_out(payload: Payload) -> bool:
        """The client was sent no work this round (its plan: no sub-model fits its budget)."""
        return payload.orders.sit_out is not None

    def client_model(self, payload: Payload) -> tuple[nn.Module, dict[str, nn.Parameter]]:
        """The model a client trains and its trainable tensors, with the payload loaded (at the
        client's LoRA rank, ``lora_rank`` of its payload, when ranks differ; over the base at
        its plan's precision, ``base_precision``: :meth:`base_at`)."""
        self.thaw_plan()  # what an earlier client's plan froze (a caller outside train_client)
        o = self.orders(payload)
        model = self.base_at(o.base_precision)
        params = self.load_model(model, payload.arrays, o.lora_rank)
        self.freeze_plan(model, payload)  # after loading: a resized adapter has new tensors
        return model, {n: p for n, p in params.items() if p.requires_grad}

    def base_at(self, precision: str | None) -> nn.Module:
        """The model clients planned at ``precision`` train: the run's (None, 'none'), or a copy
        of it with its frozen block linears quantized (``budgets.precisions``), made once per
        process (workers forked after it share it) and kept: never per client or round. It
        shares every frozen fp32 tensor with the run's model
        (:func:`fedslice.models.quantize.quantized_copy`)."""
        if precision in (None, "none", self.cfg.model.quantize):
            return self.model
        if precision not in self._bases:
            from fedslice.models.quantize import quantized_copy, quiet

            with quiet():
                self._bases[precision] = quantized_copy(self.model, precision, self.arch)
        return self._bases[precision]

    def prepare_clients(self, payloads: Mapping[int, Payload]) -> None:
        """Build, in this process, what a round's clients will share, before forked workers
        train them (they inherit it; what a worker builds dies with it). Default: nothing."""

    def planned_upload(self, payload: Payload) -> dict[str, torch.Tensor]:
        """The tensors the client of ``payload`` sends back (their shapes: what ``fedslice
        validate`` counts before training): :meth:`planned_model` at its plan's knobs (none
        under ``[budgets]``: the method's own), less the tensors it keeps for itself. The head
        stage's kept heads depend on the client's data, their count does not."""
        from fedslice.methods.plan_records import Knobs

        if self.sits_out(payload):
            return {}
        plan = self.plans.get(payload.orders.client)
        with self.top.planned_model(Knobs() if plan is None else plan.knobs) as planned:
            return self.personal.strip(planned.upload)

    def fit(self, payload: Payload, data: TokenizedSplit, seed: int) -> Reply:
        """Local training of one client: returns the trained tensors and measured costs (the
        tensors it keeps for itself, :attr:`personal`, trained beside them and kept)."""
        payload = self.personal.with_kept(payload)
        model, params = self.top.client_model(payload)
        orders = self.orders(payload)
        result = train_local(model, params, data, orders, seed, loss_fn=self.task.loss,
                             compute=self.compute, virtual_tokens=self.adapter.virtual_tokens,
                             by_parts=self.adapter.in_modules, pack=self.packs(orders))
        arrays = {n: p.detach().clone() for n, p in params.items() if n in payload.arrays}
        metrics = self.top.client_metrics(model, params, payload, arrays, result)
        return self.personal.keep(payload.orders.client, Reply(arrays=arrays, num_examples=len(data),
                                                               metrics=metrics))

    def packs(self, orders: Orders) -> bool:
        """Whether a client's training batches are packed: ``federation.pack``, where the
        architecture, head and adapter allow it (:func:`fedslice.data.packing.packs`), and the
        client's plan does not split its batches (micro-batches split rows of examples)."""
        if orders.micro_batches > 1:
            return False
        return orders.pack and self.task.packable and packs(self.arch.model_type, self.task.head,
                                                            self.adapter.in_modules)

    def batch_key(self, payload: Payload):
        """Clients whose payloads have equal keys train the same tensors of the same model and
        may share one batched pass; None: this client trains alone. Default: every client trains
        the one shared model (when the method declares ``batched_clients``), clients of one LoRA
        rank, base precision and training config (:meth:`~fedslice.fl.orders.Orders.train_key`:
        a plan's local steps, batch size, FLOPs budget) together (tensors of other shapes do not
        stack); a client whose plan splits its batches or checkpoints trains alone (the batched
        pass does neither)."""
        o = self.orders(payload)
        if not self.top.batched_clients or o.trains_alone() or o.sit_out is not None:
            return None
        return json.dumps([o.spec, o.lora_rank, o.base_precision, o.train_key()], sort_keys=True)

    def fit_batched(self, jobs: list[tuple[int, Payload, TokenizedSplit, int]], compute: Compute,
                    on_reply) -> None:
        """Train ``jobs`` (client, payload, data, seed), calling ``on_reply(client, reply)``:
        :func:`fedslice.methods.batched_fit.fit_batched`."""
        from fedslice.methods.batched_fit import fit_batched
        fit_batched(self.top, jobs, compute, on_reply)


    def client_metrics(self, model: nn.Module, params: dict[str, nn.Parameter], payload: Payload,
                       arrays: State, result: LocalResult) -> dict[str, float]:
        """A reply's metrics: its loss, steps and costs
        (:func:`fedslice.methods.client_costs.client_cost_metrics`; what a client keeps for
        itself is neither received nor sent: not counted); a stage adds its own."""
        payload = Payload(self.personal.strip(payload.arrays), payload.config, payload.model)
        return client_cost_metrics(self, model, params, payload, self.personal.strip(arrays), result)


    # -- server evaluation -------------------------------------------------------------------
    def eval_model(self, state: State) -> nn.Module:
        """The global model with ``state`` loaded (the shared model, in place)."""
        self.load_model(self.model, state)
        return self.model

    def evaluate(self, state: State, data: TokenizedSplit, batch_size: int,
                 max_generations: int | None = None) -> dict[str, Any]:
        """The task's metrics of the global model (generation tasks: BLEU/ROUGE on at most
        ``max_generations`` prompts)."""
        model = self.top.eval_model(state)
        with self.compute.autocast():
            return self.task.evaluate(model, data, batch_size, max_generations)

    # -- server work between rounds ----------------------------------------------------------
    def on_round_end(self, server_round: int, state: State,
                     replies: dict[int, Reply]) -> tuple[State, dict[str, Any]]:
        """Server work after aggregation (e.g. FedPFT's periodic re-distillation): returns the
        global state for the next round and metrics merged into the round record. ``replies``
        are the valid replies used in the aggregation. Default: nothing."""
        return state, {}

    # -- after training ----------------------------------------------------------------------
    def final_metrics(self, state: State, data: Any, records: list[dict[str, Any]],
                      batch_size: int) -> dict[str, Any]:
        """Method-specific results merged into summary.json (e.g. accuracy per sub-model size)."""
        return {}

    @classmethod
    def export_state(cls, state: State, server: dict[str, Any], arch: ArchSpec) -> State:
        """The global state as a run folder saves it, from the global state and the server's
        state as a checkpoint holds it (``{"strategy": ..., "method": ...}``): e.g. RaFFM undoes
        its re-ordering of heads and neurons. Default: the state itself."""
        return state

    def exported(self, state: State) -> State:
        """:meth:`export_state` of this run (its server state, as a checkpoint would hold it)."""
        server = {"strategy": self.strategy.state_dict(), "method": self.top.kept_state("server")}
        return type(self).export_state(state, server, self.arch)

    def write_artifacts(self, folder: Path) -> None:
        """Write method-specific files (curves, plots) into the run folder. Default: none."""

    @classmethod
    def report_views(cls, folder: Path, config: dict[str, Any], metrics: list[dict[str, Any]],
                     summary: dict[str, Any]) -> list:
        """The method's own sections of a run's HTML report (:class:`fedslice.viz.View`: a
        figure and the data behind it), from the finished run folder; a view with a ``png``
        name is also a plot ``fedslice report`` writes there (RaFFM's elastic sizes, heads'
        importance maps). Default: none."""
        return []


def _on_meta(model: nn.Module) -> bool:
    """A model built on the meta device (a Flower client's, before its first payload)."""
    return any(p.is_meta for p in model.parameters())
