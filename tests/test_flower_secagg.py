"""Secure aggregation on Flower: the ServerApp and ClientApp run the SecAgg stages as messages
(over an in-process grid of ClientApps here), with the same weights as the in-process engine,
dropouts after masking recovered and too few survivors skipping the round."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import pytest
import torch
from flwr.app import Array, ArrayRecord, Error, Message
from flwr.common.constant import ErrorCode
from flwr.supercore.inflatable.inflatable_object import get_all_nested_objects

from fedslice.api import setup
from fedslice.experiment import validate_config
from fedslice.output import read_run
from fedslice.run.engine import Simulation
from fedslice.flower.server_app import run as server_run
from tests.conftest import method_options
from tests.test_flower import (STATUS_POLL_S, InProcessGrid, _nodes, _settings, _submit,  # noqa: F401
                               _wait_for_line, _assert_quick_heartbeats, _weights, _write_config,
                               needs_flower, quick_heartbeats, started)


SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(autouse=True)
def flwr_home(tmp_path, monkeypatch) -> Path:
    home = tmp_path / "flwr-home"
    monkeypatch.setenv("FLWR_HOME", str(home))
    return home


class FailingGrid(InProcessGrid):
    """Nodes that fail one stage: ``stages`` node id -> 'train' (its masked vector never
    arrives) or 'unmask' (it vanishes after masking, before revealing its shares)."""

    def __init__(self, node_configs, stages: dict[int, str]):
        super().__init__(node_configs)
        self.stages = stages

    def _handle(self, msg: Message) -> Message:
        want = self.stages.get(msg.metadata.dst_node_id)
        rec = msg.content.config_records.get("fedslice_secagg")
        stage = "train" if msg.metadata.message_type == "train" else (rec or {}).get("stage")
        if want is not None and want == stage:
            return Message(Error(code=ErrorCode.NODE_UNAVAILABLE, reason="node down"), reply_to=msg)
        return super()._handle(msg)


def _cfg(tiny_cfg_dict, rounds=2, **privacy):
    d = copy.deepcopy(tiny_cfg_dict)
    d["federation"].update(num_clients=4, clients_per_round=4, rounds=rounds)
    d["privacy"] = {"secure_aggregation": True, "secagg_clip_range": 0.5, **privacy}
    return d


def _in_process(d):
    cfg = validate_config(d)
    method, data = setup(cfg)
    state, records, _ = Simulation(cfg, method, data).run()
    return method.exported(state), records


NARROW = [{"share": 0.5, "flops": 0.4}, {"share": 0.5, "flops": 0.7}]
#: methods sending slices, sub-models and ranks: each client embeds its own in the round's union
SLICES = {
    "raffm+heads": ({"name": "raffm+heads", "sparsity": 0.5, "width_steps": 4, "tiers": NARROW,
                     "size_weight": 1.0}, {}),
    "fedot": ("fedot", {}),
    "fedpetuning+ranks": ({"name": "fedpetuning", "tiers": [{"share": 0.5, "flops": 0.95},
                                                            {"share": 0.5, "flops": 0.92}]},
                          {"r": 8, "ranks": [2, 4, 8]}),
}


@pytest.mark.parametrize("method", ["fedpetuning", "heads", *SLICES])
def test_secure_serverapp_equals_in_process(tiny_cfg_dict, tmp_path, method):
    """The same seed: the same clients, the same masked sums, the same weights (the masks
    cancel exactly and the quantization is seeded per client and round). Methods sending
    slices (RaFFM's widths with heads and f^p, FedOT's sub-model, LoRA ranks) upload the
    union of the round's slices only, less than the full vector."""
    d = _cfg(tiny_cfg_dict)
    opts, lora = SLICES.get(method, (method, {}))
    if isinstance(opts, str):
        opts = {"name": opts, **method_options(opts, tmp_path)}
    d["method"] = opts
    d["lora"] = {**d["lora"], **lora}
    path = _write_config(d, tmp_path / "exp.json")
    run_dir = server_run(InProcessGrid(_nodes(4)), _settings(path, tmp_path / "fl"))
    _, metrics, _ = read_run(run_dir)
    want, records = _in_process(d)
    got = _weights(run_dir)
    assert sorted(got) == sorted(want)
    assert max((got[k] - want[k]).abs().max().item() for k in got) <= 1e-6
    for m, r in zip(metrics, records):
        assert m["clients"] == r["clients"] and not m["skipped"]
        assert m["secagg_clients"] == 4 and m["secagg_recovered"] == 0
        # the key stages' seconds, what a secure round adds (the round's time includes them);
        # every client's keys were drawn ahead (partition query, last unmasking): no setup
        stages = [m[f"secagg_{s}_s"] for s in ("share_keys", "unmask")]
        assert all(0 < t for t in stages) and sum(stages) < m["round_time_s"]
        assert m["secagg_setup_s"] == 0 and m["secagg_keys_ahead"] == 4
        assert m["secagg_upload_bytes"] == r["secagg_upload_bytes"]
        assert m["secagg_single_holder"] == r["secagg_single_holder"]
        assert all(c["bytes_up"] == m["secagg_upload_bytes"] for c in m["client_metrics"])
        by = lambda ms: {c["client"]: c for c in ms}  # noqa: E731
        for c, mc in by(m["client_metrics"]).items():
            rc = by(r["client_metrics"])[c]
            assert mc["loss"] == pytest.approx(rc["loss"]) and mc["bytes_up_plain"] == rc["bytes_up_plain"]
            assert "head_importance" not in mc and "head_importance" not in rc
        if method in ("raffm+heads", "fedpetuning+ranks"):
            assert m["secagg_upload_bytes"] < m["secagg_full_upload_bytes"]


