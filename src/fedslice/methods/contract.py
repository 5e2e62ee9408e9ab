"""The stage contract: the hooks a method (or a stage of a composition) may override, by role.

Every other function of :class:`~fedslice.methods.base.Method` is the library's own (loading a
state, the plan's frozen tensors, the orders' resolver, the batched pass, the cost record) and
is not overridden; ``tests/test_contract.py`` holds every registered method to this list. What
a stage *is* rather than does is a class attribute (``sends_slices``, ``sub_models``,
``batched_clients``, ``adapters``, ``lora_aggregations``, ``importance_cap``, ...), and what it
says about a config before anything is built is one record (:class:`~fedslice.methods.facts.Facts`).
A stage over another method (:class:`~fedslice.methods.stage.Stage`: the head stage) overrides
the same hooks, holding the stage below (``self.below``); its class hooks take the stages
below's answer or class as a last argument.
"""

from __future__ import annotations

from typing import Any, Protocol

#: role -> the hooks of that role, in the order a run meets them
HOOKS: dict[str, tuple[str, ...]] = {
    # class methods, before anything is built
    "checks": ("check_config", "check_supported", "facts"),
    # the server (and each client process) builds the method once
    "build": ("prepare_model", "make_strategy"),
    # a client: its model, its slice, local training, what its reply reports
    "client": ("client_model", "client_spec", "fit", "client_metrics", "prepare_clients"),
    # what the budget planner may vary, and the model each choice trains
    "plan": ("plan_axes", "planned_model"),
    # what a client keeps between participations, and the server between rounds
    "persist": ("kept_state", "restore_state"),
    # server work after aggregation
    "server": ("on_round_end",),
    # after training: summary entries, files, the report's sections and plots
    "report": ("final_metrics", "write_artifacts", "report_views"),
    # the saved state and the model evaluated from it
    "export": ("export_state", "eval_model"),
}

#: every hook, once
ALL_HOOKS: frozenset[str] = frozenset(h for hooks in HOOKS.values() for h in hooks)


class Checks(Protocol):
    @classmethod
    def check_config(cls, cfg) -> None: ...  # ValueError naming the fields, at load
    @classmethod
    def check_supported(cls, arch, task) -> None: ...  # ConfigError, before weights load
    @classmethod
    def facts(cls, cfg) -> Any: ...  # Facts: re-ordering, client statistics, precision


class Build(Protocol):
    def prepare_model(self, model) -> Any: ...  # which parameters train
    def make_strategy(self) -> Any: ...  # its payloads, weighting and first state (Strategy.initial)


class Client(Protocol):
    def client_model(self, payload) -> tuple[Any, dict]: ...  # (model, trainable), payload loaded
    def client_spec(self, payload, arrays=None) -> Any: ...  # its slice (None: the whole model)
    def fit(self, payload, data, seed: int) -> Any: ...  # local training -> Reply
    def client_metrics(self, model, params, payload, arrays, result) -> dict: ...
    def prepare_clients(self, payloads) -> None: ...  # shared work before workers fork


class Plan(Protocol):
    def plan_axes(self, budgets) -> dict[str, list]: ...  # its knobs, best first
    def planned_model(self, knobs) -> Any: ...  # context: PlannedModel(model, upload, ...)


class Persist(Protocol):
    def kept_state(self, side: str) -> dict: ...  # "client" | "server"
    def restore_state(self, side: str, state: dict) -> None: ...


class Server(Protocol):
    def on_round_end(self, server_round: int, state, replies) -> tuple[dict, dict]: ...


class Report(Protocol):
    def final_metrics(self, state, data, records, batch_size: int) -> dict: ...
    def write_artifacts(self, folder) -> None: ...
    @classmethod
    def report_views(cls, folder, config, metrics, summary) -> list: ...  # views; PNG plots too


class Export(Protocol):
    @classmethod
    def export_state(cls, state, server, arch) -> dict: ...  # as a run folder saves it
    def eval_model(self, state) -> Any: ...  # the global model holding ``state``
