"""Malformed replies, for the hypothesis tests (tests/test_malformed.py) and the matrix of
bench/malformed_matrix.py: one fitted round per method, and the ways a reply can be broken.

- :data:`REPLY_CASES` break a :class:`Reply` (what a ClientApp returns, or a buggy or lying
  in-process client): tensors missing, extra, of the wrong dtype, shape or an absurd size,
  non-finite, not tensors; metrics that are NaN, strings, missing, not a mapping; counts that are
  negative, inflated or not integers; and each method's own reports (heads' mask and importance,
  FedPFT's APoZ and its token count).
- :data:`CONTENT_CASES` break the Flower message content itself (records missing or of the wrong
  kind, JSON that does not parse, bytes that are not an array, an oversized reply).

Each case is ``fn(reply_or_content, ctx, pick) -> broken`` where ``pick(n)`` chooses an index in
``range(n)`` (hypothesis draws it; the matrix takes 0) and ``ctx`` is a :class:`Context`; a case
returns None when it does not apply to that method (e.g. heads' mask for fedavg).
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from conftest import method_options
from fedslice.api import setup
from fedslice.experiment import validate_config
from fedslice.errors import ConfigError
from fedslice.run.engine import Simulation
from fedslice.fl.strategy import Payload, Reply
from fedslice.methods import METHODS

RULES = ("mean", "median", "trimmed_mean", "krum", "multi_krum", "dp")
CLIENTS = 4


@dataclass
class Context:
    method: str
    state: dict
    payload: Payload
    expected: dict  # the tensors the client must send back (Strategy.expected_update)
    size: int  # the client's partition size
    extra: dict = field(default_factory=dict)


def config(method: str, rule: str, data_dir: Path, model_dir: Path, tmp: Path) -> dict:
    agg = {} if rule in ("mean", "dp") else {"rule": rule, "byzantine": 0}
    return {
        "seed": 0, "threads": 1, "data": {"path": str(data_dir), "max_length": 16},
        "model": {"name": str(model_dir)}, "lora": {"r": 4, "alpha": 8},
        "federation": {"num_clients": CLIENTS, "clients_per_round": CLIENTS, "rounds": 2,
                       "local_steps": 1, "batch_size": 8, "min_replies": 1},
        "method": {"name": method, **method_options(method, tmp),
                   **({"kd": "before"} if method == "fedpft" and rule == "dp" else {})},
        "aggregation": agg,
        "dp": {"enabled": True, "clip_norm": 0.5, "noise_multiplier": 1.0} if rule == "dp" else {},
        "output": {"dir": str(tmp / "runs"), "progress": False, "plots": False}}


def combinations(data_dir: Path, model_dir: Path, tmp: Path) -> list[tuple[str, str]]:
    """Every (method, rule) pair the config accepts (krum needs same-shaped updates, ...)."""
    out = []
    for method in sorted(METHODS):
        for rule in RULES:
            try:
                validate_config(config(method, rule, data_dir, model_dir, tmp))
            except (ConfigError, ValueError):
                continue
            out.append((method, rule))
    return out


@dataclass
class Fitted:
    """One round of one method: the strategy (its server state saved), payloads and replies."""

    method: Any
    data: Any
    state: dict
    clients: list[int]
    payloads: dict[int, Payload]
    replies: dict[int, Reply]
    saved: dict

    def context(self, c: int) -> Context:
        s = self.method.strategy
        return Context(self.method.name, self.state, self.payloads[c],
                       dict(s.expected_update(self.state, self.payloads[c], self.replies[c])),
                       len(self.data.partitions[c]))

    def reset(self) -> None:
        """The strategy as after ``configure_train`` of round 1 (the state a reply meets)."""
        s = self.method.strategy
        s.load_state_dict(copy.deepcopy(self.saved))
        s.sent = list(self.clients)

    def aggregate(self, replies: dict[int, Any]):
        self.reset()
        return self.method.strategy.aggregate_train(1, self.state, self.payloads, replies)


def fit_round(method: str, rule: str, data_dir: Path, model_dir: Path, tmp: Path,
              replies: dict[int, Reply] | None = None) -> Fitted:
    """Build ``method`` with ``rule`` and configure round 1; fit every client unless ``replies``
    (of the same method, fitted under another rule: the same payloads) are given."""
    cfg = validate_config(config(method, rule, data_dir, model_dir, tmp))
    m, data = setup(cfg)
    Simulation(cfg, m, data)  # tells the strategy the partition sizes
    state = m.initial_state()
    payloads = m.strategy.configure_train(1, state, list(range(CLIENTS)))
    clients = [c for c in range(CLIENTS) if m.strategy.absent(payloads[c]) is None]  # RaFFM's sit out
    payloads = {c: payloads[c] for c in clients}
    saved = copy.deepcopy(m.strategy.state_dict())
    if replies is None:
        replies = {c: m.fit(payloads[c], data.client(c), c) for c in clients}
    return Fitted(m, data, state, clients, payloads, replies, saved)


# --------------------------------------------------------------------------------------------
# Broken replies
# --------------------------------------------------------------------------------------------

def _with(reply: Reply, arrays=None, num_examples=None, metrics=None, **changes) -> Reply:
    a = dict(reply.arrays) if arrays is None else arrays
    m = dict(reply.metrics) if metrics is None else metrics
    m.update(changes)
    return Reply(a, reply.num_examples if num_examples is None else num_examples, m)


def _key(reply: Reply, ctx: Context, pick) -> str:
    keys = sorted(k for k in ctx.expected if k in reply.arrays and reply.arrays[k].is_floating_point())
    return keys[pick(len(keys))]


def _set(reply: Reply, key: str, value) -> Reply:
    arrays = dict(reply.arrays)
    arrays[key] = value
    return _with(reply, arrays)


def _drop(reply: Reply, key: str) -> Reply:
    return _with(reply, {k: v for k, v in reply.arrays.items() if k != key})


def _poison(reply: Reply, ctx: Context, pick, value: float) -> Reply:
    k = _key(reply, ctx, pick)
    t = reply.arrays[k].clone()
    t.view(-1)[pick(t.numel())] = value
    return _set(reply, k, t)


def _outside(reply: Reply, ctx: Context, pick) -> Reply:
    other = sorted(k for k in ctx.state if k not in ctx.expected and k not in reply.arrays)
    if not other:
        return _set(reply, "bogus.weight", torch.zeros(3))
    k = other[pick(len(other))]
    return _set(reply, k, ctx.state[k].clone())


def _heads(fn: Callable) -> Callable:
    return lambda r, ctx, pick: fn(r, ctx, pick) if ctx.method == "heads" else None


def _fedpft(fn: Callable) -> Callable:
    """A case of FedPFT's APoZ report (rounds that ask for one; never under DP)."""
    return lambda r, ctx, pick: fn(r, ctx, pick) if any(k.startswith("apoz.") for k in r.arrays) else None


