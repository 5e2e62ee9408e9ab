"""The server side of a federated method, as small hooks over state dicts.

Modelled on Flower's ``serverapp/strategy/fedavg.py``: ``configure_train`` builds one payload per
client, ``aggregate_train`` validates replies and calls ``aggregate``. These three are the
*templates*; everything they call is a *hook*:

* a method's strategy overrides hooks: what a client receives (``payload_for``), what it may send
  back (``expected_update``, ``check_reply``), its **weighting** (``client_updates``: each
  client's delta in full shape and its weight, a float or per-element tensors: FedAvg's
  examples, RaFFM's holders, heads' Eq. 8 importance; ``mean``: the weighted mean they feed)
  and work after aggregating (``after_aggregate``: RaFFM's re-ordering);
* an aggregation **rule** (:mod:`fedslice.fl.rules`: clipping, median, trimmed mean, Krum,
  DP-FedAvg, ...) wraps any strategy, like Flower's ``DifferentialPrivacyServerSideFixedClipping``,
  delegates every hook to it and overrides the one it changes (``combine``, ``min_valid``), so
  valid combinations need no new class.

A strategy wrapped by rules must not override a template (:class:`fedslice.fl.rules.Rule`
checks). Collaborators (the partition sizes, the rule's options, the DP accountant) are passed
to ``__init__``, never set afterwards. Nothing here touches a model: the in-process engine and
the Flower ServerApp call the same functions.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fedslice.config import FederationConfig
from fedslice.fl.orders import Orders, order_fields
from fedslice.fl.validation import check_num_examples, check_update
from fedslice.slicing.aggregate import aggregate_deltas, client_delta

log = logging.getLogger(__name__)

State = dict[str, torch.Tensor]


@dataclass
class Payload:
    """Server -> client: the tensors the client receives and JSON-able instructions.

    ``model``: at a client's first contact, the frozen tensors of the smaller model it trains
    (fedpft's proxy, fedot's adapter + emulator) by that model's names, for a client that holds
    no copy of the model (counted in the bytes sent); empty otherwise."""

    arrays: State
    config: dict[str, Any] = field(default_factory=dict)
    model: State = field(default_factory=dict)

    @property
    def orders(self) -> Orders:
        """The config as its typed record (:class:`fedslice.fl.orders.Orders`): what every
        reader takes; the dict is the wire form."""
        return Orders.of(self.config)


@dataclass
class Reply:
    """Client -> server: the client's trained tensors, its example count and scalar metrics."""

    arrays: State
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)


def skipped_reason(reply: Any) -> str | None:
    """Why a client trained nothing though it was sent work, from its reply's metrics (a memory
    budget its step did not fit one example at a time: fl.memory_hold.MemoryBudgetExceeded), or None."""
    metrics = getattr(reply, "metrics", None)
    if not isinstance(metrics, dict) or not metrics.get("memory_skipped"):
        return None
    return (f"memory budget {float(metrics['memory_budget_mb']):g} MiB; its cheapest step (one "
            f"example) needs {float(metrics['memory_needed_mb']):.1f} MiB (the data outgrew the plan)")


def host_state(state: State) -> State:
    """``state`` with every tensor in host (CPU) memory: the server aggregates there, in fp32
    (a no-op for tensors already on the CPU)."""
    return {k: v if v.device.type == "cpu" else v.detach().cpu() for k, v in state.items()}


def on_host(reply: Reply) -> Reply:
    """A reply whose tensors are in host memory (clients training on a GPU send device tensors)."""
    if all(v.device.type == "cpu" for v in reply.arrays.values()):
        return reply
    return Reply(arrays=host_state(reply.arrays), num_examples=reply.num_examples,
                 metrics=reply.metrics)


@dataclass
class RoundResult:
    state: State
    used: list[int]
    excluded: list[dict[str, Any]]
    skipped: bool = False  # fewer than min_replies valid replies: the state is unchanged
    rejected: int = 0  # replies that failed validation (part of ``excluded``)
    #: the clients of those replies (what they reported is not recorded: it is not trusted)
    invalid: list[int] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)  # of the aggregation (clipping, DP)


#: The template methods of :class:`Strategy`: a wrapped strategy must not override them.
TEMPLATES = ("configure_train", "aggregate_train", "aggregate")


