"""Issue 37, part 4: the CLI never shows a traceback for a user's mistake or an environment fault.

Hypothesis drives ``run``, ``validate``, ``compare``, ``export``, ``predict`` and ``evaluate``
with broken config files (encodings, syntax, formats, wrong values), broken data files
(encodings, delimiters, quoting, huge fields, empty and header-only files, missing columns, bad
labels) and broken run folders (files missing, truncated, corrupted). Every generated case is
broken by construction; for each the CLI must answer with a non-zero exit code and exactly one
``fedslice: error:`` line, no traceback, nothing written outside its output folder and no
existing file changed.

Every kind of defect, file format and command is a case of its own (parametrized), and
hypothesis generates the content within each: ``FEDSLICE_CLI_EXAMPLES`` examples per case
(default 2; 20 times as many per command for run folders), about 400 in all and a minute on 2
cores; ``bench/cli_property.py`` runs a larger count (BENCHMARKS.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedslice.api import run_experiment
from fedslice.cli import main
from fedslice.experiment import validate_config
from fedslice.run.engine import Simulation

EXAMPLES = int(os.environ.get("FEDSLICE_CLI_EXAMPLES", "2"))
_SETTINGS = dict(deadline=None, derandomize=True, database=None,
                 suppress_health_check=list(HealthCheck))
PROPERTY = settings(max_examples=EXAMPLES, **_SETTINGS)
FOLDERS = settings(max_examples=20 * EXAMPLES, **_SETTINGS)
CONFIG_KINDS = ["wrong", "syntax", "encoding", "not_table", "suffix", "empty"]
DEFECTS = ["empty", "header_only", "no_label_column", "float_label", "negative_label", "encoding",
           "unbalanced_quote", "huge_field", "wrong_delimiter", "nul", "empty_text", "extra_cells"]
FORMATS = [".tsv", ".csv", ".jsonl"]
#: defects of what predict does not read (labels): a valid file for predict
PREDICT_READS_NO_LABELS = ("float_label", "negative_label", "no_label_column", "huge_field", "nul")
RUN_FILES = ("config.json", "inference.json", "final_trainable.safetensors", "summary.json")


# --------------------------------------------------------------------------------------------
# fixtures: a valid config and a finished run (once)
# --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def base(tiny_model_dir, tiny_data_dir, tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("property")
    cfg = {"seed": 0, "threads": 1, "name": "ok",
           "data": {"path": str(tiny_data_dir), "max_length": 16},
           "model": {"name": str(tiny_model_dir)},
           "lora": {"r": 4, "alpha": 8, "targets": ["q", "v"]},
           "federation": {"num_clients": 4, "clients_per_round": 2, "rounds": 1, "local_steps": 2,
                          "batch_size": 8, "lr": 5e-2},
           "method": {"name": "fedpetuning"}, "evaluation": {"every": 1, "batch_size": 32},
           "output": {"dir": str(root / "runs"), "progress": False, "plots": False}}
    run = run_experiment(validate_config(cfg))
    return {"cfg": cfg, "run": run, "test": tiny_data_dir / "test.tsv"}


@pytest.fixture(autouse=True)
def _no_training(monkeypatch):
    """Every case is broken before training: a case that trains is a failure of the test."""
    def trains(*a, **k):
        raise AssertionError("a broken case reached training")
    monkeypatch.setattr(Simulation, "run", trains)


# --------------------------------------------------------------------------------------------
# the invariant
# --------------------------------------------------------------------------------------------

def _snapshot(root: Path, skip: Path) -> dict[str, str]:
    out = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and skip not in p.parents:
            out[str(p.relative_to(root))] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def _check(argv: list[str], work: Path, capsys) -> tuple[int, str]:
    """Run the CLI on a broken case; assert the issue's invariant; return (rc, the message)."""
    out = work / "out"
    before = _snapshot(work, out)
    capsys.readouterr()
    rc = main([str(a) for a in argv])
    err = capsys.readouterr().err
    assert "Traceback" not in err, (argv, err)
    assert rc in (1, 2), (argv, rc, err)
    lines = [x for x in err.splitlines() if x.startswith("fedslice: error:")]
    assert len(lines) == 1 and len(lines[0]) > len("fedslice: error: ") + 10, (argv, err)
    assert _snapshot(work, out) == before, argv  # nothing outside out/ written or changed
    return rc, lines[0]


