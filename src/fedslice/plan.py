"""``fedslice validate``: everything a run checks before it trains, and the plan it would follow.

Loads the config, the data (sizes, labels, the partition among clients, token lengths) and the
model's config, and builds the method on a weightless copy of the model (PyTorch's ``meta``
device: shapes without memory), so the plan's sizes are those the run will use: what each
client receives and sends back, per-client sub-model sizes for the slicing methods. Server work
that needs weights (distillation before FL, salience ordering) is not done. The time per round
is estimated from one timed training step of a randomly initialised model (skippable).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field

import torch

from fedslice import measure
from fedslice.config import ExperimentConfig
from fedslice.errors import ConfigError, FedsliceError
from fedslice.fl.devices import describe_clock
from fedslice.fl.rules import describe_rules
from fedslice.fl.wire import wire_bytes
from fedslice.data.federated import FederatedData
from fedslice.measure import ClientCost
from fedslice.models.loading import LoadedModel, build_from_config, load_config
from fedslice.run.setup import Inputs, configure_process, load_inputs


@dataclass
class Plan:
    """What ``fedslice validate`` prints (``render``) and tests check (the fields)."""

    name: str
    method: str
    splits: dict[str, int]
    sources: dict[str, str]
    label_names: list[str] | None
    num_labels: int
    client_sizes: list[int]
    model: str
    total_params: int
    rounds: int
    clients_per_round: int
    costs: dict[int, ClientCost] = field(default_factory=dict)  # per client, round 1 (sizes)
    submodel_params: dict[int, int] = field(default_factory=dict)  # per client, slicing methods
    steps_per_client: dict[int, int] = field(default_factory=dict)
    mean_tokens: float = 0.0
    step_seconds: float | None = None
    notes: list[str] = field(default_factory=list)
    aggregation: str = ""  # how the server combines a round's updates (rules, server optimizer)
    upload_dtype: str = "fp32"  # federation.upload_dtype: what the up bytes count in
    clock: str = ""  # the round policy and the devices on the simulated clock ([devices])

    @property
    def bytes_down(self) -> dict[int, int]:
        """Per client, the bytes of its first payload's tensors."""
        return {c: cost.bytes_down for c, cost in self.costs.items()}

    @property
    def bytes_up(self) -> dict[int, int]:
        """Per client, the bytes of the trained tensors it sends back."""
        return {c: cost.bytes_up for c, cost in self.costs.items()}

    @property
    def round_bytes(self) -> float:
        """Expected bytes per round (down + up, all clients of a round): the mean client's
        times clients per round."""
        per = [self.bytes_down.get(c, 0) + self.bytes_up.get(c, 0) for c in self.bytes_down]
        return statistics.fmean(per) * self.clients_per_round if per else 0.0

    @property
    def round_seconds(self) -> float | None:
        """Estimated time per round: clients per round x mean local steps x one full-model step
        (an upper bound for methods that train a smaller model)."""
        if self.step_seconds is None or not self.steps_per_client:
            return None
        return self.clients_per_round * statistics.fmean(self.steps_per_client.values()) \
            * self.step_seconds

    def render(self) -> str:
        from fedslice.progress import fmt_duration

        sizes = self.client_sizes
        lines = [f"plan for {self.name} (method {self.method}): config, data and model are valid",
                 "data:"]
        for split, n in self.splits.items():
            lines.append(f"  {split:5s} {n:>8d} examples  ({self.sources[split]})")
        labels = ", ".join(self.label_names) if self.label_names else "ids 0.." + str(self.num_labels - 1)
        lines.append(f"  labels: {self.num_labels} ({labels}); mean {self.mean_tokens:.1f} tokens "
                     "per training example")
        lines.append(f"clients: {len(sizes)}, {self.clients_per_round} per round, {self.rounds} "
                     f"rounds; examples per client min {min(sizes)}, median "
                     f"{statistics.median(sizes):g}, max {max(sizes)}")
        if len(sizes) <= 20:
            lines.append("  sizes: " + " ".join(str(s) for s in sizes))
        lines.append(f"model: {self.model}, {self.total_params / 1e6:.2f} M parameters")
        if self.submodel_params:
            by_size: dict[int, list[int]] = {}
            for c, n in sorted(self.submodel_params.items()):
                by_size.setdefault(n, []).append(c)
            lines.append("sub-models (parameters, share of the full model: clients):")
            for n, cs in sorted(by_size.items(), reverse=True):
                shown = ", ".join(map(str, cs[:12])) + (", ..." if len(cs) > 12 else "")
                lines.append(f"  {n / 1e6:8.2f} M  {n / self.total_params:6.1%}: {len(cs)} "
                             f"client(s) [{shown}]")
        if self.bytes_down:
            down = statistics.fmean(self.bytes_down.values())
            up = statistics.fmean(self.bytes_up.values())
            wire = "" if self.upload_dtype == "fp32" else f" (in {self.upload_dtype})"
            lines.append(f"bytes per client per round: down {down / 1e6:.3f} MB, up "
                         f"{up / 1e6:.3f} MB{wire}; per round ({self.clients_per_round} clients): "
                         f"{self.round_bytes / 1e6:.3f} MB")
        if self.aggregation:
            lines.append(f"aggregation: {self.aggregation}")
        if self.clock:
            lines.append(f"simulated clock: {self.clock}")
        if self.round_seconds is not None:
            steps = statistics.fmean(self.steps_per_client.values())
            lines.append(f"time per round: about {fmt_duration(self.round_seconds)} "
                         f"({self.clients_per_round} clients x {steps:.1f} local steps x "
                         f"{self.step_seconds:.3f} s per full-model step on this machine; "
                         f"evaluation not included); {self.rounds} rounds: about "
                         f"{fmt_duration(self.round_seconds * self.rounds)}")
        lines += [f"note: {n}" for n in self.notes]
        return "\n".join(lines)


