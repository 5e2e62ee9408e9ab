"""Our payloads and replies as Flower records, and back.

A message's content is a ``RecordDict`` with

- ``"arrays"``: an ``ArrayRecord`` of the tensors (a payload's or a reply's ``arrays``);
- ``"model"`` (payloads at a client's first contact only): an ``ArrayRecord`` of the frozen
  tensors of the model the client trains (``Payload.model``: fedpft's proxy, fedot's adapter +
  emulator), so a SuperNode never needs the full model;
- ``"fedslice"``: a ``ConfigRecord`` whose string fields hold JSON (the experiment config, a
  payload's ``config`` or a reply's metrics): JSON keeps any structure a method puts there
  (nested lists, ``None``), which Flower's scalar records do not;
- ``"metrics"`` (replies only): a ``MetricRecord`` with ``num-examples`` and ``loss``, so Flower's
  own tools (logs, FedAvg weighting) see the usual keys.

Tensors cross as float arrays of the same dtype, so decoding gives back the exact values.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedslice.fl.strategy import Payload, Reply, State

ARRAYS, META, METRICS, MODEL = "arrays", "fedslice", "metrics", "model"


def state_to_record(state: State) -> ArrayRecord:
    """Tensors -> ``ArrayRecord`` (key order kept)."""
    return ArrayRecord.from_torch_state_dict({k: t.detach().contiguous() for k, t in state.items()})


def record_to_state(record: ArrayRecord) -> State:
    """``ArrayRecord`` -> writable CPU tensors (copies: the record's buffers are read-only)."""
    return {k: torch.from_numpy(np.array(arr.numpy(), copy=True)) for k, arr in record.items()}


def _dumps(obj: Any) -> str:
    """JSON text; NaN stays NaN (a non-finite loss must reach the server's checks)."""
    return json.dumps(obj, default=lambda v: v.item() if hasattr(v, "item") else str(v))


def _json_field(content: RecordDict, key: str) -> Any:
    return json.loads(str(content[META][key]))


def encode_payload(payload: Payload, experiment: dict[str, Any]) -> RecordDict:
    """A train message's content: the payload plus the experiment config the client builds from."""
    meta = ConfigRecord({"experiment": _dumps(experiment), "payload": _dumps(payload.config)})
    content = RecordDict({ARRAYS: state_to_record(payload.arrays), META: meta})
    if payload.model:
        content[MODEL] = state_to_record(payload.model)
    return content


def decode_payload(content: RecordDict) -> tuple[Payload, dict[str, Any]]:
    """Inverse of :func:`encode_payload`: ``(payload, experiment config dict)``."""
    model = record_to_state(content[MODEL]) if MODEL in content.array_records else {}
    payload = Payload(arrays=record_to_state(content[ARRAYS]), config=_json_field(content, "payload"),
                      model=model)
    return payload, _json_field(content, "experiment")


def encode_reply(reply: Reply) -> RecordDict:
    """A train reply's content."""
    numeric = {"num-examples": int(reply.num_examples),
               "loss": float(reply.metrics.get("loss", float("nan")))}
    meta = ConfigRecord({"metrics": _dumps(reply.metrics), "num_examples": int(reply.num_examples)})
    return RecordDict({ARRAYS: state_to_record(reply.arrays), META: meta,
                       METRICS: MetricRecord(numeric)})


def decode_reply(content: RecordDict) -> Reply:
    """Inverse of :func:`encode_reply`."""
    return Reply(arrays=record_to_state(content[ARRAYS]),
                 num_examples=int(content[META]["num_examples"]),
                 metrics=_json_field(content, "metrics"))


def error_reason(msg: Message) -> str:
    """A reply's error as one readable line (Flower wraps ClientApp exceptions as
    ``<class 'X'>:<'text'>``)."""
    reason = msg.error.reason
    m = re.fullmatch(r"<class '(?:[\w.]*\.)?(\w+)'>:<'(.*)'>", reason, flags=re.S)
    return f"{m.group(1)}: {m.group(2)}" if m else f"{reason} (error code {msg.error.code})"
