"""Nothing finished is lost: a failed, interrupted or killed run keeps what it finished and says
how to resume it; a compare keeps every run that ended before a later one failed."""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from fedslice.api import compare_experiments, run_experiment
from fedslice.run.checkpoint import CHECKPOINT, read_checkpoint
from fedslice.cli import main
from fedslice.experiment import validate_config
from fedslice.errors import FedsliceError
from fedslice.run import engine
from fedslice.run.engine import Simulation
from fedslice.output import LATEST_WEIGHTS

SRC = Path(__file__).resolve().parents[1] / "src"
RESUME = re.compile(r"continue it with: (fedslice run --resume \S+)")


def _records(folder: Path) -> list[dict]:
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _fail_in_round(monkeypatch, failing: int, exc: BaseException, name: str | None = None) -> None:
    real = Simulation.run_round

    def run_round(self, server_round, state):
        if server_round == failing and (name is None or self.cfg.run_name == name):
            raise exc
        return real(self, server_round, state)

    monkeypatch.setattr(Simulation, "run_round", run_round)


def test_checkpoints_are_on_by_default(tiny_cfg_dict):
    assert validate_config(tiny_cfg_dict).output.checkpoint_every == 1


def test_failure_in_the_final_evaluation_keeps_everything_and_prints_the_resume_command(
        tiny_cfg_dict, tmp_path, monkeypatch, caplog):
    """The last round done, then the test evaluation raises: metrics, the final weights and the
    checkpoint are kept; the printed command finishes the run with the uninterrupted weights."""
    reference = run_experiment(validate_config(tiny_cfg_dict), tmp_path / "ref")
    real = engine.finalize
    with monkeypatch.context() as m:
        m.setattr(engine, "finalize", lambda *a, **k: (_ for _ in ()).throw(MemoryError("eval OOM")))
        with caplog.at_level("WARNING"), pytest.raises(MemoryError) as err:
            run_experiment(validate_config(tiny_cfg_dict))
    (staging,) = Path(tiny_cfg_dict["output"]["dir"]).iterdir()
    assert staging.name.startswith(".fedpetuning.partial-")
    assert [r["round"] for r in _records(staging)] == [1, 2]
    assert read_checkpoint(staging).round == 2
    latest = load_file(str(staging / LATEST_WEIGHTS))
    with safe_open(str(staging / LATEST_WEIGHTS), "pt") as f:
        assert f.metadata()["round"] == "2"
    assert _same(latest, load_file(str(reference / "final_trainable.safetensors")))
    command = RESUME.search(caplog.text).group(1)
    assert any(command in note for note in err.value.__notes__)
    assert engine.finalize is real
    assert main(shlex.split(command)[1:] + ["--no-progress"]) == 0
    final = Path(tiny_cfg_dict["output"]["dir"]) / "fedpetuning"
    assert not staging.exists() and sorted(os.listdir(final.parent)) == ["fedpetuning"]
    assert not (final / CHECKPOINT).exists() and not (final / LATEST_WEIGHTS).exists()
    assert _same(load_file(str(final / "final_trainable.safetensors")),
                 load_file(str(reference / "final_trainable.safetensors")))


def test_ctrl_c_keeps_the_rounds_done_and_a_run_that_never_trained_leaves_nothing(
        tiny_cfg_dict, tmp_path, monkeypatch):
    tiny_cfg_dict["federation"]["rounds"] = 3
    out = Path(tiny_cfg_dict["output"]["dir"])
    with monkeypatch.context() as m:
        _fail_in_round(m, 1, RuntimeError("in round 1"))
        with pytest.raises(RuntimeError):
            run_experiment(validate_config(tiny_cfg_dict))
    assert not out.exists() or list(out.iterdir()) == []
    with monkeypatch.context() as m:
        _fail_in_round(m, 3, KeyboardInterrupt())
        with pytest.raises(KeyboardInterrupt) as err:
            run_experiment(validate_config(tiny_cfg_dict))
    (staging,) = out.iterdir()
    assert [r["round"] for r in _records(staging)] == [1, 2]
    assert read_checkpoint(staging).round == 2
    assert (staging / LATEST_WEIGHTS).is_file()
    (note,) = err.value.__notes__
    assert note.startswith("the run interrupted; what it finished is kept in ")


def test_without_checkpoints_a_failed_run_keeps_metrics_and_weights_and_says_it_cannot_resume(
        tiny_cfg_dict, monkeypatch):
    tiny_cfg_dict["output"]["checkpoint_every"] = 0
    with monkeypatch.context() as m:
        _fail_in_round(m, 2, RuntimeError("disk full"))
        with pytest.raises(RuntimeError) as err:
            run_experiment(validate_config(tiny_cfg_dict))
    (staging,) = Path(tiny_cfg_dict["output"]["dir"]).iterdir()
    assert {"config.json", "metrics.jsonl", LATEST_WEIGHTS} <= set(os.listdir(staging))
    assert not (staging / CHECKPOINT).exists()
    assert "cannot be resumed" in err.value.__notes__[0]
    # what it kept is usable: `fedslice export --allow-partial` exports the round-1 weights
    from fedslice.export import read_run
    kept = read_run(staging, allow_partial=True)
    assert kept.partial.startswith("latest weights after round 1 of 2")
    assert _same(kept.state, load_file(str(staging / LATEST_WEIGHTS)))
    (staging / LATEST_WEIGHTS).unlink()
    with pytest.raises(FedsliceError, match="neither a checkpoint .* nor the latest weights"):
        read_run(staging, allow_partial=True)


