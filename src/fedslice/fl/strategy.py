"""The server side of a federated method, as small hooks over state dicts.

Modelled on Flower's ``serverapp/strategy/fedavg.py``: ``configure_train`` builds one payload per
client, ``aggregate_train`` validates replies and calls ``aggregate``. A method variant overrides
one hook (e.g. head-weighted aggregation overrides ``aggregate``; sub-model methods override
``payload_for``). Nothing here touches a model: the in-process engine and the Flower ServerApp
call the same functions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from fedslice.config import AggregationConfig, FederationConfig
from fedslice.fl.privacy import Privacy
from fedslice.fl.validation import check_num_examples, check_update
from fedslice.slicing.aggregate import aggregate_deltas, client_delta
from fedslice.slicing.robust import clip_update, robust_aggregate

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


@dataclass
class Reply:
    """Client -> server: the client's trained tensors, its example count and scalar metrics."""

    arrays: State
    num_examples: int
    metrics: dict[str, float] = field(default_factory=dict)


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


class Strategy:
    """FedAvg over the trainable state, with server learning rate eta (Eq. 5 of the heads paper)."""

    def __init__(self, fed: FederationConfig):
        self.fed = fed
        self.sent: list[int] = []  # clients of the round being trained
        self.population: int | None = None  # clients they were sampled from
        #: client -> size of its partition, when the server knows it (num_examples is checked)
        self.client_sizes: dict[int, int] = {}
        self.rule = AggregationConfig()  # robust rules and clipping (set by the method)
        self.privacy: Privacy | None = None  # DP-FedAvg (set by the method)
        self.agg_metrics: dict[str, Any] = {}

    # -- configure ---------------------------------------------------------------------------
    def train_config(self, server_round: int) -> dict[str, Any]:
        f = self.fed
        return {"round": server_round, "lr": f.lr, "weight_decay": f.weight_decay,
                "local_epochs": f.local_epochs, "local_steps": f.local_steps or 0,
                "batch_size": f.batch_size, "group_by_length": f.group_by_length,
                "max_grad_norm": f.max_grad_norm or 0.0,
                "fedprox_mu": f.fedprox_mu}

    def payload_for(self, server_round: int, state: State, client: int, config: dict) -> Payload:
        """The payload of one client. Default: the whole trainable state (tensors shared, not copied)."""
        return Payload(arrays=dict(state), config={**config, "client": client})

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

    # -- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Server-side state a resumed run needs (nested JSON with tensors): here the privacy
        accountant; variants add theirs."""
        return {"privacy": self.privacy.state_dict()} if self.privacy else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`."""
        if self.privacy and "privacy" in state:
            self.privacy.load_state_dict(state["privacy"])

    # -- aggregate ---------------------------------------------------------------------------
    def expected_update(self, state: State, payload: Payload, reply: Reply) -> dict[str, torch.Tensor]:
        """The tensors a client may send back (its slice of the trainable state), by name, as
        it was sent them: the shapes and dtypes a reply must have. Default: the payload."""
        return payload.arrays

    def absent(self, payload: Payload) -> str | None:
        """Why a client was not expected to train this round (e.g. it sat out), or None."""
        return None

    def check_reply(self, state: State, payload: Payload, reply: Reply) -> str | None:
        """Why a reply must be rejected, or None (:mod:`fedslice.fl.validation`). Flower
        averages NaN silently: we do not."""
        return check_update(self.expected_update(state, payload, reply), reply.arrays,
                            reply.num_examples, reply.metrics,
                            self.client_sizes.get(payload.config.get("client")))

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
                                        self.client_sizes.get(payload.config.get("client"))):
            return reason
        try:
            return self.check_reply(state, payload, reply)
        except Exception as e:  # noqa: BLE001 - a malformed reply must never end the round
            log.warning("validation raised on a malformed reply", exc_info=True)
            return f"malformed reply ({type(e).__name__}: {e})"

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

    def aggregate(self, server_round: int, state: State, payloads: dict[int, Payload],
                  replies: dict[int, Reply]) -> State:
        """Clip, then the method's mean, a robust rule or DP-FedAvg (``aggregation``, ``dp``)."""
        deltas, weights = self.client_updates(server_round, state, payloads, replies)
        eta, rule = self.fed.server_lr, self.rule
        self.agg_metrics = {}
        if self.privacy is not None:
            new, self.agg_metrics = self.privacy.aggregate(server_round, state, deltas, eta,
                                                           self.population)
            return new
        if rule.clip_norm is not None:
            clipped = [clip_update(d, rule.clip_norm) for d in deltas]
            deltas = [d for d, _ in clipped]
            self.agg_metrics["clipped"] = sum(n > rule.clip_norm for _, n in clipped)
        if rule.rule == "mean":
            return self.mean(server_round, state, deltas, weights)
        return robust_aggregate(state, deltas, weights, rule.rule, eta=eta,
                                trim_fraction=rule.trim_fraction, byzantine=rule.byzantine,
                                keep=rule.multi_krum_keep,
                                num_examples=[replies[c].num_examples for c in sorted(replies)])

    def min_valid(self) -> int:
        """Valid replies a round needs: min_replies, and 2f + 3 for Krum."""
        krum = self.rule.rule in ("krum", "multi_krum")
        return max(self.fed.min_replies, 2 * self.rule.byzantine + 3 if krum else 0)

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
                log.warning("round %d: %d valid replies, %s needs 2f + 3 = %d: skipped", server_round,
                            len(valid), self.rule.rule, self.min_valid())
            return RoundResult(state, sorted(valid), excluded, skipped=True, rejected=len(invalid),
                               invalid=invalid)
        new_state = self.aggregate(server_round, state, payloads, valid)
        return RoundResult(new_state, sorted(valid), excluded, rejected=len(invalid),
                           metrics=dict(self.agg_metrics), invalid=invalid)
