"""Deployment hygiene: run-config paths stay under the operator's server root, private keys are
0600, SuperNodes remove a run's model files when it ends and cap what they keep."""

from __future__ import annotations

import os
import shutil
import stat
import time
from pathlib import Path

import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict

from fedslice.errors import FedsliceError
from fedslice.flower.client_app import KEPT_MODEL, prune_runs, query, store_kept
from fedslice.flower.nodes import END_RUN
from fedslice.flower.settings import SERVER_ROOT_ENV, RunSettings, server_roots

from test_flower import InProcessGrid, _nodes, _write_config, flwr_home  # noqa: F401


def test_run_config_paths_outside_the_server_root_are_refused_naming_the_key(tmp_path, monkeypatch):
    root = tmp_path / "srv"
    (root / "configs").mkdir(parents=True)
    (root / "escape").symlink_to(tmp_path)  # a link inside the root that points out of it
    monkeypatch.chdir(root)
    ok = RunSettings.from_run_config({"config": "configs/exp.toml", "out-dir": "runs",
                                      "result-file": str(root / "result.txt"),
                                      "resume": "runs/.x.partial-1"}, roots=(root,))
    assert ok.config == root / "configs" / "exp.toml" and ok.out_dir == str(root / "runs")
    for key, value in [("config", "/etc/passwd"), ("out-dir", "../elsewhere"),
                       ("result-file", "escape/result.txt"), ("resume", "/tmp"),
                       ("config", "~/exp.toml/../../../../etc/passwd")]:
        with pytest.raises(FedsliceError, match=rf"run config {key}=.* outside the server root "
                                                rf"{root}.*{SERVER_ROOT_ENV}"):
            RunSettings.from_run_config({"config": "configs/exp.toml", key: value}, roots=(root,))
    with pytest.raises(FedsliceError, match="must be a path"):
        RunSettings.from_run_config({"config": 3}, roots=(root,))
    # the operator's setting: FEDSLICE_SERVER_ROOT (several roots), else the working directory
    assert server_roots() == (root.resolve(),)
    monkeypatch.setenv(SERVER_ROOT_ENV, f"{tmp_path / 'a'}{os.pathsep}{tmp_path / 'b'}")
    assert server_roots() == ((tmp_path / "a").resolve(), (tmp_path / "b").resolve())
    RunSettings.from_run_config({"config": str(tmp_path / "b" / "x.toml")})
    with pytest.raises(FedsliceError, match="config="):
        RunSettings.from_run_config({"config": str(root / "configs" / "exp.toml")})


def test_a_submitted_run_config_is_held_to_the_operators_root(tmp_path, monkeypatch):
    """As the ServerApp parses a submitted run config (no ``roots`` argument: the operator's
    FEDSLICE_SERVER_ROOT): a config, out-dir, result-file or resume outside it is refused, where
    before issue 24 any path on the server host was taken as given."""
    root = tmp_path / "srv"
    root.mkdir()
    monkeypatch.setenv("FEDSLICE_SERVER_ROOT", str(root))
    inside = str(root / "exp.toml")
    assert RunSettings.from_run_config({"config": inside}).config == Path(inside).resolve()
    for key, value in [("config", "/etc/passwd"), ("out-dir", str(tmp_path)),
                       ("result-file", str(tmp_path / "result.txt")), ("resume", "/tmp")]:
        with pytest.raises(FedsliceError, match=rf"run config {key}=.* outside the server root"):
            RunSettings.from_run_config({"config": inside, key: value})


def test_the_configs_output_dir_is_checked_when_it_places_the_run_folder(tiny_cfg_dict, tmp_path,
                                                                          monkeypatch):
    """Without out-dir the config's output.dir (which `overrides` can set) decides where the run
    folder goes: outside the root it is refused before anything is trained."""
    from fedslice.flower.server_app import run as server_run

    root = tmp_path / "srv"
    root.mkdir()
    monkeypatch.setenv("FEDSLICE_SERVER_ROOT", str(root))  # as the operator sets it
    path = _write_config(tiny_cfg_dict, root / "exp.json")
    settings = RunSettings.from_run_config({"config": str(path), "overrides":
                                            f"output.dir={tmp_path / 'out'}"})
    with pytest.raises(FedsliceError, match=r"output.dir \(of the experiment config\)=.* outside"):
        server_run(InProcessGrid(_nodes(4)), settings)
    assert not (tmp_path / "out").exists()


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_every_private_key_is_0600(tmp_path):
    from fedslice.flower.local import make_certificates, make_node_key

    old = os.umask(0o022)
    try:
        certs = make_certificates(tmp_path / "certificates")
        private, public = make_node_key(tmp_path / "keys", "supernode-0")
    finally:
        os.umask(old)
    for key in (certs.key, tmp_path / "certificates" / "ca.key", private):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
        assert key.read_bytes().strip()  # openssl wrote the key into the 0600 file
    assert stat.S_IMODE(public.stat().st_mode) == 0o644


