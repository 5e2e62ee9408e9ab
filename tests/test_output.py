"""Tests for fedslice.output (atomic run folders) and fedslice.report (tables and plots)."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from fedslice.errors import FedsliceError
from fedslice.output import RunDir, read_run
from fedslice.report import markdown_table, report, render_table, rounds_to_target, summary_row


def _leftovers(out: Path) -> list[str]:
    return sorted(p.name for p in out.iterdir())


def test_commit_renames_staging(tmp_path):
    run = RunDir.create(tmp_path, "exp")
    assert run.path.name == f".exp.partial-{os.getpid()}"
    run.write_config({"lr": 1e-3, "out": tmp_path, "missing": None})
    run.append_metrics({"round": 1, "dev_accuracy": 0.5})
    run.append_metrics({"round": 2, "dev_accuracy": np.float32(0.75)})
    run.write_summary({"name": "exp", "test_accuracy": 0.8})
    final = run.commit()
    assert final == tmp_path / "exp" == run.path == run.final_path
    assert _leftovers(tmp_path) == ["exp"]
    assert {"config.json", "metrics.jsonl", "summary.json"} <= set(os.listdir(final))
    config, metrics, summary = read_run(final)
    assert config["out"] == str(tmp_path) and config["lr"] == 1e-3
    assert [m["dev_accuracy"] for m in metrics] == [0.5, 0.75]
    assert summary["test_accuracy"] == 0.8
    with pytest.raises(RuntimeError):
        run.append_metrics({"round": 3})


def test_abort_leaves_nothing(tmp_path):
    run = RunDir.create(tmp_path, "exp")
    run.append_metrics({"round": 1})
    run.abort()
    assert _leftovers(tmp_path) == []


def test_name_collision_gives_suffix(tmp_path):
    for _ in range(3):
        with RunDir.create(tmp_path, "exp") as run:
            run.write_summary({"name": "exp"})
    assert _leftovers(tmp_path) == ["exp", "exp-2", "exp-3"]
    assert run.final_path == tmp_path / "exp-3"


def test_exception_before_a_round_leaves_nothing_after_one_keeps_the_staging_folder(tmp_path):
    with pytest.raises(ValueError, match="boom"):
        with RunDir.create(tmp_path, "exp") as run:
            run.write_config({"lr": 1})
            raise ValueError("boom")
    assert _leftovers(tmp_path) == []
    with pytest.raises(KeyboardInterrupt):
        with RunDir.create(tmp_path, "exp") as run:
            run.append_metrics({"round": 1})
            raise KeyboardInterrupt
    assert _leftovers(tmp_path) == [run.staging_path.name] and run.kept
    assert read_run_metrics(run.staging_path) == [{"round": 1}]
    # a later run of this process with the same name never reuses (or removes) that folder
    with RunDir.create(tmp_path, "exp") as again:
        again.write_summary({"name": "exp"})
    assert again.final_path == tmp_path / "exp" and run.staging_path.is_dir()


def read_run_metrics(folder):
    import json
    return [json.loads(x) for x in (folder / "metrics.jsonl").read_text().splitlines()]


def test_json_handles_nan_numpy_torch_and_paths(tmp_path):
    with RunDir.create(tmp_path, "exp") as run:
        run.write_summary(
            {
                "test_loss": float("nan"),
                "inf": float("inf"),
                "np_int": np.int64(7),
                "np_nan": np.float64("nan"),
                "torch": torch.tensor(0.5),
                "path": Path("/x/y"),
                "tuple": (1, 2),
            }
        )
    text = (tmp_path / "exp" / "summary.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    summary = json.loads(text)
    assert summary["test_loss"] is None and summary["inf"] is None and summary["np_nan"] is None
    assert summary["np_int"] == 7 and summary["torch"] == 0.5
    assert summary["path"] == "/x/y" and summary["tuple"] == [1, 2]


def test_save_weights_with_shared_storage(tmp_path):
    from safetensors.torch import load_file

    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    state = {"w": base, "w_t": base.t(), "row": base[1], "same": base}
    with RunDir.create(tmp_path, "exp") as run:
        run.write_summary({})
        path = run.save_weights(state)
    assert path.name == "final_trainable.safetensors"
    loaded = load_file(str(tmp_path / "exp" / path.name))
    for k, v in state.items():
        assert torch.equal(loaded[k], v)


def test_read_run_errors(tmp_path):
    with pytest.raises(FedsliceError, match="does not exist"):
        read_run(tmp_path / "nope")
    run = RunDir.create(tmp_path, "exp")
    with pytest.raises(FedsliceError, match="unfinished"):
        read_run(run.path)
    with pytest.raises(FedsliceError, match="unfinished run is at"):
        read_run(tmp_path / "exp")
    run.commit()
    with pytest.raises(FedsliceError, match="summary.json"):
        read_run(tmp_path / "exp")


def test_invalid_run_name(tmp_path):
    for bad in ["", "a/b", ".hidden"]:
        with pytest.raises(FedsliceError):
            RunDir.create(tmp_path, bad)


# ---------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------

ROUNDS = [
    {
        "round": r,
        "clients": [4, 17],
        "excluded": [{"client": 9, "reason": "non-finite loss"}] if r == 2 else [],
        "train_loss": 0.7 - 0.1 * r,
        "dev_accuracy": acc,
        "dev_loss": None if acc is None else 1 - acc,
        "bytes_down_mean": 2_000_000,
        "bytes_up_mean": 500_000,
        "flops_measured_mean": 1e12,
        "flops_analytic_mean": 1.1e12,
        "peak_rss_mb_max": 300.0,
        "round_time_s": 12.3,
        "client_metrics": [{"client": 4, "num_examples": 300, "loss": 0.5, "bytes_down": 2_000_000}],
    }
    for r, acc in [(1, 0.6), (2, None), (3, 0.81), (4, 0.84)]
]

SUMMARY = {
    "name": "sst2-lora",
    "method": "fedpetuning",
    "test_accuracy": 0.86,
    "test_loss": 0.3,
    "rounds": 4,
    "target_accuracy": 0.8,
    "rounds_to_target": 3,
    "bytes_down_mean": 2_000_000,
    "bytes_up_mean": 500_000,
    "flops_measured_mean": 1e12,
    "flops_analytic_mean": 1.1e12,
    "peak_rss_mb_max": 300.0,
    "activation_mb_max": 42.0,
    "trainable_params": 12345,
    "wall_time_s": 50.0,
}


def _hand_written_run(folder: Path, summary: dict) -> Path:
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for record in ROUNDS:
            f.write(json.dumps(record) + "\n")
    (folder / "summary.json").write_text(json.dumps(summary))
    return folder


def test_rounds_to_target():
    assert rounds_to_target(ROUNDS, 0.8) == 3
    assert rounds_to_target(ROUNDS, 0.6) == 1
    assert rounds_to_target(ROUNDS, 0.9) is None
    assert rounds_to_target(ROUNDS, None) is None


def test_summary_row_and_tables():
    row = summary_row(SUMMARY)
    assert row["method"] == "fedpetuning"
    assert row["test metric"] == "0.8600"
    assert row["rounds→target"] == "3"
    assert row["down MB/client/round"] == "2.000"
    assert row["up MB/client/round"] == "0.500"
    assert row["train GFLOPs/client/round (analytic)"] == "1,000 (1,100)"
    assert row["peak mem MB (activations)"] == "300.0 (42.0)"
    not_reached = summary_row({**SUMMARY, "rounds_to_target": None, "test_accuracy": math.nan})
    assert not_reached["rounds→target"] == ">4" and not_reached["test metric"] == "—"
    small = summary_row({**SUMMARY, "flops_measured_mean": 2.345e9, "flops_analytic_mean": None})
    assert small["train GFLOPs/client/round (analytic)"] == "2.35"

    text = render_table([row], "results", color=False)
    assert "fedpetuning" in text and "results" in text and "\x1b[" not in text
    md = markdown_table([row]).splitlines()
    assert md[0].startswith("| run | method | test metric |")
    assert md[1].startswith("|:---|:---|---:|")
    assert "| sst2-lora | fedpetuning | 0.8600 |" in md[2]


def test_report_single_run_writes_plots(tmp_path):
    run = _hand_written_run(tmp_path / "sst2-lora", SUMMARY)
    text = report(run, color=False)
    assert "fedpetuning" in text and "0.8600" in text
    for name in ("accuracy.png", "bytes.png"):
        assert (run / name).stat().st_size > 1000


def test_report_generation_run_uses_its_primary_metric(tmp_path):
    gen = {**SUMMARY, "primary_metric": "rougeL", "test_rougeL": 45.0, "test_bleu": 30.5,
           "target_accuracy": 40.0, "rounds_to_target": None}
    del gen["test_accuracy"]
    assert summary_row(gen)["test metric"] == "rougeL 45.00, bleu 30.50"
    run = tmp_path / "e2e"
    _hand_written_run(run, gen)
    with open(run / "metrics.jsonl", "w") as f:  # dev ROUGE-L 38 then 41: the target 40 at round 2
        for r, v in [(1, 38.0), (2, 41.0)]:
            f.write(json.dumps({**ROUNDS[0], "round": r, "dev_rougeL": v, "dev_accuracy": None}) + "\n")
    del gen["rounds_to_target"]
    (run / "summary.json").write_text(json.dumps(gen))
    text = report(run, color=False)
    assert "45.00" in text and "30.50" in text
    metrics = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert rounds_to_target(metrics, 40.0, "rougeL") == 2
    assert (run / "rougeL.png").stat().st_size > 1000 and not (run / "accuracy.png").exists()


def test_report_compare_folder(tmp_path):
    compare = tmp_path / "compare"
    _hand_written_run(compare / "a", SUMMARY)
    other = {**SUMMARY, "name": "b", "method": "fedavg-full", "test_accuracy": 0.9}
    other.pop("rounds_to_target")  # recomputed from metrics.jsonl
    _hand_written_run(compare / "b", other)
    (compare / ".c.partial-123").mkdir()  # unfinished runs are skipped
    text = report(compare, color=False)
    assert "fedpetuning" in text and "fedavg-full" in text
    assert (compare / "compare.png").stat().st_size > 1000
    assert (compare / "b" / "accuracy.png").exists()
    with pytest.raises(FedsliceError):
        report(tmp_path / "empty-does-not-exist")
