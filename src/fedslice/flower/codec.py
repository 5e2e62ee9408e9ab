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

Decoding a reply never trusts it: a malformed one raises :class:`MalformedReply`, which the
ServerApp turns into a rejected reply (logged and counted, never raised).

Tensors cross as float arrays of the same dtype, so decoding gives back the exact values; a
reply's floating tensors travel in ``federation.upload_dtype`` (:mod:`fedslice.fl.wire`) and
are restored to fp32 on decoding.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict

from fedslice.fl.strategy import Payload, Reply, State
from fedslice.fl.wire import from_wire

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


class MalformedReply(ValueError):
    """A reply that cannot be decoded into a :class:`Reply` (the reason is the message)."""


def reply_size(content: Any) -> int:
    """Bytes of a reply's tensors as they arrived (before any is decoded); 0 if it has none."""
    try:
        return sum(len(a.data) for a in content[ARRAYS].values())
    except Exception:  # noqa: BLE001 - a malformed reply: decode_reply says what is wrong
        return 0


def decode_reply(content: Any, max_bytes: int | None = None, upload_dtype: str = "fp32") -> Reply:
    """Inverse of :func:`encode_reply`, tensors sent in ``upload_dtype`` restored to fp32
    (:func:`fedslice.fl.wire.from_wire`). Anything else (a record missing or of the wrong kind,
    JSON that does not parse, tensors that do not decode, more than ``max_bytes`` of tensors)
    raises :class:`MalformedReply` with the reason; the values themselves are checked by the
    strategy (:mod:`fedslice.fl.validation`)."""
    try:
        arrays, meta = content[ARRAYS], content[META]
    except Exception as e:  # noqa: BLE001
        raise MalformedReply(f"no {e} record") from None
    if not isinstance(arrays, ArrayRecord) or not isinstance(meta, ConfigRecord):
        raise MalformedReply(f"records {ARRAYS!r} / {META!r} are a {type(arrays).__name__} / "
                             f"{type(meta).__name__}")
    size = reply_size(content)
    if max_bytes is not None and size > max_bytes:
        raise MalformedReply(f"{size} bytes of tensors, more than the {max_bytes} its payload "
                             "allows")
    try:
        num_examples = meta["num_examples"]
        metrics = json.loads(str(meta["metrics"]))
    except KeyError as e:
        raise MalformedReply(f"no {e} in the {META!r} record") from None
    except ValueError as e:
        raise MalformedReply(f"its metrics are not JSON ({e})") from None
    try:
        state = record_to_state(arrays)
    except Exception as e:  # noqa: BLE001 - bytes that are not an array, an unknown dtype
        raise MalformedReply(f"a tensor does not decode ({type(e).__name__}: {e})") from None
    return Reply(arrays=from_wire(state, upload_dtype), num_examples=num_examples, metrics=metrics)


def error_reason(msg: Message) -> str:
    """A reply's error as one readable line (Flower wraps ClientApp exceptions as
    ``<class 'X'>:<'text'>``)."""
    reason = msg.error.reason
    m = re.fullmatch(r"<class '(?:[\w.]*\.)?(\w+)'>:<'(.*)'>", reason, flags=re.S)
    return f"{m.group(1)}: {m.group(2)}" if m else f"{reason} (error code {msg.error.code})"
