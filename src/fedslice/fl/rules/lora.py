"""LoRA aggregation rules (``lora.aggregation``) and heterogeneous ranks (``lora.ranks``): rules
that wrap any method's strategy, so they keep its weighting (FedAvg's examples, RaFFM's holders,
the heads paper's Eq. 8) and compose with clipping.

``lora.aggregation``:

* ``fedit`` (the default): A and B averaged apart by the method's own mean: no rule;
* ``ffa``: FFA-LoRA; the adapter draws every A from the seed and freezes it, so A is neither
  trained nor sent (half the bytes) and the mean of the B's is exact: no server change, no rule;
* ``fedex`` (:class:`FedEx`): FedEx-LoRA; the method's mean of A and B, plus the residual
  ``mean(s B_c A_c) - s B_new A_new`` folded into the frozen base weight, which the global state
  then holds and every later payload carries densely (counted in ``bytes_down``);
* ``flora`` (:class:`FLoRA`): stacking; the weighted sum of the clients' ``s B_c A_c`` (what the
  stacked adapter ``[B_1 .. B_K] [A_1; ..; A_K]`` computes) merged into the base, and a fresh
  adapter (A re-drawn from the seed and the round, B = 0) for the next round;
* ``svd`` (:class:`SVD`): FlexLoRA; the weighted mean of the full-size ``s B_c A_c``
  re-factorised to the global rank by truncated SVD (components ordered by singular value, so a
  client of rank r gets the best rank-r approximation); the discarded energy is reported;
* ``fedsa`` (:class:`FedSA`): FedSA-LoRA; A shared and averaged, each client keeps its own B
  (never sent; the method keeps it on the client).

``lora.ranks`` (:class:`LoraRanks`): each client trains the leading ``r_c`` components of the
global adapter (its rank from the method's planner, ``Strategy.client_rank``); replies are
zero-padded to the global rank and each component is averaged over the clients that hold it
(``lora.padding = "holders"``) or over every client, counting the missing ones as zeros
(``"zeros"``, HetLoRA's plain padding). The pure math is in
:mod:`fedslice.peft.tuners.lora.aggregate`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, ClassVar

import torch

from fedslice.config import ExperimentConfig
from fedslice.fl.orders import order_fields
from fedslice.fl.rules.base import Rule
from fedslice.fl.strategy import Payload, Reply, State, Strategy
from fedslice.measure import count_flops
from fedslice.models.arch import LINEAR, Layout
from fedslice.peft.tuners.lora.aggregate import (LoraPair, discarded_energy, fresh_a, lora_pairs,
                                                 pad_rank, product, rank_axis, rank_mask,
                                                 svd_factors, svd_flops, target_update,
                                                 truncate_rank)
from fedslice.registry import METHODS, register_rule


def trains_lora(cfg: ExperimentConfig) -> bool:
    """The config's method trains the LoRA adapter (``[lora]`` applies)."""
    return METHODS.get(cfg.method.name).method_cls.adapter_name(cfg) == "lora"


def check_lora_fields(cfg: ExperimentConfig, adapter: str) -> None:
    """``lora.aggregation`` (other than the default ``"fedit"``) and ``lora.ranks`` say how LoRA
    factors are trained and combined: a ValueError naming them and the adapter when the method
    trains another adapter (they would be ignored)."""
    if adapter == "lora":
        return
    given = [f"lora.aggregation={cfg.lora.aggregation!r}"] if cfg.lora.aggregation != "fedit" else []
    if cfg.lora.ranks is not None:
        given.append(f"lora.ranks={cfg.lora.ranks}")
    if given:
        raise ValueError(f"{' and '.join(given)} apply to the LoRA adapter; method "
                         f"{cfg.method.name!r} trains peft.method={adapter!r}")


def lora_aggregations(method_cls: type) -> tuple[str, ...]:
    """The ``lora.aggregation`` values a method supports (``Method.lora_aggregations``)."""
    return tuple(getattr(method_cls, "lora_aggregations", ("fedit", "ffa")))