def test_node_lost_after_masking_is_recovered(tiny_cfg_dict, tmp_path):
    """A node that vanishes after sending its masked vector (before the unmasking) is still in
    the sum: the others' shares rebuild its private mask; the weights are those of the run
    without the failure. A node whose vector never arrives is dead: its pairwise masks are
    removed and the round completes with the others."""
    d = _cfg(tiny_cfg_dict, rounds=1, secagg_threshold=2)
    path = _write_config(d, tmp_path / "exp.json")
    want, _ = _in_process(d)
    run_dir = server_run(FailingGrid(_nodes(4), {102: "unmask"}), _settings(path, tmp_path / "a"))
    _, metrics, _ = read_run(run_dir)
    got = _weights(run_dir)
    assert max((got[k] - want[k]).abs().max().item() for k in got) <= 1e-6
    assert metrics[0]["secagg_clients"] == 4
    run_dir = server_run(FailingGrid(_nodes(4), {101: "train"}), _settings(path, tmp_path / "b"))
    _, metrics, _ = read_run(run_dir)
    m = metrics[0]
    assert not m["skipped"] and m["secagg_clients"] == 3 and m["secagg_recovered"] == 1
    assert [e["client"] for e in m["excluded"]] == [1]
    init = setup(validate_config(d))[0].initial_state()
    assert any(not torch.equal(_weights(run_dir)[k], init[k]) for k in init)


class WireGrid(InProcessGrid):
    """Keeps the content of every TRAIN reply by node; a node in ``cut`` sends its masked vector
    one number short (a reply that fails the protocol's checks)."""

    def __init__(self, node_configs, cut: frozenset[int] = frozenset()):
        super().__init__(node_configs)
        self.cut, self.train_replies = cut, {}

    def _handle(self, msg: Message) -> Message:
        reply = super()._handle(msg)
        nid = msg.metadata.dst_node_id
        if msg.metadata.message_type == "train" and not reply.has_error():
            if nid in self.cut:
                a = reply.content["arrays"]["masked"].numpy()
                reply.content["arrays"] = ArrayRecord({"masked": Array(a[:-1].copy())})
            self.train_replies[nid] = reply.content
        return reply