def _steps(cfg: ExperimentConfig, n: int) -> int:
    fed = cfg.federation
    return fed.local_steps or fed.local_epochs * -(-n // fed.batch_size)


def _random_model(cfg: ExperimentConfig, task, num_labels: int | None) -> LoadedModel:
    """The model with random values (the run's shapes) and the task's head."""
    return build_from_config(cfg.model, num_labels, head=task.head, device="cpu", seed=cfg.seed)


def _time_step(cfg: ExperimentConfig, task, data: FederatedData, num_labels: int | None) -> float:
    """Seconds of one training step of the full model (random weights) on a batch of the
    client data (the task's loss)."""
    model = _random_model(cfg, task, num_labels).model.train()
    order = torch.argsort(data.train.lengths, stable=True)
    mid = max(0, len(order) // 2 - cfg.federation.batch_size // 2)  # a typical length
    batch = data.train.collate(order[mid:mid + cfg.federation.batch_size])
    times = []
    for _ in range(3):  # the first step warms up
        t0 = time.perf_counter()
        task.loss(model, batch).backward()
        times.append(time.perf_counter() - t0)
    return min(times[1:])


def make_plan(cfg: ExperimentConfig, *, timing: bool = True) -> Plan:
    """Check config, data and model as a run would, without weights; return the plan.

    Raises the errors a run would raise at start (ConfigError, DataError, ModelError).
    """
    configure_process(cfg)
    inputs = load_inputs(cfg, role="client", weights="shapes")
    task, raw, data = inputs.task, inputs.raw, inputs.data
    k = task.num_labels(raw)
    sizes = [len(p) for p in data.partitions]
    mean_tokens = float(data.train.lengths.float().mean()) if len(data.train) else 0.0
    plan = Plan(name=cfg.run_name, method=cfg.method.name,
                splits={s: len(getattr(data, s)) for s in ("train", "dev", "test")},
                sources={s: raw[s].source for s in ("train", "dev", "test")},
                label_names=task.label_names, num_labels=k or 0, client_sizes=sizes,
                model=str(load_config(cfg.model)[1]), total_params=0,
                rounds=cfg.federation.rounds, clients_per_round=cfg.federation.clients_per_round,
                mean_tokens=mean_tokens, aggregation=describe_rules(cfg),
                upload_dtype=cfg.federation.upload_dtype, clock=describe_clock(cfg))
    try:
        _method_sizes(cfg, plan, inputs, inputs.loaded)
    except _NeedsValues as e:
        # e.g. raffm's planner reads values (.item()): random weights have the same shapes, and
        # what each client's budget buys depends on shapes only
        try:
            _method_sizes(cfg, plan, inputs, _random_model(cfg, task, k))
            plan.notes.append(f"{cfg.method.name}: sizes measured on randomly initialised weights "
                              "(the shapes of the real ones)")
        except _NeedsValues:
            plan.notes.append(f"{cfg.method.name}: sizes per client need the model's weights "
                              f"({e}); they are measured in the run")
    if note := cfg.method.set_aside_note():
        plan.notes.append(note)
    if cfg.budgets is not None:
        plan.notes.append("budgets: each client's plan (measured on the model) is printed by "
                          "`fedslice plan CONFIG`")
    plan.steps_per_client = {c: _steps(cfg, n) for c, n in enumerate(sizes) if n}
    if timing:
        plan.step_seconds = _time_step(cfg, task, data, k)
    return plan


def _method_sizes(cfg: ExperimentConfig, plan: Plan, inputs: Inputs, loaded: LoadedModel) -> None:
    """Build the method on ``loaded``; record what each client receives and sends (under
    ``[budgets]`` each client's model and upload are its plan's: ``fedslice plan`` measures them)."""
    plan.total_params = sum(p.numel() for p in loaded.model.parameters())
    if cfg.budgets is not None:
        return
    try:
        method = inputs.method(cfg, role="client", loaded=loaded)
        state = method.initial_state()
        clients = [c for c, n in enumerate(plan.client_sizes) if n]
        payloads = method.strategy.configure_train(1, state, clients)
        first_contact = []
        for c, payload in payloads.items():
            client_model, params = method.client_model(payload)
            up = method.planned_upload(payload)
            plan.costs[c] = ClientCost(
                bytes_down=measure.tensor_bytes(payload.arrays),
                bytes_up=wire_bytes(up, cfg.federation.upload_dtype),  # as it travels
                params_down=measure.num_params(payload.arrays), params_up=measure.num_params(up),
                trainable_params=sum(p.numel() for p in params.values()))
            first_contact.append(measure.tensor_bytes(payload.model))
            if client_model is not method.model:
                plan.submodel_params[c] = sum(p.numel() for p in client_model.parameters())
        if any(first_contact):
            plan.notes.append(f"{cfg.method.name}: a client's first payload also carries the frozen "
                              f"tensors of the model it trains, {statistics.fmean(first_contact) / 1e6:.3f}"
                              " MB once (sub-model above): no client reads the full model")
    except FedsliceError:
        raise
    except Exception as e:  # noqa: BLE001 - a method whose set-up needs tensor values
        raise _NeedsValues(f"{type(e).__name__}: {str(e).splitlines()[0][:120]}") from e


class _NeedsValues(Exception):
    """Building the method read tensor values, which a weightless (meta) model does not have."""


def budget_plan(cfg: ExperimentConfig, json_path: str | None = None) -> str:
    """``fedslice plan``: every client's plan under ``[budgets]``, measured as the run measures
    it (the model with random weights of the real shapes, quantized as ``model.quantize`` asks,
    on the task's profile batch), grouped by budget and plan; ``json_path``: every client's plan
    as JSON. A ConfigError when the config has no budgets or a client's budget fits no plan."""
    import json

    from fedslice.methods.plan_records import too_few_eligible
    from fedslice.methods.plan_report import render_plans

    if cfg.budgets is None:
        raise ConfigError("fedslice plan: the config has no [budgets] section (tiers or a csv of "
                          "client budgets)")
    configure_process(cfg)
    inputs = load_inputs(cfg, role="both", weights="random")
    method = inputs.method(cfg, "both")
    from fedslice.methods.plan_batches import planning_lengths

    fed = cfg.federation
    longest, per_example = planning_lengths(cfg, inputs.data.train.lengths)
    base = cfg.model.quantize if cfg.model.quantize != "none" else "fp32"
    lower = [m for m in (cfg.budgets.precisions if cfg.budgets else []) if m != "none"]
    if lower:
        base += f", or a client's {'/'.join(lower)} copy where its plan says"
    lines = [f"plans for {cfg.run_name} (method {cfg.method.name}, {fed.num_clients} clients, "
             f"base {base}): measured on "
             f"a batch of {fed.batch_size} x {longest} tokens (the longest example), FLOPs per "
             f"round for each client's examples at {per_example:.1f} tokens each"]
    lines += render_plans(method.plans, method.client_sizes)
    if note := too_few_eligible(method.plans, fed.clients_per_round):
        lines.append(f"  {note}")
    if json_path:
        with open(json_path, "w") as f:
            json.dump({str(c): p.to_dict() for c, p in sorted(method.plans.items())}, f, indent=1)
        lines.append(f"every client's plan: {json_path}")
    return "\n".join(lines)