_UMASK_OPENSSL = """#!{python}
# openssl, except that its -out file is written as most programs write: created with the mode the
# umask leaves (0644 under 022), an existing file's mode kept
import os, subprocess, sys
args = sys.argv[1:]
out = args[args.index("-out") + 1] if "-out" in args else None
if out:
    args[args.index("-out") + 1] = out + ".real"
code = subprocess.run([{real!r}, *args]).returncode
if out and code == 0:
    data = open(out + ".real", "rb").read()
    os.unlink(out + ".real")
    with open(out, "wb") as f:
        f.write(data)
sys.exit(code)
"""


@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs openssl")
def test_tls_keys_are_0600_whatever_mode_openssl_gives_its_output(tmp_path, monkeypatch):
    """The 0600 of ca.key and server.key is fedslice's doing, not openssl's: OpenSSL 3 creates
    an ``ecparam -genkey`` output 0600 itself, but with an openssl that writes its output as the
    umask allows (emulated here) the keys are still 0600."""
    import sys

    from fedslice.flower.local import make_certificates

    wrapper = tmp_path / "bin" / "openssl"
    wrapper.parent.mkdir()
    wrapper.write_text(_UMASK_OPENSSL.format(python=sys.executable, real=shutil.which("openssl")))
    wrapper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{wrapper.parent}{os.pathsep}{os.environ['PATH']}")
    old = os.umask(0o022)
    try:
        certs = make_certificates(tmp_path / "certificates")
    finally:
        os.umask(old)
    for key in (certs.key, tmp_path / "certificates" / "ca.key"):
        assert stat.S_IMODE(key.stat().st_mode) == 0o600, key
        assert key.read_bytes().startswith(b"-----BEGIN EC PRIVATE KEY")
    assert stat.S_IMODE(certs.ca.stat().st_mode) == 0o644  # the wrapper did write with the umask


def _ctx(run_id: int, node_id: int = 3, **node_config) -> Context:
    return Context(run_id=run_id, node_id=node_id, node_config=node_config, state=RecordDict(),
                   run_config={})


def test_supernode_caps_the_runs_it_keeps_and_removes_a_run_at_its_end(tmp_path, flwr_home, monkeypatch):
    import torch
    from flwr.supercore.task_identity import TaskIdentity

    # a Message takes its run id from the process's task identity, which a ServerApp sets (here:
    # set, not left to whichever earlier test of this worker process set it)
    for name, value in (("_run_id", 9), ("_node_id", 1), ("_task_id", 1)):
        monkeypatch.setattr(TaskIdentity, name, value)

    model = {"base.w": torch.ones(3)}
    folder = flwr_home / "fedslice-node-state"
    for run_id in range(1, 6):
        store_kept(_ctx(run_id), model, received_model=True)
        os.utime(folder / f"run-{run_id}", (run_id, run_id))  # older runs have older folders
    assert sorted(p.name for p in folder.iterdir()) == ["run-3", "run-4", "run-5"]  # default 3
    store_kept(_ctx(9, **{"state-max-runs": 1}), model, received_model=True)
    assert sorted(p.name for p in folder.iterdir()) == ["run-9"]
    with pytest.raises(FedsliceError, match="state-max-runs=0"):
        store_kept(_ctx(10, **{"state-max-runs": 0}), model, received_model=True)
    assert prune_runs(folder, keep=folder / "run-9", max_runs=1) == []
    # the ServerApp's end-of-run query: the node removes the run's folder and its reference
    ctx = _ctx(9)
    store_kept(ctx, model, received_model=True)
    msg = Message(RecordDict({"fedslice": ConfigRecord({END_RUN: 1})}), dst_node_id=3,
                  message_type=MessageType.QUERY)
    msg.metadata.__dict__["_message_id"] = msg.object_id
    reply = query(msg, ctx)
    assert not reply.has_error() and not (folder / "run-9").exists()
    assert KEPT_MODEL not in ctx.state.config_records