class LoraRule(Rule):
    """Base of the ``lora.aggregation`` rules: selected by that field when the adapter is LoRA;
    the method must list the value in ``Method.lora_aggregations``."""

    selected_by = "lora.aggregation"
    order = 12  # around a robust rule (10) and the rank padding (11), inside clipping (20)
    takes_arch = True
    #: the rule corrects the method's weighted mean: a rule that replaces the mean (median,
    #: Krum, DP-FedAvg) cannot combine with it
    needs_mean: ClassVar[bool] = True
    #: the rule changes the frozen base weights of the adapted layers (held in the global state)
    changes_base: ClassVar[bool] = False

    def __init__(self, inner: Strategy, scale: float, seed: int = 0, layout: Layout = LINEAR):
        super().__init__(inner)
        self.scale, self.seed, self.layout = scale, seed, layout
        self.folded = False  # the base weights differ from the model's (sent from then on)
        self._own_base: set[str] | None = None

    @classmethod
    def selected(cls, cfg: ExperimentConfig) -> bool:
        return trains_lora(cfg) and cfg.lora.aggregation == cls.name

    @classmethod
    def setting(cls, cfg: ExperimentConfig) -> str:
        return f"lora.aggregation={cls.name!r}"

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, method_cls: type) -> None:
        super().check_config(cfg, method_cls)
        if cls.name not in lora_aggregations(method_cls):
            why = getattr(method_cls, "lora_aggregation_hint", "") or ""
            raise ValueError(f"{cls.setting(cfg)} cannot combine with method.name="
                             f"{cfg.method.name!r}{': ' + why if why else ''} (it supports "
                             f"{', '.join(lora_aggregations(method_cls))})")
        if cls.needs_mean and cfg.aggregation.rule != "mean":
            raise ValueError(f"{cls.setting(cfg)} corrects the weighted mean of the clients' "
                             f"B A; aggregation.rule={cfg.aggregation.rule!r} replaces that mean: "
                             "use one of them")
        if cfg.dp.enabled:
            raise ValueError(f"{cls.setting(cfg)} cannot combine with dp.enabled: DP-FedAvg "
                             "clips and noises whole same-shaped updates")

    @classmethod
    def from_config(cls, inner: Strategy, cfg: ExperimentConfig, role: str, arch=None) -> Strategy:
        return cls(inner, cfg.lora.scale, cfg.seed, arch.layout if arch is not None else LINEAR)

    # -- the base weights the rule changes --------------------------------------------------
    def frozen_state_keys(self, trainable, frozen) -> list[str]:
        keys = list(self.inner.frozen_state_keys(trainable, frozen))
        if self.changes_base:
            frozen = set(frozen)
            keys += [p.base for p in lora_pairs(trainable) if p.base in frozen and p.base not in keys]
        return keys

    def own_base(self, state: State) -> set[str]:
        """The base weights the global state holds only because this rule changes them (the
        method's own strategy may hold some anyway: RaFFM's sliceable tensors)."""
        if self._own_base is None:
            names = list(state)
            theirs = set(self.inner.frozen_state_keys(names, names))
            self._own_base = {p.base for p in lora_pairs(names) if p.base in state} - theirs
        return self._own_base

    def expected_update(self, state: State, payload: Payload, reply: Reply) -> dict:
        """The inner strategy's, without the base weights this rule folds updates into: they are
        sent down, but clients train only their adapter and never send them back."""
        out = self.inner.expected_update(state, payload, reply)
        if not self.changes_base:
            return out
        own = self.own_base(state)
        return {k: t for k, t in out.items() if k not in own}

    def check_reply(self, state: State, payload: Payload, reply: Reply) -> str | None:
        """The inner strategy's checks, the base weights sent down counted as returned as sent."""
        own = self.own_base(state) if self.changes_base else set()
        sent = {k: payload.arrays[k] for k in own if k in payload.arrays and k not in reply.arrays}
        if not sent:
            return self.inner.check_reply(state, payload, reply)
        return self.inner.check_reply(state, payload, Reply({**reply.arrays, **sent},
                                                            reply.num_examples, reply.metrics))

    def payload_for(self, server_round: int, state: State, client: int, config: dict) -> Payload:
        p = self.inner.payload_for(server_round, state, client, config)
        if not self.changes_base or self.folded:
            return p
        # nothing folded yet: every client holds the model's base weights already
        own = self.own_base(state)
        return Payload({k: t for k, t in p.arrays.items() if k not in own}, p.config, p.model)

    def pairs(self, state: State) -> list[LoraPair]:
        pairs = lora_pairs(state)
        if self.changes_base:
            missing = [p.base for p in pairs if p.base not in state]
            if missing:
                raise RuntimeError(f"{self.name}: the global state does not hold the base weights "
                                   f"{missing[:3]} (Method.initial_state asks frozen_state_keys)")
        return pairs

    def fold(self, new: State, pair: LoraPair, update: torch.Tensor) -> None:
        """``new[base] += update`` (out, in), in the base weight's layout and dtype."""
        w = new[pair.base]
        step = update.T if self.layout.transposed else update
        new[pair.base] = (w.float() + step).to(w.dtype)

    def state_dict(self) -> dict[str, Any]:
        return {**self.inner.state_dict(), "lora_base_folded": self.folded}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state)
        self.folded = bool(state.get("lora_base_folded", False))


