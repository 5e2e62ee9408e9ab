"""The Flower app: records, partitions, the ServerApp loop over an in-process grid (every method),
and end-to-end runs on Flower's Deployment Engine (SuperLink + SuperNodes on loopback)."""

from __future__ import annotations

import functools
import json
import math
import os
import re
import shutil
import signal
import time
import tomllib
from pathlib import Path

import pytest
import torch
from flwr.app import ConfigRecord, Context, Error, Message, RecordDict
from flwr.common.constant import ErrorCode
from flwr.serverapp import Grid
from flwr.supercore.task_identity import TaskIdentity

from fedslice.experiment import validate_config
from fedslice.errors import FedsliceError
from fedslice.api import setup
from fedslice.run.engine import Simulation
from fedslice.fl.strategy import Payload, Reply
from fedslice.flower import codec
from fedslice.flower.client_app import app as client_app
from fedslice.flower.nodes import DeploymentError, node_partition
from fedslice.flower.server_app import run as server_run
from fedslice.flower.settings import RUN_CONFIG_DEFAULTS, RunSettings
from fedslice.methods import METHODS
from fedslice.output import read_run

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def flwr_home(tmp_path, monkeypatch) -> Path:
    """A private Flower home: where a ClientApp called in this process keeps the model its node
    received (``$FLWR_HOME/fedslice-node-state``), never the user's ``~/.flwr``."""
    home = tmp_path / "flwr-home"
    monkeypatch.setenv("FLWR_HOME", str(home))
    return home


# --------------------------------------------------------------------------------------------
# Records and settings
# --------------------------------------------------------------------------------------------

def test_payload_and_reply_round_trip_exactly():
    state = {"a.weight": torch.randn(3, 4), "b.bias": torch.randn(2)}
    payload = Payload(arrays=state, config={"round": 2, "lr": 1e-3, "mask": [[0, 1], None]})
    back, experiment = codec.decode_payload(codec.encode_payload(payload, {"seed": 3}))
    assert experiment == {"seed": 3} and back.config == payload.config
    assert list(back.arrays) == list(state)
    assert all(torch.equal(back.arrays[k], state[k]) for k in state)
    back.arrays["b.bias"] += 1  # writable copies
    reply = Reply(arrays=state, num_examples=7, metrics={"loss": math.nan, "steps": 3})
    content = codec.encode_reply(reply)
    assert content["metrics"]["num-examples"] == 7
    got = codec.decode_reply(content)
    assert got.num_examples == 7 and math.isnan(got.metrics["loss"]) and got.metrics["steps"] == 3


def test_node_partition_checks():
    assert node_partition({"partition-id": 1, "num-partitions": 2}, 2) == 1
    assert node_partition({"partition-id": 0}, 5) == 0
    with pytest.raises(DeploymentError, match="partition-id=2 is out of range.*num_clients=2"):
        node_partition({"partition-id": 2, "num-partitions": 3}, 2)
    with pytest.raises(DeploymentError, match="num-partitions=3 differs"):
        node_partition({"partition-id": 0, "num-partitions": 3}, 2)
    with pytest.raises(DeploymentError, match="no partition-id"):
        node_partition({}, 2)
    with pytest.raises(DeploymentError, match="not an integer"):
        node_partition({"partition-id": "0"}, 2)


def test_run_settings():
    s = RunSettings.from_run_config({"config": "/x.toml", "overrides": "seed=1; federation.rounds=2"},
                                    roots=(Path("/"),))
    assert s.config == Path("/x.toml") and s.overrides == ["seed=1", "federation.rounds=2"]
    assert s.out_dir is None and s.round_timeout == RUN_CONFIG_DEFAULTS["round-timeout"]
    with pytest.raises(FedsliceError, match="no experiment config"):
        RunSettings.from_run_config({})
    with pytest.raises(FedsliceError, match="round-timeout"):
        RunSettings.from_run_config({"config": "/x.toml", "round-timeout": 0}, roots=(Path("/"),))


def test_repo_pyproject_declares_the_same_app():
    from fedslice.flower.deploy import app_pyproject

    ours = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    generated = app_pyproject()["tool"]["flwr"]["app"]
    assert ours["components"] == generated["components"]
    assert ours["config"] == generated["config"] == RUN_CONFIG_DEFAULTS


# --------------------------------------------------------------------------------------------
# The ServerApp over an in-process grid: the ClientApp's handlers called directly
# --------------------------------------------------------------------------------------------

class InProcessGrid(Grid):
    """A Grid whose nodes are the fedslice ClientApp called in this process (no SuperLink)."""

    def __init__(self, node_configs: dict[int, dict], fail: set[int] = frozenset(), keep_state: bool = True):
        self.node_configs, self.fail, self.keep_state = node_configs, set(fail), keep_state
        self._replies: dict[str, Message] = {}
        self._states: dict[int, RecordDict] = {}  # Context.state per node, kept like a SuperNode does
        TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 1, 1, 1

    def set_run(self, run):
        pass

    @property
    def run(self):
        return None

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

    def get_node_ids(self):
        return list(self.node_configs)

    def _handle(self, msg: Message) -> Message:
        nid = msg.metadata.dst_node_id
        if nid in self.fail and msg.metadata.message_type == "train":
            return Message(Error(code=ErrorCode.NODE_UNAVAILABLE, reason="node down"), reply_to=msg)
        state = self._states.setdefault(nid, RecordDict()) if self.keep_state else RecordDict()
        ctx = Context(run_id=1, node_id=nid, node_config=self.node_configs[nid], state=state,
                      run_config={})
        try:
            return client_app(message=msg, context=ctx)
        except Exception as ex:  # what Flower's runtime sends back
            return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION,
                                 reason=f"{type(ex)}:<'{ex}'>"), reply_to=msg)

    def push_messages(self, messages):
        ids = []
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = msg.object_id
            self._replies[msg.object_id] = self._handle(msg)
            ids.append(msg.object_id)
        return ids

    def pull_messages(self, message_ids):
        return [self._replies.pop(i) for i in list(message_ids) if i in self._replies]

    def send_and_receive(self, messages, *, timeout=None):
        return self.pull_messages(self.push_messages(messages))


