"""Issue 37: no silent wrong result, and every bad input or environment fault a one-line error.

Each test fails on the code before the issue: a relabelling evaluate, a traceback, a misleading
message. Faults the user meets (a truncated weight file, a full disk, a read-only folder) are
injected as a user would meet them; the CLI's answer is checked: exit code, one line, no
traceback, nothing lost.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import signal
import stat
import time
from pathlib import Path

import pytest

from fedslice.api import run_experiment
from fedslice.cli import main
from fedslice.experiment import validate_config
from fedslice.run.engine import Simulation


def _cfg(tiny_cfg_dict, **federation):
    d = json.loads(json.dumps(tiny_cfg_dict))
    d["federation"].update({"rounds": 1, "lr": 5e-2, **federation})
    return d


@pytest.fixture
def int_run(tiny_cfg_dict):
    """A finished run trained on integer labels 0/1."""
    return run_experiment(validate_config(_cfg(tiny_cfg_dict)))


def _one_error(capsys) -> str:
    """stderr of a failed command: one ``fedslice: error:`` line, no traceback."""
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [x for x in err.splitlines() if x.startswith("fedslice: error:")]
    assert len(lines) == 1, err
    return lines[0]


def _tsv(path: Path, rows: list[tuple[str, str]]) -> Path:
    path.write_text("sentence\tlabel\n" + "".join(f"{s}\t{y}\n" for s, y in rows))
    return path


POS3 = ["a good film", "great fun", "a lovely story"]


# ---- 1. evaluate reads labels as the run's ---------------------------------------------------

def test_evaluate_refuses_label_names_an_integer_run_never_saw(int_run, tmp_path, capsys):
    ids = _tsv(tmp_path / "ids.tsv", [(s, "1") for s in POS3])
    words = _tsv(tmp_path / "words.tsv", [(s, "positive") for s in POS3])
    assert main(["evaluate", str(int_run), "--data", str(ids), "--name", "ids"]) == 0
    # before: 'positive' became id 0 of this file's own order and scored silently
    assert main(["evaluate", str(int_run), "--data", str(words), "--name", "words"]) == 2
    line = _one_error(capsys)
    assert "label 'positive'" in line and "ids 0 .. 1 (no names)" in line
    assert "data.labels" not in line and not (int_run / "eval-words.json").exists()


def test_evaluate_refuses_an_id_out_of_the_runs_range(int_run, tmp_path, capsys):
    three = _tsv(tmp_path / "three.tsv", [(POS3[0], "1"), (POS3[1], "2")])
    assert main(["evaluate", str(int_run), "--data", str(three)]) == 2  # before: IndexError
    line = _one_error(capsys)
    assert "label '2'" in line and str(three) in line and "line 3" in line


def test_evaluate_of_a_named_run_accepts_its_names_and_its_ids(tiny_cfg_dict, tiny_data_dir,
                                                               tmp_path, capsys):
    data = tmp_path / "named"
    data.mkdir()
    for split in ("train", "dev", "test"):  # names in the reverse of alphabetical order
        rows = [r.split("\t") for r in (tiny_data_dir / f"{split}.tsv").read_text().splitlines()[1:]]
        _tsv(data / f"{split}.tsv", [(s, "yes" if y == "1" else "no") for s, y in rows])
    d = _cfg(tiny_cfg_dict)
    d["data"].update(path=str(data), labels=["yes", "no"])
    run = run_experiment(validate_config(d))
    assert json.loads((run / "labels.json").read_text())["names"] == ["yes", "no"]
    rows = [r.split("\t") for r in (data / "test.tsv").read_text().splitlines()[1:]]
    by_id = _tsv(tmp_path / "by-id.tsv", [(s, "0" if y == "yes" else "1") for s, y in rows])
    # only 'no' rows: alphabetical ids of this file would call 'no' id 0, i.e. 'yes'
    only_no = _tsv(tmp_path / "no.tsv", [(s, y) for s, y in rows if y == "no"])
    results = {}
    for name, f in (("names", data / "test.tsv"), ("ids", by_id), ("no", only_no)):
        assert main(["evaluate", str(run), "--data", str(f), "--name", name]) == 0
        results[name] = json.loads((run / f"eval-{name}.json").read_text())["metrics"]["all"]
    summary = json.loads((run / "summary.json").read_text())
    assert results["names"]["accuracy"] == results["ids"]["accuracy"] == summary["test_accuracy"]
    assert results["no"]["accuracy"] == results["names"]["per_class_accuracy"]["no"]
    assert main(["evaluate", str(run), "--data", str(only_no), "--set", 'data.labels=["no","yes"]']) == 2
    assert "cannot change them" in _one_error(capsys)
    maybe = _tsv(tmp_path / "maybe.tsv", [(POS3[0], "yes"), (POS3[1], "maybe")])
    assert main(["evaluate", str(run), "--data", str(maybe)]) == 2
    line = _one_error(capsys)
    assert "label 'maybe'" in line and "names 'yes', 'no'" in line


# ---- 3. tracebacks where a one-line error is promised -----------------------------------------

def _truncate(file: Path) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: len(data) // 2])


def test_truncated_weights_are_one_line_in_export_predict_evaluate(int_run, tiny_data_dir, capsys):
    weights = int_run / "final_trainable.safetensors"
    _truncate(weights)
    test = str(tiny_data_dir / "test.tsv")
    for argv in (["export", str(int_run), "--format", "merged"],
                 ["predict", str(int_run), "--input", test],
                 ["evaluate", str(int_run), "--data", test]):
        assert main(argv) == 2, argv
        line = _one_error(capsys)
        assert f"{weights} is damaged" in line and "truncated" in line
    assert not (int_run / "export").exists() and not list(int_run.glob("eval-*"))


def test_predict_on_a_header_only_file_says_so(int_run, tmp_path, capsys):
    empty = tmp_path / "header.tsv"
    empty.write_text("sentence\tlabel\n")
    assert main(["predict", str(int_run), "--input", str(empty)]) == 2  # before: IndexError
    assert "has no rows to predict" in _one_error(capsys)


def test_predict_on_an_empty_text_names_the_row_not_a_setting_it_cannot_set(int_run, tmp_path,
                                                                            capsys):
    f = tmp_path / "gap.tsv"
    f.write_text("sentence\tlabel\nfine film\t1\n \t0\n")
    assert main(["predict", str(int_run), "--input", str(f)]) == 2
    line = _one_error(capsys)
    assert "line 3" in line and "'sentence'" in line and "bad_rows" not in line


def test_latin1_config_file_names_the_byte_and_its_line(tmp_path, capsys):
    f = tmp_path / "c.toml"
    f.write_bytes(b'name = "caf\xe9"\n' + '[data]\npath = "x"\n'.encode())
    assert main(["validate", str(f)]) == 2  # before: UnicodeDecodeError
    line = _one_error(capsys)
    assert "not UTF-8" in line and "byte 0xe9 at line 1, column 12" in line


def test_read_only_output_folder_is_an_environment_fault(tiny_cfg_dict, tmp_path, capsys,
                                                         monkeypatch):
    out = tmp_path / "ro"
    out.mkdir()
    real = Path.mkdir

    def mkdir(self, *a, **k):  # what a read-only folder does (tests run as root: chmod cannot)
        if Path(self).parent == out:
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", mkdir)
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(_cfg(tiny_cfg_dict)))
    assert main(["run", str(cfg), "--out", str(out)]) == 1
    line = _one_error(capsys)
    assert "Permission denied" in line and "choose a folder you can write" in line
    assert not any(out.iterdir())
    with pytest.raises(PermissionError):  # --debug: the traceback
        main(["run", str(cfg), "--out", str(out), "--debug"])


def test_full_disk_at_a_checkpoint_keeps_the_run_and_says_so_in_one_line(tiny_cfg_dict, tmp_path,
                                                                         capsys, monkeypatch):
    import fedslice.run.checkpoint as ckpt_mod
    real = ckpt_mod.write_bytes_atomic

    def full(path, data):
        if json.loads((path.parent / "metrics.jsonl").read_text().splitlines()[-1])["round"] == 2:
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(path, data)

    monkeypatch.setattr(ckpt_mod, "write_bytes_atomic", full)
    d = _cfg(tiny_cfg_dict, rounds=3)
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(d))
    assert main(["run", str(cfg)]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert "fedslice: error: No space left on device" in err and "the disk is full" in err
    kept = list(Path(d["output"]["dir"]).glob(".*.partial-*"))
    assert len(kept) == 1 and (kept[0] / "checkpoint.safetensors").is_file()  # round 1's


# ---- 5. misleading messages ----------------------------------------------------------------

@pytest.mark.parametrize("gone", ["inference.json", "config.json"])
def test_run_folder_with_one_file_missing_names_it(int_run, gone, capsys):
    (int_run / gone).unlink()
    assert main(["export", str(int_run), "--format", "merged"]) == 2
    line = _one_error(capsys)
    assert f"with {gone} missing" in line and "fedslice version" not in line


def test_unknown_hub_model_offline_is_told_at_once(tiny_cfg_dict, tmp_path, capsys, monkeypatch):
    from huggingface_hub import constants
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    d = _cfg(tiny_cfg_dict)
    d["model"]["name"] = "nobody/no-such-model-xyz"
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(d))
    start = time.monotonic()
    assert main(["validate", str(cfg), "--no-timing"]) == 2
    assert time.monotonic() - start < 5  # before: ~25 s of retries
    line = _one_error(capsys)
    assert "not a hub id in the local cache" in line and "HF_HUB_OFFLINE" in line


def test_export_allow_partial_falls_back_from_a_corrupt_checkpoint(tiny_cfg_dict, tmp_path,
                                                                   monkeypatch, capsys):
    real = Simulation.run_round

    def crash(self, server_round, state):
        if server_round == 3:
            raise RuntimeError("simulated crash")
        return real(self, server_round, state)

    monkeypatch.setattr(Simulation, "run_round", crash)
    d = _cfg(tiny_cfg_dict, rounds=3)
    with pytest.raises(RuntimeError):
        run_experiment(validate_config(d))
    staging = next(Path(d["output"]["dir"]).glob(".*.partial-*"))
    _truncate(staging / "checkpoint.safetensors")
    out = tmp_path / "exp"
    assert main(["export", str(staging), "--format", "merged", "--allow-partial", "--out", str(out)]) == 0
    meta = json.loads((out / "fedslice_export.json").read_text())
    assert meta["partial"].startswith("latest weights after round 2 of 3")
    _truncate(staging / "latest_trainable.safetensors")  # both damaged: one line naming both
    assert main(["export", str(staging), "--format", "merged", "--allow-partial",
                 "--out", str(tmp_path / "exp2")]) == 2
    line = _one_error(capsys)
    assert "checkpoint.safetensors" in line and "latest_trainable.safetensors" in line


# ---- 6. small ones ---------------------------------------------------------------------------

def test_output_name_changed_on_resume_names_the_folder(tiny_cfg_dict, monkeypatch, capsys):
    real = Simulation.run_round

    def crash(self, server_round, state):
        if server_round == 2:
            raise RuntimeError("simulated crash")
        return real(self, server_round, state)

    monkeypatch.setattr(Simulation, "run_round", crash)
    d = _cfg(tiny_cfg_dict, rounds=2)
    with pytest.raises(RuntimeError):
        run_experiment(validate_config(d))
    monkeypatch.setattr(Simulation, "run_round", real)
    staging = next(Path(d["output"]["dir"]).glob(".*.partial-*"))
    assert main(["run", "--resume", str(staging), "--set", 'output.name="renamed"']) == 0
    final = Path(d["output"]["dir"]) / "renamed"
    assert json.loads((final / "summary.json").read_text())["name"] == "renamed"
    assert json.loads((final / "config.json").read_text())["output"]["name"] == "renamed"


def test_second_run_of_a_name_is_named_by_its_folder(tiny_cfg_dict):
    cfg = validate_config(_cfg(tiny_cfg_dict, rounds=1))
    first, second = run_experiment(cfg), run_experiment(cfg)
    assert second.name == first.name + "-2"
    from fedslice.report import summary_row
    rows = [summary_row(json.loads((p / "summary.json").read_text())) for p in (first, second)]
    assert [r["run"] for r in rows] == [first.name, second.name]


def test_weights_have_the_mode_of_the_other_run_files(int_run):
    mode = lambda f: stat.S_IMODE((int_run / f).stat().st_mode)  # noqa: E731
    assert mode("final_trainable.safetensors") == mode("config.json") == mode("summary.json")


def test_compare_checks_every_model_before_training(tiny_cfg_dict, tmp_path, capsys, monkeypatch):
    trained = []
    monkeypatch.setattr(Simulation, "run", lambda *a, **k: trained.append(1))
    files = []
    for i, model in enumerate([tiny_cfg_dict["model"]["name"], str(tmp_path / "no-model")]):
        d = _cfg(tiny_cfg_dict)
        d.update(name=f"r{i}", model={"name": model})
        files.append(tmp_path / f"c{i}.json")
        files[-1].write_text(json.dumps(d))
    assert main(["compare", *map(str, files), "--out", str(tmp_path / "cmp")]) == 2
    assert "no-model does not exist" in _one_error(capsys)
    assert not trained and not (tmp_path / "cmp").exists()


def test_interrupted_cli_ignores_further_ctrl_c_while_the_process_exits(monkeypatch, capsys):
    import fedslice.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_main", interrupted)
    monkeypatch.setattr("sys.argv", ["fedslice", "validate", "x.toml"])
    before = signal.getsignal(signal.SIGINT)
    try:
        assert cli.main() == 130
        assert signal.getsignal(signal.SIGINT) == signal.SIG_IGN  # atexit handlers run unbroken
    finally:
        signal.signal(signal.SIGINT, before)
    assert "interrupted" in capsys.readouterr().err


# ---- 4. CSV/TSV fields over the csv module's default limit -----------------------------------

@pytest.mark.parametrize("suffix", [".tsv", ".csv"])
def test_a_field_over_131072_characters_reads_as_from_jsonl(tmp_path, suffix):
    import csv

    from fedslice.data.tables import read_table
    sep = "\t" if suffix == ".tsv" else ","
    rows = [("short one", "0"), ("y" * 200_000, "1"), ("last", "0")]
    f = tmp_path / f"big{suffix}"
    f.write_text(f"sentence{sep}label\n" + "".join(f"{s}{sep}{y}\n" for s, y in rows))
    j = tmp_path / "big.jsonl"
    j.write_text("".join(json.dumps({"sentence": s, "label": y}) + "\n" for s, y in rows))
    limit = csv.field_size_limit()
    try:
        csv.field_size_limit(131_072)  # the default, whatever an earlier test raised it to
        table = read_table(f)  # before: "malformed TSV file (field larger than field limit)"
    finally:
        csv.field_size_limit(limit)
    assert table.columns == read_table(j).columns and table.lines == [2, 3, 4]


def test_a_row_the_csv_module_refuses_names_its_line_or_is_skipped(tmp_path, monkeypatch, caplog):
    import csv

    import fedslice.data.tables as loading
    from fedslice.errors import DataError
    monkeypatch.setattr(loading, "_allow_fields_of", lambda path: None)
    f = tmp_path / "d.csv"
    f.write_text("sentence,label\nfine,0\n" + "z" * 80 + ",1\nalso fine,1\n")
    limit = csv.field_size_limit()
    try:
        csv.field_size_limit(50)  # a row csv cannot parse (whatever the reason)
        with pytest.raises(DataError, match=r"d\.csv, line 3: malformed row .*data\.bad_rows"):
            loading.read_table(f)
        table = loading.read_table(f, skip_bad_rows=True)
    finally:
        csv.field_size_limit(limit)
    assert table.columns["sentence"] == ["fine", "also fine"] and table.lines == [2, 4]
    assert table.skipped == [3]


# ---- 2/3. resume knows its data --------------------------------------------------------------

def test_resume_refuses_changed_data_unless_allowed_and_then_records_it(tiny_cfg_dict, tiny_data_dir,
                                                                        tmp_path, monkeypatch, capsys):
    data = tmp_path / "data"
    shutil.copytree(tiny_data_dir, data)
    real = Simulation.run_round

    def crash(self, server_round, state):
        if server_round == 3:
            raise RuntimeError("simulated crash")
        return real(self, server_round, state)

    monkeypatch.setattr(Simulation, "run_round", crash)
    d = _cfg(tiny_cfg_dict, rounds=3)
    d["data"]["path"] = str(data)
    with pytest.raises(RuntimeError):
        run_experiment(validate_config(d))
    monkeypatch.setattr(Simulation, "run_round", real)
    staging = next(Path(d["output"]["dir"]).glob(".*.partial-*"))
    train = data / "train.tsv"
    lines = train.read_text().splitlines()  # every label flipped, as in the issue
    train.write_text("\n".join([lines[0]] + [s[:-1] + ("0" if s[-1] == "1" else "1")
                                             for s in lines[1:]]) + "\n")
    before = (staging / "checkpoint.safetensors").read_bytes()
    assert main(["run", "--resume", str(staging)]) == 2
    line = _one_error(capsys)
    assert "the data changed since the checkpoint" in line and f"train split from {train}" in line
    assert "--allow-data-change" in line and "dev split" not in line
    assert (staging / "checkpoint.safetensors").read_bytes() == before  # nothing lost
    assert main(["run", "--allow-data-change", str(tmp_path / "c.toml")]) == 2  # needs --resume
    assert "goes with --resume" in _one_error(capsys)
    assert main(["run", "--resume", str(staging), "--allow-data-change"]) == 0
    final = next(p for p in Path(d["output"]["dir"]).iterdir() if not p.name.startswith("."))
    records = [json.loads(x) for x in (final / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in records] == [1, 2, 3]
    changed = records[1]["data_changed_on_resume"]  # on the checkpoint's round (2)
    assert [(c["split"], c["source"]) for c in changed] == [("train", str(train))]
    assert changed[0]["checkpoint"] != changed[0]["now"]
    assert "data_changed_on_resume" not in records[0] and "data_changed_on_resume" not in records[2]


def test_an_output_folder_that_cannot_be_made_is_told_by_whose_fault(tiny_cfg_dict, tmp_path,
                                                                      capsys, monkeypatch):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps(_cfg(tiny_cfg_dict)))
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    assert main(["run", str(cfg), "--out", str(blocker / "runs")]) == 2  # the path given: input
    assert "cannot create output folder" in _one_error(capsys)
    real = Path.mkdir

    def denied(self, *a, **k):
        if self.name == "locked":
            raise PermissionError(errno.EACCES, "Permission denied", str(self))
        return real(self, *a, **k)

    monkeypatch.setattr(Path, "mkdir", denied)
    assert main(["run", str(cfg), "--out", str(tmp_path / "locked")]) == 1  # the machine's
    assert "cannot create output folder" in _one_error(capsys)