def test_masked_vector_travels_as_one_array(tiny_cfg_dict, tmp_path):
    """Each TRAIN reply carries its masked vector as one flat array, so a reply is a handful of
    Flower objects (each pushed and pulled by a request of its own) whatever the number of
    tensors; the server splits it by the round's layout. A vector of the wrong length is refused
    naming its client, and the round completes with the others (its masks removed with the
    survivors' shares)."""
    d = _cfg(tiny_cfg_dict, rounds=1, secagg_threshold=2)
    path = _write_config(d, tmp_path / "exp.json")
    grid = WireGrid(_nodes(4), cut=frozenset({102}))
    run_dir = server_run(grid, _settings(path, tmp_path / "fl"))
    _, metrics, _ = read_run(run_dir)
    m = metrics[0]
    assert sorted(grid.train_replies) == [100, 101, 102, 103]
    for nid, content in grid.train_replies.items():
        assert list(content.array_records) == ["arrays"] and list(content["arrays"]) == ["masked"]
        size = content["arrays"]["masked"].numpy().size
        assert size == m["secagg_upload_bytes"] // 4 - (nid == 102)
        assert len(get_all_nested_objects(content)) <= 8
    # the layout holds many more arrays than the reply's objects (update, weight per tensor)
    assert 2 * len(setup(validate_config(d))[0].strategy.trainable) + 1 > 8
    assert not m["skipped"] and m["secagg_clients"] == 3 and m["secagg_recovered"] == 1
    (bad,) = m["excluded"]
    assert bad["client"] == 2 and re.search(r"client 2: its masked vector holds \d+ numbers",
                                             bad["reason"])


def test_too_few_survivors_skip_the_round(tiny_cfg_dict, tmp_path):
    d = _cfg(tiny_cfg_dict, rounds=1, secagg_threshold=3)
    path = _write_config(d, tmp_path / "exp.json")
    run_dir = server_run(FailingGrid(_nodes(4), {101: "train", 102: "unmask"}),
                         _settings(path, tmp_path / "fl"))
    _, metrics, _ = read_run(run_dir)
    assert metrics[0]["skipped"] and "fewer than privacy.secagg_threshold=3" in \
        metrics[0]["secagg_skipped"]
    init = setup(validate_config(d))[0].initial_state()
    got = _weights(run_dir)
    assert all(torch.equal(got[k], init[k]) for k in init)


@needs_flower
def test_deployed_secure_aggregation_with_a_killed_supernode(tiny_cfg_dict, tmp_path, started,
                                                             quick_heartbeats):
    """SuperLink + 3 SuperNodes, secure aggregation with threshold 2, a method sending slices
    (RaFFM's widths with heads, no client the whole model): a SuperNode killed while it trains
    (it has shared its keys; its masked vector never arrives) is recovered from the two others'
    shares, the round completes with their sum, each uploading the union of the round's slices
    only, and the run finishes. Also the suite's killed-SuperNode deployment (the secure
    strategy is FlowerAdapter with the key stages): the SuperLink drops the silent node (node
    heartbeats every 10 s) and the round ends before its timeout, the failure in the run's log
    and in metrics.jsonl with its reason, the summary counting one failed node."""
    from fedslice.flower.local import LocalFederation

    d = copy.deepcopy(tiny_cfg_dict)
    d["federation"].update(num_clients=3, clients_per_round=3, rounds=1)
    d["method"] = SLICES["raffm+heads"][0]
    d["privacy"] = {"secure_aggregation": True, "secagg_threshold": 2, "secagg_clip_range": 0.5}
    path = _write_config(d, tmp_path / "exp.json")
    result = tmp_path / "result.txt"
    with LocalFederation(tmp_path / "work", nodes=3, server_roots=[tmp_path]) as fed:
        run_id = _submit(fed, tmp_path, path, **{"round-timeout": 90.0, "connect-timeout": 60.0,
                                                 "result-file": str(result)})
        victim = fed.processes[3]  # supernode-2
        _wait_for_line(victim.log_path, "Receiving: train message", timeout=180)
        fed.kill_supernode(2)
        assert fed.wait(run_id, 300, STATUS_POLL_S, finished_hint=result.exists) == "finished:completed"
        run_log = fed.run_log(run_id)
        _assert_quick_heartbeats(fed)  # the dead node dropped ~20 s after the kill, not 60 s
    # the usual reason is the SuperLink's verdict on the silent node; a busy machine can reach
    # the round timeout first
    reason = r"(no reply within 90 s|node \d+ failed: .+)"
    assert re.search(rf"round 1: client 2 excluded: {reason}", run_log)
    (run_dir,) = (tmp_path / "runs").iterdir()
    _, metrics, summary = read_run(run_dir)
    m = metrics[0]
    assert not m["skipped"] and m["secagg_clients"] == 2 and m["secagg_recovered"] == 1
    assert [e["client"] for e in m["excluded"]] == [2]
    assert re.fullmatch(reason, m["excluded"][0]["reason"])
    assert summary["failed_nodes"] == 1
    assert sorted(c["client"] for c in m["client_metrics"]) == [0, 1]
    assert all(c["bytes_up"] == m["secagg_upload_bytes"] for c in m["client_metrics"])
    assert m["secagg_upload_bytes"] < m["secagg_full_upload_bytes"]
    init = setup(validate_config(d))[0].initial_state()
    assert any(not torch.equal(_weights(run_dir)[k], init[k]) for k in init)