def _apoz_key(reply: Reply) -> str:
    return sorted(k for k in reply.arrays if k.startswith("apoz."))[0]


KEPT, ALPHA = "heads.kept", "heads.alpha"

REPLY_CASES: dict[str, Callable] = {
    # tensors
    "tensor missing": lambda r, ctx, pick: _drop(r, _key(r, ctx, pick)),
    "tensor outside the slice": _outside,
    "tensor of another dtype": lambda r, ctx, pick: _set(r, k := _key(r, ctx, pick), r.arrays[k].double()),
    "tensor of another shape": lambda r, ctx, pick: _set(
        r, k := _key(r, ctx, pick), torch.cat([r.arrays[k].flatten(), r.arrays[k].flatten()[:1]])),
    "tensor of absurd size": lambda r, ctx, pick: _set(
        r, _key(r, ctx, pick), torch.zeros(1).expand(1 << 40)),  # a view: no memory behind it
    "NaN in a tensor": lambda r, ctx, pick: _poison(r, ctx, pick, math.nan),
    "inf in a tensor": lambda r, ctx, pick: _poison(r, ctx, pick, -math.inf),
    "tensor as a list": lambda r, ctx, pick: _set(r, k := _key(r, ctx, pick), r.arrays[k].tolist()),
    "tensors not a mapping": lambda r, ctx, pick: _with(r, list(r.arrays.values())),
    # metrics
    "NaN loss": lambda r, ctx, pick: _with(r, loss=math.nan),
    "loss as text": lambda r, ctx, pick: _with(r, loss="0.3"),
    "negative loss": lambda r, ctx, pick: _with(r, loss=-1.0),
    "loss missing": lambda r, ctx, pick: _with(r, metrics={k: v for k, v in r.metrics.items() if k != "loss"}),
    "NaN cost metric": lambda r, ctx, pick: _with(r, bytes_up=math.nan),
    "negative cost metric": lambda r, ctx, pick: _with(r, flops_measured=-5.0),
    "metric as a mapping": lambda r, ctx, pick: _with(r, peak_rss_mb={"a": 1}),
    "metric list with NaN": lambda r, ctx, pick: _with(r, extra=[1.0, math.nan]),
    "metrics not a mapping": lambda r, ctx, pick: Reply(r.arrays, r.num_examples, [1, 2]),
    # counts
    "zero examples": lambda r, ctx, pick: _with(r, num_examples=0),
    "negative examples": lambda r, ctx, pick: _with(r, num_examples=-3),
    "inflated examples": lambda r, ctx, pick: _with(r, num_examples=ctx.size + 1 + pick(10**6)),
    "examples as float": lambda r, ctx, pick: _with(r, num_examples=float(r.num_examples)),
    "examples as text": lambda r, ctx, pick: _with(r, num_examples=str(r.num_examples)),
    "examples as bool": lambda r, ctx, pick: _with(r, num_examples=True),
    "not a reply": lambda r, ctx, pick: {"arrays": r.arrays},
    # heads: keep-mask and Eq. 8 importance
    "heads: mask of floats": _heads(lambda r, ctx, pick: _set(r, KEPT, r.arrays[KEPT].float())),
    "heads: every head kept": _heads(lambda r, ctx, pick: _set(r, KEPT, torch.ones_like(r.arrays[KEPT]))),
    "heads: mask missing": _heads(lambda r, ctx, pick: _drop(r, KEPT)),
    "heads: importance above 1": _heads(lambda r, ctx, pick: _set(r, ALPHA, r.arrays[ALPHA] * 0 + 5.0 * r.arrays[KEPT])),
    "heads: NaN importance": _heads(lambda r, ctx, pick: _set(r, ALPHA, r.arrays[ALPHA] * math.nan)),
    "heads: importance on a pruned head": _heads(lambda r, ctx, pick: _set(r, ALPHA, r.arrays[ALPHA] + 0.5 * ~r.arrays[KEPT])),
    "heads: zero importance on a kept head": _heads(lambda r, ctx, pick: _set(r, ALPHA, r.arrays[ALPHA] * 0)),
    "heads: head_kept metric differs": _heads(lambda r, ctx, pick: _with(r, head_kept=[1, 0])),
    # fedpft: APoZ report of an alignment round
    "fedpft: APoZ above 1": _fedpft(lambda r, ctx, pick: _set(r, k := _apoz_key(r), r.arrays[k] + 2.0)),
    "fedpft: APoZ layer missing": _fedpft(lambda r, ctx, pick: _drop(r, _apoz_key(r))),
    "fedpft: inflated apoz_tokens": _fedpft(lambda r, ctx, pick: _with(r, apoz_tokens=10**12)),
    "fedpft: negative apoz_tokens": _fedpft(lambda r, ctx, pick: _with(r, apoz_tokens=-4)),
    "fedpft: NaN apoz_tokens": _fedpft(lambda r, ctx, pick: _with(r, apoz_tokens=math.nan)),
}


