"""federation.round_policy = 'deadline' on a real local Flower federation: a SuperNode
throttled to be slow (node config ``throttle-s-per-step``) misses the round deadline and its
reply is dropped, as the in-process engine drops a simulated late reply (tests/test_time.py).
What Flower does not run yet is refused before anything is loaded."""

from __future__ import annotations

import json
import threading
import time

import pytest

from fedslice.errors import ConfigError
from fedslice.experiment import validate_config
from fedslice.flower.client_app import THROTTLE
from fedslice.flower.server_app import reply_wait
from fedslice.output import read_run
from fedslice.flower.server_app import PromptGrid
from fedslice.flower.server_app import run as server_run
from test_flower import InProcessGrid, _settings


@pytest.mark.parametrize("change, message", [
    ({"devices": {"gflops_per_s": 1.0}}, "[devices]"),
    ({"federation": {"round_policy": "deadline", "round_deadline_s": 5.0, "overselect": 0.5}},
     "federation.overselect = 0.5"),
])
def test_what_flower_does_not_run_yet_is_refused(tiny_cfg_dict, change, message):
    d = json.loads(json.dumps(tiny_cfg_dict))
    for k, v in change.items():
        d[k] = {**d.get(k, {}), **v}
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        reply_wait(validate_config(d), 90.0)


def test_the_deadline_is_the_reply_timeout_on_flower(tiny_cfg_dict):
    d = json.loads(json.dumps(tiny_cfg_dict))
    assert reply_wait(validate_config(d), 90.0) == 90.0
    d["federation"].update(round_policy="deadline", round_deadline_s=12.5)
    assert reply_wait(validate_config(d), 90.0) == 12.5


class ThrottledGrid(InProcessGrid):
    """The ClientApp in this process, a throttled node's messages answered from a thread (its
    reply lands in the grid when its ClientApp returns, sleep included), so the ServerApp's
    real wait (:class:`PromptGrid`) sees it late; the other nodes answer as they are pushed."""

    def push_messages(self, messages):
        ids, slow = [], []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = msg.object_id
            ids.append(msg.object_id)
            if self.node_configs[msg.metadata.dst_node_id].get(THROTTLE):
                slow.append(msg)
            else:
                self._replies[msg.object_id] = self._handle(msg)
        for msg in slow:
            threading.Thread(target=self._answer, args=(msg,), daemon=True).start()
        return ids

    def _answer(self, msg):
        self._replies[msg.object_id] = self._handle(msg)


def test_deadline_drops_a_throttled_nodes_reply(tiny_cfg_dict, tmp_path):
    """The ServerApp's round waits the deadline (real seconds) through the Message API's reply
    timeout; node 1, throttled (node config), answers after it: dropped and said why."""
    d = json.loads(json.dumps(tiny_cfg_dict))
    d["federation"].update(num_clients=2, clients_per_round=2, rounds=1, round_policy="deadline",
                           round_deadline_s=4.0)
    path = tmp_path / "exp.json"
    path.write_text(json.dumps(d))
    nodes = {100: {"partition-id": 0, "num-partitions": 2},
             101: {"partition-id": 1, "num-partitions": 2, THROTTLE: 3.0}}
    run_dir = server_run(PromptGrid(ThrottledGrid(nodes), poll=0.05), _settings(path, tmp_path / "fl"))
    _, metrics, _ = read_run(run_dir)
    (record,) = metrics
    assert record["clients"] == [0, 1]
    assert [m["client"] for m in record["client_metrics"] if m["used"]] == [0]
    assert record["excluded"] == [{"client": 1, "reason": "no reply within the 4 s round "
                                   "deadline (federation.round_deadline_s)"}]


class DelayedGrid(InProcessGrid):
    """Every node's ClientApp in this process, one message at a time, each train reply landing
    in the grid ``delay[node]`` seconds after the ClientApp returned (a thread per message):
    nodes of different speeds behind the Message API's push and pull."""

    def __init__(self, node_configs: dict[int, dict], delay: dict[int, float]):
        super().__init__(node_configs)
        self.delay, self.lock = delay, threading.Lock()

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = msg.object_id
            ids.append(msg.object_id)
            if msg.metadata.message_type != "train":  # the partition query, the run's end
                with self.lock:
                    self._replies[msg.object_id] = self._handle(msg)
                continue
            threading.Thread(target=self._answer, args=(msg,), daemon=True).start()
        return ids

    def _answer(self, msg):
        with self.lock:  # one ClientApp call at a time (they share this process's model)
            reply = self._handle(msg)
        time.sleep(self.delay.get(msg.metadata.dst_node_id, 0.0))
        self._replies[msg.object_id] = reply


def test_async_on_flower_pushes_and_pulls_per_node(tiny_cfg_dict, tmp_path):
    """FedBuff on the ServerApp: two nodes train at once (concurrency 2), every reply is a
    version (buffer 1); the slow node's replies come in stale and are recorded as such."""
    d = json.loads(json.dumps(tiny_cfg_dict))
    d["federation"].update(num_clients=2, clients_per_round=1, rounds=6, round_policy="async",
                           concurrency=2, buffer_size=1)
    d["evaluation"] = {"every": 3, "batch_size": 32}
    path = tmp_path / "exp.json"
    path.write_text(json.dumps(d))
    grid = DelayedGrid({100: {"partition-id": 0, "num-partitions": 2},
                        101: {"partition-id": 1, "num-partitions": 2}}, {100: 0.4, 101: 1.0})
    run_dir = server_run(grid, _settings(path, tmp_path / "fl"))
    _, metrics, summary = read_run(run_dir)
    assert [r["round"] for r in metrics] == list(range(1, 7)) and summary["engine"] == "flower"
    seen = [(m["client"], m["staleness"], r["round"] - 1 - m["base_version"])
            for r in metrics for m in r["client_metrics"]]
    assert all(s == expected for _, s, expected in seen)
    assert {c for c, _, _ in seen} == {0, 1}  # both nodes' replies were aggregated
    assert max(s for c, s, _ in seen if c == 1) >= 1  # the slow node's, stale
    assert all(len(r["clients"]) == 1 and not r["skipped"] for r in metrics)
