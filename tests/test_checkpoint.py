"""Checkpoints: bit-identical resume for every method, kill-safe writes, refused config changes."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import method_options
from fedslice.api import resume_experiment, run_experiment
from fedslice.run.checkpoint import (CHECKPOINT, Checkpoint, config_diff, read_checkpoint,
                                 write_checkpoint)
from fedslice.cli import main
from fedslice.experiment import validate_config
from fedslice.errors import ConfigError, FedsliceError
from fedslice.run.engine import Simulation
from fedslice.methods import METHODS

SRC = Path(__file__).resolve().parents[1] / "src"


def _weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(str(run / "final_trainable.safetensors"))


def _crash_at(monkeypatch, crash_round: int, policy: str = "all") -> None:
    """The engine's round (an async run's version) ``crash_round`` raises."""
    from fedslice.run.asynchronous import AsyncSimulation

    cls, hook = (AsyncSimulation, "run_version") if policy == "async" else (Simulation, "run_round")
    real = getattr(cls, hook)

    def crash(self, server_round, state):
        if server_round == crash_round:
            raise RuntimeError("simulated crash")
        return real(self, server_round, state)

    monkeypatch.setattr(cls, hook, crash)


def reference_and_resumed(cfg_dict: dict, tmp_path: Path, monkeypatch,
                          crash_round: int = 3) -> tuple[Path, Path]:
    """The run folders of ``cfg_dict`` run uninterrupted and of the same run crashed in round
    ``crash_round`` (after the checkpoint of the round before; under ``round_policy = "async"``,
    in that version) and resumed."""
    reference = run_experiment(validate_config(cfg_dict), tmp_path / "ref")
    cfg_dict = {**cfg_dict, "output": {**cfg_dict["output"], "checkpoint_every": 1}}
    with monkeypatch.context() as m:
        _crash_at(m, crash_round, cfg_dict["federation"].get("round_policy", "all"))
        with pytest.raises(RuntimeError, match="simulated crash"):
            run_experiment(validate_config(cfg_dict), tmp_path / "out")
    (staging,) = (tmp_path / "out").iterdir()
    return reference, resume_experiment(staging)


def _records(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("method", sorted(METHODS) + ["fedot+dp+faults"])
def test_resume_is_bit_identical(tiny_cfg_dict, tmp_path, monkeypatch, method):
    """Crash in round 3 of 3 after the round-2 checkpoint; the resumed run ends with exactly the
    weights, selections and losses of an uninterrupted run (DP: the accountant and the noise
    too; faults: the same clients drop out)."""
    if method == "fedot+dp+faults":  # a strategy with state of its own, plus the accountant
        method = "fedot"
        tiny_cfg_dict["dp"] = {"enabled": True, "clip_norm": 0.05, "noise_multiplier": 0.5}
        tiny_cfg_dict["faults"] = {"dropout": 0.3}
    tiny_cfg_dict["method"] = {"name": method, **method_options(method, tmp_path)}
    tiny_cfg_dict["federation"]["rounds"] = 3
    if method != "fedpetuning":
        # one client after another in this process: a round's forked workers cost ~0.5 s (the
        # full gc.collect before the fork) in each of the 3 runs' rounds, and what a checkpoint
        # must hold is the same (a resumed run builds a fresh method either way; in-process,
        # state a client leaves on the method object is lost at the resume too). Resuming with
        # forked workers: the fedpetuning case; forked = in-process weights per method:
        # test_workers.py
        tiny_cfg_dict["compute"] = {"workers": 1}
    else:  # forked whatever the cores ("auto" is 1 under make test: tests/conftest.py)
        tiny_cfg_dict["compute"] = {"workers": 2}
    if method == "heads":
        tiny_cfg_dict["federation"]["selection"] = "loss_gap"  # selector state is resumed too
    reference = run_experiment(validate_config(tiny_cfg_dict), tmp_path / "ref")

    tiny_cfg_dict["output"]["checkpoint_every"] = 1
    cfg = validate_config(tiny_cfg_dict)
    with monkeypatch.context() as m:
        _crash_at(m, 3)
        with pytest.raises(RuntimeError, match="simulated crash"):
            run_experiment(cfg, tmp_path / "out")
    (staging,) = (tmp_path / "out").iterdir()
    assert staging.name.startswith(f".{cfg.run_name}.partial-")
    assert read_checkpoint(staging).round == 2

    resumed = resume_experiment(staging)
    assert resumed == tmp_path / "out" / cfg.run_name and not staging.exists()
    assert not (resumed / CHECKPOINT).exists()
    ref_w, res_w = _weights(reference), _weights(resumed)
    assert ref_w.keys() == res_w.keys()
    for k in ref_w:
        assert torch.equal(ref_w[k], res_w[k]), k
    a, b = _records(reference), _records(resumed)
    assert [r["round"] for r in b] == [1, 2, 3]
    assert [r["clients"] for r in a] == [r["clients"] for r in b]
    assert [r["train_loss"] for r in a] == [r["train_loss"] for r in b]
    assert [r["dev_accuracy"] for r in a] == [r["dev_accuracy"] for r in b]
    assert [r.get("dp_epsilon") for r in a] == [r.get("dp_epsilon") for r in b]
    if "dp" in tiny_cfg_dict:
        assert b[-1]["dp_epsilon"] > b[0]["dp_epsilon"] > 0


def test_changed_config_is_refused_naming_fields(tiny_cfg_dict, tmp_path, monkeypatch, capsys):
    tiny_cfg_dict["output"]["checkpoint_every"] = 1
    cfg = validate_config(tiny_cfg_dict)
    with monkeypatch.context() as m:
        _crash_at(m, 2)
        with pytest.raises(RuntimeError):
            run_experiment(cfg, tmp_path / "out")
    (staging,) = (tmp_path / "out").iterdir()
    with pytest.raises(ConfigError) as e:
        resume_experiment(staging, overrides=["federation.lr=0.5", "seed=3", "output.progress=true"])
    msg = str(e.value)
    assert "federation.lr: 0.005 in the checkpoint, 0.5 now" in msg and "seed: 0" in msg
    assert "output" not in msg.split("\n", 1)[1]  # output.* does not change results
    # the CLI: exit code 2, one message, no traceback; the final name finds the staging folder
    assert main(["run", "--resume", str(tmp_path / "out" / cfg.run_name),
                 "--set", "lora.r=8"]) == 2
    err = capsys.readouterr().err
    assert "lora.r: 4 in the checkpoint, 8 now" in err and "Traceback" not in err
    # unchanged: the CLI resumes it to the end
    assert main(["run", "--resume", str(staging), "--set", "output.progress=false"]) == 0
    assert (tmp_path / "out" / cfg.run_name / "summary.json").is_file()
    assert main(["run", "--resume", str(tmp_path / "out" / cfg.run_name)]) == 2
    assert "finished run" in capsys.readouterr().err


def test_config_diff_lists_every_field():
    a = {"seed": 0, "federation": {"lr": 0.1, "rounds": 3}, "output": {"dir": "a"}}
    b = {"seed": 0, "federation": {"lr": 0.2, "rounds": 3}, "output": {"dir": "b"}, "x": 1}
    assert config_diff(a, b) == ["federation.lr: 0.1 in the checkpoint, 0.2 now",
                                 "x: <absent> in the checkpoint, 1 now"]


def _ckpt(rnd: int, size: int) -> Checkpoint:
    g = torch.Generator().manual_seed(rnd)
    return Checkpoint(round=rnd, config={"seed": rnd}, state={"w": torch.randn(size, generator=g)},
                      server={"strategy": {"m": [torch.ones(2, dtype=torch.bool)]}, "method": {},
                              "selector": {"rng": {"state": 2**100}}},
                      rng={}, records=[{"round": rnd}], elapsed_s=1.5)


def test_checkpoint_round_trip(tmp_path):
    ck = _ckpt(4, 10)
    write_checkpoint(tmp_path, ck)
    back = read_checkpoint(tmp_path)
    assert back.round == 4 and torch.equal(back.state["w"], ck.state["w"])
    assert back.server["selector"]["rng"]["state"] == 2**100
    assert torch.equal(back.server["strategy"]["m"][0], torch.ones(2, dtype=torch.bool))
    (tmp_path / CHECKPOINT).write_bytes(b"garbage")
    with pytest.raises(FedsliceError, match="cannot be read"):
        read_checkpoint(tmp_path)


_KILLED_WRITER = textwrap.dedent("""
    import os, sys, time, torch
    sys.path.insert(0, {src!r})
    sys.path.insert(0, {tests!r})
    from test_checkpoint import _ckpt
    from fedslice.run.checkpoint import write_checkpoint
    folder = sys.argv[1]
    write_checkpoint(folder, _ckpt(1, 1000))            # a complete checkpoint
    real_write, calls = os.write, [0]
    def write(fd, data):                                  # the next one stalls mid-file
        calls[0] += 1
        if calls[0] == {stall_at}:
            print("STALLED", flush=True)
            time.sleep(120)
        return real_write(fd, data)
    os.write = write
    real_fsync = os.fsync
    def fsync(fd):                                        # or after the data, before the rename
        if {stall_fsync}:
            print("STALLED", flush=True)
            time.sleep(120)
        return real_fsync(fd)
    os.fsync = fsync
    write_checkpoint(folder, _ckpt(2, 3_000_000))       # 12 MB: several 1 MiB writes