def _nodes(n: int, offset: int = 100) -> dict[int, dict]:
    return {offset + i: {"partition-id": i, "num-partitions": n} for i in range(n)}


def _write_config(cfg_dict: dict, path: Path) -> Path:
    path.write_text(json.dumps(cfg_dict))
    return path


def _settings(path: Path, out: Path, **kw) -> RunSettings:
    """The run config of ``path`` into ``out``, with the server root their common folder."""
    root = Path(os.path.commonpath([path, out]))
    return RunSettings.from_run_config({"config": str(path), "out-dir": str(out),
                                        "connect-timeout": 5.0, **kw}, roots=(root,))


def _in_process(cfg_dict: dict):
    cfg = validate_config(cfg_dict)
    method, data = setup(cfg)
    state, records, summary = Simulation(cfg, method, data).run()
    return method.exported(state), records, summary  # as saved in a run folder


def _weights(run_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file
    return load_file(str(run_dir / "final_trainable.safetensors"))


def _assert_same_state(a: dict, b: dict, atol: float = 1e-5) -> None:
    assert sorted(a) == sorted(b)
    worst = max((a[k] - b[k]).abs().max().item() for k in a)
    assert worst <= atol, worst


def _method_options(method: str, tmp_path: Path) -> dict:
    """Options that fit the 2-layer tiny model and exercise each method's server work."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"a plot about {i} actors in a film" for i in range(50)))
    distill = {"corpus": str(corpus), "steps": 2, "batch_size": 4, "max_length": 16, "cache_dir": ""}
    return {"fedot": {"bottom_layers": 1, "top_layers": 0, "distill_emulator": True, "distill": distill},
            "fedpft": {"whole_layers": [0], "align_every": 1, "align_steps": 2, "distill": distill},
            }.get(method, {})


@pytest.mark.parametrize("method", sorted(METHODS))
def test_serverapp_matches_in_process_engine(tiny_cfg_dict, tmp_path, method):
    """Same config and seed: the Flower path (records, node map, client seeds, aggregation order)
    gives the in-process engine's weights and selections, for every method."""
    tiny_cfg_dict["method"] = {"name": method, **_method_options(method, tmp_path)}
    tiny_cfg_dict["federation"].update(num_clients=3, clients_per_round=2)
    state, records, _ = _in_process(tiny_cfg_dict)
    path = _write_config(tiny_cfg_dict, tmp_path / "exp.json")
    run_dir = server_run(InProcessGrid(_nodes(3)), _settings(path, tmp_path / "fl"))
    _assert_same_state(_weights(run_dir), state)
    _, metrics, summary = read_run(run_dir)
    assert [m["clients"] for m in metrics] == [r["clients"] for r in records]
    assert [m["train_loss"] for m in metrics] == pytest.approx([r["train_loss"] for r in records])
    assert summary["engine"] == "flower" and summary["failed_nodes"] == 0
    assert {p.name for p in run_dir.iterdir()} >= {"config.json", "metrics.jsonl", "summary.json",
                                                   "partition.json", "final_trainable.safetensors"}


@pytest.mark.parametrize("method,extra", [("raffm+heads", {}), ("fedpetuning", {"lora": {"ranks": [2, 4]}})])
def test_serverapp_runs_planned_clients_as_in_process(tiny_cfg_dict, tmp_path, method, extra):
    """[budgets]: each client's plan (sub-model, sparsity or rank, micro-batches) travels in its
    Flower message; the weights and the plans' records equal the in-process engine's."""
    tiny_cfg_dict["method"] = {"name": method}
    tiny_cfg_dict["federation"].update(num_clients=4, clients_per_round=4, rounds=1, pack=False)
    tiny_cfg_dict["budgets"] = {"tiers": [{"share": 0.5, "memory_mb": 1000},
                                          {"share": 0.5, "memory_mb": 4.05, "upload_mb_per_round": 0.003}]}
    tiny_cfg_dict.update(extra)
    state, records, summary = _in_process(tiny_cfg_dict)
    assert len({json.dumps(g["plan"], sort_keys=True) for g in summary["plans"]}) == 2
    path = _write_config(tiny_cfg_dict, tmp_path / "exp.json")
    run_dir = server_run(InProcessGrid(_nodes(4)), _settings(path, tmp_path / "fl"))
    _assert_same_state(_weights(run_dir), state)
    _, _, fl_summary = read_run(run_dir)
    assert [g["plan"] for g in fl_summary["plans"]] == [g["plan"] for g in summary["plans"]]
    assert [g["measured"]["upload_mb_mean"] for g in fl_summary["plans"]] == \
        pytest.approx([g["measured"]["upload_mb_mean"] for g in summary["plans"]])


def test_serverapp_enforces_flops_budgets_as_in_process(tiny_cfg_dict, tmp_path):
    """A FLOPs budget the planner's prediction misses for some clients (data of many lengths,
    0.8x the whole round): the budget travels in each client's message and cuts the same local
    steps on a Flower node as in process (budgets.enforce_flops); the weights are the same."""
    tiny_cfg_dict["federation"].update(num_clients=4, clients_per_round=4, rounds=2, pack=False)
    tiny_cfg_dict["budgets"] = {"tiers": [{"share": 1.0, "memory_mb": 1e4}], "micro_batches": [1],
                                "checkpointing": False}
    method, _ = setup(validate_config(tiny_cfg_dict))
    whole = next(iter(method.plans.values())).gflops_per_round
    tiny_cfg_dict["budgets"]["tiers"] = [{"share": 1.0, "gflops_per_round": round(0.8 * whole, 6)}]
    state, records, summary = _in_process(tiny_cfg_dict)
    cut = {(r["round"], m["client"]): m["steps_cut"] for r in records for m in r.get("client_metrics", [])}
    assert any(cut.values())
    path = _write_config(tiny_cfg_dict, tmp_path / "exp.json")
    run_dir = server_run(InProcessGrid(_nodes(4)), _settings(path, tmp_path / "fl"))
    _assert_same_state(_weights(run_dir), state)
    _, metrics, fl_summary = read_run(run_dir)
    assert {(r["round"], m["client"]): m["steps_cut"] for r in metrics
            for m in r.get("client_metrics", [])} == cut
    assert fl_summary["plans"][0]["measured"]["steps_cut"] == summary["plans"][0]["measured"]["steps_cut"]


def test_serverapp_holds_memory_budgets_as_in_process(tiny_cfg_dict, tmp_path, monkeypatch):
    """A memory budget the planner's profile underestimates (its packed batch a quarter of the
    clients' rows, as data whose layout the simulation missed would be): the budget and the
    planner's measured step travel in each client's message, a Flower node runs the same steps
    as micro-batches as in process (budgets.enforce_memory), and the weights are the same."""
    import fedslice.methods.plan_batches as planner  # where make_plans reads packed_peak_shape

    monkeypatch.setattr(planner, "packed_peak_shape", lambda *a: (1, 16, 8))
    tiny_cfg_dict["federation"].update(num_clients=4, clients_per_round=4, rounds=1, pack=True)
    tiny_cfg_dict["budgets"] = {"tiers": [{"share": 1.0, "memory_mb": 1e4}], "micro_batches": [1],
                                "checkpointing": False}
    method, _ = setup(validate_config(tiny_cfg_dict))
    tiny_cfg_dict["budgets"]["tiers"] = [
        {"share": 1.0, "memory_mb": round(1.02 * next(iter(method.plans.values())).memory_mb, 4)}]
    state, records, summary = _in_process(tiny_cfg_dict)
    down = {(r["round"], m["client"]): m["plan_downgrades"] for r in records for m in r.get("client_metrics", [])}
    assert any(down.values())
    path = _write_config(tiny_cfg_dict, tmp_path / "exp.json")
    run_dir = server_run(InProcessGrid(_nodes(4)), _settings(path, tmp_path / "fl"))
    _assert_same_state(_weights(run_dir), state)
    _, metrics, fl_summary = read_run(run_dir)
    assert {(r["round"], m["client"]): m["plan_downgrades"] for r in metrics
            for m in r.get("client_metrics", [])} == down
    assert fl_summary["plans"][0]["measured"]["plan_downgrades"] == \
        summary["plans"][0]["measured"]["plan_downgrades"]


@pytest.mark.parametrize("model_type, method", [("llama", "fedpetuning"), ("t5", "fedpetuning"),
                                               ("gpt2", "fedavg")])
def test_serverapp_matches_in_process_engine_on_generative_models(tiny_gen_cfg_dict, tiny_lm_dirs,
                                                                  tmp_path, model_type, method):
    """Generation (BLEU/ROUGE evaluation) through the ServerApp/ClientApp code: the in-process
    engine's weights, selections and dev metrics."""
    tiny_gen_cfg_dict["model"]["name"] = str(tiny_lm_dirs[model_type])
    tiny_gen_cfg_dict["method"]["name"] = method
    tiny_gen_cfg_dict["federation"].update(rounds=2)
    state, records, summary = _in_process(tiny_gen_cfg_dict)
    path = _write_config(tiny_gen_cfg_dict, tmp_path / "exp.json")
    run_dir = server_run(InProcessGrid(_nodes(3)), _settings(path, tmp_path / "fl"))
    _assert_same_state(_weights(run_dir), state)
    _, metrics, fl_summary = read_run(run_dir)
    assert [m["clients"] for m in metrics] == [r["clients"] for r in records]
    assert [m["dev_rougeL"] for m in metrics] == pytest.approx([r["dev_rougeL"] for r in records])
    assert fl_summary["test_bleu"] == pytest.approx(summary["test_bleu"])
    assert fl_summary["primary_metric"] == "rougeL"


@pytest.mark.parametrize("method, reason", [("fedpft", "this worker holds version None"),
                                            ("fedot", "no distilled emulator")])
def test_node_that_lost_its_kept_state_recovers(tiny_cfg_dict, tmp_path, method, reason):
    """What the server sends once (FedPFT's proxy, FedOT's distilled emulator) lives in the node's
    Context.state. A SuperNode whose state is gone (restarted) fails the round that assumes it,
    with a clear reason, and the server sends it whole at the node's next participation."""
    tiny_cfg_dict["method"] = {"name": method, **_method_options(method, tmp_path)}
    tiny_cfg_dict["federation"].update(num_clients=2, clients_per_round=2, min_replies=1, rounds=3)
    path = _write_config(tiny_cfg_dict, tmp_path / "exp.json")
    run_dir = server_run(InProcessGrid(_nodes(2), keep_state=False), _settings(path, tmp_path / "fl"))
    _, metrics, _ = read_run(run_dir)
    reasons = [[e["reason"] for e in m["excluded"]] for m in metrics]
    assert reasons[0] == [] and reasons[2] == []  # round 1: sent whole; round 3: whole again
    assert len(reasons[1]) == 2 and all(reason in r for r in reasons[1])


class TimedGrid(InProcessGrid):
    """Replies that arrive ``delays[i]`` s after the push of message ``i`` (never, for None);
    counts the pulls."""

    def __init__(self, delays: list[float | None]):
        super().__init__({})
        self.delays, self.pulls, self.due = list(delays), 0, {}

    def push_messages(self, messages):
        ids = []
        for msg, delay in zip(messages, self.delays):
            msg.metadata.__dict__["_message_id"] = msg.object_id
            reply = Message(RecordDict(), reply_to=msg)
            self.due[msg.object_id] = (None if delay is None else time.monotonic() + delay, reply)
            ids.append(msg.object_id)
        return ids

    def pull_messages(self, message_ids):
        self.pulls += 1
        now = time.monotonic()
        ready = [i for i in message_ids if i in self.due and self.due[i][0] is not None
                 and self.due[i][0] <= now]
        return [self.due.pop(i)[1] for i in ready]


def _messages(n: int) -> list[Message]:
    return [Message(RecordDict({"c": ConfigRecord({"i": i})}), dst_node_id=100 + i,
                    message_type="query") for i in range(n)]


def test_promptgrid_returns_the_replies_as_they_arrive():
    """Flower 1.41's send_and_receive pulls every 3 s: each round, query and end of run waited up
    to 3 s after its last reply. The ServerApp's grid pulls every REPLY_POLL_S: the same replies
    (all of them, or those in before the timeout), a quarter of a second after the last."""
    from fedslice.flower.server_app import REPLY_POLL_S, PromptGrid

    assert REPLY_POLL_S <= 0.25
    grid, messages = TimedGrid([0.2, 0.6]), _messages(2)
    t0 = time.monotonic()
    replies = list(PromptGrid(grid).send_and_receive(messages, timeout=30))
    waited = time.monotonic() - t0
    assert [r.metadata.reply_to_message_id for r in replies] == [m.object_id for m in messages]
    assert 0.6 <= waited < 0.6 + REPLY_POLL_S + 0.5, waited
    assert 3 <= grid.pulls <= 10
    # a reply that never comes: what is in by the timeout, returned at the timeout
    grid = TimedGrid([0.1, None])
    t0 = time.monotonic()
    replies = list(PromptGrid(grid).send_and_receive(_messages(2), timeout=1.0))
    assert len(replies) == 1 and 1.0 <= time.monotonic() - t0 < 1.5
    # no timeout: until every reply is in
    replies = list(PromptGrid(TimedGrid([0.3, 0.1])).send_and_receive(_messages(2)))
    assert len(replies) == 2
    # the in-memory grid's own interval (0.1 s) is kept
    grid = TimedGrid([])
    grid.pull_interval = 0.1
    assert PromptGrid(grid).poll == 0.1 and PromptGrid(TimedGrid([])).poll == REPLY_POLL_S


def test_failed_node_is_excluded_and_recorded(tiny_cfg_dict, tmp_path):
    tiny_cfg_dict["federation"].update(num_clients=2, clients_per_round=2, min_replies=1)
    path = _write_config(tiny_cfg_dict, tmp_path / "exp.json")
    run_dir = server_run(InProcessGrid(_nodes(2), fail={101}), _settings(path, tmp_path / "fl"))
    _, metrics, summary = read_run(run_dir)
    for m in metrics:
        assert m["excluded"] == [{"client": 1, "reason": "node 101 failed: node down (error code 5)"}]
        assert not m["skipped"] and m["failed_nodes"] == 1
        assert [c["client"] for c in m["client_metrics"]] == [0]
    assert summary["failed_nodes"] == 2 and summary["excluded_replies"] == 2


def test_too_few_replies_keep_the_state(tiny_cfg_dict, tmp_path):
    tiny_cfg_dict["federation"].update(num_clients=2, clients_per_round=2, min_replies=2)
    path = _write_config(tiny_cfg_dict, tmp_path / "exp.json")
    run_dir = server_run(InProcessGrid(_nodes(2), fail={101}), _settings(path, tmp_path / "fl"))
    _, metrics, _ = read_run(run_dir)
    assert all(m["skipped"] for m in metrics)
    cfg = validate_config(tiny_cfg_dict)
    _assert_same_state(_weights(run_dir), setup(cfg)[0].initial_state(), atol=0)


def test_partition_out_of_range_fails_the_run(tiny_cfg_dict, tmp_path):
    tiny_cfg_dict["federation"].update(num_clients=2, clients_per_round=2)
    path = _write_config(tiny_cfg_dict, tmp_path / "exp.json")
    nodes = {100: {"partition-id": 0}, 101: {"partition-id": 7}}
    with pytest.raises(DeploymentError, match="SuperNode 101: DeploymentError: partition-id=7 is out"):
        server_run(InProcessGrid(nodes), _settings(path, tmp_path / "fl"))
    dup = {100: {"partition-id": 0}, 101: {"partition-id": 0}}
    with pytest.raises(DeploymentError, match="both hold partition-id=0"):
        server_run(InProcessGrid(dup), _settings(path, tmp_path / "fl"))
    assert not (tmp_path / "fl").exists() or not any((tmp_path / "fl").iterdir())


def test_no_supernode_fails_within_the_connect_timeout(tiny_cfg_dict, tmp_path):
    path = _write_config(tiny_cfg_dict, tmp_path / "exp.json")
    t0 = time.monotonic()
    with pytest.raises(DeploymentError, match="no SuperNode answered within 1 s"):
        server_run(InProcessGrid({}), _settings(path, tmp_path / "fl", **{"connect-timeout": 1.0}))
    assert time.monotonic() - t0 < 30


def test_bad_config_is_a_fedslice_error(tmp_path):
    with pytest.raises(FedsliceError, match="does not exist"):
        server_run(InProcessGrid(_nodes(2)), _settings(tmp_path / "nope.toml", tmp_path))


# --------------------------------------------------------------------------------------------
# End to end: a SuperLink and SuperNodes on loopback (each test well under two minutes)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("method", ["fedpetuning", "heads", "fedpft"])
def test_serverapp_matches_in_process_engine_on_images(tiny_img_cfg_dict, tmp_path, method):
    """Image classification through the ServerApp/ClientApp code (the ClientApp preprocesses its
    images with the backbone's processor): the in-process engine's weights, selections and dev
    accuracy; FedPFT distils on the images the server keeps apart."""
    options = {"heads": {"sparsity": 0.5},
               "fedpft": {"whole_layers": [0], "align_every": 1, "align_steps": 1,
                          "distill": {"corpus": "server_holdout", "steps": 2, "batch_size": 4,
                                      "cache_dir": ""}}}
    tiny_img_cfg_dict["method"] = {"name": method, **options.get(method, {})}
    tiny_img_cfg_dict["data"]["server_holdout"] = 0.1
    tiny_img_cfg_dict["federation"].update(rounds=2)
    state, records, summary = _in_process(tiny_img_cfg_dict)
    path = _write_config(tiny_img_cfg_dict, tmp_path / "exp.json")
    run_dir = server_run(InProcessGrid(_nodes(3)), _settings(path, tmp_path / "fl"))
    _assert_same_state(_weights(run_dir), state)
    _, metrics, fl_summary = read_run(run_dir)
    assert [m["clients"] for m in metrics] == [r["clients"] for r in records]
    assert [m["dev_accuracy"] for m in metrics] == pytest.approx([r["dev_accuracy"] for r in records])
    assert fl_summary["test_accuracy"] == pytest.approx(summary["test_accuracy"])
    assert json.loads((run_dir / "labels.json").read_text())["names"] == ["left", "right"]


BIN = Path(os.sys.executable).parent
_have_flower = pytest.mark.skipif(not (BIN / "flower-superlink").exists(),
                                  reason="Flower's executables are not installed beside python")


def needs_flower(test, group: str = "deployment"):
    """An end-to-end deployment test (marker ``deployment``: ``-m "not deployment"`` skips).
    Under pytest-xdist (``make test``: ``--dist loadgroup``) every one of them runs on the same
    worker, one after another: their SuperLinks, SuperNodes and ServerApps never compete with
    each other for the cores or for loopback ports. ``group="ray"``: the tests that start Ray
    (Flower's simulation engine, the GPU check's Flower baseline) run on one worker of their
    own, beside the deployment group (they start no SuperNode), so the two longest groups of
    the suite do not run one after the other."""
    return pytest.mark.xdist_group(group)(pytest.mark.deployment(_have_flower(test)))


@pytest.fixture
def started(monkeypatch):
    """Every process the deployment helpers start; the test checks (and, as a safety net,
    ensures) that each one and its descendants are gone afterwards."""
    import psutil

    from fedslice.flower import local

    procs: list = []
    family: list = []
    real_start, real_stop = local.start_process, local.stop_processes

    def start(*args, **kw):
        proc = real_start(*args, **kw)
        procs.append(proc)
        return proc

    def stop(ps, *args, **kw):
        family.extend(c for p in ps for c in local.descendants(p.pid))
        return real_stop(ps, *args, **kw)

    monkeypatch.setattr(local, "start_process", start)
    monkeypatch.setattr(local, "stop_processes", stop)
    yield procs
    leftovers = [p.popen for p in procs if p.alive()] + [c for c in family if c.is_running()]
    for p in procs:
        if p.alive():
            p.popen.kill()
    for c in family:
        try:
            c.kill()
        except psutil.Error:
            pass
    assert not leftovers, f"processes left running: {leftovers}"


#: Seconds between two status checks (``flwr ls``) while a test waits for a run: each check
#: starts the ``flwr`` CLI (1.4 CPU s at load 6, 2026-11-29), and at LocalFederation.wait's 5 s
#: they were ~11% of a deployment test's CPU (the killed node's: 53 -> 47 CPU s at 30 s). Every
#: wait here has a finished hint (the run's result file, or the SuperLink's log line for a run
#: that fails), on which the status is read within a second: the checks in between only catch a
#: run that ends without its hint (the test then fails that much later). At 60 s (was 30 s; the
#: first check comes after it too): a loaded CI machine's deployment waits of 60-200 s read the
#: status 1-3 times besides the hint's, not 2-6 (`flwr ls`: 1.6 CPU-s each, 11 of them in the
#: deployment tests at 30 s, load 4-10, 2026-11-29).
STATUS_POLL_S = 60.0


@pytest.fixture
def rare_status_checks(monkeypatch):
    """``deploy_local``'s wait for its run checks the status every ``STATUS_POLL_S`` (its hint:
    the run's result file)."""
    from fedslice.flower import local

    wait = local.LocalFederation.wait

    def rare(self, run_id, timeout, poll=STATUS_POLL_S, finished_hint=None):
        assert finished_hint is not None, "a wait without a finished hint needs the 5 s checks"
        return wait(self, run_id, timeout, poll, finished_hint)

    monkeypatch.setattr(local.LocalFederation, "wait", rare)


#: The node heartbeat interval (s) of the SuperNodes in the tests that kill one (Flower's is
#: 30 s, its least 10 s): the SuperLink drops a node that sent none for 2 intervals and answers
#: the messages waiting for it with an error. At 30 s the killed node's round waited for its
#: round timeout and the end of the run for the drop (up to 60 s after the kill); at 10 s both
#: end about 20 s after the kill. Only the SuperNode process announces it (its ClientApps keep
#: Flower's task heartbeats).
QUICK_HEARTBEAT_S = 10
QUICK_HEARTBEAT_LINE = f"fedslice tests: node heartbeat every {QUICK_HEARTBEAT_S} s"

QUICK_HEARTBEAT_SITECUSTOMIZE = f'''
import os, sys
if os.path.basename(sys.argv[0]) == "flower-supernode":
    import flwr.supercore.heartbeat as _sender
    import flwr.supernode.fleet_http_connection as _connection
    _sender.HEARTBEAT_DEFAULT_INTERVAL = {QUICK_HEARTBEAT_S}
    _connection.HEARTBEAT_DEFAULT_INTERVAL = {QUICK_HEARTBEAT_S}
    print({QUICK_HEARTBEAT_LINE!r}, file=sys.stderr, flush=True)
'''


@pytest.fixture
def quick_heartbeats(tmp_path, monkeypatch):
    """SuperNodes started in the test announce a node heartbeat of ``QUICK_HEARTBEAT_S``
    (a ``sitecustomize`` on their PYTHONPATH; each SuperNode's log says so: the test checks it
    with :func:`_assert_quick_heartbeats`). Only the start of the processes is patched."""
    from fedslice.flower import local

    site = tmp_path / "quick-heartbeats"
    site.mkdir()
    (site / "sitecustomize.py").write_text(QUICK_HEARTBEAT_SITECUSTOMIZE)
    start = local.start_process

    def start_with_quick_heartbeats(name, argv, env, log_dir):
        if name.startswith("supernode"):
            path = [str(site)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else [])
            env = {**env, "PYTHONPATH": os.pathsep.join(path)}
        return start(name, argv, env, log_dir)

    monkeypatch.setattr(local, "start_process", start_with_quick_heartbeats)


def _assert_quick_heartbeats(fed) -> None:
    nodes = [p for p in fed.processes if p.name.startswith("supernode")]
    assert nodes and all(QUICK_HEARTBEAT_LINE in p.log_path.read_text(errors="replace") for p in nodes)


def _e2e_config(cfg_dict: dict, tmp_path: Path, method: str, rounds: int = 2,
                num_clients: int = 2) -> Path:
    cfg_dict["method"] = {"name": method}
    cfg_dict["federation"].update(num_clients=num_clients, clients_per_round=2, rounds=rounds)
    return _write_config(cfg_dict, tmp_path / f"{method}.json")


def _check_deployed_run(run_dir: Path, cfg_dict: dict, node_logs: bool = True,
                        logs: bool = True) -> None:
    """The in-process engine's weights and selections; with ``logs``, the logs ``fedslice
    deploy`` collects into the run folder (``node_logs``: a SuperNode's too)."""
    state, records, _ = _in_process(cfg_dict)
    _assert_same_state(_weights(run_dir), state)
    _, metrics, summary = read_run(run_dir)
    assert [m["clients"] for m in metrics] == [r["clients"] for r in records]
    assert summary["engine"] == "flower" and summary["failed_nodes"] == 0
    if logs:
        wanted = {"run.log", "superlink.log"} | ({"supernode-0.log"} if node_logs else set())
        assert wanted <= {p.name for p in (run_dir / "flower").iterdir()}


def _run_on(fed, tmp_path: Path, config: Path, timeout: float = 240.0,
            round_timeout: float = 90.0) -> Path:
    """Submit ``config`` to a running federation (``flwr run``), wait for it to complete; its
    run folder."""
    result = tmp_path / "result.txt"
    run_id = _submit(fed, tmp_path, config, **{"result-file": str(result),
                                               "round-timeout": round_timeout,
                                               "connect-timeout": 60.0})
    status = fed.wait(run_id, timeout, STATUS_POLL_S, finished_hint=result.exists)
    assert status == "finished:completed" and result.is_file(), fed.run_log(run_id)[-3000:]
    return Path(result.read_text().strip())


@needs_flower
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_deploy_local_two_supernodes_matches_in_process(tiny_img_cfg_dict, tmp_path, started,
                                                         rare_status_checks):
    """`fedslice deploy local --tls --auth`: SuperLink + 2 SuperNodes, TLS certificates made with
    openssl in the test, SuperNode keys registered with `flwr supernode register`; a round of
    full fine-tuning (fedavg) of a tiny DINOv2 classifying images (each node preprocesses its
    images), finished:completed (checked inside deploy_local), the in-process engine's weights
    and per-class test accuracy. (One federation for what were three tests, a plain 2-round
    deployment, a 1-round TLS + auth one and a 1-round image classification on the loopback
    federation: TLS and authentication change the connection only, and the task is what the
    nodes run over it. The plain connection is every other deployment test's: the proxy
    methods' federation, the killed SuperNodes, the bad input's; deploy_local without TLS:
    test_simulation_engine_matches_in_process. One round: a fedavg node's later rounds are its
    first again, a fresh ClientApp process given the aggregate; later rounds on SuperNodes: the
    proxy methods' deployments, 2 rounds each and state kept on the nodes,
    tests/test_flower_proxy.py; every method's 2 rounds through the ServerApp and ClientApp code:
    test_serverapp_matches_in_process_engine, on images
    test_serverapp_matches_in_process_engine_on_images.)"""
    from fedslice.flower.deploy import deploy_local

    tiny_img_cfg_dict["method"] = {"name": "fedavg"}
    tiny_img_cfg_dict["federation"].update(num_clients=2, clients_per_round=2, rounds=1)
    path = _write_config(tiny_img_cfg_dict, tmp_path / "img.json")
    run_dir = deploy_local(path, nodes=2, out_dir=tmp_path / "runs", tls=True, auth=True,
                           round_timeout=90, connect_timeout=60, timeout=240,
                           workdir=tmp_path / "work")
    assert [p.name for p in started] == ["superlink", "supernode-0", "supernode-1"]
    assert (tmp_path / "work" / "certificates" / "ca.crt").is_file()
    superlink = (tmp_path / "work" / "logs" / "superlink.log").read_text()
    assert "https://127.0.0.1" in superlink
    _check_deployed_run(run_dir, tiny_img_cfg_dict)
    _, _, summary = read_run(run_dir)
    assert summary["task"] == "image_classification" and summary["method"] == "fedavg"
    assert set(summary["test_accuracy_per_class"]) == {"left", "right"}


@functools.partial(needs_flower, group="ray")
def test_simulation_engine_matches_in_process(tiny_gen_cfg_dict, tmp_path, started, rare_status_checks):
    """Flower's simulation engine (Ray, the `simulation` extra): 4 virtual SuperNodes, 2 per
    round, same selections and weights as the in-process engine, on a decoder LLM (tiny LLaMA,
    grouped-query attention) generating: BLEU/ROUGE in the summary. One Ray actor (a CPU for
    Ray, one per client): the virtual nodes' ClientApps run one after another in one process
    (each actor imports torch and fedslice: a second one costs more than it overlaps on CI's 2
    cores). (One federation for what were two tests, this one on the tiny BERT and a 1-round
    decoder deployment on the loopback SuperNodes: the ClientApp code a node runs is the same
    on both engines; what the deployment engine adds, a process per message and the node state
    kept between them, every other deployment test runs: the TLS + auth image run, the proxy
    methods' 2 rounds with state kept on the nodes, the killed SuperNodes. The decoder through
    the ServerApp/ClientApp code, 2 rounds: test_serverapp_matches_in_process_engine_on_generative_models.)"""
    pytest.importorskip("ray")
    from fedslice.flower.deploy import deploy_local

    tiny_gen_cfg_dict["federation"].update(num_clients=4, clients_per_round=2, rounds=2)
    path = _write_config(tiny_gen_cfg_dict, tmp_path / "gen.json")
    run_dir = deploy_local(path, out_dir=tmp_path / "runs", round_timeout=90, connect_timeout=60,
                           timeout=240, workdir=tmp_path / "work",
                           simulation={"client-resources-num-cpus": 1, "init-args-num-cpus": 1})
    assert [p.name for p in started] == ["superlink"]
    _check_deployed_run(run_dir, tiny_gen_cfg_dict, node_logs=False)
    _, _, summary = read_run(run_dir)
    assert summary["primary_metric"] == "rougeL" and "test_bleu" in summary


def _submit(fed, tmp_path: Path, config: Path, **run_config) -> int:
    from fedslice.flower.deploy import _run_config, write_app

    values = {"config": str(config), "out-dir": str(tmp_path / "runs"), **run_config}
    return fed.submit(write_app(tmp_path / "app"), _run_config(tmp_path / "rc.toml", values))


def _task_finished(fed, run_id: int):
    """A cheap ``finished_hint`` for ``fed.wait`` where the run writes no result file (it fails):
    the SuperLink has logged the end of the run's ServerApp task. A hint only: the wait still
    returns the status ``flwr ls`` reports (read within a second of the hint, not at the next
    5 s poll)."""
    pattern = re.compile(rf"Finished task \d+ of run {run_id}\b")
    log_path = fed.log_dir / "superlink.log"
    return lambda: log_path.is_file() and bool(pattern.search(log_path.read_text(errors="replace")))


def _wait_for_line(path: Path, text: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.is_file() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.2)
    raise AssertionError(f"{text!r} not in {path} after {timeout} s")


# A SuperNode killed while it trains (the round ends with the other replies, the failure logged
# and in metrics.jsonl, the run completes): tests/test_flower_secagg.py::
# test_deployed_secure_aggregation_with_a_killed_supernode, whose secure strategy is
# fedslice.flower.strategy.FlowerAdapter (configure_train, _collect, _record) with the key
# stages added. One killed-node deployment for what were two (this module's plain 2-node one,
# ~59 s of a quiet suite, mostly the wait for the SuperLink to drop the node); the plain
# aggregation of a round that lost a node: test_failed_node_is_excluded_and_recorded (in-process
# grid).


@needs_flower
def test_bad_input_fails_the_run_with_a_clear_error(tiny_cfg_dict, tmp_path, started):
    """A config the ServerApp cannot load, then a SuperNode whose partition is out of range: each
    run ends `finished:failed` with the reason in its log (no hang). Then Ctrl-C (or an error)
    inside the federation's block stops the SuperLink and SuperNodes (on this federation: what
    was a test of its own, starting one)."""
    from fedslice.flower.local import LocalFederation

    path = _e2e_config(tiny_cfg_dict, tmp_path, "fedpetuning")
    with pytest.raises(KeyboardInterrupt):
        with LocalFederation(tmp_path / "work", nodes=1, node_config={"partition-id": 5},
                             server_roots=[tmp_path]) as fed:
            missing = _submit(fed, tmp_path, tmp_path / "missing.toml")
            ended = _task_finished(fed, missing)
            assert fed.wait(missing, 120, STATUS_POLL_S, finished_hint=ended) == "finished:failed"
            assert f"config file {tmp_path / 'missing.toml'} does not exist" in fed.run_log(missing)
            bad_node = _submit(fed, tmp_path, path, **{"connect-timeout": 60.0})
            ended = _task_finished(fed, bad_node)
            assert fed.wait(bad_node, 120, STATUS_POLL_S, finished_hint=ended) == "finished:failed"
            assert "partition-id=5 is out of range" in fed.run_log(bad_node)
            assert len(started) == 2 and all(p.alive() for p in started)
            raise KeyboardInterrupt
    assert not any(p.alive() for p in started)  # the fixture also checks their descendants
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def test_deploy_rejects_a_node_count_other_than_num_clients(tiny_cfg_dict, tmp_path, capsys):
    from fedslice.cli import main

    path = _write_config(tiny_cfg_dict, tmp_path / "exp.json")  # num_clients=4
    assert main(["deploy", "local", str(path), "--nodes", "2"]) == 2
    err = capsys.readouterr().err
    assert "--nodes 2 but federation.num_clients=4" in err and "--set federation.num_clients=2" in err


def test_deploy_of_natural_clients_needs_their_number(tiny_lm_dirs, tmp_path, capsys):
    from fedslice.cli import main
    from test_chat import natural_cfg, write_chat_jsonl

    d = natural_cfg(write_chat_jsonl(tmp_path / "chat"), tiny_lm_dirs, tmp_path)
    path = _write_config(d, tmp_path / "exp.json")
    assert main(["deploy", "local", str(path), "--nodes", "5"]) == 2
    assert "--set federation.num_clients=N" in capsys.readouterr().err


def test_sigterm_unwinds_like_ctrl_c():
    from fedslice.interrupt import terminate_as_interrupt

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with terminate_as_interrupt():
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)
    assert signal.getsignal(signal.SIGTERM) is before