class CountingGrid(FailingGrid):
    """Records each message it handles: (type, stage or 'partition'/'end', round asked ahead)."""

    def __init__(self, node_configs, stages: dict[int, str] | None = None):
        super().__init__(node_configs, stages or {})
        self.log: list[tuple[int, str, str, int | None]] = []

    def _handle(self, msg: Message) -> Message:
        recs = msg.content.config_records
        stage = (recs["fedslice_secagg"]["stage"] if "fedslice_secagg" in recs and
                 msg.metadata.message_type == "query" else msg.metadata.message_type)
        if "fedslice" in recs and msg.metadata.message_type == "query":
            stage = "end" if "end-run" in recs["fedslice"] else "partition"
        ahead = recs.get("fedslice_secagg_ahead")
        self.log.append((msg.metadata.dst_node_id, msg.metadata.group_id, stage,
                         None if ahead is None else int(ahead["round"])))
        return super()._handle(msg)

    def by_round(self, group: str) -> list[tuple[str, int | None]]:
        return sorted((s, a) for _, g, s, a in self.log if g == group)


def test_keys_drawn_ahead_spare_the_setup_messages(tiny_cfg_dict, tmp_path):
    """Stage 0 rides on queries the nodes answer anyway: the partition query draws round 1's
    keys, round 1's unmasking round 2's; the last round's unmasking asks for none. No setup
    message is sent; the weights are the in-process run's."""
    d = _cfg(tiny_cfg_dict, rounds=2)
    path = _write_config(d, tmp_path / "exp.json")
    grid = CountingGrid(_nodes(4))
    run_dir = server_run(grid, _settings(path, tmp_path / "fl"))
    assert [a for _, _, s, a in grid.log if s == "partition"] == [1] * 4
    assert grid.by_round("1") == [("share_keys", None)] * 4 + [("train", None)] * 4 + \
        [("unmask", 2)] * 4
    assert grid.by_round("2") == [("share_keys", None)] * 4 + [("train", None)] * 4 + \
        [("unmask", None)] * 4
    _, metrics, _ = read_run(run_dir)
    assert [m["secagg_keys_ahead"] for m in metrics] == [4, 4]
    want, _ = _in_process(d)
    got = _weights(run_dir)
    assert max((got[k] - want[k]).abs().max().item() for k in got) <= 1e-6


def test_clients_without_keys_ahead_get_a_setup(tiny_cfg_dict, tmp_path):
    """2 of 4 clients per round: a client that was not in the previous round (or whose
    unmasking answer was lost) gets a setup message, the others none; the weights are the
    in-process run's."""
    d = _cfg(tiny_cfg_dict, rounds=3, secagg_threshold=2)
    d["federation"]["clients_per_round"] = 2
    path = _write_config(d, tmp_path / "exp.json")
    grid = CountingGrid(_nodes(4))
    run_dir = server_run(grid, _settings(path, tmp_path / "fl"))
    _, metrics, _ = read_run(run_dir)
    for prev, m in zip([None, *metrics], metrics):
        kept = set(m["clients"]) & set(prev["clients"]) if prev else set(m["clients"])
        setups = sorted(n - 100 for n, g, s, _ in grid.log if g == str(m["round"]) and s == "setup")
        assert setups == sorted(set(m["clients"]) - kept)
        assert m["secagg_keys_ahead"] == len(kept) and not m["skipped"]
        assert (m["secagg_setup_s"] > 0) == bool(setups)
    assert any(s == "setup" for _, _, s, _ in grid.log)  # the selection moved at least once
    want, _ = _in_process(d)
    got = _weights(run_dir)
    assert max((got[k] - want[k]).abs().max().item() for k in got) <= 1e-6

    # a node that vanished after masking in round 1 holds no keys for round 2: a setup for it
    d = _cfg(tiny_cfg_dict, rounds=2, secagg_threshold=2)
    path = _write_config(d, tmp_path / "exp2.json")
    grid = CountingGrid(_nodes(4), {102: "unmask"})
    run_dir = server_run(grid, _settings(path, tmp_path / "fl2"))
    assert [(n, s) for n, g, s, _ in grid.log if g == "2" and s == "setup"] == [(102, "setup")]
    _, metrics, _ = read_run(run_dir)
    assert [m["secagg_keys_ahead"] for m in metrics] == [4, 3]
    assert [m["secagg_clients"] for m in metrics] == [4, 4]
    want, _ = _in_process(d)
    got = _weights(run_dir)
    assert max((got[k] - want[k]).abs().max().item() for k in got) <= 1e-6


