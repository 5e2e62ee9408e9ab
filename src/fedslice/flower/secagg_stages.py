"""The ClientApp's key stages of secure aggregation (:mod:`fedslice.flower.secagg`): stage 0
(``setup``), stage 1 (``share_keys``) and stage 3 (``unmask``) answered from the node's
``Context.state``. Light on purpose: Flower starts a fresh ClientApp process per message, and a
stage needs Flower's primitives only, never torch or the model.

**Keys ahead.** A QUERY the node answers anyway (the partition query at the start of a run, the
unmasking of round r) may carry the record ``fedslice_secagg_ahead`` naming a later round: the
node then also draws that round's two fresh key pairs (stage 0 of that round), keeps them in
``Context.state`` tagged with the round (record ``fedslice_secagg_next``) and answers their
public keys, so that round needs no setup message of its own. They are the same fresh keys stage
0 would draw, only drawn earlier; they serve that round's key sharing only (another round's, or
a node whose state lost them, fails the stage, and the server then sends that node a setup)."""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedslice.fl import secagg as sp

SECAGG = "fedslice_secagg"  # record name: in stage messages, train messages and Context.state
AHEAD = "fedslice_secagg_ahead"  # a QUERY's request (and its answer) of a later round's keys
NEXT = "fedslice_secagg_next"  # Context.state: the keys drawn ahead, for their round only


# -- a client's secrets in Context.state ------------------------------------------------------
def secrets_to_record(me: sp.ClientSecrets, server_round: int) -> ConfigRecord:
    return ConfigRecord({
        "round": server_round, "nid": me.nid, "sk1": me.sk1, "pk1": me.pk1, "sk2": me.sk2,
        "pk2": me.pk2, "seed": me.seed,
        "seed_owners": list(me.seed_shares), "seed_shares": list(me.seed_shares.values()),
        "sk1_owners": list(me.sk1_shares), "sk1_shares": list(me.sk1_shares.values()),
        "peers": list(me.peers), "peer_pk1": [p[0] for p in me.peers.values()],
        "peer_pk2": [p[1] for p in me.peers.values()]})


def secrets_from_record(r: ConfigRecord) -> sp.ClientSecrets:
    def pairs(keys, values):
        return dict(zip(list(r.get(keys, [])), list(r.get(values, []))))

    me = sp.ClientSecrets(int(r["nid"]), r["sk1"], r["pk1"], r["sk2"], r["pk2"], r.get("seed", b""))
    me.seed_shares, me.sk1_shares = pairs("seed_owners", "seed_shares"), pairs("sk1_owners", "sk1_shares")
    me.peers = {int(n): (a, b) for n, a, b in zip(r.get("peers", []), r.get("peer_pk1", []),
                                                   r.get("peer_pk2", []))}
    return me


# -- the ClientApp's side -----------------------------------------------------------------------
def client_stage(msg: Message, context: Context, client: int) -> Message:
    """A QUERY of stage 0, 1 or 3 for this node's ``client``."""
    fields = msg.content.config_records[SECAGG]
    stage, server_round = str(fields["stage"]), int(fields["round"])
    if stage == "setup":
        me = sp.setup(client)
        out = {"pk1": me.pk1, "pk2": me.pk2}
        ahead = context.state.config_records.get(NEXT)
        if ahead is not None and int(ahead["round"]) <= server_round:  # not used: superseded
            del context.state[NEXT]
    else:
        if stage == "share_keys":
            _take_ahead(context, server_round)
        me = secrets(context, stage, server_round)
        if stage == "share_keys":
            peers = {int(n): (a, b) for n, a, b in zip(fields["nids"], fields["pk1"], fields["pk2"])}
            boxes = sp.share_keys(me, peers, int(fields["threshold"]))
            out = {"dst": list(boxes), "ct": list(boxes.values())}
        elif stage == "unmask":
            shares = sp.unmask_shares(me, [int(c) for c in fields["active"]],
                                      [int(c) for c in fields["dead"]], int(fields["threshold"]))
            out = {"owners": list(shares), "shares": list(shares.values())}
        else:
            raise ValueError(f"unknown secure aggregation stage {stage!r}")
    context.state[SECAGG] = secrets_to_record(me, server_round)
    return Message(RecordDict({SECAGG: ConfigRecord(out)}), reply_to=msg)


def secrets(context: Context, stage: str, server_round: int) -> sp.ClientSecrets:
    """This node's secrets of ``server_round`` (its setup, or the keys drawn ahead for it)."""
    kept = context.state.config_records.get(SECAGG)
    if kept is None:
        raise RuntimeError(f"secure aggregation stage {stage!r} before this node's setup")
    if int(kept.get("round", -1)) != server_round:
        raise RuntimeError(f"secure aggregation stage {stage!r} of round {server_round}: this "
                           f"node holds the keys of round {kept.get('round')}")
    return secrets_from_record(kept)


def _take_ahead(context: Context, server_round: int) -> None:
    """The keys drawn ahead for ``server_round``, if the node holds them, become its secrets."""
    ahead = context.state.config_records.get(NEXT)
    if ahead is not None and int(ahead["round"]) == server_round:
        context.state[SECAGG] = ahead
        del context.state[NEXT]


def answer_ahead(msg: Message, context: Context, client: int) -> ConfigRecord | None:
    """When ``msg`` asks for a later round's keys (record ``fedslice_secagg_ahead``): draw them,
    keep them for that round and return their public keys (the answer's record); else None."""
    ask = msg.content.config_records.get(AHEAD)
    if ask is None:
        return None
    server_round = int(ask["round"])
    me = sp.setup(client)
    context.state[NEXT] = secrets_to_record(me, server_round)
    return ConfigRecord({"round": server_round, "pk1": me.pk1, "pk2": me.pk2})


def ahead_request(server_round: int) -> ConfigRecord:
    """The record a QUERY carries to ask for the keys of ``server_round`` (:func:`answer_ahead`)."""
    return ConfigRecord({"round": server_round})


def ahead_keys(content: RecordDict, server_round: int) -> tuple[bytes, bytes] | None:
    """The public keys of ``server_round`` that an answer's ``content`` carries, if any."""
    got = content.config_records.get(AHEAD)
    if got is None or int(got.get("round", -1)) != server_round:
        return None
    pk1, pk2 = got.get("pk1"), got.get("pk2")
    return (pk1, pk2) if isinstance(pk1, bytes) and isinstance(pk2, bytes) else None
