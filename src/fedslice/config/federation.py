"""The ``[federation]`` section: clients, rounds, local work, round policies.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fedslice.config.base import Section


class FederationConfig(Section):
    num_clients: int = Field(100, gt=0)
    clients_per_round: int = Field(10, gt=0)
    rounds: int = Field(20, gt=0)
    local_epochs: int = Field(1, gt=0)
    local_steps: int | None = Field(None, gt=0, description="If set: optimizer steps per round "
                                    "(cycling the local data), instead of local_epochs.")
    batch_size: int = Field(32, gt=0)
    group_by_length: bool = Field(True, description="Batch local examples of similar length "
                                  "together (less padding, same examples per epoch).")
    pack: bool = Field(True, description="Pack each training batch's examples end to end into "
                       "rows (block-diagonal attention, positions restart per example): a step "
                       "costs its real tokens, not its padding. The same examples and loss as "
                       "padded batches (equal to float rounding without dropout; with dropout "
                       "the masks are drawn over other shapes: false reproduces a run made "
                       "before packing). Where the architecture and task allow it: encoder "
                       "classification (bert, roberta, distilbert) and causal-LM tasks (llama, "
                       "gpt2); elsewhere batches stay padded (docs/performance.md says why).")
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0)
    server_lr: float = Field(1.0, gt=0, description="eta of Eq. 5 (heads paper).")
    upload_dtype: Literal["fp32", "fp16"] = Field(
        "fp32", description="Precision of the floating tensors a client sends back: 'fp16' "
        "halves the upload (each value rounded to 11 significant bits; the server restores fp32 "
        "before checking and aggregating; the state and what is sent down stay fp32). The "
        "planner counts upload budgets in it (docs/aggregation.md).")
    fedprox_mu: float = Field(0.0, ge=0)
    selection: Literal["uniform", "random", "loss_gap"] = Field(
        "uniform", description="'uniform'/'random': seeded uniform sampling; 'loss_gap': Eq. 9 of "
        "the heads paper (largest last local loss minus global loss first, unseen clients first).")
    cold_start: Literal["unseen_first", "probe"] = Field(
        "unseen_first", description="loss_gap before a client's first loss is known: "
        "'unseen_first' tries every client once (uniform order) before ranking; 'probe' asks every "
        "client without a loss for the global model's loss on `probe_examples` of its examples "
        "(forward only, simulation only) and ranks by Eq. 9 from round 1.")
    probe_examples: int = Field(32, gt=0, description="Examples per client of a cold-start probe.")
    min_replies: int = Field(1, gt=0, description="A round with fewer valid replies keeps the "
                             "global state unchanged.")
    round_policy: Literal["all", "deadline", "async"] = Field(
        "all", description="What a round waits for on the simulated clock ([devices]): 'all' "
        "every selected client; 'deadline' the replies before `round_deadline_s` (later ones "
        "dropped, their work counted as wasted; `overselect` more clients selected, the first "
        "clients_per_round replies used); 'async' none: FedBuff, `concurrency` clients training "
        "at all times, the server aggregating every `buffer_size` replies, each weighted by "
        "(1 + staleness)^-staleness_exponent (docs/time.md). federation.rounds counts aggregations.")
    round_deadline_s: float | None = Field(None, gt=0, description="round_policy = 'deadline': "
                                           "the round's length in simulated seconds.")
    overselect: float = Field(0.0, ge=0, description="round_policy = 'deadline': select "
                              "ceil(clients_per_round x (1 + overselect)) clients; the first "
                              "clients_per_round replies are used (Bonawitz et al. 2019 select "
                              "130%: 0.3).")
    concurrency: int | None = Field(None, gt=0, description="round_policy = 'async': clients "
                                    "training at once (default: 2 x clients_per_round, at most "
                                    "num_clients).")
    buffer_size: int | None = Field(None, gt=0, description="round_policy = 'async': replies "
                                    "per aggregation (default: clients_per_round).")
    staleness_exponent: float = Field(0.5, ge=0, description="round_policy = 'async': a reply "
                                      "`tau` versions stale scales its update by (1 + tau)^-a, "
                                      "a = this (FedBuff's 0.5; 0: no down-weighting).")

    def async_sizes(self) -> tuple[int, int]:
        """(concurrency, buffer_size) of round_policy = 'async', defaults resolved."""
        conc = self.concurrency or min(2 * self.clients_per_round, self.num_clients)
        return conc, self.buffer_size or min(self.clients_per_round, conc)

    @model_validator(mode="after")
    def _check_counts(self) -> "FederationConfig":
        if self.clients_per_round > self.num_clients:
            raise ValueError(f"clients_per_round={self.clients_per_round} is larger than "
                             f"num_clients={self.num_clients}")
        if self.min_replies > self.clients_per_round:
            raise ValueError(f"min_replies={self.min_replies} is larger than "
                             f"clients_per_round={self.clients_per_round}")
        return self._check_policy()

    def _check_policy(self) -> "FederationConfig":
        """The fields of each round policy, set only with it."""
        p = self.round_policy
        if p == "deadline" and self.round_deadline_s is None:
            raise ValueError("round_policy = 'deadline' needs round_deadline_s (seconds)")
        for name, only in (("round_deadline_s", "deadline"), ("overselect", "deadline"),
                           ("concurrency", "async"), ("buffer_size", "async")):
            if p != only and getattr(self, name) not in (None, 0.0):
                raise ValueError(f"{name} = {getattr(self, name)} applies to round_policy = "
                                 f"{only!r}, not {p!r}")
        if p != "async" and self.staleness_exponent != 0.5:
            raise ValueError(f"staleness_exponent = {self.staleness_exponent} applies to "
                             f"round_policy = 'async', not {p!r}")
        if p == "async":
            if self.concurrency is not None and self.concurrency > self.num_clients:
                raise ValueError(f"concurrency = {self.concurrency} is larger than num_clients = "
                                 f"{self.num_clients}")
            conc, buf = self.async_sizes()
            if buf > conc:
                raise ValueError(f"buffer_size = {buf} is larger than concurrency = {conc}: an "
                                 "aggregation would wait for more replies than clients train")
            if self.min_replies > buf:
                raise ValueError(f"min_replies = {self.min_replies} is larger than buffer_size = "
                                 f"{buf}")
            if self.selection == "loss_gap":
                raise ValueError("selection = 'loss_gap' ranks a round's clients together; "
                                 "round_policy = 'async' starts each client as a slot frees: "
                                 "use selection = 'uniform'")
        return self