def _norm2(t: torch.Tensor) -> float:
    return float(t.double().pow(2).sum())


class FedEx(LoraRule):
    """FedEx-LoRA: the method's mean of A and B, and the residual to the exact weighted mean of
    the clients' ``s B_c A_c`` folded into the frozen weight."""

    name = "fedex"
    changes_base = True
    same_round = ("it folds the residual of one round's factors into the base weights; a stale "
                  "reply's factors belong to another base")
    server_opt_refusal = ("it folds each round's residual into the frozen base weights, which a "
                          "server optimizer's step on the factors would leave at the plain mean")

    def combine(self, server_round: int, state: State, deltas: list[State], weights: list,
                replies: dict[int, Reply]) -> tuple[State, dict[str, Any]]:
        new, metrics = self.inner.combine(server_round, state, deltas, weights, replies)
        new = dict(new)
        res, tgt = 0.0, 0.0
        with count_flops() as fc:
            for pair in self.pairs(state):
                target, _ = target_update(state, deltas, weights, pair, self.scale, self.fed.server_lr)
                residual = target - product(new, pair, self.scale)            # (out, in)
                self.fold(new, pair, residual)
                res, tgt = res + _norm2(residual), tgt + _norm2(target)
        self.folded = True
        return new, {**metrics, "aggregate_flops": float(fc.total),
                     "fedex_residual_norm": math.sqrt(res),
                     "fedex_residual_rel": math.sqrt(res / tgt) if tgt > 0 else 0.0}


class FLoRA(LoraRule):
    """FLoRA: the weighted sum of the clients' ``s B_c A_c`` (the stacked adapter's product)
    merged into the base weight; the next round starts from a fresh adapter."""

    name = "flora"
    changes_base = True
    same_round = ("every round restarts the adapter, so a stale reply trained an adapter the "
                  "server no longer holds")
    server_opt_refusal = ("it merges the round's update into the base weights and restarts the "
                          "adapter, so the factors' change is not a step to take again")

    def combine(self, server_round: int, state: State, deltas: list[State], weights: list,
                replies: dict[int, Reply]) -> tuple[State, dict[str, Any]]:
        new, metrics = self.inner.combine(server_round, state, deltas, weights, replies)
        new = dict(new)
        clients = sorted(replies)
        ranks = [self.client_rank(c) for c in clients]
        stack = 0
        with count_flops() as fc:
            for pair in self.pairs(state):
                target, _ = target_update(state, deltas, weights, pair, self.scale, self.fed.server_lr)
                self.fold(new, pair, target)
                a, b = state[pair.a], state[pair.b]
                new[pair.a] = fresh_a(a.shape, self.seed, f"{pair.a}#round{server_round}").to(a.dtype)
                new[pair.b] = torch.zeros_like(b)
                # the stacked adapter a client that trained last round would receive: every
                # client's A and B at its rank, one after another along the rank
                stack += sum((r or a.shape[0]) * (a.shape[1] + b.shape[0]) for r in ranks) * a.element_size()
        self.folded = True
        return new, {**metrics, "aggregate_flops": float(fc.total), "flora_stack_bytes": stack}


