"""Issue 17: a user's own headerless file runs with a short config; the CLI says what it is
doing (one line per round off a terminal, bars on one), `--version`, `validate`."""

from __future__ import annotations

import io
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest

from fedslice import __version__
from fedslice.cli import main
from fedslice.progress import LogDisplay, RichDisplay, activate, round_line, task

TOPICS = {"World": ["war", "talks", "leaders"], "Sports": ["goal", "match", "coach"],
          "Business": ["stocks", "profit", "bank"], "Sci/Tech": ["chip", "space", "software"]}
FILL = ["the", "a", "report", "on", "new", "today", "says", "after"]


def write_news_tsv(path: Path, n: int = 240, seed: int = 0) -> Path:
    """A headerless TSV as topic-classification data is often distributed: text, word label."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        topic = rng.choice(sorted(TOPICS))
        words = rng.sample(FILL, 4) + [rng.choice(TOPICS[topic])]
        rng.shuffle(words)
        rows.append(f"{' '.join(words)}\t{topic}")
    path.write_text("\n".join(rows) + "\n")
    return path


def news_config(tmp_path: Path, model_dir: Path) -> Path:
    """The user's whole config: 10 lines."""
    data = write_news_tsv(tmp_path / "news.tsv")
    text = f"""[data]
path = "{data}"
header = false
columns = ["text", "label"]
text_columns = ["text"]
[model]
name = "{model_dir}"
[federation]
num_clients = 4
clients_per_round = 2
"""
    assert len(text.splitlines()) <= 10
    cfg = tmp_path / "news.toml"
    cfg.write_text(text)
    return cfg


