"""The budgets CSV and tiers as a new user writes them (issue 61, "Bad input"): each mistake is a
one-line error naming the file, the row (its line in the file) and the field, given by
``fedslice run`` before anything trains (no run folder); what is valid (a byte-order mark, a
blank line, a path relative to the config's folder) works.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fedslice.cli import main
from fedslice.experiment import load_config
from fedslice.methods.budgets import client_budgets, read_budget_csv


def _write_config(tiny_cfg_dict, folder: Path, budgets: dict) -> Path:
    import tomli_w

    d = json.loads(json.dumps(tiny_cfg_dict))
    d["federation"] = {**d["federation"], "num_clients": 2, "clients_per_round": 2, "rounds": 1,
                       "local_steps": 1, "pack": False}
    d["output"] = {**d["output"], "dir": str(folder / "runs")}
    d["budgets"] = budgets
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "c.toml"
    path.write_bytes(tomli_w.dumps(d).encode())
    return path


def _run_fails(config: Path, capsys, *extra: str) -> str:
    """``fedslice run``'s one error line; asserts it exits 2 and nothing trained."""
    assert main(["run", str(config), "--no-progress", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedslice: error: ") and "\n" not in err, err
    assert not (config.parent / "runs").exists()  # nothing trained: no run folder
    return err


def _csv_error(tiny_cfg_dict, tmp_path, capsys, text: str | bytes) -> tuple[str, Path]:
    csv = tmp_path / "cfg" / "clients.csv"
    csv.parent.mkdir(parents=True, exist_ok=True)
    csv.write_bytes(text if isinstance(text, bytes) else text.encode())
    config = _write_config(tiny_cfg_dict, tmp_path / "cfg", {"csv": "clients.csv"})
    return _run_fails(config, capsys), csv


# -- the CSV ------------------------------------------------------------------------------------
def test_a_row_with_more_cells_than_the_header_is_refused(tiny_cfg_dict, tmp_path, capsys):
    err, csv = _csv_error(tiny_cfg_dict, tmp_path, capsys, "client,memory_mb\n0,100\n1,100,50\n")
    assert f"budgets.csv {csv} row 3: 3 cells, the header has 2 (client,memory_mb" in err


def test_a_row_with_fewer_cells_than_the_header_is_refused(tiny_cfg_dict, tmp_path, capsys):
    err, csv = _csv_error(tiny_cfg_dict, tmp_path, capsys,
                          "client,memory_mb,upload_mb_per_round\n0,100,1\n1,100\n")
    assert f"budgets.csv {csv} row 3: 2 cells, the header has 3" in err
    assert "an empty cell is no limit" in err


def test_a_duplicated_column_is_refused(tiny_cfg_dict, tmp_path, capsys):
    err, csv = _csv_error(tiny_cfg_dict, tmp_path, capsys,
                          "client,memory_mb,memory_mb\n0,100,200\n1,100,200\n")
    assert f"budgets.csv {csv} row 1: column 'memory_mb' appears twice (columns 2 and 3)" in err


def test_a_column_without_a_name_is_refused(tiny_cfg_dict, tmp_path, capsys):
    err, csv = _csv_error(tiny_cfg_dict, tmp_path, capsys, "client,memory_mb,\n0,100,\n1,100,\n")
    assert f"budgets.csv {csv} row 1: column 3 has no name (columns: client,memory_mb,)" in err


def test_a_header_only_file_says_it_has_no_rows(tiny_cfg_dict, tmp_path, capsys):
    err, csv = _csv_error(tiny_cfg_dict, tmp_path, capsys, "client,memory_mb\n")
    assert f"budgets.csv {csv}: no rows after the header (give one row per client, ids 0..1)" in err
    assert "no `client` column" not in err


def test_an_empty_file_says_so(tiny_cfg_dict, tmp_path, capsys):
    err, csv = _csv_error(tiny_cfg_dict, tmp_path, capsys, "\n\n")
    assert f"budgets.csv {csv}: the file is empty" in err


def test_rows_are_numbered_by_their_line_in_the_file(tiny_cfg_dict, tmp_path, capsys):
    err, csv = _csv_error(tiny_cfg_dict, tmp_path, capsys, "client,memory_mb\n0,100\n\n\n1,abc\n")
    assert f"budgets.csv {csv} row 5, memory_mb: 'abc' is not a number" in err


def test_inf_in_the_csv_says_to_leave_the_cell_empty(tiny_cfg_dict, tmp_path, capsys):
    err, csv = _csv_error(tiny_cfg_dict, tmp_path, capsys, "client,memory_mb\n0,100\n1,inf\n")
    assert f"budgets.csv {csv} row 3, memory_mb: inf is not a budget (leave the cell empty for " \
           "no limit)" in err


def test_a_file_that_is_not_utf8_names_the_line(tiny_cfg_dict, tmp_path, capsys):
    err, csv = _csv_error(tiny_cfg_dict, tmp_path, capsys, b"client,memory_mb\n0,100\n1,1\xe900\n")
    assert f"budgets.csv {csv} is not UTF-8 text: byte 0xe9 at line 3" in err


def test_a_folder_names_the_field(tiny_cfg_dict, tmp_path, capsys):
    config = _write_config(tiny_cfg_dict, tmp_path / "cfg", {"csv": "."})
    err = _run_fails(config, capsys)
    assert f"budgets.csv = '{tmp_path / 'cfg'}' is a folder: give a CSV file" in err


def test_an_empty_path_names_the_field(tiny_cfg_dict, tmp_path, capsys):
    config = _write_config(tiny_cfg_dict, tmp_path / "cfg", {"csv": " "})
    assert main(["run", str(config), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "budgets.csv: an empty path" in err and not (tmp_path / "cfg" / "runs").exists()


def test_a_missing_file_names_the_field_and_where_it_was_looked_for(tiny_cfg_dict, tmp_path, capsys):
    config = _write_config(tiny_cfg_dict, tmp_path / "cfg", {"csv": "nope.csv"})
    err = _run_fails(config, capsys)
    assert f"budgets.csv {tmp_path / 'cfg' / 'nope.csv'}: no such file" in err


def test_a_byte_order_mark_before_the_header_is_read(tmp_path):
    path = tmp_path / "b.csv"
    path.write_text("client,memory_mb\r\n0,100\r\n1,200\r\n", encoding="utf-8-sig")
    assert path.read_bytes().startswith(b"\xef\xbb\xbf")  # as Excel's "CSV UTF-8" writes it
    b = read_budget_csv(path, 2)
    assert b[0].memory_mb == 100.0 and b[1].memory_mb == 200.0 and b[1].field == "budgets.csv row 3"


def test_blank_lines_and_spaces_are_not_rows(tmp_path):
    path = tmp_path / "b.csv"
    path.write_text("client , memory_mb\n\n 1 , 200 \n\n0,100\n\n")
    b = read_budget_csv(path, 2)
    assert b[0].field == "budgets.csv row 5" and b[1].limits() == {"memory_mb": 200.0}


# -- where a relative path points -----------------------------------------------------------------
def test_a_relative_csv_is_read_from_the_configs_folder(tiny_cfg_dict, tmp_path, monkeypatch):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "clients.csv").write_text("client,memory_mb\n0,100\n1,200\n")
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "clients.csv").write_text("client,memory_mb\n0,7\n1,7\n")
    config = _write_config(tiny_cfg_dict, tmp_path / "cfg", {"csv": "clients.csv"})
    monkeypatch.chdir(tmp_path / "elsewhere")
    cfg = load_config(config)
    assert cfg.budgets.csv == str(tmp_path / "cfg" / "clients.csv")
    got = client_budgets(cfg.budgets, 2, seed=0)
    assert [b.memory_mb for _, b in got.values()] == [100.0, 200.0]
    # a relative config path: its folder relative to the working directory
    monkeypatch.chdir(tmp_path)
    assert load_config(Path("cfg") / "c.toml").budgets.csv == str(tmp_path / "cfg" / "clients.csv")


def test_a_relative_csv_given_with_set_is_read_from_the_working_directory(tiny_cfg_dict, tmp_path,
                                                                          monkeypatch):
    (tmp_path / "cfg").mkdir()
    (tmp_path / "cfg" / "clients.csv").write_text("client,memory_mb\n0,100\n1,200\n")
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "mine.csv").write_text("client,memory_mb\n0,7\n1,8\n")
    config = _write_config(tiny_cfg_dict, tmp_path / "cfg", {"csv": "clients.csv"})
    monkeypatch.chdir(tmp_path / "here")
    cfg = load_config(config, ["budgets.csv='mine.csv'"])
    assert cfg.budgets.csv == str(tmp_path / "here" / "mine.csv")
    assert [b.memory_mb for _, b in client_budgets(cfg.budgets, 2, seed=0).values()] == [7.0, 8.0]


# -- tiers ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("value,message", [
    (True, "budgets.tiers.0.memory_mb: True is not a number (got True)"),
    ("300", "budgets.tiers.0.memory_mb: '300' is not a number (a string: write the number "
            "without quotes)"),
    (float("inf"), "budgets.tiers.0.memory_mb: inf is not a budget (leave the field out for no "
                   "limit)"),
    (float("nan"), "budgets.tiers.0.memory_mb: nan is not a budget"),
    ("inf", "budgets.tiers.0.memory_mb: 'inf' is not a number (got 'inf')"),
])
def test_a_tiers_budget_is_a_finite_number(tiny_cfg_dict, tmp_path, capsys, value, message):
    config = _write_config(tiny_cfg_dict, tmp_path / "cfg", {"tiers": [{"share": 1.0, "memory_mb": value}]})
    assert main(["run", str(config), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"invalid config {config}:" in err and message in err, err
    assert not (tmp_path / "cfg" / "runs").exists()


@pytest.mark.parametrize("field", ["gflops_per_round", "upload_mb_per_round"])
def test_every_tier_budget_is_strict(tiny_cfg_dict, tmp_path, capsys, field):
    config = _write_config(tiny_cfg_dict, tmp_path / "cfg", {"tiers": [{"share": 1.0, field: False}]})
    assert main(["run", str(config), "--no-progress"]) == 2
    assert f"budgets.tiers.0.{field}: False is not a number" in capsys.readouterr().err


def test_a_tiers_budget_may_be_an_integer_or_set_from_the_command_line(tiny_cfg_dict, tmp_path):
    config = _write_config(tiny_cfg_dict, tmp_path / "cfg", {"tiers": [{"share": 1.0, "memory_mb": 300}]})
    assert load_config(config).budgets.tiers[0].memory_mb == 300.0
    cfg = load_config(config, ["budgets.tiers=[{share = 1.0, memory_mb = 250.5}]"])
    assert cfg.budgets.tiers[0].memory_mb == 250.5