def test_keys_ahead_serve_their_round_only():
    """A node's keys drawn ahead serve the key sharing of their round only: another round's
    stage fails with a clear reason; a setup of that round supersedes them."""
    from flwr.app import ConfigRecord, Context, RecordDict
    from flwr.supercore.task_identity import TaskIdentity

    from fedslice.flower.secagg_stages import AHEAD, NEXT, SECAGG, answer_ahead, client_stage

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 7, 1  # as a ClientApp's
    ctx = Context(run_id=1, node_id=7, node_config={}, state=RecordDict(), run_config={})

    def msg(records):
        return Message(RecordDict(records), dst_node_id=7, message_type="query")

    keys = answer_ahead(msg({AHEAD: ConfigRecord({"round": 3})}), ctx, 0)
    assert keys["round"] == 3 and ctx.state.config_records[NEXT]["round"] == 3
    peers = {"nids": [0], "pk1": [keys["pk1"]], "pk2": [keys["pk2"]], "threshold": 1}
    with pytest.raises(RuntimeError, match="before this node's setup"):  # round 2: not its keys
        client_stage(msg({SECAGG: ConfigRecord({"stage": "share_keys", "round": 2, **peers})}), ctx, 0)
    client_stage(msg({SECAGG: ConfigRecord({"stage": "share_keys", "round": 3, **peers})}), ctx, 0)
    assert ctx.state.config_records[SECAGG]["round"] == 3 and NEXT not in ctx.state.config_records
    with pytest.raises(RuntimeError, match="stage 'unmask' of round 4: this node holds the keys "
                                           "of round 3"):
        client_stage(msg({SECAGG: ConfigRecord({"stage": "unmask", "round": 4, "active": [0],
                                                "dead": [], "threshold": 1})}), ctx, 0)
    answer_ahead(msg({AHEAD: ConfigRecord({"round": 4})}), ctx, 0)
    reply = client_stage(msg({SECAGG: ConfigRecord({"stage": "setup", "round": 4})}), ctx, 0)
    assert NEXT not in ctx.state.config_records  # superseded by the setup of its round
    assert ctx.state.config_records[SECAGG]["pk1"] == reply.content[SECAGG]["pk1"]


def test_key_stages_never_import_torch():
    """Flower starts a fresh ClientApp process per message: loading the ClientApp module and
    answering the partition query and every key stage imports neither torch nor transformers
    nor fedslice's training code (the TRAIN message alone does)."""
    import subprocess
    import sys

    code = """
import sys
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.supercore.task_identity import TaskIdentity
from fedslice.flower.client_app import app, query
TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 7, 1
ctx = Context(run_id=1, node_id=7, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
def ask(records):
    return query(Message(RecordDict(records), dst_node_id=7, message_type="query"), ctx)
r = ask({"fedslice": ConfigRecord({"num_clients": 2}),
         "fedslice_secagg_ahead": ConfigRecord({"round": 1})})
k = r.content["fedslice_secagg_ahead"]
stage = lambda **f: ask({"fedslice_secagg": ConfigRecord({"num_clients": 2, "round": 1, **f})})
stage(stage="share_keys", nids=[0], pk1=[k["pk1"]], pk2=[k["pk2"]], threshold=1)
stage(stage="unmask", active=[0], dead=[], threshold=1)
stage(stage="setup")
heavy = [m for m in sys.modules if m.split(".")[0] in ("torch", "transformers", "peft")
         or m.startswith(("fedslice.methods", "fedslice.models", "fedslice.run", "fedslice.fl.rules"))]
print("HEAVY", heavy)
"""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "HEAVY []" in out.stdout, out.stdout