def test_headerless_word_label_tsv_runs_with_a_ten_line_config(tmp_path, tiny_model_dir):
    """`fedslice run CONFIG > log.txt`: the file is used as it is; log.txt has a line per round."""
    cfg = news_config(tmp_path, tiny_model_dir)
    with (tmp_path / "log.txt").open("w") as log:
        proc = subprocess.run([sys.executable, "-m", "fedslice.cli", "run", str(cfg), "--set",
                               "federation.rounds=3", "--set", "federation.local_steps=2",
                               "--out", str(tmp_path / "runs")],
                              stdout=log, stderr=subprocess.PIPE, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    lines = (tmp_path / "log.txt").read_text().splitlines()
    rounds = [line for line in lines if "| clients 2 |" in line]
    assert [r.split(" | ")[0].split("round ")[1] for r in rounds] == ["1/3", "2/3", "3/3"]
    for line in rounds:
        assert "train loss" in line and "dev accuracy" in line and "elapsed" in line and "ETA" in line
    assert "carved dev (24 rows), test (24 rows) off train" in proc.stderr  # stated in the log
    run = next((tmp_path / "runs").iterdir())
    labels = json.loads((run / "labels.json").read_text())
    assert labels["names"] == ["Business", "Sci/Tech", "Sports", "World"]
    assert labels["ids"]["World"] == 3
    summary = json.loads((run / "summary.json").read_text())
    assert summary["rounds"] == 3
    per_class = summary["test_accuracy_per_class"]  # reports use the label names
    assert list(per_class) == labels["names"] and all(0 <= a <= 1 for a in per_class.values())
    assert (run / "classes.png").is_file()
    log_text = (tmp_path / "log.txt").read_text()
    assert "test accuracy per class" in log_text and "Sci/Tech" in log_text


def test_quiet_prints_no_round_lines(tmp_path, tiny_cfg_dict, capsys):
    import tomli_w
    cfg = tmp_path / "c.toml"
    tiny_cfg_dict["output"]["progress"] = True
    cfg.write_text(tomli_w.dumps(tiny_cfg_dict))
    assert main(["run", "-q", str(cfg)]) == 0
    out = capsys.readouterr().out
    assert "round 1/2" not in out and "results:" in out
    assert main(["run", str(cfg), "-v"]) == 0
    out = capsys.readouterr().out
    assert "round 1/2 | clients 2 |" in out and "client losses" in out


def test_round_line_and_eta():
    record = {"round": 2, "clients": [3, 1], "train_loss": 0.5, "dev_accuracy": 0.75,
              "dev_loss": 0.6, "excluded": []}
    line = round_line(record, 5, elapsed=60.0)
    assert line == ("round 2/5 | clients 2 | train loss 0.5000 | dev accuracy 0.7500 | "
                    "dev loss 0.6000 | elapsed 1m00s | ETA 1m30s")
    buf = io.StringIO()
    with activate(LogDisplay(5, "x", buf)):
        with task("local training steps", 3) as advance:  # sub-tasks are silent off a terminal
            advance()
        from fedslice.progress import round_done
        round_done({**record, "elapsed_s": 10.0})
    assert buf.getvalue() == "x: " + round_line(record, 5, 10.0) + "\n"


def test_rich_bars_show_rounds_and_subtasks():
    from rich.console import Console
    buf = io.StringIO()
    display = RichDisplay(2, "demo", console=Console(file=buf, force_terminal=True, width=120))
    with activate(display):
        with task("evaluation", 4) as advance:
            for _ in range(4):
                advance()
            display.bar.refresh()
            assert [t.completed for t in display.bar.tasks] == [0, 4]
        display.round_done({"round": 1, "train_loss": 0.25, "dev_accuracy": 0.5})
        display.bar.refresh()
    text = buf.getvalue()
    assert "demo rounds" in text and "evaluation" in text and "loss 0.250" in text
    assert len(display.bar.tasks) == 1 and display.bar.tasks[0].completed == 1


def test_version(capsys):
    with pytest.raises(SystemExit) as info:
        main(["--version"])
    assert info.value.code == 0
    assert capsys.readouterr().out.strip() == f"fedslice {__version__}"


def test_validate_prints_the_plan_without_training(tmp_path, tiny_model_dir, capsys):
    cfg = news_config(tmp_path, tiny_model_dir)
    assert main(["validate", str(cfg), "--no-timing"]) == 0
    out = capsys.readouterr().out
    assert "train      192 examples" in out and "dev         24 examples" in out
    assert "labels: 4 (Business, Sci/Tech, Sports, World)" in out
    assert "clients: 4, 2 per round, 20 rounds; examples per client min 48, median 48, max 48" in out
    assert "bytes per client per round: down" in out
    assert "aggregation: the method's weighted mean\n" in out  # no rule asked for
    assert not (tmp_path / "runs").exists()
    from fedslice.experiment import load_config
    from fedslice.plan import make_plan
    plan = make_plan(load_config(cfg, ["federation.local_steps=3"]), timing=True)
    assert plan.client_sizes == [48] * 4 and plan.step_seconds > 0
    assert plan.bytes_down == plan.bytes_up and len(set(plan.bytes_down.values())) == 1
    lora = (2 * 2) * 16 * (32 + 32)  # 2 layers x (q, v) x r=16 x (in + out), hidden 32
    classifier = 32 * 4 + 4  # 4 classes (the checkpoint's 2-class head is replaced)
    assert plan.bytes_down[0] == 4 * (lora + classifier)  # float32
    assert plan.round_seconds == pytest.approx(2 * 3 * plan.step_seconds)
    assert "time per round: about" in plan.render()


def test_validate_and_dry_run_stop_on_the_errors_a_run_would_hit(tmp_path, tiny_model_dir, capsys):
    cfg = news_config(tmp_path, tiny_model_dir)
    (tmp_path / "news.tsv").write_text("a story\tWorld\nanother\n")
    for argv in (["validate", str(cfg)], ["run", "--dry-run", str(cfg)]):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert "news.tsv, line 2: expected 2 fields" in err and "Traceback" not in err
    assert main(["validate", str(cfg), "--set", "model.name=/no/such/model"]) == 2


DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_config_reference_table_is_current():
    from fedslice.config_doc import main as config_doc
    assert config_doc(["--check", str(DOCS / "configuration.md")]) == 0, \
        "run: python -m fedslice.config_doc --write docs/configuration.md"
    from fedslice.config_doc import markdown
    table = markdown()
    for field in ("`data.header`", "`data.holdout_fraction`", "`method.distill.steps`",
                  "`method.tiers[].share`", "`federation.rounds`"):
        assert field in table


def test_own_data_config_is_short_and_valid(tmp_path, tiny_model_dir):
    import tomllib
    from fedslice.experiment import validate_config
    text = (DOCS / "data.md").read_text().split("# Your own data", 1)[1]
    block = text.split("```toml\n", 1)[1].split("```", 1)[0]
    assert len(block.strip().splitlines()) <= 10
    cfg = validate_config(tomllib.loads(block))
    assert cfg.data.header is False and cfg.data.columns == ["text", "label"]
    # and it reads a headerless word-label file as docs/data.md says
    write_news_tsv(tmp_path / "ag_news.tsv")
    from fedslice.data.sources import load_raw_splits
    data = cfg.data.model_copy(update={"path": str(tmp_path / "ag_news.tsv")})
    splits = load_raw_splits(data, cfg.seed)
    assert splits["train"].label_names == sorted(TOPICS) and len(splits["test"]) == 24


def test_validate_points_raffm_sub_model_sizes_to_the_planner(tiny_cfg_dict):
    """RaFFM's clients are planned ([budgets], its tiers a spelling of them): validate does not
    plan, it says where each client's sub-model is printed (`fedslice plan`)."""
    from fedslice.experiment import validate_config
    from fedslice.plan import make_plan

    tiny_cfg_dict["method"] = {"name": "raffm", "width_steps": 4,
                               "tiers": [{"share": 0.5, "flops": 0.5}, {"share": 0.5, "flops": 1.0}]}
    plan = make_plan(validate_config(tiny_cfg_dict), timing=False)
    assert not plan.submodel_params and plan.total_params > 0
    assert any("fedslice plan CONFIG" in n for n in plan.notes)