class SVD(LoraRule):
    """FlexLoRA: the weighted mean of the clients' ``s B_c A_c`` re-factorised to the global
    rank by truncated SVD; the energy the truncation drops, at the global rank and at every
    client rank of the round, is reported."""

    name = "svd"
    same_round = ("it re-factorizes the round's mean every round; a stale reply's factors are "
                  "another factorization's")
    server_opt_refusal = ("it re-factorizes the averaged B A every round, so the factors' change "
                          "is a new factorization, not a step along a gradient")

    def combine(self, server_round: int, state: State, deltas: list[State], weights: list,
                replies: dict[int, Reply]) -> tuple[State, dict[str, Any]]:
        new, metrics = self.inner.combine(server_round, state, deltas, weights, replies)
        new = dict(new)
        ranks = sorted({r for c in replies if (r := self.client_rank(c)) is not None})
        total, dropped, flops = 0.0, {}, 0.0
        with count_flops() as fc:
            for pair in self.pairs(state):
                target, _ = target_update(state, deltas, weights, pair, self.scale, self.fed.server_lr)
                rank = state[pair.a].shape[0]
                B, A, S = svd_factors(target, rank, self.scale)
                new[pair.a], new[pair.b] = A.to(state[pair.a].dtype), B.to(state[pair.b].dtype)
                energy = float((S.double() ** 2).sum())
                total += energy
                for r in {rank, *ranks}:
                    dropped[r] = dropped.get(r, 0.0) + discarded_energy(S, r) * energy
                flops += svd_flops(*target.shape)
        out = {**metrics, "aggregate_flops": float(fc.total), "svd_flops_analytic": flops}
        for r, d in sorted(dropped.items()):
            key = "svd_discarded_energy" if r == max(dropped) else f"svd_discarded_energy_r{r}"
            out[key] = d / total if total > 0 else 0.0
        return new, out


class FedSA(LoraRule):
    """FedSA-LoRA: A (and every non-LoRA trainable tensor) shared and averaged by the method's
    weighting; each client keeps its own B: not in its payload, not in its reply."""

    name = "fedsa"
    needs_mean = False
    from_sums = True

    def personal_tensors(self, names) -> set[str]:
        return self.inner.personal_tensors(names) | {p.b for p in lora_pairs(names)}

    def _shared(self, arrays: State) -> State:
        personal = self.personal_tensors(arrays)
        return {k: t for k, t in arrays.items() if k not in personal}

    def payload_for(self, server_round: int, state: State, client: int, config: dict) -> Payload:
        p = self.inner.payload_for(server_round, state, client, config)
        return Payload(self._shared(p.arrays), p.config, p.model)

    def expected_update(self, state: State, payload: Payload, reply: Reply) -> dict:
        return self._shared(self.inner.expected_update(state, payload, reply))