class Strategy:
    """FedAvg over the trainable state, with server learning rate eta (Eq. 5 of the heads paper).

    ``client_sizes``: client -> size of its partition, when the server knows it (a reply's
    ``num_examples`` is checked against it)."""

    def __init__(self, fed: FederationConfig, client_sizes: Mapping[int, int] | None = None):
        self.fed = fed
        self.client_sizes: dict[int, int] = dict(client_sizes or {})
        self.sent: list[int] = []  # clients of the round being trained
        self.population: int | None = None  # clients they were sampled from

    # -- configure ---------------------------------------------------------------------------
    def train_config(self, server_round: int) -> dict[str, Any]:
        f = self.fed
        return order_fields(round=server_round, lr=f.lr, weight_decay=f.weight_decay,
                            local_epochs=f.local_epochs, local_steps=f.local_steps or 0,
                            batch_size=f.batch_size, group_by_length=f.group_by_length, pack=f.pack,
                            max_grad_norm=f.max_grad_norm or 0.0, fedprox_mu=f.fedprox_mu)

    def payload_for(self, server_round: int, state: State, client: int, config: dict) -> Payload:
        """The payload of one client. Default: the whole trainable state (tensors shared, not copied)."""
        return Payload(arrays=dict(state), config={**config, **order_fields(client=client)})

    def configure_train(self, server_round: int, state: State, clients: list[int],
                        population: int | None = None) -> dict[int, Payload]:
        """One payload per client; ``population``: how many clients the selector sampled them
        from (the DP accountant's sampling rate)."""
        config = self.train_config(server_round)
        self.sent, self.population = list(clients), population
        return {c: self.payload_for(server_round, state, c, config) for c in clients}

    def forget(self, client: int) -> None:
        """A client sent a payload did not reply (failed node, refused payload): drop what the
        server assumed it now holds, so its next payload is whole. Default: nothing is assumed."""

    # -- what the global state holds, and what clients keep --------------------------------------
    def frozen_state_keys(self, trainable: Iterable[str], frozen: Iterable[str]) -> list[str]:
        """Frozen model tensors (among ``frozen``) that the global state must hold because the
        server changes them (FedEx-LoRA and FLoRA fold updates into the base weights). Default:
        none."""
        return []

    def initial(self, state: State) -> State:
        """The global state the first round starts from, given the model's tensors of the
        state's keys (as Flower's ``Strategy.initialize_parameters``): RaFFM salience-orders them,
        FedPFT adds its proxy's tensors. Default: as given."""
        return state

    def personal_tensors(self, names: Iterable[str]) -> set[str]:
        """Trainable tensors (among ``names``) that each client keeps for itself: never sent,
        never aggregated (FedSA-LoRA's B). Default: none."""
        return set()

    def client_rank(self, client: int) -> int | None:
        """The adapter rank of ``client`` (heterogeneous LoRA ranks), None for the global one."""
        return None

    def client_slice(self, payload: Payload):
        """The slice of the global state (a :class:`fedslice.slicing.spec.Spec`, in full-model
        indices) that ``payload``'s client trains, when it trains a sub-model (RaFFM); None: the
        whole state. A stage above (heads' selection) cuts its own choice out of it."""
        return None

    def client_factor(self, payload: Payload) -> float:
        """A factor on every aggregation weight of the client of ``payload`` (RaFFM's f^p, which
        its payload carries: the client weighs its own update under secure aggregation).
        Default: 1."""
        return 1.0

    def client_view(self, payload: Payload, shapes: Mapping[str, tuple[int, ...]]
                    ) -> tuple[State, dict[str, torch.Tensor]]:
        """The global state as the client of ``payload`` knows it, over the keys of ``shapes``
        (the trainable state's full shapes): the tensors it was sent at their places in the full
        shapes (zeros elsewhere) and, per key, where it holds them (a mask broadcasting to the
        shape; a key it was not sent is absent). What a client computes its own update and
        weights from under secure aggregation (:mod:`fedslice.fl.rules.secagg`), and the slices
        whose union the server announces. Default: the payload's tensors of full shape, whole."""
        held = {k: payload.arrays[k] for k, s in shapes.items()
                if k in payload.arrays and tuple(payload.arrays[k].shape) == tuple(s)}
        return held, {k: torch.ones(()) for k in held}

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Server-side state a resumed run needs (nested JSON with tensors): none here; variants
        and rules (the DP accountant) add theirs, each under its own keys."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""

    # -- aggregate ---------------------------------------------------------------------------
    def expected_update(self, state: State, payload: Payload, reply: Reply) -> dict[str, torch.Tensor]:
        """The tensors a client may send back (its slice of the trainable state), by name, as
        it was sent them: the shapes and dtypes a reply must have. Default: the payload."""
        return payload.arrays

    def absent(self, payload: Payload) -> str | None:
        """Why a client was not expected to train this round, or None. Default: it was sent no
        work (its payload's ``sit_out``: no plan fits its budget)."""
        why = payload.orders.sit_out
        return None if why is None else f"sat out: {why}"

    def check_reply(self, state: State, payload: Payload, reply: Reply) -> str | None:
        """Why a reply must be rejected, or None (:mod:`fedslice.fl.validation`). Flower
        averages NaN silently: we do not."""
        return check_update(self.expected_update(state, payload, reply), reply.arrays,
                            reply.num_examples, reply.metrics,
                            self.client_sizes.get(payload.orders.client))

    def validate(self, state: State, payload: Payload, reply: Any) -> str | None:
        """:meth:`check_reply`, made total: a reply of another shape (not a :class:`Reply`, its
        tensors or metrics not mappings) is rejected first, and a check that raises on input it
        did not foresee rejects the reply (logged with the traceback) instead of the round."""
        if not isinstance(reply, Reply):
            return f"the reply is a {type(reply).__name__}, not a Reply"
        for what, value in (("tensors", reply.arrays), ("metrics", reply.metrics)):
            if not isinstance(value, dict):
                return f"the reply's {what} are a {type(value).__name__}, not a mapping"
        if reason := check_num_examples(reply.num_examples,
                                        self.client_sizes.get(payload.orders.client)):
            return reason
        try:
            if payload.orders.frozen_tensors:
                return self._check_below_depth(state, payload, reply)
            return self.check_reply(state, payload, reply)
        except Exception as e:  # noqa: BLE001 - a malformed reply must never end the round
            log.warning("validation raised on a malformed reply", exc_info=True)
            return f"malformed reply ({type(e).__name__}: {e})"

    def _check_below_depth(self, state: State, payload: Payload, reply: Reply) -> str | None:
        """:meth:`check_reply` of a client whose plan leaves the tensors below its adapter depth
        frozen (``frozen_tensors``): it must not send them, and its other tensors are checked
        as if it had sent those unchanged (they are then absent from its update: each is
        averaged over the clients that trained it)."""
        below = payload.orders.frozen_tensors
        if sent := [k for k in below if k in reply.arrays]:
            return (f"tensor {sent[0]} is below the client's adapter depth (its plan leaves it "
                    "frozen)")
        expected = self.expected_update(state, payload, reply)
        filled = {**reply.arrays, **{k: expected[k] for k in below if k in expected}}
        return self.check_reply(state, payload, Reply(filled, reply.num_examples, reply.metrics))

    def client_updates(self, server_round: int, state: State, payloads: dict[int, Payload],
                       replies: dict[int, Reply]) -> tuple[list[State], list]:
        """Each valid client's update as a full-shape delta and its aggregation weight (a float
        or per key a tensor; 0 where it holds nothing), in client order. Default: the deltas of
        the tensors it sent, weighted by its examples (FedAvg)."""
        clients = sorted(replies)
        return ([client_delta(state, replies[c].arrays) for c in clients],
                [float(replies[c].num_examples) for c in clients])

    def mean(self, server_round: int, state: State, deltas: list[State], weights: list) -> State:
        """The method's weighted mean (the hook variants override: e.g. Eq. 8)."""
        return aggregate_deltas(state, deltas, weights, eta=self.fed.server_lr)

    def combine(self, server_round: int, state: State, deltas: list[State], weights: list,
                replies: dict[int, Reply]) -> tuple[State, dict[str, Any]]:
        """The new global state from the valid clients' deltas and weights (client order, as
        ``replies`` sorted), and metrics of the aggregation. The hook rules override (median,
        DP-FedAvg) or transform the inputs of (clipping). Default: :meth:`mean`."""
        return self.mean(server_round, state, deltas, weights), {}

    def after_aggregate(self, server_round: int, state: State) -> State:
        """Server work on the new global state (e.g. RaFFM's re-ordering). Default: none."""
        return state

    def aggregate(self, server_round: int, state: State, payloads: dict[int, Payload],
                  replies: dict[int, Reply]) -> tuple[State, dict[str, Any]]:
        """The template: the method's weighting, the (possibly wrapped) combination, then
        :meth:`after_aggregate`; returns the new state and the aggregation's metrics."""
        deltas, weights = self.client_updates(server_round, state, payloads, replies)
        new, metrics = self.combine(server_round, state, deltas, weights, replies)
        return self.after_aggregate(server_round, new), metrics

    def min_valid(self) -> int:
        """Valid replies a round needs (rules raise it: 2f + 3 for Krum)."""
        return self.fed.min_replies

    def min_valid_reason(self) -> str:
        """Who needs :meth:`min_valid` replies (for the log of a skipped round)."""
        return f"federation.min_replies needs {self.fed.min_replies}"

    def aggregate_train(self, server_round: int, state: State, payloads: dict[int, Payload],
                        replies: dict[int, Reply]) -> RoundResult:
        for c in self.sent:
            if c not in replies:
                self.forget(c)
        valid: dict[int, Reply] = {}
        excluded = []
        invalid: list[int] = []
        for c in sorted(replies):
            reason = self.absent(payloads[c])
            if reason is None and (reason := skipped_reason(replies[c])) is not None:
                log.warning("round %d: client %d skipped: %s", server_round, c, reason)
            if reason is None:
                reason = self.validate(state, payloads[c], replies[c])
                if reason is not None:
                    invalid.append(c)
                    log.warning("round %d: update of client %d rejected: %s", server_round, c, reason)
            if reason is None:
                valid[c] = replies[c]
            else:
                excluded.append({"client": c, "reason": reason})
        if len(valid) < self.min_valid():
            if len(valid) >= self.fed.min_replies:
                log.warning("round %d: %d valid replies, %s: skipped", server_round, len(valid),
                            self.min_valid_reason())
            return RoundResult(state, sorted(valid), excluded, skipped=True, rejected=len(invalid),
                               invalid=invalid)
        t0 = time.perf_counter()
        new_state, metrics = self.aggregate(server_round, state, payloads, valid)
        # the server's seconds for the round's aggregation (weighting, rules, re-ordering)
        metrics = {**metrics, "aggregate_s": time.perf_counter() - t0}
        return RoundResult(new_state, sorted(valid), excluded, rejected=len(invalid),
                           metrics=metrics, invalid=invalid)


