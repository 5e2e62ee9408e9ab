"""Secure aggregation on the Deployment Engine: the SecAgg stages as Flower messages.

Why not Flower's ``SecAggPlusWorkflow`` and ``secaggplus_mod``: the workflow runs inside the
legacy ``DefaultWorkflow`` with a ``LegacyContext`` and a legacy ``flwr.server.strategy``
(``configure_fit`` / ``aggregate_fit`` over ``FitRes``), and the mod acts on TRAIN replies that
convert to a legacy ``FitRes``; fedslice's ServerApp is a Message API app whose strategy is a
``flwr.serverapp.strategy.Strategy`` (per-client payloads, validation, checkpoints). The workflow
also scales every vector by one scalar weight per client (``max_weight``), while fedslice sums a
per-coordinate weight vector with the update. So the ServerApp drives the same protocol from
Flower's own primitives (:mod:`fedslice.fl.secagg`, shared with the in-process engine):

* stage 0 (``setup``) and stage 1 (``share_keys``): QUERY messages sent from ``configure_train``
  (Flower's ``Strategy.start`` hands it the grid); a node that fails them is left out of the round.
  Stage 0 rides on queries the nodes answer anyway (keys ahead,
  :mod:`fedslice.flower.secagg_stages`): the partition query at the start draws the first
  round's key pairs, each round's unmasking the next round's; a setup message goes only to a
  client of the round without them (a client that was not in the previous round, or whose
  unmasking answer was lost). Flower starts a fresh ClientApp process per message, so each
  message a round saves is ten process starts on ten nodes;
* stage 2: the TRAIN message carries the payload, the encrypted shares for that client and the
  round's public layout (the union of the round's slices: a client of a method sending slices
  embeds its own in it, from its payload alone); the ClientApp trains, builds its vector with the same
  :meth:`~fedslice.fl.rules.secagg.SecureAggregation.client_vector` as in process, masks it and
  replies with the masked vector (uint32, its arrays in one flat array: Flower moves each
  array of a message as objects of its own, one request each), its example count and scalar
  metrics only;
* stage 3 (``unmask``): QUERY messages from ``aggregate_train``; the server's side is
  :meth:`~fedslice.fl.rules.secagg.SecureAggregation.aggregate_masked`, as in process.

A client keeps its keys and shares between the stages in ``Context.state`` (record
``fedslice_secagg``), which Flower keeps per node across the messages of a run.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np
from flwr.app import (Array, ArrayRecord, ConfigRecord, Context, Message, MessageType, MetricRecord,
                      RecordDict)
from flwr.serverapp import Grid

from fedslice.fl import secagg as sp
from fedslice.fl.rules import SecureAggregation, find_rule
from fedslice.fl.rules.secagg import clear_metrics, upload_metrics
from fedslice.fl.strategy import Payload, Reply, RoundResult
from fedslice.flower.secagg_stages import (AHEAD, SECAGG, ahead_keys, ahead_request, secrets,
                                           secrets_to_record)
from fedslice.flower.codec import encode_reply, error_reason, state_to_record
from fedslice.flower.strategy import TTL_MARGIN_S, FlowerAdapter

log = logging.getLogger(__name__)

MASKED = "masked"  # a reply's one array: its masked vector, flat (:func:`fedslice.fl.secagg.flat`)


def masked_reply(msg: Message, context: Context, method, payload: Payload, reply: Reply) -> RecordDict:
    """Stage 2 after local training: this client's vector (its reply, checked by itself,
    weighted by the method and encoded by :meth:`SecureAggregation.client_vector`), masked; the
    reply carries it, the example count and the scalar metrics, never the update."""
    fields = msg.content.config_records[SECAGG]
    server_round = int(fields["round"])
    me = secrets(context, "mask", server_round)
    sp.receive_shares(me, dict(zip([int(s) for s in fields["src"]], fields["ct"])))
    layout = layout_from_record(fields)
    params = sp.Params(int(fields["threshold"]), float(fields["clip"]), int(fields["target"]))
    rule = find_rule(method.strategy, SecureAggregation)
    vector, reason = rule.client_vector(payload.orders.round, payload, reply, layout, params)
    if vector is None:
        raise RuntimeError(f"secure aggregation: this client's update is refused: {reason}")
    masked = sp.mask(me, vector, params)
    context.state[SECAGG] = secrets_to_record(me, server_round)
    metrics = upload_metrics(clear_metrics(reply.metrics), layout)
    content = encode_reply(Reply({}, reply.num_examples, metrics))
    content["arrays"] = ArrayRecord({MASKED: Array(sp.flat(masked).astype(np.uint32))})
    return content


def layout_to_record(layout: sp.Layout) -> dict[str, Any]:
    """The round's public layout as the TRAIN message announces it: per key its full shape and
    weight shape (JSON), the union of the round's slices (one bit per element; empty bytes: the
    whole tensor) and the weights' bound."""
    keys = list(layout.shapes)
    return {"layout": json.dumps([[k, list(layout.shapes[k]), list(layout.weight_shape(k))]
                                  for k in keys]),
            "union": [sp.pack_union(layout.union[k]) if k in layout.union else b"" for k in keys],
            "bound": float(next(iter(layout.bounds.values()), 1.0))}


