"""The ClientApp's key stages of secure aggregation (:mod:`fedslice.flower.secagg`): stage 0
(``setup``), stage 1 (``share_keys``) and stage 3 (``unmask``) answered from the node's
``Context.state``. Light on purpose: Flower starts a fresh ClientApp process per message, and a
stage needs Flower's primitives only, never torch or the model."""

from __future__ import annotations

from flwr.app import ConfigRecord, Context, Message, RecordDict

from fedslice.fl import secagg as sp

SECAGG = "fedslice_secagg"  # record name: in stage messages, train messages and Context.state


# -- a client's secrets in Context.state ------------------------------------------------------
def secrets_to_record(me: sp.ClientSecrets) -> ConfigRecord:
    return ConfigRecord({
        "nid": me.nid, "sk1": me.sk1, "pk1": me.pk1, "sk2": me.sk2, "pk2": me.pk2, "seed": me.seed,
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
    stage = str(fields["stage"])
    if stage == "setup":
        me = sp.setup(client)
        context.state[SECAGG] = secrets_to_record(me)
        out = {"pk1": me.pk1, "pk2": me.pk2}
    else:
        if SECAGG not in context.state.config_records:
            raise RuntimeError(f"secure aggregation stage {stage!r} before this node's setup")
        me = secrets_from_record(context.state.config_records[SECAGG])
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
        context.state[SECAGG] = secrets_to_record(me)
    return Message(RecordDict({SECAGG: ConfigRecord(out)}), reply_to=msg)