class Wrapper(Strategy):
    """A strategy around ``inner`` whose every hook delegates to it: a subclass overrides the
    hooks it changes. Aggregation rules (:class:`fedslice.fl.rules.Rule`) are wrappers; so is a
    method stage that changes what clients send of the state below it (heads' selection inside
    RaFFM's sub-models: :class:`fedslice.methods.heads.HeadsStrategy`). The templates are not
    delegated: they run on the wrapper and call its hooks."""

    def __init__(self, inner: Strategy):
        self.inner = inner
        self.sent: list[int] = []
        self.population: int | None = None

    @property
    def fed(self):
        return self.inner.fed

    @property
    def client_sizes(self) -> dict[int, int]:
        return self.inner.client_sizes

    # -- hooks: delegated ----------------------------------------------------------------------
    def train_config(self, server_round: int) -> dict[str, Any]:
        return self.inner.train_config(server_round)

    def payload_for(self, server_round: int, state: State, client: int, config: dict) -> Payload:
        return self.inner.payload_for(server_round, state, client, config)

    def forget(self, client: int) -> None:
        self.inner.forget(client)

    def frozen_state_keys(self, trainable, frozen) -> list[str]:
        return self.inner.frozen_state_keys(trainable, frozen)

    def initial(self, state: State) -> State:
        return self.inner.initial(state)

    def personal_tensors(self, names) -> set[str]:
        return self.inner.personal_tensors(names)

    def client_rank(self, client: int) -> int | None:
        return self.inner.client_rank(client)

    def client_slice(self, payload: Payload):
        return self.inner.client_slice(payload)

    def client_factor(self, payload: Payload) -> float:
        return self.inner.client_factor(payload)

    def client_view(self, payload: Payload, shapes) -> tuple[State, dict[str, torch.Tensor]]:
        return self.inner.client_view(payload, shapes)

    def state_dict(self) -> dict[str, Any]:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)

    def expected_update(self, state: State, payload: Payload, reply: Reply) -> dict:
        return self.inner.expected_update(state, payload, reply)

    def absent(self, payload: Payload) -> str | None:
        return self.inner.absent(payload)

    def check_reply(self, state: State, payload: Payload, reply: Reply) -> str | None:
        return self.inner.check_reply(state, payload, reply)

    def client_updates(self, server_round: int, state: State, payloads: dict[int, Payload],
                       replies: dict[int, Reply]) -> tuple[list[State], list]:
        return self.inner.client_updates(server_round, state, payloads, replies)

    def mean(self, server_round: int, state: State, deltas: list[State], weights: list) -> State:
        return self.inner.mean(server_round, state, deltas, weights)

    def combine(self, server_round: int, state: State, deltas: list[State], weights: list,
                replies: dict[int, Reply]) -> tuple[State, dict[str, Any]]:
        return self.inner.combine(server_round, state, deltas, weights, replies)

    def after_aggregate(self, server_round: int, state: State) -> State:
        return self.inner.after_aggregate(server_round, state)

    def min_valid(self) -> int:
        return self.inner.min_valid()

    def min_valid_reason(self) -> str:
        return self.inner.min_valid_reason()


def find_inner(strategy: Strategy, cls: type, required: bool = True) -> Any:
    """The strategy of type ``cls`` in a chain of wrappers (rules, stages); when there is none,
    a TypeError naming the chain (``required``) or None."""
    chain, s = [], strategy
    while True:
        if isinstance(s, cls):
            return s
        chain.append(type(s).__name__)
        if not isinstance(s, Wrapper):
            if not required:
                return None
            raise TypeError(f"no {cls.__name__} in the strategy chain {' > '.join(chain)}")
        s = s.inner