def _work() -> Path:
    return Path(tempfile.mkdtemp(prefix="fedslice-prop-"))


# --------------------------------------------------------------------------------------------
# broken config files
# --------------------------------------------------------------------------------------------

def _dump(data, suffix: str) -> str:
    if suffix == ".json":
        return json.dumps(data)
    import tomli_w
    return tomli_w.dumps(data)


def _set(d: dict, dotted: str, value) -> dict:
    d = json.loads(json.dumps(d))
    node = d
    *parents, leaf = dotted.split(".")
    for p in parents:
        node = node.setdefault(p, {})
    node[leaf] = value
    return d


#: a field and a value no config accepts (types, bounds, unknown names, missing paths)
WRONG = st.sampled_from([
    ("federation.rounds", 0), ("federation.rounds", "three"), ("federation.num_clients", -2),
    ("federation.clients_per_round", 99), ("federation.lr", "fast"), ("data.max_length", 0),
    ("method.name", "no-such-method"), ("data.path", "/nonexistent/data.tsv"),
    ("model.name", "/nonexistent/model"), ("federation.nope", 1), ("lora.r", -4),
    ("data.format", "xlsx"), ("data.label_column", "no_such_column"), ("seed", [1, 2]),
    ("peft.method", "magic"), ("output.checkpoint_every", -1), ("data.bad_rows", "maybe"),
])


@st.composite
def broken_config(draw, kind: str) -> tuple[str, bytes | dict]:
    """(suffix, file content or a config dict to mutate) of a config file with a ``kind`` of
    defect."""
    suffix = draw(st.sampled_from([".toml", ".json"]))
    if kind == "wrong":
        return suffix, {"wrong": draw(WRONG)}
    if kind == "syntax":
        junk = draw(st.sampled_from(['[data\npath = "x"', 'name = "unterminated', '{"a": 1,,}',
                                      "= = =", "[[variants]]\nname = 1\n[[variants"]))
        return suffix, junk.encode()
    if kind == "encoding":
        bad = draw(st.sampled_from([b"\xe9", b"\xff\xfe", b"\x80\x81", b"\xc3"]))
        return ".toml", b'name = "caf' + bad + b'"\n'
    if kind == "not_table":
        return ".json", draw(st.sampled_from([b"[1, 2]", b'"text"', b"3"]))
    if kind == "suffix":
        return draw(st.sampled_from([".txt", ".ini", ".cfg", ""])), b"name = 'x'\n"
    return suffix, draw(st.sampled_from([b"", b"\n", b"   "])) if suffix == ".json" else b"\x00"


def _write_config(work: Path, base_cfg: dict, case) -> Path:
    suffix, content = case
    f = work / f"config{suffix}"
    if isinstance(content, dict):
        field, value = content["wrong"]
        f.write_text(_dump(_set(base_cfg, field, value), suffix))
    else:
        f.write_bytes(content)
    return f


@pytest.mark.parametrize("command", ["validate", "run", "compare"])
@pytest.mark.parametrize("kind", CONFIG_KINDS)
@PROPERTY
@given(data=st.data())
def test_broken_config_files(base, capsys, kind, command, data):
    case = data.draw(broken_config(kind))
    work = _work()
    try:
        cfg = _set(base["cfg"], "output.dir", str(work / "out"))
        f = _write_config(work, cfg, case)
        argv = {"validate": ["validate", f, "--no-timing"], "run": ["run", f],
                # the broken config first: compare runs every config on the first one's data
                "compare": ["compare", f, _good_config(work, cfg), "--out", work / "out"]}[command]
        _check(argv, work, capsys)
        assert not any((work / "out").glob("*/summary.json"))  # nothing finished, nothing trained
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _good_config(work: Path, cfg: dict) -> Path:
    f = work / "good.json"
    f.write_text(json.dumps({**cfg, "name": "good"}))
    return f


# --------------------------------------------------------------------------------------------
# broken data files
# --------------------------------------------------------------------------------------------

SENTENCES = st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), min_size=1,
                    max_size=30).filter(lambda s: s.strip() and "\t" not in s and "," not in s
                                        and '"' not in s)