class LoraRanks(Rule):
    """Heterogeneous LoRA ranks: payloads truncated to each client's rank, replies zero-padded to
    the global rank, each rank component averaged over its holders (or over every client,
    counting zeros: ``lora.padding = "zeros"``)."""

    name = "lora_ranks"
    selected_by = "lora.ranks"
    order = 11
    from_sums = True  # each client pads and masks its own update

    def __init__(self, inner: Strategy, padding: str = "holders"):
        super().__init__(inner)
        if padding not in ("holders", "zeros"):
            raise ValueError(f"lora.padding must be 'holders' or 'zeros', got {padding!r}")
        self.padding = padding

    @classmethod
    def selected(cls, cfg: ExperimentConfig) -> bool:
        return trains_lora(cfg) and cfg.lora.ranks is not None

    @classmethod
    def setting(cls, cfg: ExperimentConfig) -> str:
        return f"lora.ranks={cfg.lora.ranks}"

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, method_cls: type) -> None:
        super().check_config(cfg, method_cls)
        if not getattr(method_cls, "lora_ranks_per_client", False):
            raise ValueError(f"{cls.setting(cfg)}: method.name={cfg.method.name!r} trains every "
                             "client at lora.r (ranks per client: fedpetuning, raffm, heads, raffm+heads)")
        if cfg.privacy.secure_aggregation and cfg.lora.padding == "zeros":
            raise ValueError("privacy.secure_aggregation: lora.padding='zeros' counts the rank "
                             "components a client does not hold as zeros, an update there of minus "
                             "global values it was never sent (under secure aggregation each client "
                             "weighs its own update); use lora.padding='holders'")

    @classmethod
    def from_config(cls, inner: Strategy, cfg: ExperimentConfig, role: str) -> Strategy:
        return cls(inner, cfg.lora.padding)

    # -- shapes ------------------------------------------------------------------------------
    @staticmethod
    def _truncate(arrays: Mapping[str, torch.Tensor], r: int) -> State:
        out = {}
        for k, t in arrays.items():
            axis = rank_axis(k)
            out[k] = truncate_rank(t, axis, r) if axis is not None and t.dim() == 2 else t
        return out

    @staticmethod
    def _pad(arrays: Mapping[str, torch.Tensor], state: Mapping) -> State:
        """``arrays`` zero-padded to the global rank (``state``: tensors or their shapes)."""
        out = {}
        for k, t in arrays.items():
            axis = rank_axis(k)
            ok = axis is not None and t.dim() == 2 and k in state
            out[k] = pad_rank(t, axis, _shape(state[k])[axis]) if ok else t
        return out

    def _padded(self, state: State, payload: Payload, reply: Reply | None = None):
        p = Payload(self._pad(payload.arrays, state), payload.config, payload.model)
        if reply is None:
            return p
        return p, Reply(self._pad(reply.arrays, state), reply.num_examples, reply.metrics)

    # -- hooks ---------------------------------------------------------------------------------
    def payload_for(self, server_round: int, state: State, client: int, config: dict) -> Payload:
        p = self.inner.payload_for(server_round, state, client, config)
        r = self.client_rank(client)
        if r is None:
            return p
        return Payload(self._truncate(p.arrays, r), {**p.config, **order_fields(lora_rank=r)}, p.model)

    def expected_update(self, state: State, payload: Payload, reply: Reply) -> dict:
        r = payload.orders.lora_rank
        if r is None:
            return self.inner.expected_update(state, payload, reply)
        full = self.inner.expected_update(state, *self._padded(state, payload, reply))
        return self._truncate(full, r)

    def client_view(self, payload: Payload, shapes) -> tuple[State, dict[str, torch.Tensor]]:
        """The inner view of the payload padded to the global rank, held up to the client's."""
        r = payload.orders.lora_rank
        if r is None:
            return self.inner.client_view(payload, shapes)
        padded = Payload(self._pad(payload.arrays, shapes), payload.config, payload.model)
        view, held = self.inner.client_view(padded, shapes)
        for k in list(held):
            axis = rank_axis(k)
            if axis is not None and len(shapes[k]) == 2 and r < shapes[k][axis]:
                held[k] = torch.as_tensor(held[k]) * rank_mask(shapes[k], axis, r)
        return view, held

    def check_reply(self, state: State, payload: Payload, reply: Reply) -> str | None:
        r = payload.orders.lora_rank
        if r is None:
            return self.inner.check_reply(state, payload, reply)
        for k, t in reply.arrays.items():
            axis = rank_axis(k)
            if axis is not None and k in state and t.dim() == 2 and t.shape[axis] != r:
                return f"tensor {k} has rank {t.shape[axis]}, the client's rank is {r}"
        return self.inner.check_reply(state, *self._padded(state, payload, reply))

    def client_updates(self, server_round: int, state: State, payloads: dict[int, Payload],
                       replies: dict[int, Reply]) -> tuple[list[State], list]:
        padded = {c: self._padded(state, payloads[c], replies[c]) for c in replies}
        deltas, weights = self.inner.client_updates(server_round, state,
                                                    {c: p for c, (p, _) in padded.items()},
                                                    {c: r for c, (_, r) in padded.items()})
        out_w = []
        for c, delta, w in zip(sorted(replies), deltas, weights):
            r = payloads[c].orders.lora_rank
            per_key = dict(w) if isinstance(w, Mapping) else {k: w for k in delta}
            for k in list(delta):
                axis = rank_axis(k)
                if r is None or axis is None or delta[k].dim() != 2 or r >= state[k].shape[axis]:
                    continue
                mask = rank_mask(state[k].shape, axis, r)
                if self.padding == "holders":  # the components above r are not held
                    delta[k] = delta[k] * mask
                    per_key[k] = torch.as_tensor(per_key[k], dtype=torch.float32) * mask
                else:  # counted as zeros: the padded values are 0, not the global ones
                    delta[k] = torch.where(mask > 0, delta[k], -state[k].float())
            out_w.append(per_key)
        return deltas, out_w


def _shape(t) -> tuple[int, ...]:
    return tuple(t.shape) if isinstance(t, torch.Tensor) else tuple(t)


for _rule in (FedEx, FLoRA, SVD, FedSA, LoraRanks):
    register_rule(name=_rule.name, rule_cls=_rule)
