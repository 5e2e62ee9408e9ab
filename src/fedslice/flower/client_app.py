"""The Flower ClientApp: one SuperNode = one client = one partition of the train split.

``query`` answers which partition this SuperNode holds (the ServerApp maps node ids to client
ids with it); ``train`` builds the method from the experiment config in the message as ``fedslice
run`` builds it, in the client role (no server-side distillation: FedPFT's proxy and FedOT's
distilled emulator arrive in the payload), loads the payload and runs ``method.fit`` on this
node's partition with the in-process engine's seed ``client_seed(seed, round, partition)``.

A SuperNode needs the model and the train data at the paths of the config (the ServerApp sends the
config, not the data). Flower starts a fresh ClientApp process per message in a deployment, so
each round loads the model and data again; the simulation engine reuses its workers, and the last
setup is kept in memory then. What a method's client keeps between its participations
(``Method.client_state``: FedPFT's proxy copy) lives in the node's ``Context.state``, which Flower
keeps per node across messages of a run.
"""

from __future__ import annotations

import json
from typing import Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedslice.flower.nodes import NUM_PARTITIONS, PARTITION_ID, node_partition

app = ClientApp()

_CACHE: dict[str, Any] = {}
CLIENT_STATE = "fedslice_client_state"  # what a method keeps between participations (Context.state)


def _setup(experiment: dict[str, Any]):
    """``(cfg, method, data)`` for an experiment config dict, kept for the next message."""
    from fedslice.api import setup
    from fedslice.config import validate_config

    key = json.dumps(experiment, sort_keys=True)
    if _CACHE.get("key") != key:
        _CACHE.clear()
        cfg = validate_config(experiment, "<config sent by the ServerApp>")
        method, data = setup(cfg, role="client")
        _CACHE.update(key=key, value=(cfg, method, data))
    return _CACHE["value"]


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Reply with this node's partition (validated against the server's num_clients)."""
    num_clients = int(msg.content["fedslice"]["num_clients"])
    pid = node_partition(context.node_config, num_clients)
    record = ConfigRecord({PARTITION_ID: pid, NUM_PARTITIONS: num_clients})
    return Message(RecordDict({"fedslice": record}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Local training of this node's partition on the received payload."""
    from fedslice.fl.engine import client_seed
    from fedslice.flower.codec import decode_payload, encode_reply, record_to_state, state_to_record

    payload, experiment = decode_payload(msg.content)
    cfg, method, data = _setup(experiment)
    pid = node_partition(context.node_config, cfg.federation.num_clients)
    client = payload.config.get("client", pid)
    if client != pid:
        raise RuntimeError(f"payload for client {client} reached the node of partition {pid}")
    kept = context.state.array_records.get(CLIENT_STATE)
    method.load_client_state(record_to_state(kept) if kept is not None else {})
    reply = method.fit(payload, data.client(pid), client_seed(cfg.seed, payload.config["round"], pid))
    if state := method.client_state():
        context.state[CLIENT_STATE] = state_to_record(state)
    return Message(encode_reply(reply), reply_to=msg)