@st.composite
def broken_data(draw, defect: str, suffix: str) -> tuple[str, bytes, str]:
    """(file suffix, content, the defect) of a data file no loader accepts."""
    sep = {".tsv": "\t", ".csv": ","}.get(suffix)
    rows = draw(st.lists(SENTENCES, min_size=2, max_size=6))

    def table(lines: list[list[str]]) -> bytes:
        if sep is None:
            keys = lines[0]
            return "".join(json.dumps(dict(zip(keys, r))) + "\n" for r in lines[1:]).encode()
        return "".join(sep.join(r) + "\n" for r in lines).encode()

    good = good_rows(rows)
    if defect == "empty":
        return suffix, b"", defect
    if defect == "header_only":
        return suffix, (b"" if sep is None else table(good[:1])), defect
    if defect == "no_label_column":
        return suffix, table([["sentence", "stars"]] + [r for r in good[1:]]), defect
    if defect == "float_label":
        return suffix, table(good[:1] + [[s, "0.5"] for s, _ in good[1:]]), defect
    if defect == "negative_label":
        return suffix, table(good[:1] + [[s, "-3"] for s, _ in good[1:]]), defect
    if defect == "encoding":
        return suffix, table(good).replace(b"label", b"lab\xe9l", 1) + b"\xff\xfe\n", defect
    if defect == "huge_field":  # the huge field has no label: the row is broken either way
        huge = "x" * draw(st.integers(131_073, 300_000))
        body = table(good) + (json.dumps({"sentence": huge}).encode() + b"\n" if sep is None
                              else f"{huge}{sep}\n".encode())
        return suffix, body, defect
    if defect == "empty_text":
        return suffix, table(good[:2] + [["", "1"]] + good[2:]), defect
    if sep is None:  # JSONL: lines that are not JSON objects
        junk = draw(st.sampled_from([b"{not json}\n", b"[1, 2]\n", b'{"sentence": "x", \n']))
        return suffix, table(good) + junk, defect
    if defect == "unbalanced_quote" and sep == ",":  # TSV reads quotes as text (SST-2): it
        # gets the extra cells below
        return suffix, table(good[:2]) + f'"{rows[0]}{sep}1\n'.encode(), defect
    if defect == "wrong_delimiter":
        other = ";" if sep == "," else "|"
        return suffix, "".join(other.join(r) + "\n" for r in good).encode(), defect
    if defect == "nul":
        return suffix, table(good).replace(b"label", b"la\x00bel", 1), defect
    return suffix, table(good[:2]) + f"{rows[0]}{sep}1{sep}extra{sep}cells\n".encode(), defect


def good_rows(rows: list[str]) -> list[list[str]]:
    """A header and enough labelled rows for the base config (4 clients, dev and test carved):
    the table each defect breaks."""
    filler = [f"{w} film number {i}" for i, w in enumerate(["good", "bad"] * 12)]
    return [["sentence", "label"]] + [[s, str(i % 2)] for i, s in enumerate(filler + rows)]


def _write_table(f: Path, lines: list[list[str]]) -> None:
    if f.suffix == ".jsonl":
        f.write_text("".join(json.dumps(dict(zip(lines[0], r))) + "\n" for r in lines[1:]))
    else:
        sep = "\t" if f.suffix == ".tsv" else ","
        f.write_text("".join(sep.join(r) + "\n" for r in lines))


@pytest.mark.parametrize("suffix", [".tsv", ".csv", ".jsonl"])
def test_the_table_each_defect_breaks_is_valid(base, capsys, suffix):
    """Without its defect a generated data file trains and predicts: the errors above are the
    defects', not a too-small table's."""
    work = _work()
    try:
        f = work / f"data{suffix}"
        _write_table(f, good_rows(["one more", "and another"]))
        cfg = _set(_set(base["cfg"], "data.path", str(f)), "output.dir", str(work / "out"))
        c = work / "c.json"
        c.write_text(json.dumps(cfg))
        assert main(["validate", str(c), "--no-timing"]) == 0
        assert main(["predict", str(base["run"]), "--input", str(f), "--output",
                     str(work / "out" / "p.jsonl")]) == 0
        assert main(["evaluate", str(base["run"]), "--data", str(f), "--name", "prop"]) == 0
    finally:
        shutil.rmtree(work, ignore_errors=True)
        (base["run"] / "eval-prop.json").unlink(missing_ok=True)


