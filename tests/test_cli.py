"""End-to-end CLI: a real MiniLM run on a small SST-2 slice, reports, and bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from fedslice.cli import main
from conftest import SST2

CONFIGS = Path(__file__).resolve().parents[1] / "configs"


def _small(out: Path) -> list[str]:
    return ["--set", f"data.path={json.dumps(str(SST2))}", "--set", "data.max_train_examples=400",
            "--set", "data.max_dev_examples=96", "--set", "data.max_test_examples=96",
            "--set", "federation.num_clients=4", "--set", "federation.clients_per_round=2",
            "--set", "federation.rounds=2", "--set", "federation.local_steps=3",
            "--set", "federation.batch_size=16", "--set", "threads=2", "--out", str(out),
            "--no-progress"]


@pytest.mark.slow
@pytest.mark.skipif(not SST2.is_dir(), reason="../shared/data/sst2 not present")
def test_run_and_report_on_sst2_slice(tmp_path, capsys):
    code = main(["run", str(CONFIGS / "fedpetuning_sst2.toml"), *_small(tmp_path)])
    out = capsys.readouterr().out
    assert code == 0, out
    run = tmp_path / "fedpetuning-sst2-demo"
    for name in ("config.json", "metrics.jsonl", "summary.json", "final_trainable.safetensors",
                 "accuracy.png", "bytes.png"):
        assert (run / name).is_file(), name
    assert "fedpetuning" in out and str(run) in out
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds"] == 2 and 0 <= summary["test_accuracy"] <= 1
    assert summary["bytes_up_mean"] > 0 and summary["flops_measured_mean"] > 0
    rounds = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rounds] == [1, 2]
    assert json.loads((run / "config.json").read_text())["federation"]["rounds"] == 2
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging left
    (run / "accuracy.png").unlink()
    assert main(["report", str(run)]) == 0
    assert "fedpetuning" in capsys.readouterr().out and (run / "accuracy.png").is_file()


def _bad(tmp_path, capsys, argv) -> str:
    code = main(argv)
    err = capsys.readouterr().err
    assert code == 2
    assert "Traceback" not in err
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())
    return err


def test_bad_inputs_exit_2_with_clear_message(tmp_path, capsys, tiny_cfg_dict, tiny_data_dir):
    cfg = CONFIGS / "fedpetuning_sst2.toml"
    out = ["--out", str(tmp_path / "runs")]
    err = _bad(tmp_path, capsys, ["run", str(cfg), "--set", "data.path=./no/such/folder", *out])
    assert "no/such/folder" in err and "does not exist" in err
    err = _bad(tmp_path, capsys, ["run", str(cfg), "--set", "method.name=fedmagic", *out])
    assert "fedmagic" in err
    err = _bad(tmp_path, capsys, ["run", str(cfg), "--set", "model.name=/no/such/model", *out])
    assert "/no/such/model" in err
    err = _bad(tmp_path, capsys, ["run", str(tmp_path / "missing.toml"), *out])
    assert "missing.toml" in err
    broken = tmp_path / "broken"
    broken.mkdir()
    for split in ("train", "dev", "test"):
        (broken / f"{split}.tsv").write_text("text\tlabel\nfine movie\tpositive\n")
    err = _bad(tmp_path, capsys, ["run", str(cfg), "--set", f"data.path={json.dumps(str(broken))}",
                                  "--set", 'data.text_columns=["sentence"]', *out])
    assert "sentence" in err  # the missing column is named
    err = _bad(tmp_path, capsys, ["run", str(cfg), "--set", f"data.path={json.dumps(str(broken))}",
                                  "--set", 'data.text_columns=["text"]', *out])
    assert "positive" in err  # the non-integer label is named
    (broken / "train.tsv").write_text("")
    err = _bad(tmp_path, capsys, ["run", str(cfg), "--set", f"data.path={json.dumps(str(broken))}",
                                  "--set", 'data.text_columns=["text"]', *out])
    assert "train.tsv" in err and "empty" in err


def test_console_entry_point_exit_code(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "fedslice.cli", "run", str(tmp_path / "nope.toml")],
                          capture_output=True, text=True)
    assert proc.returncode == 2 and "nope.toml" in proc.stderr and "Traceback" not in proc.stderr


def test_compare_two_methods_same_partition(tmp_path, capsys, tiny_cfg_dict):
    import tomli_w
    base = dict(tiny_cfg_dict)
    base.pop("method")
    base["variants"] = [{"name": "full", "method": {"name": "fedavg"}},
                        {"name": "lora", "method": {"name": "fedpetuning"}}]
    suite = tmp_path / "suite.toml"
    suite.write_text(tomli_w.dumps(base))
    code = main(["compare", str(suite), "--out", str(tmp_path / "cmp"), "--name", "c", "--no-progress"])
    out = capsys.readouterr().out
    assert code == 0, out
    folder = tmp_path / "cmp" / "c"
    assert (folder / "compare.png").is_file() and (folder / "results.md").is_file()
    assert "fedavg" in out and "fedpetuning" in out
    parts = [json.loads((folder / n / "partition.json").read_text()) for n in ("full", "lora")]
    assert parts[0] == parts[1]
    s_full = json.loads((folder / "full" / "summary.json").read_text())
    s_lora = json.loads((folder / "lora" / "summary.json").read_text())
    assert s_full["bytes_up_mean"] > 10 * s_lora["bytes_up_mean"]