def test_serverapp_ends_the_run_on_every_node(tiny_cfg_dict, tmp_path, flwr_home):
    """fedot's nodes keep the adapter + emulator they received in files; at the end of the run
    the ServerApp's end-run query removes them."""
    from conftest import method_options
    from fedslice.flower.server_app import run as server_run

    from test_flower import _settings

    tiny_cfg_dict["method"] = {"name": "fedot", **method_options("fedot", tmp_path)}
    tiny_cfg_dict["federation"].update(num_clients=2, clients_per_round=2, rounds=1)
    path = _write_config(tiny_cfg_dict, tmp_path / "exp.json")
    grid = InProcessGrid(_nodes(2))
    seen: list[str] = []
    handle = grid._handle

    def recording(msg):
        if msg.metadata.message_type == "query":
            seen.append(",".join(sorted(msg.content["fedslice"].keys())))
        elif (flwr_home / "fedslice-node-state" / "run-1").exists():
            seen.append("files")
        return handle(msg)

    grid._handle = recording
    server_run(grid, _settings(path, tmp_path / "fl"))
    assert seen[-2:] == [END_RUN, END_RUN] and "files" in seen
    assert not (flwr_home / "fedslice-node-state" / "run-1").exists()


class ChurnGrid(InProcessGrid):
    """Nodes that die and come back: from round ``die`` on, messages to ``victims`` get no reply
    and from the round after they are no longer connected; from round ``back`` on they are
    connected again under new node ids (a restarted SuperNode), holding the same partitions."""

    def __init__(self, nodes: dict, victims: list[int], die: int, back: int):
        super().__init__(nodes)
        self.victims, self.die, self.back, self.round = victims, die, back, 0
        self.dead: set[int] = set()

    def get_node_ids(self):
        return [n for n in self.node_configs if n not in self.dead]

    def push_messages(self, messages):
        messages = list(messages)
        rounds = {int(m.metadata.group_id) for m in messages if m.metadata.message_type == "train"}
        if rounds:
            self.round = max(rounds)
            if self.round == self.die:
                self.dead |= set(self.victims)
            if self.round == self.back - 1:  # restarted before the next round is configured
                for v in self.victims:
                    self.node_configs[v + 100] = dict(self.node_configs[v])
        alive = [m for m in messages if m.metadata.dst_node_id not in self.dead]
        ids = super().push_messages(alive)
        for m in messages:
            if m not in alive:
                m.metadata.__dict__["_message_id"] = m.object_id
                ids.append(m.object_id)
        return ids


def test_serverapp_under_node_churn(tiny_cfg_dict, tmp_path, flwr_home):
    """The soak test's small version, in-process: 6 SuperNodes, 3 per round, 10 rounds; two die
    in round 4 (no reply) and come back in round 7 under new node ids. Every round uses at least
    min_replies replies, the lost replies are recorded, the dead nodes' partitions are not
    selected while they are away and are trained again after, and the ServerApp's memory does not
    grow after round 5 (bench/soak_flower.py runs 10 SuperNodes x 30 rounds on loopback)."""
    from fedslice.flower.server_app import run as server_run
    from fedslice.output import read_run

    from test_flower import _settings

    tiny_cfg_dict["federation"].update(num_clients=6, clients_per_round=3, rounds=10, min_replies=2,
                                       local_steps=1)
    path = _write_config(tiny_cfg_dict, tmp_path / "exp.json")
    grid = ChurnGrid(_nodes(6), victims=[101, 102], die=4, back=7)
    run_dir = server_run(grid, _settings(path, tmp_path / "fl", **{"round-timeout": 1.0}))
    _, metrics, summary = read_run(run_dir)
    assert len(metrics) == 10 and summary["skipped_rounds"] == 0
    for m in metrics:
        assert sum(c["used"] for c in m["client_metrics"]) >= 2
    lost = [e for e in metrics[3]["excluded"] if e["client"] in (1, 2)]
    assert lost and all(e["reason"] == "no reply within 1 s" for e in lost)
    assert metrics[3]["failed_nodes"] == len(lost)
    for m in metrics[4:6]:
        assert not {1, 2} & set(m["clients"])
    assert {1, 2} & {c for m in metrics[6:] for c in m["clients"]}
    rss = [m["server_rss_mb"] for m in metrics]
    assert max(rss[4:]) <= 1.10 * rss[4], rss