def layout_from_record(fields: ConfigRecord) -> sp.Layout:
    keys = json.loads(str(fields["layout"]))  # [[name, shape, weight shape], ...]
    shapes = {k: tuple(s) for k, s, _ in keys}
    union = {k: sp.unpack_union(u, shapes[k]) for (k, _, _), u in zip(keys, fields["union"]) if u}
    return sp.Layout(shapes, {k: float(fields["bound"]) for k in shapes},
                     {k: (() if not w else tuple(shapes[k])) for k, _, w in keys}, union)


# -- the ServerApp's side ---------------------------------------------------------------------
class SecureFlowerAdapter(FlowerAdapter):
    """The adapter with the SecAgg stages around each round's training (module doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.rule: SecureAggregation = find_rule(self.inner, SecureAggregation)
        self._secure: dict[str, Any] = {}  # the round being trained: layout, keys, failures
        self._stage_s: dict[str, float] = {}  # the round's seconds per key stage (its record's)
        #: keys drawn ahead: client -> (its node, the round they are for, pk1, pk2), from the
        #: partition query (the first round's) and each unmasking (the next round's)
        self._ahead: dict[int, tuple[int, int, bytes, bytes]] = {}
        first = self.offset + 1
        for c, nid in self.partitions.nodes.items():
            answer = self.partitions.answers.get(nid)
            if answer is not None and (keys := ahead_keys(answer, first)) is not None:
                self._ahead[c] = (nid, first, *keys)

    @staticmethod
    def first_keys_request(first_round: int) -> dict[str, ConfigRecord]:
        """What the partition query at the start carries: the request of the first round's keys."""
        return {AHEAD: ahead_request(first_round)}

    def _exchange(self, grid: Grid, server_round: int, fields: Mapping[int, dict],
                  ahead: int | None = None) -> tuple[dict[int, ConfigRecord], dict[int, str]]:
        """One QUERY per client (``fields``: client -> the stage's fields); the answers by
        client and why the others failed. ``ahead``: each query also asks for the keys of that
        round (kept for it)."""
        n = self.cfg.federation.num_clients
        ask = {} if ahead is None else {AHEAD: ahead_request(ahead)}
        msgs = {c: Message(RecordDict({SECAGG: ConfigRecord({**f, "round": server_round,
                                                             "num_clients": n}), **ask}),
                           dst_node_id=self.partitions.nodes[c], message_type=MessageType.QUERY,
                           group_id=str(server_round), ttl=self.round_timeout + TTL_MARGIN_S)
                for c, f in fields.items()}
        t0 = time.perf_counter()
        answers = list(grid.send_and_receive(list(msgs.values()), timeout=self.round_timeout))
        stage = f"secagg_{next(iter(fields.values()), {}).get('stage', 'stage')}_s"
        self._stage_s[stage] = self._stage_s.get(stage, 0.0) + time.perf_counter() - t0
        by_id = {m.metadata.message_id: c for c, m in msgs.items()}  # set when pushed
        got, failed = {}, {}
        for m in answers:
            c = by_id.get(m.metadata.reply_to_message_id)
            if c is None:
                continue
            if m.has_error():
                failed[c] = f"node {self.partitions.nodes[c]} failed: {error_reason(m)}"
            elif SECAGG not in m.content.config_records:
                failed[c] = "its answer holds no secure aggregation record"
            else:
                got[c] = m.content.config_records[SECAGG]
                if ahead is not None and (keys := ahead_keys(m.content, ahead)) is not None:
                    self._ahead[c] = (self.partitions.nodes[c], ahead, *keys)
        for c in fields:
            if c not in got and c not in failed:
                failed[c] = f"no answer within {self.round_timeout:g} s"
        return got, failed

    def configure_train(self, server_round: int, arrays, config, grid: Grid) -> Iterable[Message]:
        super().configure_train(server_round, arrays, config, grid)  # the round's payloads (sent below, masked)
        self._stage_s = {}
        sent = self._round
        layout = self.rule.layout(sent.state, sent.payloads)
        params = self.rule.params(len(sent.clients))
        ahead, self._ahead = self._ahead, {}
        ready = {c: (a[2], a[3]) for c, a in ahead.items() if c in sent.clients
                 and a[:2] == (self.partitions.nodes.get(c), sent.number)}
        need = [c for c in sent.clients if c not in ready]
        stage0, failed = self._exchange(grid, sent.number, {c: {"stage": "setup"} for c in need}) \
            if need else ({}, {})
        self._stage_s.setdefault("secagg_setup_s", 0.0)
        peers = dict(sorted({**ready, **{c: (r["pk1"], r["pk2"]) for c, r in stage0.items()}}.items()))
        order = sorted(peers)
        boxes, failed1 = self._exchange(grid, sent.number, {c: {
            "stage": "share_keys", "nids": order, "pk1": [peers[n][0] for n in order],
            "pk2": [peers[n][1] for n in order], "threshold": params.threshold} for c in order})
        failed.update(failed1)
        keyholders = sorted(boxes)
        self._secure = {"layout": layout, "params": params, "peers": peers,
                        "keyholders": keyholders, "failed": failed, "grid": grid,
                        "keys_ahead": len(ready)}
        if len(keyholders) < params.threshold:
            log.warning("round %d: %d clients shared keys, fewer than privacy.secagg_threshold=%d",
                        sent.number, len(keyholders), params.threshold)
            return []
        announced = layout_to_record(layout)
        out = []
        for c in keyholders:
            srcs = [s for s in keyholders if s != c and c in _dsts(boxes[s])]
            old = sent.messages[c]
            content = old.content
            content[SECAGG] = ConfigRecord({
                "src": srcs, "ct": [_box(boxes[s], c) for s in srcs], **announced,
                "clip": float(params.clip_range), "threshold": params.threshold,
                "target": params.target_range, "round": sent.number})
            # a new message: its time to live starts now, after the key stages
            sent.messages[c] = Message(content, dst_node_id=old.metadata.dst_node_id,
                                       message_type=MessageType.TRAIN, group_id=str(sent.number),
                                       ttl=self.round_timeout + TTL_MARGIN_S)
            out.append(sent.messages[c])
        return out

    def max_reply_bytes(self, payload: Payload) -> int:
        return 4 * self._secure["layout"].coordinates() + (1 << 20)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]):
        server_round += self.offset
        sent, self._round = self._round, None
        assert sent is not None and sent.number == server_round, "aggregate without configure"
        replies = list(replies)
        log.info("round %d: %d replies to the training in", server_round, len(replies))
        received, failures, malformed = self._collect(sent, replies)  # sized by the layout
        s, self._secure = self._secure, {}
        for c, why in s["failed"].items():  # failed in stage 0 or 1: never trained
            failures = [f for f in failures if f["client"] != c] + [{"client": c, "reason": why}]
        for c in self.inner.sent:
            if c not in received:
                self.inner.forget(c)
        masked = {c: (r.arrays[MASKED].numpy() if set(r.arrays) == {MASKED} else None)
                  for c, r in received.items()}  # one flat array each: checked and split there
        grid, params = s["grid"], s["params"]

        # the unmasking also draws the next round's keys (the last round's has no next)
        following = server_round + 1 if server_round < self.cfg.federation.rounds else None

        def reveal(active, dead):
            log.info("round %d: unmasking asked of %d clients", server_round, len(active))
            got, failed = self._exchange(grid, server_round, {c: {
                "stage": "unmask", "active": list(active), "dead": list(dead),
                "threshold": params.threshold} for c in active}, ahead=following)
            log.info("round %d: unmasking answered by %d clients", server_round, len(got))
            for c, why in failed.items():
                log.warning("round %d: client %d did not answer the unmasking: %s", server_round, c, why)
            return {c: dict(zip([int(o) for o in r["owners"]], r["shares"])) for c, r in got.items()}

        if len(s["keyholders"]) < params.threshold:
            why = (f"{len(s['keyholders'])} clients shared keys, fewer than "
                   f"privacy.secagg_threshold={params.threshold}")
            new, metrics, bad = None, {}, []
        else:
            new, metrics, bad, why = self.rule.aggregate_masked(
                server_round, sent.state, masked, reveal, s["keyholders"], s["peers"],
                s["layout"], params, sent.payloads)
        if why is not None:
            log.warning("round %d: secure aggregation skipped: %s; global state unchanged",
                        server_round, why)
            result = RoundResult(sent.state, [], bad, skipped=True, rejected=len(bad),
                                 invalid=[e["client"] for e in bad], metrics={"secagg_skipped": why})
        else:
            used = sorted(c for c in masked if c not in {e["client"] for e in bad})
            result = RoundResult(new, used, bad, rejected=len(bad),
                                 invalid=[e["client"] for e in bad], metrics=metrics)
        # the key stages' wall seconds (setup, key sharing, unmasking: what a round adds)
        result.metrics.update(self._stage_s)
        result.metrics["secagg_keys_ahead"] = s.get("keys_ahead", 0)  # clients sent no setup
        new_state, server_metrics = self.method.on_round_end(
            server_round, result.state, {c: received[c] for c in result.used})
        self._record(sent, received, failures, result, server_metrics, malformed)
        out = {"num-replies": len(received), "num-failed": len(failures)}
        if self.record["train_loss"] is not None:
            out["train-loss"] = self.record["train_loss"]
        return state_to_record(new_state), MetricRecord(out)


def _dsts(box: ConfigRecord) -> list[int]:
    return [int(d) for d in box["dst"]]


def _box(box: ConfigRecord, dst: int) -> bytes:
    return dict(zip(_dsts(box), box["ct"]))[dst]
