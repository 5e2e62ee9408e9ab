"""The Flower ClientApp: one SuperNode = one client = one partition of the train split.

``query`` answers which partition this SuperNode holds (the ServerApp maps node ids to client
ids with it); ``train`` builds the method from the experiment config in the message as ``fedslice
run`` builds it, in the client role (no server-side distillation: FedPFT's proxy and FedOT's
distilled emulator arrive in the payload), loads the payload and runs ``method.fit`` on this
node's partition with the in-process engine's seed ``client_seed(seed, round, partition)``.

A SuperNode needs the model and the train data at the paths of the config (the ServerApp sends the
config, not the data). For ``fedpft`` and ``fedot`` (``Method.client_model_from_server``) it needs
the model's config and tokenizer files only, never its weights: the method is built from the HF
config on the meta device, and the tensors of the smaller model the client trains (FedPFT's proxy,
FedOT's adapter + emulator) arrive in its first train message (the ``model`` record of
:mod:`fedslice.flower.codec`, counted in ``bytes_down``). Flower starts a fresh ClientApp process
per message in a deployment, so each round loads the model (or builds it from its config) and the
data again; the simulation engine reuses its workers, and the last setup is kept in memory then.
What a method's client keeps between its participations (``Method.kept_state("client")``) lives in the
node's ``Context.state``, which Flower keeps per node across messages of a run, except the model
the node received (the ``base.*`` tensors: tens of MB for MiniLM, far more for larger models): it
is written once, when it arrives, to a safetensors file on the node's own disk (node config
``state-dir``, default ``$FLWR_HOME/fedslice-node-state``: ``fedslice deploy local`` removes it
with its work folder), and ``Context.state`` holds its path and a token. Flower sends the whole
``Context.state`` between the SuperNode and each fresh ClientApp process, in both directions, with
a 30 s limit per call in 1.41: a model there would travel twice per message (a MiniLM proxy missed
that limit on a loaded machine). A node that lost what it kept (state or file) fails that round
with a clear reason, and the server sends it the whole model again at its next participation.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp

from fedslice.flower.nodes import (END_RUN, NUM_PARTITIONS, PARTITION_ID, DeploymentError,
                                   node_partition)

if TYPE_CHECKING:  # SuperNodes start a ClientApp process per message: a query needs no torch
    from fedslice.fl.strategy import State

log = logging.getLogger(__name__)

app = ClientApp()

_CACHE: dict[str, Any] = {}
CLIENT_STATE = "fedslice_client_state"  # what a method keeps between participations (Context.state)
KEPT_MODEL = "fedslice_kept_model"  # path and token of the file with the model the node received
STATE_DIR = "state-dir"  # node config: the folder of that file
MAX_RUNS = "state-max-runs"  # node config: run folders kept in it (this run's included)
DEFAULT_MAX_RUNS = 3
#: node config: seconds this node sleeps per local step after training (a slow device: tests
#: of federation.round_policy = 'deadline' on a real federation)
THROTTLE = "throttle-s-per-step"


def _setup(experiment: dict[str, Any]):
    """``(cfg, method, data)`` for an experiment config dict, kept for the next message."""
    from fedslice.run.setup import setup
    from fedslice.experiment import validate_config

    key = json.dumps(experiment, sort_keys=True)
    if _CACHE.get("key") != key:
        _CACHE.clear()
        cfg = validate_config(experiment, "<config sent by the ServerApp>")
        method, data = setup(cfg, role="client")
        _CACHE.update(key=key, value=(cfg, method, data))
    return _CACHE["value"]


def state_dir(context: Context) -> Path:
    """Where this node keeps the model it received: node config ``state-dir``, else
    ``$FLWR_HOME/fedslice-node-state`` (Flower's folder of this node, ``~/.flwr`` by default)."""
    configured = context.node_config.get(STATE_DIR)
    if configured:
        return Path(str(configured)).expanduser()
    home = os.environ.get("FLWR_HOME")
    return (Path(home) if home else Path.home() / ".flwr") / "fedslice-node-state"


def load_kept(context: Context) -> State:
    """What this node kept after its last participation: ``Context.state`` and the model file."""
    from safetensors import safe_open

    from fedslice.flower.codec import record_to_state
    from fedslice.methods.submodel import BASE_PREFIX

    kept = context.state.array_records.get(CLIENT_STATE)
    state = record_to_state(kept) if kept is not None else {}
    ref = context.state.config_records.get(KEPT_MODEL)
    if ref is not None:
        path = Path(str(ref["path"]))
        try:
            with safe_open(str(path), framework="pt") as f:
                if (f.metadata() or {}).get("token") != str(ref["token"]):
                    raise OSError("the file was written by another run or node")
                state.update({BASE_PREFIX + k: f.get_tensor(k) for k in f.keys()})
        except Exception as e:  # noqa: BLE001 - missing, truncated or foreign: the node holds no model
            log.warning("the model this node kept in %s cannot be read (%s): it holds none", path, e)
    return state


def store_kept(context: Context, state: State, received_model: bool) -> None:
    """Keep ``state`` for the node's next participation: the model (``base.*``) in a file
    written when it was received, the rest in ``Context.state``."""
    from safetensors.torch import save_file

    from fedslice.flower.codec import state_to_record
    from fedslice.methods.submodel import BASE_PREFIX

    model = {k[len(BASE_PREFIX):]: t.contiguous() for k, t in state.items() if k.startswith(BASE_PREFIX)}
    context.state[CLIENT_STATE] = state_to_record({k: t for k, t in state.items()
                                                   if not k.startswith(BASE_PREFIX)})
    if not model:
        if KEPT_MODEL in context.state.config_records:
            del context.state[KEPT_MODEL]
        return
    if not received_model and KEPT_MODEL in context.state.config_records:
        return  # the file holds it already (read at the start of this message)
    max_runs = _max_runs(context)
    folder = state_dir(context) / f"run-{context.run_id}"
    folder.mkdir(parents=True, exist_ok=True)
    prune_runs(folder.parent, keep=folder, max_runs=max_runs)
    path = folder / f"node-{context.node_id}.safetensors"
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    token = secrets.token_hex(8)
    save_file(model, str(tmp), metadata={"token": token})
    os.replace(tmp, path)
    context.state[KEPT_MODEL] = ConfigRecord({"path": str(path), "token": token})


def _max_runs(context: Context) -> int:
    value = context.node_config.get(MAX_RUNS, DEFAULT_MAX_RUNS)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise DeploymentError(f"node config {MAX_RUNS}={value!r} must be an integer >= 1")
    return value


def prune_runs(root: Path, keep: Path, max_runs: int) -> list[Path]:
    """Remove the ``run-*`` folders under ``root`` but ``keep`` and the newest ``max_runs - 1``
    others (by modification time); return the removed ones."""
    others = sorted((p for p in root.glob("run-*") if p.is_dir() and p != keep),
                    key=lambda p: p.stat().st_mtime, reverse=True)
    removed = others[max_runs - 1:]
    for p in removed:
        shutil.rmtree(p, ignore_errors=True)
        log.info("removed the model files of an earlier run: %s", p)
    return removed


def end_run(context: Context) -> None:
    """The run is over: remove its folder of model files and forget the reference to it."""
    shutil.rmtree(state_dir(context) / f"run-{context.run_id}", ignore_errors=True)
    if KEPT_MODEL in context.state.config_records:
        del context.state[KEPT_MODEL]


@app.query()
def query(msg: Message, context: Context) -> Message:
    """Reply with this node's partition (validated against the server's num_clients); an
    ``end-run`` query removes the run's model files instead; a secure aggregation stage is
    answered by :mod:`fedslice.flower.secagg_stages`, and a query that asks for a later round's
    keys (the partition query, the unmasking) gets them in its answer too."""
    from fedslice.flower.secagg_stages import AHEAD, SECAGG, answer_ahead, client_stage

    if SECAGG in msg.content.config_records:  # a secure aggregation stage
        num_clients = int(msg.content.config_records[SECAGG]["num_clients"])
        pid = node_partition(context.node_config, num_clients)
        reply = client_stage(msg, context, pid)
    else:
        fields = msg.content["fedslice"]
        if END_RUN in fields:
            end_run(context)
            return Message(RecordDict({"fedslice": ConfigRecord({END_RUN: 1})}), reply_to=msg)
        num_clients = int(fields["num_clients"])
        pid = node_partition(context.node_config, num_clients)
        record = ConfigRecord({PARTITION_ID: pid, NUM_PARTITIONS: num_clients})
        reply = Message(RecordDict({"fedslice": record}), reply_to=msg)
    if (keys := answer_ahead(msg, context, pid)) is not None:
        reply.content[AHEAD] = keys
    return reply


def throttle(context: Context, payload) -> None:
    """Sleep ``throttle-s-per-step`` x the round's local steps (node config; none: no sleep)."""
    per_step = float(context.node_config.get(THROTTLE, 0) or 0)
    if per_step > 0:
        import time
        time.sleep(per_step * max(1, payload.orders.local_steps))


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Local training of this node's partition on the received payload."""
    from fedslice.run.engine import client_seed
    from fedslice.flower.codec import decode_payload, encode_reply
    from fedslice.fl.wire import to_wire, upload_dtype_of

    payload, experiment = decode_payload(msg.content)
    cfg, method, data = _setup(experiment)
    pid = node_partition(context.node_config, cfg.federation.num_clients)
    orders = payload.orders
    client = pid if orders.client is None else orders.client
    if client != pid:
        raise RuntimeError(f"payload for client {client} reached the node of partition {pid}")
    method.restore_state("client", load_kept(context))
    reply = method.train_client(payload, data.client(pid), client_seed(cfg.seed, orders.round, pid))
    throttle(context, payload)
    wire = upload_dtype_of(orders, cfg.federation.upload_dtype)  # the plan's, else the run's
    if state := method.kept_state("client"):
        store_kept(context, state, received_model=bool(payload.model))
    if "fedslice_secagg" in msg.content.config_records:  # only the masked vector leaves
        from fedslice.fl.wire import received
        from fedslice.flower.secagg import masked_reply

        sent = received(to_wire(reply, wire), wire)
        return Message(masked_reply(msg, context, method, payload, sent), reply_to=msg)
    return Message(encode_reply(to_wire(reply, wire)), reply_to=msg)