def test_compare_keeps_the_runs_that_ended_and_names_the_failed_one(tiny_cfg_dict, tmp_path,
                                                                     monkeypatch):
    cfgs = [validate_config({**tiny_cfg_dict, "name": n}) for n in ("a", "b", "c")]
    with monkeypatch.context() as m:
        _fail_in_round(m, 2, RuntimeError("node lost"), name="b")
        with pytest.raises(RuntimeError) as err:
            compare_experiments(cfgs, tmp_path / "cmp", name="cmp")
    folder = tmp_path / "cmp" / "cmp"
    assert (folder / "a" / "summary.json").is_file()  # the run that ended is kept (first: the bug)
    assert "compare: run 'b' (2 of 3) failed; finished runs in" in err.value.__notes__[-1]
    assert "not run: c" in err.value.__notes__[-1]
    names = sorted(os.listdir(folder))
    assert names[0].startswith(".b.partial-") and names[1:] == ["a", "results.json", "results.md"]
    assert [r["round"] for r in _records(folder / names[0])] == [1]
    assert [row["run"] for row in json.loads((folder / "results.json").read_text())] == ["a"]
    # a user error of a later run names it too (one line on the CLI)
    with monkeypatch.context() as m:
        _fail_in_round(m, 1, FedsliceError("bad data"), name="b")
        with pytest.raises(FedsliceError, match=r"run 'b' \(2 of 3\) failed; finished runs in .*: a; "
                                                 r"not run: c: bad data"):
            compare_experiments(cfgs, tmp_path / "cmp", name="cmp")
    assert sorted(os.listdir(tmp_path / "cmp" / "cmp-2")) == ["a", "results.json", "results.md"]


_SLOW_RUN = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {src!r})
    from fedslice.run.engine import Simulation
    real = Simulation.run_round
    def run_round(self, server_round, state):
        if server_round == 2:
            print("ROUND1-DONE", flush=True)
            time.sleep(120)
        return real(self, server_round, state)
    Simulation.run_round = run_round
    from fedslice.cli import main
    sys.exit(main(["run", sys.argv[1], "--no-progress"]))
""")


def test_sigterm_keeps_the_run_and_the_printed_command_resumes_it(tiny_cfg_dict, tmp_path):
    """`kill PID` of a real `fedslice run` in round 2: exit code 143, the staging folder with
    round 1's metrics, weights and checkpoint, and on stderr the command that finishes it."""
    tiny_cfg_dict["federation"]["rounds"] = 3
    path = tmp_path / "exp.json"
    path.write_text(json.dumps(tiny_cfg_dict))
    proc = subprocess.Popen([sys.executable, "-c", _SLOW_RUN.format(src=str(SRC)), str(path)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(SRC)})
    try:
        while (line := proc.stdout.readline()) and "ROUND1-DONE" not in line:
            pass
        assert "ROUND1-DONE" in line, proc.stderr.read()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(timeout=120)
    finally:
        proc.kill()
    stderr = proc.stderr.read()
    assert code == 143, stderr
    (staging,) = Path(tiny_cfg_dict["output"]["dir"]).iterdir()
    assert [r["round"] for r in _records(staging)] == [1]
    assert read_checkpoint(staging).round == 1 and (staging / LATEST_WEIGHTS).is_file()
    command = RESUME.search(stderr.replace("\n", " ")).group(1)
    assert Path(shlex.split(command)[-1]) == staging
    assert main(shlex.split(command)[1:] + ["--no-progress"]) == 0
    assert [r["round"] for r in _records(staging.parent / "fedpetuning")] == [1, 2, 3]


def test_flower_serverapp_keeps_a_failed_run_and_names_the_deploy_command(tiny_cfg_dict, tmp_path,
                                                                          monkeypatch, caplog):
    from test_flower import InProcessGrid, _nodes, _settings, _write_config
    from fedslice.flower.server_app import run as server_run
    from fedslice.flower.strategy import FlowerAdapter

    tiny_cfg_dict["federation"].update(num_clients=2, clients_per_round=2)
    path = _write_config(tiny_cfg_dict, tmp_path / "exp.json")
    real = FlowerAdapter.configure_train

    def configure_train(self, server_round, *args):
        if server_round == 2:
            raise KeyboardInterrupt
        return real(self, server_round, *args)

    monkeypatch.setattr(FlowerAdapter, "configure_train", configure_train)
    with caplog.at_level("WARNING"), pytest.raises(KeyboardInterrupt):
        server_run(InProcessGrid(_nodes(2)), _settings(path, tmp_path / "fl"))
    (staging,) = (tmp_path / "fl").iterdir()
    assert [r["round"] for r in _records(staging)] == [1] and (staging / LATEST_WEIGHTS).is_file()
    assert f"fedslice deploy local {path} --resume {staging}" in caplog.text