def _data_case(work: Path, case) -> Path:
    suffix, content, _ = case
    f = work / f"data{suffix}"
    f.write_bytes(content)
    return f


@pytest.mark.parametrize("command", ["validate", "run"])
@pytest.mark.parametrize("suffix", FORMATS)
@pytest.mark.parametrize("defect", DEFECTS)
@PROPERTY
@given(data=st.data())
def test_broken_training_data(base, capsys, defect, suffix, command, data):
    case = data.draw(broken_data(defect, suffix))
    work = _work()
    try:
        data = _data_case(work, case)
        cfg = _set(_set(base["cfg"], "data.path", str(data)), "output.dir", str(work / "out"))
        cfg["data"]["format"] = {".tsv": "tsv", ".csv": "csv", ".jsonl": "jsonl"}[data.suffix]
        f = work / "c.json"
        f.write_text(json.dumps(cfg))
        argv = ["validate", f, "--no-timing"] if command == "validate" else ["run", f]
        rc, _ = _check(argv, work, capsys)
        assert rc == 2
    finally:
        shutil.rmtree(work, ignore_errors=True)


@pytest.mark.parametrize("defect, suffix, command", [
    (d, f, c) for d in DEFECTS for f in FORMATS for c in ("predict", "evaluate")
    if not (c == "predict" and d in PREDICT_READS_NO_LABELS)])
@PROPERTY
@given(data=st.data())
def test_broken_data_after_training(base, capsys, defect, suffix, command, data):
    case = data.draw(broken_data(defect, suffix))
    work = _work()
    run = work / "run"
    shutil.copytree(base["run"], run)
    try:
        data = _data_case(work, case)
        argv = (["predict", run, "--input", data, "--output", work / "out" / "p.jsonl"]
                if command == "predict" else ["evaluate", run, "--data", data])
        rc, _ = _check(argv, work, capsys)
        assert rc == 2
    finally:
        shutil.rmtree(work, ignore_errors=True)


# --------------------------------------------------------------------------------------------
# broken run folders
# --------------------------------------------------------------------------------------------

@st.composite
def damage(draw) -> list[tuple[str, str, float]]:
    """1-3 defects (file, how, where): removed, truncated at a fraction, bytes overwritten
    (summary.json only removed: export, predict and evaluate do not read it)."""
    defect = st.tuples(st.sampled_from(RUN_FILES),
                       st.sampled_from(["remove", "truncate", "garble", "empty"]),
                       st.floats(0.0, 0.95))
    found = draw(st.lists(defect, min_size=1, max_size=3))
    return [(f, "remove" if f == "summary.json" else how, at) for f, how, at in found]


def _damage(run: Path, defects) -> bool:
    """Apply the defects; True when one of them breaks a file every command reads."""
    broken = False
    for name, how, at in defects:
        f = run / name
        if not f.is_file():
            continue
        data = f.read_bytes()
        if how == "remove":
            f.unlink()
        elif how == "empty":
            f.write_bytes(b"")
        elif how == "truncate":
            f.write_bytes(data[: int(len(data) * at)])
        else:  # garble the first bytes: a JSON or safetensors header no reader accepts
            f.write_bytes(b"\xff\x00garbled\x00" + data[12:])
        broken = True
    return broken


@pytest.mark.parametrize("command", ["export", "predict", "evaluate"])
@FOLDERS
@given(defects=damage())
def test_broken_run_folders(base, capsys, command, defects):
    work = _work()
    run = work / "run"
    shutil.copytree(base["run"], run)
    try:
        assert _damage(run, defects)
        argv = {"export": ["export", run, "--format", "merged", "--out", work / "out" / "m"],
                "predict": ["predict", run, "--input", base["test"], "--output",
                            work / "out" / "p.jsonl"],
                "evaluate": ["evaluate", run, "--data", base["test"]]}[command]
        _check(argv, work, capsys)
        assert not (work / "out" / "m").exists()
    finally:
        shutil.rmtree(work, ignore_errors=True)