""")


@pytest.mark.parametrize("where", ["mid-write", "before-rename"])
def test_sigkill_during_checkpoint_write_keeps_the_previous_one(tmp_path, where):
    script = _KILLED_WRITER.format(src=str(SRC), tests=str(Path(__file__).parent),
                                   stall_at=3 if where == "mid-write" else 0,
                                   stall_fsync=where == "before-rename")
    proc = subprocess.Popen([sys.executable, "-c", script, str(tmp_path)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()  # blocks until the writer stalls (or dies)
        assert line.strip() == "STALLED", proc.stderr.read()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    assert proc.returncode == -signal.SIGKILL
    tmp = list(tmp_path.glob(f".{CHECKPOINT}.tmp-*"))
    assert len(tmp) == 1 and tmp[0].stat().st_size > 0  # the interrupted write is really there
    back = read_checkpoint(tmp_path)
    assert back.round == 1 and torch.equal(back.state["w"], _ckpt(1, 1000).state["w"])
    write_checkpoint(tmp_path, _ckpt(3, 10))  # the next write succeeds and clears the stale file
    assert read_checkpoint(tmp_path).round == 3 and not list(tmp_path.glob(".*tmp-*"))


_KILLED_RUN = textwrap.dedent("""
    import json, os, sys, time
    sys.path.insert(0, {src!r})
    import fedslice.run.checkpoint as ck
    real, count = ck.write_bytes_atomic, [0]
    def write(path, data):
        count[0] += 1
        if count[0] == 2:                                 # the round-2 checkpoint: killed mid-write
            fd = os.open(path.with_name("." + path.name + ".tmp-" + str(os.getpid())),
                         os.O_WRONLY | os.O_CREAT)
            os.write(fd, data[: len(data) // 2])
            print("STALLED", flush=True)
            time.sleep(120)
        return real(path, data)
    ck.write_bytes_atomic = write
    from fedslice.cli import main
    sys.exit(main(["run", sys.argv[1], "--no-progress"]))
""")


def test_killed_run_resumes_from_the_last_complete_checkpoint(tiny_cfg_dict, tmp_path):
    """A real `fedslice run` SIGKILLed while writing its round-2 checkpoint: the round-1
    checkpoint loads, and `fedslice run --resume` finishes with the uninterrupted weights."""
    tiny_cfg_dict["federation"]["rounds"] = 3
    tiny_cfg_dict["output"]["checkpoint_every"] = 1
    path = tmp_path / "exp.json"
    path.write_text(json.dumps(tiny_cfg_dict))
    env = {**os.environ, "PYTHONPATH": str(SRC)}
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_RUN.format(src=str(SRC)), str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = proc.stdout.readline()
        assert line.strip() == "STALLED", proc.stderr.read()
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait(timeout=60)
    out = Path(tiny_cfg_dict["output"]["dir"])
    (staging,) = out.iterdir()
    assert read_checkpoint(staging).round == 1
    assert [r["round"] for r in _records(staging)] == [1, 2]  # round 2 finished, not checkpointed
    assert main(["run", "--resume", str(staging), "--no-progress"]) == 0
    resumed = out / "fedpetuning"
    assert [r["round"] for r in _records(resumed)] == [1, 2, 3]
    tiny_cfg_dict["output"]["checkpoint_every"] = 0
    reference = run_experiment(validate_config(tiny_cfg_dict), tmp_path / "ref")
    ref_w, res_w = _weights(reference), _weights(resumed)
    assert all(torch.equal(ref_w[k], res_w[k]) for k in ref_w) and ref_w.keys() == res_w.keys()


def test_flower_serverapp_resumes_bit_identically(tiny_cfg_dict, tmp_path, monkeypatch):
    """The ServerApp writes the same checkpoints; `resume` (run config) continues the run. The
    resumed Flower run is a new run whose SuperNodes kept nothing: FedPFT's proxy is sent whole
    again, and the weights are those of the uninterrupted Flower run."""
    from test_flower import InProcessGrid, _nodes, _settings, _write_config
    from fedslice.flower.server_app import run as server_run
    from fedslice.flower.strategy import FlowerAdapter

    tiny_cfg_dict["method"] = {"name": "fedpft", **method_options("fedpft", tmp_path)}
    tiny_cfg_dict["federation"].update(num_clients=3, clients_per_round=2, rounds=3)
    tiny_cfg_dict["output"]["checkpoint_every"] = 1
    path = _write_config(tiny_cfg_dict, tmp_path / "exp.json")
    reference = server_run(InProcessGrid(_nodes(3)), _settings(path, tmp_path / "ref"))

    real = FlowerAdapter.configure_train

    def configure_train(self, server_round, *args):
        if server_round + self.offset == 3:
            raise RuntimeError("simulated crash")
        return real(self, server_round, *args)

    with monkeypatch.context() as m:
        m.setattr(FlowerAdapter, "configure_train", configure_train)
        with pytest.raises(RuntimeError, match="simulated crash"):
            server_run(InProcessGrid(_nodes(3)), _settings(path, tmp_path / "fl"))
    (staging,) = (tmp_path / "fl").iterdir()
    assert read_checkpoint(staging).round == 2
    resumed = server_run(InProcessGrid(_nodes(3)), _settings(path, tmp_path / "fl",
                                                              resume=str(staging)))
    ref_w, res_w = _weights(reference), _weights(resumed)
    assert ref_w.keys() == res_w.keys() and all(torch.equal(ref_w[k], res_w[k]) for k in ref_w)
    assert [r["round"] for r in _records(resumed)] == [1, 2, 3]
    assert [r["clients"] for r in _records(resumed)] == [r["clients"] for r in _records(reference)]
