"""``privacy.secure_aggregation``: the server learns only the sum of the round's updates.

A rule around the whole chain (outermost): each client turns its own reply into one vector of
the full trainable shape, its update times its weight and its weight (the method's weighting:
FedAvg's examples, RaFFM's held-masks, heads' Eq. 8 importance, LoRA rank masks; zeros where it
trained nothing), masks it (:mod:`fedslice.fl.secagg`, on Flower's primitives) and sends that;
the server sums the masked vectors, unmasks the sum with the survivors' Shamir shares, and divides
per coordinate: ``sum w delta / sum w`` is what every weighted mean of this library computes
(:func:`fedslice.slicing.aggregate.aggregate_deltas`). The server hands the method's own ``combine``
one pseudo-client, the mean update weighted by the summed weights, so the method's mean (with
its epsilon), a server optimizer and ``after_aggregate`` run unchanged, on sums only.

Rules that need each client's update (median, trimmed mean, Krum, server-side clipping and
DP-FedAvg, FedEx/FLoRA/SVD's per-client products), loss-gap selection (per-client losses) and a
method that reads the replies after aggregating are refused by the config (``from_sums``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fedslice.config import ExperimentConfig, PrivacyConfig
from fedslice.fl.rules.base import Rule, selected_rules
from fedslice.fl.strategy import Payload, Reply, RoundResult, State, Strategy
from fedslice.registry import register_rule

log = logging.getLogger(__name__)

#: a client's masked vector (a list of integer arrays)
Masked = list
#: the largest round: its quantization keeps Flower's 2^22 levels (``fedslice.fl.secagg``'s
#: modulus over them; a test checks they agree); smaller rounds get finer levels
#: (:func:`fedslice.fl.secagg.target_range`)
MAX_CLIENTS = 1024


def protocol():
    """:mod:`fedslice.fl.secagg` (imports Flower: only when secure aggregation runs)."""
    from fedslice.fl import secagg
    return secagg


class SecureAggregation(Rule):
    """Secure aggregation around ``inner``: in process, :meth:`aggregate_train` runs every
    client's side of the protocol on that client's own reply (:meth:`client_vector`) and the
    server's side (:meth:`aggregate_masked`) on the masked vectors alone."""

    name = "secure_aggregation"
    same_round = ("the masks cancel within one round's cohort, fixed when the round starts; an "
                  "asynchronous buffer's clients are not known in advance")
    selected_by = "privacy.secure_aggregation"
    order = 50  # outermost: it replaces how the replies reach every rule inside it
    from_sums = True
    takes_trainable = True

    def __init__(self, inner: Strategy, privacy: PrivacyConfig, trainable: Sequence[str],
                 seed: int = 0):
        """``trainable``: the names of the tensors the clients train (the vector's keys, less
        the ones each keeps for itself)."""
        super().__init__(inner)
        self.privacy, self.seed = privacy, seed
        personal = self.personal_tensors(list(trainable))
        self.trainable = [k for k in trainable if k not in personal]

    # -- config ------------------------------------------------------------------------------
    @classmethod
    def selected(cls, cfg: ExperimentConfig) -> bool:
        return cfg.privacy.secure_aggregation

    @classmethod
    def setting(cls, cfg: ExperimentConfig) -> str:
        return "privacy.secure_aggregation"

    @classmethod
    def describe(cls, cfg: ExperimentConfig) -> str:
        p, fed = cfg.privacy, cfg.federation
        return (f"privacy.secure_aggregation (SecAgg: threshold {p.threshold(fed.clients_per_round)}"
                f", clipping range {p.secagg_clip_range:g})")

    @classmethod
    def check_config(cls, cfg: ExperimentConfig, method_cls: type) -> None:
        s, fed, p = cls.setting(cfg), cfg.federation, cfg.privacy
        for rule in selected_rules(cfg):
            if not rule.from_sums:
                raise ValueError(f"{s}: the server sees only the sum of the updates; "
                                 f"{rule.setting(cfg)} needs each client's update"
                                 f"{rule.secagg_hint}")
        if fed.selection == "loss_gap":
            raise ValueError(f"{s}: federation.selection='loss_gap' ranks clients by their own "
                             "losses (Eq. 9); use 'uniform'")
        if _reads_replies(method_cls):
            raise ValueError(f"{s} cannot combine with method.name={cfg.method.name!r}: it reads "
                             "the clients' updates after aggregating")
        if p.secagg_threshold is not None and p.secagg_threshold > fed.clients_per_round:
            raise ValueError(f"privacy.secagg_threshold={p.secagg_threshold} is larger than "
                             f"federation.clients_per_round={fed.clients_per_round}")
        if fed.clients_per_round > MAX_CLIENTS:
            raise ValueError(f"{s}: federation.clients_per_round={fed.clients_per_round} is more "
                             f"than the {MAX_CLIENTS} clients whose quantized vectors sum without "
                             "wrapping")

    @classmethod
    def from_config(cls, inner: Strategy, cfg: ExperimentConfig, role: str,
                    trainable: Sequence[str] = ()) -> Strategy:
        return cls(inner, cfg.privacy, trainable, cfg.seed)

    # -- the round's public parameters ---------------------------------------------------------
    def params(self, clients: int):
        """The round's public parameters for ``clients`` clients: the threshold, the clipping
        range and the finest quantization their sum allows (:func:`~fedslice.fl.secagg.target_range`)."""
        sp = protocol()
        return sp.Params(self.privacy.threshold(clients), self.privacy.secagg_clip_range,
                         sp.target_range(clients))

    def layout(self, state: State, payloads: Mapping[int, Payload]):
        """The vector's layout: every tensor the clients train (its full shape) restricted to
        the union of the slices the round's clients were sent (:meth:`held`; keys nobody holds
        are left out), and per key W, the largest weight a client of the round may give one of
        its elements: its partition size, the bound the server checks ``num_examples`` against
        (the method's weights are that times factors at most 1: held-masks, f^p, importance)."""
        sp = protocol()
        sizes = [self.client_sizes.get(p.orders.client) for p in payloads.values()]
        if any(s is None for s in sizes) or not sizes:
            raise ValueError("privacy.secure_aggregation needs the clients' partition sizes on the "
                             "server (the weights' public bound)")
        bound = float(max(sizes))
        shapes = {k: tuple(state[k].shape) for k in self.trainable if k in state}
        held = [self.held(p, shapes) for p in payloads.values() if self.absent(p) is None]
        union = sp.union_of(shapes, held)
        shapes = {k: s for k, s in shapes.items() if k not in union or union[k].any()}
        union = {k: u for k, u in union.items() if k in shapes}
        return sp.Layout(shapes, {k: bound for k in shapes},
                         self.weight_shapes(state, payloads, shapes), union)

    def held(self, payload: Payload, shapes: Mapping[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
        """Where the client of ``payload`` may update the trainable state: its slice
        (:meth:`~fedslice.fl.strategy.Strategy.client_view`) less the tensors its plan leaves
        frozen (``frozen_tensors``)."""
        _, held = self.inner.client_view(payload, shapes)
        frozen = set(payload.orders.frozen_tensors)
        return {k: m for k, m in held.items() if k not in frozen}

    def single_holder(self, state: State, payloads: Mapping[int, Payload],
                      clients: Sequence[int]) -> int:
        """Coordinates that exactly one of ``clients`` (the round's masked vectors in the sum)
        was sent to train: there the unmasked sum is that client's weighted update and weight,
        and the server, which chose the slices, knows whose (docs/security.md). Zero where every
        client holds every coordinate (FedAvg)."""
        shapes = {k: tuple(state[k].shape) for k in self.trainable if k in state}
        count = {k: torch.zeros(s, dtype=torch.int32) for k, s in shapes.items()}
        for c in clients:
            if c in payloads and self.absent(payloads[c]) is None:
                for k, m in self.held(payloads[c], shapes).items():
                    count[k] += (torch.as_tensor(m).expand(shapes[k]) != 0).to(torch.int32)
        return sum(int((v == 1).sum()) for v in count.values())

    def weight_shapes(self, state: State, payloads: Mapping[int, Payload],
                      shapes: Mapping[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
        """Per key, ``()`` where the method weighs every client's tensor by one number (FedAvg's
        examples: half the upload), else its full shape (held-masks, importance, rank masks).
        Asked of the method's weighting on each payload sent back unchanged; a client whose
        real weight then varies over the tensor refuses to send (:func:`~fedslice.fl.secagg.encode`)."""
        one = set(shapes)
        for c, p in payloads.items():
            if self.absent(p) is not None:
                continue
            try:
                echo = Reply(dict(self.expected_update(state, p, Reply(dict(p.arrays), 1, {}))), 1, {})
                _, weights = self.inner.client_updates(0, state, {c: p}, {c: echo})
            except Exception:  # noqa: BLE001 - a weighting that needs more than an echo: full shapes
                return dict(shapes)
            w = weights[0]
            for k in list(one):
                wk = w.get(k) if isinstance(w, Mapping) else w
                if torch.is_tensor(wk) and wk.numel() > 1:
                    one.discard(k)
        return {k: (() if k in one else s) for k, s in shapes.items()}

    # -- a client's side -----------------------------------------------------------------------
    def client_vector(self, server_round: int, payload: Payload, reply: Reply, layout, params
                      ) -> tuple[list[np.ndarray] | None, str | None]:
        """What client ``payload.orders.client`` puts under the mask, from what it holds
        (its payload, seen in the full shapes: :meth:`~fedslice.fl.strategy.Strategy.client_view`,
        in process as on Flower): its own reply checked (the server cannot check it any more),
        its weighting for itself alone, encoded on the round's union; or why it sends nothing."""
        if reason := self.absent(payload):
            return None, reason
        state, _ = self.inner.client_view(payload, layout.shapes)
        if reason := self.validate(state, payload, reply):
            return None, reason
        c = payload.orders.client
        deltas, weights = self.inner.client_updates(server_round, state, {c: payload}, {c: reply})
        extra = [k for k in deltas[0] if k not in layout.shapes]
        if extra:
            return None, f"tensor {extra[0]} is not a tensor the clients train"
        seed = int(np.random.SeedSequence([self.seed, server_round, c, 7]).generate_state(1)[0])
        try:
            return protocol().encode(deltas[0], weights[0], layout, params, seed), None
        except protocol().ProtocolError as e:
            return None, str(e)

    # -- the server's side ---------------------------------------------------------------------
    def aggregate_masked(self, server_round: int, state: State, masked: Mapping[int, Masked],
                         reveal: Callable[[list[int], list[int]], Mapping[int, Mapping[int, bytes]]],
                         keyholders: Sequence[int], peers: Mapping[int, tuple[bytes, bytes]],
                         layout, params, payloads: Mapping[int, Payload] | None = None
                         ) -> tuple[State | None, dict[str, Any], list[dict], str | None]:
        """The server's side of a round from the clients' masked vectors alone: each checked
        (a vector that fails is dropped, naming its client), summed, unmasked with the shares
        ``reveal(active, dead)`` returns (survivor -> {client: share}), divided per coordinate
        and combined by the inner chain. Returns the new state (None: skipped), the
        aggregation's metrics, the clients excluded and why the round was skipped. With the
        round's ``payloads`` (the server made them) the metrics count the coordinates only one
        summed client held (:meth:`single_holder`)."""
        sp = protocol()
        excluded, good = [], {}
        for c, v in sorted(masked.items()):
            try:
                good[c] = sp.check_masked(c, v, layout.array_shapes(), params)
            except sp.ProtocolError as e:
                log.warning("round %d: %s: dropped", server_round, e)
                excluded.append({"client": c, "reason": str(e)})
        need = max(params.threshold, self.min_valid())
        if len(good) < need:
            return None, {}, excluded, (f"{len(good)} masked vectors arrived, secure aggregation "
                                        f"needs {need} (privacy.secagg_threshold / "
                                        "federation.min_replies)")
        active = sorted(good)
        dead = sorted(set(keyholders) - set(active))
        revealed = reveal(active, dead)
        if len(revealed) < params.threshold:
            return None, {}, excluded, (f"{len(revealed)} clients answered the unmasking, "
                                        f"fewer than privacy.secagg_threshold={params.threshold}")
        shares: dict[int, list[bytes]] = {}
        for survivor in sorted(revealed):
            for owner, share in revealed[survivor].items():
                shares.setdefault(owner, []).append(share)
        try:
            total = sp.unmask(sp.add_masked([good[c] for c in active], params), shares, active,
                              dead, peers, params)
        except sp.ProtocolError as e:
            return None, {}, excluded, f"unmasking failed: {e}"
        num, den, clipped = sp.decode(total, len(active), layout, params)
        new, metrics = self.combine_sums(server_round, state, num, den)
        metrics = {**metrics, "secagg_clients": len(active), "secagg_recovered": len(dead),
                   "secagg_clipped": clipped,
                   "secagg_upload_bytes": 4 * layout.coordinates(),
                   "secagg_full_upload_bytes": 4 * layout.full_coordinates()}
        if payloads is not None:
            metrics["secagg_single_holder"] = self.single_holder(state, payloads, active)
        return new, metrics, excluded, None

    def combine_sums(self, server_round: int, state: State, num: Mapping[str, torch.Tensor],
                     den: Mapping[str, torch.Tensor]) -> tuple[State, dict[str, Any]]:
        """The inner chain's ``combine`` and ``after_aggregate`` over one pseudo-client: the
        mean update ``num / den`` weighted by ``den`` (its mean is ``num / (den + eps)``: the
        method's own, epsilon included), every key nobody trained left out."""
        delta, weight = {}, {}
        for k in num:
            held = den[k] > 0
            if not bool(held.any()):
                continue
            delta[k] = torch.where(held, num[k] / torch.where(held, den[k], 1.0), 0.0)
            weight[k] = den[k]
        new, metrics = self.inner.combine(server_round, state, [delta], [weight], {})
        return self.inner.after_aggregate(server_round, new), metrics

    # -- in process: both sides ----------------------------------------------------------------
    def aggregate_train(self, server_round: int, state: State, payloads: dict[int, Payload],
                        replies: dict[int, Reply]) -> RoundResult:
        """One round of the protocol in process. Every client configured this round shares keys
        (it was reachable when its payload went out); those whose replies arrived mask their own
        vector; the others are dead and their pairwise masks are removed from the survivors'
        shares."""
        return self.secure_round(server_round, state, payloads, replies, set())

    def secure_round(self, server_round: int, state: State, payloads: dict[int, Payload],
                     replies: dict[int, Reply], gone_after_masking: set[int]) -> RoundResult:
        """:meth:`aggregate_train` with ``gone_after_masking``: clients whose masked vectors
        arrived but who vanish before revealing their shares (in the sum; their private masks
        rebuilt from the others' shares)."""
        sp = protocol()
        for c in self.sent:
            if c not in replies:
                self.forget(c)
        clients = sorted(set(self.sent) | set(payloads))
        params, layout = self.params(len(clients)), self.layout(state, payloads)
        # stages 0 and 1: keys and encrypted shares, relayed by the server
        secrets = {c: sp.setup(c) for c in clients}
        peers = {c: (s.pk1, s.pk2) for c, s in secrets.items()}
        if len(clients) < params.threshold:
            return RoundResult(state, [], [], skipped=True, metrics={
                "secagg_skipped": f"{len(clients)} clients, threshold {params.threshold}"})
        boxes = {c: sp.share_keys(secrets[c], peers, params.threshold) for c in clients}
        for c in clients:
            sp.receive_shares(secrets[c], {src: boxes[src][c] for src in clients if src != c})
        # stage 2: each client on its own reply
        masked, excluded, invalid = {}, [], []
        for c in sorted(replies):
            vector, reason = self.client_vector(server_round, payloads[c], replies[c], layout,
                                                params)
            if vector is None:
                excluded.append({"client": c, "reason": reason})
                if self.absent(payloads[c]) is None:
                    invalid.append(c)
                    log.warning("round %d: client %d sends no masked vector: %s", server_round,
                                c, reason)
                continue
            masked[c] = sp.mask(secrets[c], vector, params)
        for r in replies.values():  # what stays in the clear, as a Flower client sends it
            r.metrics = upload_metrics(clear_metrics(r.metrics), layout)

        def reveal(active, dead):  # stage 3, on every survivor
            return {c: sp.unmask_shares(secrets[c], active, dead, params.threshold)
                    for c in active if c not in gone_after_masking}

        new, metrics, bad, why = self.aggregate_masked(server_round, state, masked, reveal,
                                                       clients, peers, layout, params, payloads)
        excluded += bad
        invalid += [e["client"] for e in bad]
        if why is not None:
            log.warning("round %d: secure aggregation skipped: %s; global state unchanged",
                        server_round, why)
            return RoundResult(state, [], excluded, skipped=True, rejected=len(invalid),
                               invalid=invalid, metrics={"secagg_skipped": why})
        used = sorted(c for c in masked if c not in {e["client"] for e in bad})
        return RoundResult(new, used, excluded, rejected=len(invalid), invalid=invalid,
                           metrics=metrics)


def clear_metrics(metrics: Mapping[str, Any]) -> dict[str, Any]:
    """The metrics a client reports in the clear under secure aggregation: its scalars (loss,
    costs). Lists (heads' keep-mask and importance: its per-element weights) stay with it."""
    return {k: v for k, v in metrics.items() if isinstance(v, (int, float)) or v is None}


def upload_metrics(metrics: Mapping[str, Any], layout) -> dict[str, Any]:
    """A client's upload counted as it travels: the masked vector (32-bit integers), the plain
    reply's bytes kept as ``bytes_up_plain`` (the key stages' few hundred bytes per peer are not
    counted)."""
    out = dict(metrics)
    if "bytes_up" in out:
        out["bytes_up_plain"] = out["bytes_up"]
    out["bytes_up"], out["params_up"] = 4 * layout.coordinates(), layout.coordinates()
    return out


def _reads_replies(method_cls: type) -> bool:
    """The method overrides ``on_round_end``, which receives the round's replies (FedPFT's
    alignment reads them)."""
    return method_cls.overrides("on_round_end")


register_rule(name=SecureAggregation.name, rule_cls=SecureAggregation)