@needs_flower
def test_unreachable_superlink_is_a_quick_clear_error(tmp_path):
    """`flwr` exits with 0 and `"success": false` when the SuperLink cannot be reached: reported
    as a DeploymentError within seconds, not a hang."""
    from fedslice.flower.local import LocalFederation, free_ports

    fed = LocalFederation(tmp_path / "work", nodes=1)
    fed.port = free_ports(1)[0]  # nothing listens there
    fed.home.mkdir(parents=True)
    fed._write_connection()
    t0 = time.monotonic()
    with pytest.raises(DeploymentError, match="Connection to the SuperLink is unavailable"):
        fed.status(1)
    assert time.monotonic() - t0 < 60


def test_serverapp_matches_in_process_on_a_chat_task_with_natural_clients(tiny_lm_dirs, tmp_path):
    """A chat round (loss on assistant tokens, answers scored) with one client per user
    (data.partition = 'natural'): the ServerApp over its ClientApps trains the same partitions to
    the same weights as the in-process engine; num_clients comes from the data on both sides."""
    from test_chat import natural_cfg, write_chat_jsonl

    d = natural_cfg(write_chat_jsonl(tmp_path / "chat"), tiny_lm_dirs, tmp_path, clients_per_round=3)
    d["federation"].update(rounds=2)
    state, records, summary = _in_process(d)
    path = _write_config(d, tmp_path / "exp.json")
    run_dir = server_run(InProcessGrid(_nodes(5)), _settings(path, tmp_path / "fl"))
    _assert_same_state(_weights(run_dir), state)
    _, metrics, fl_summary = read_run(run_dir)
    assert [m["clients"] for m in metrics] == [r["clients"] for r in records]
    assert [m["dev_loss"] for m in metrics] == pytest.approx([r["dev_loss"] for r in records])
    assert fl_summary["test_loss"] == pytest.approx(summary["test_loss"])
    assert fl_summary["task"] == "chat"
    part = json.loads((run_dir / "partition.json").read_text())
    assert part["natural_ids"] == ["ann", "bob", "cy", "dee", "eve"]