# --------------------------------------------------------------------------------------------
# Broken Flower message contents (RecordDict of fedslice.flower.codec.encode_reply)
# --------------------------------------------------------------------------------------------

def _content_copy(content):
    from flwr.app import RecordDict
    return RecordDict({k: copy.deepcopy(v) for k, v in content.items()})


def _meta(content, **values):
    out = _content_copy(content)
    for k, v in values.items():
        out["fedslice"][k] = v
    return out


def _without(content, key: str):
    out = _content_copy(content)
    del out[key]
    return out


def _bad_array(content, ctx, pick, array):
    out = _content_copy(content)
    keys = sorted(out["arrays"].keys())
    out["arrays"][keys[pick(len(keys))]] = array
    return out


def _oversized(content, ctx, pick):
    from flwr.app import Array
    out = _content_copy(content)
    sent = sum(t.numel() * t.element_size() for t in [*ctx.payload.arrays.values(), *ctx.payload.model.values()])
    out["arrays"]["padding"] = Array(np.zeros((2 * sent + (2 << 20)) // 4, dtype=np.float32))
    return out


def _config_as_arrays(content, ctx, pick):
    from flwr.app import ConfigRecord
    out = _content_copy(content)
    out["arrays"] = ConfigRecord({"x": 1})
    return out


def _garbage_bytes(content, ctx, pick):
    from flwr.app import Array
    return _bad_array(content, ctx, pick, Array(dtype="float32", shape=(3,), stype="numpy.ndarray",
                                                data=b"not an npy file"))


def _text_array(content, ctx, pick):
    from flwr.app import Array
    return _bad_array(content, ctx, pick, Array(np.array(["a", "b"])))


CONTENT_CASES: dict[str, Callable] = {
    "metrics not JSON": lambda c, ctx, pick: _meta(c, metrics="{not json"),
    "metrics JSON is a list": lambda c, ctx, pick: _meta(c, metrics="[1, 2]"),
    "NaN in the metrics JSON": lambda c, ctx, pick: _meta(c, metrics='{"loss": NaN}'),
    "num_examples as text": lambda c, ctx, pick: _meta(c, num_examples="12"),
    "no arrays record": lambda c, ctx, pick: _without(c, "arrays"),
    "no fedslice record": lambda c, ctx, pick: _without(c, "fedslice"),
    "arrays record of configs": _config_as_arrays,
    "bytes that are not an array": _garbage_bytes,
    "array of strings": _text_array,
    "oversized reply": _oversized,
}


# --------------------------------------------------------------------------------------------
# The ServerApp's side: FlowerAdapter over a round of message contents
# --------------------------------------------------------------------------------------------

def _privacy(f: Fitted):
    """The DP accountant of a fitted method's strategy chain (None without DP)."""
    from fedslice.fl.rules import DPFedAvg, find_rule
    rule = find_rule(f.method.strategy, DPFedAvg)
    return rule.privacy if rule is not None else None


class _Grid:
    def __init__(self, nodes):
        self.nodes = nodes

    def get_node_ids(self):
        return list(self.nodes)


class FlowerHarness:
    """:class:`fedslice.flower.strategy.FlowerAdapter` of a fitted method, fed message contents
    as its round-1 replies (FedPFT's re-distillation after the round is left out: it is not
    what is tested, and it changes the method's model)."""

    def __init__(self, f: Fitted, dp: bool = False):
        from flwr.supercore.task_identity import TaskIdentity

        from fedslice.flower.discovery import PartitionMap
        from fedslice.flower.strategy import FlowerAdapter

        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1  # a ServerApp's
        self.f = f
        parts = PartitionMap(len(f.data.partitions))
        parts.nodes = {c: 100 + c for c in range(len(f.data.partitions))}
        f.method.on_round_end = lambda server_round, state, replies: (state, {})
        self.adapter = FlowerAdapter(f.method.cfg, f.method, f.data, parts, round_timeout=5.0)
        self.grid = _Grid(list(parts.nodes.values()))
        self.dp = None
        if dp:  # as the ServerApp runs DP: inside Flower's wrapper (flower/server_app._with_dp)
            from fedslice.flower.strategy import CentralDP
            p = _privacy(f)
            self.dp = CentralDP(self.adapter, p.z, p.clip, p.n)

    def content(self, c: int):
        from fedslice.flower.codec import encode_reply
        return encode_reply(self.f.replies[c])

    def round(self, contents: dict[int, Any]) -> tuple[dict, dict]:
        """The global state after round 1 with these replies, and the round's record."""
        from flwr.app import ConfigRecord, Message

        from fedslice.flower.codec import record_to_state, state_to_record

        self.f.reset()
        self.adapter.record = None
        outer = self.dp or self.adapter
        privacy = _privacy(self.f)
        if privacy is not None:
            privacy.external_noise = self.dp is not None  # Flower adds the noise
        messages = outer.configure_train(1, state_to_record(self.f.state), ConfigRecord(), self.grid)
        for m in messages:
            m.metadata.__dict__["_message_id"] = m.object_id  # as the SuperLink numbers them
        to = {m.metadata.dst_node_id: m for m in messages}
        replies = [Message(content, reply_to=to[100 + c]) for c, content in contents.items()]
        try:
            arrays, _ = outer.aggregate_train(1, replies)
        finally:
            if privacy is not None:
                privacy.external_noise = False
        return record_to_state(arrays), self.adapter.record
