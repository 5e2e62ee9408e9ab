"""The documentation (issue 25, part 5): the README is a short front page, the site builds with
``mkdocs build --strict``, the generated references are current, and every command shown in a
shell block of the README or docs/ is run by a test: fedslice commands are run here, each a test
of its own (with the commands that read the folder it writes), in a scratch folder whose
``../shared/data`` holds the first rows of the real data sets (runs also shrunk by ``--set`` to one round on a few examples: the documented commands, with the
real models, on a smaller budget); other commands name the test that runs them, or are marked
``# needs the network``."""

from __future__ import annotations

import functools
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from fedslice.cli import main
from fedslice.experiment import load_config, load_variants, validate_config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
PAGES = [README, *sorted(DOCS.glob("*.md"))]
NETWORK = "needs the network"
#: Commands for hardware CI does not have (a GPU) carry this mark instead.
HARDWARE = "needs a GPU"

#: Commands run by other tests (the prefix, and the test that runs the same steps).
COVERED = {
    "make demo": "tests/test_docs.py::test_documented_commands_run (`make demo` is `fedslice run "
                 "configs/fedpetuning_sst2.toml` in the Makefile, run here)",
    "make test": ".ci/run (CI runs it)",
    # docs/preference.md: the run needs the HH-RLHF pairs (../shared/data), which the scratch
    # folder does not hold; the same config runs on tiny pairs there, the builder on tiny records
    "fedslice run configs/dpo_hh_smollm2.toml": "tests/test_preference.py::test_the_dpo_config_runs",
    "python bench/data/hh_harmless_pairs.py": "tests/test_preference.py::test_hh_builder_keeps_single_turn_pairs",
    "fedslice deploy local --nodes 2 --tls --auth": "tests/test_flower.py::test_deploy_local_two_supernodes_matches_in_process",
    "fedslice deploy local": "tests/test_flower.py::test_deploy_local_two_supernodes_matches_in_process",
    "fedslice deploy simulation": "tests/test_flower.py::test_simulation_engine_matches_in_process",
    # the by-hand steps of docs/flower.md are what `fedslice deploy local` runs
    "flower-superlink --insecure --simulation": "tests/test_flower.py::test_simulation_engine_matches_in_process",
    "flwr run . loopback --stream --federation-config": "tests/test_flower.py::test_simulation_engine_matches_in_process",
    "flower-superlink --ssl": "tests/test_flower.py::test_deploy_local_two_supernodes_matches_in_process",
    "flower-supernode --root-certificates": "tests/test_flower.py::test_deploy_local_two_supernodes_matches_in_process",
    "flwr supernode register": "tests/test_flower.py::test_deploy_local_two_supernodes_matches_in_process",
    "openssl": "tests/test_flower.py::test_deploy_local_two_supernodes_matches_in_process",
    "ssh-keygen": "tests/test_flower.py::test_deploy_local_two_supernodes_matches_in_process",
    "flower-superlink": "tests/test_flower.py::test_deploy_local_two_supernodes_matches_in_process",
    "flower-supernode": "tests/test_flower.py::test_deploy_local_two_supernodes_matches_in_process",
    "flwr run": "tests/test_flower.py::test_deploy_local_two_supernodes_matches_in_process",
    "flwr ls": "tests/test_flower.py::test_deploy_local_two_supernodes_matches_in_process",
    "flwr log": "tests/test_flower.py::test_deploy_local_two_supernodes_matches_in_process",
    # docs/harness.md: a run's harness scores against lm_eval's CLI on its merged export
    "fedslice evaluate runs/my-run --harness": "tests/test_harness.py::test_harness_equals_lm_eval_cli_on_the_merged_export",
    "fedslice export runs/my-run --format merged": "tests/test_harness.py::test_harness_equals_lm_eval_cli_on_the_merged_export",
    "lm_eval --model hf": "tests/test_harness.py::test_harness_equals_lm_eval_cli_on_the_merged_export",
}
#: Shell glue around the commands (environment, folders, files), not commands of their own.
GLUE = ("source ", "export ", "mkdir ", "cd ", "cat ", "printf ", "EOF")

#: Appended to `run`, `compare` and `validate`: one round on a few examples.
SHRINK = ["federation.num_clients=2", "federation.clients_per_round=2", "federation.rounds=1",
          "federation.local_steps=1", "federation.batch_size=4", "data.max_train_examples=32",
          "data.max_dev_examples=8", "data.max_test_examples=8", "evaluation.batch_size=8",
          "evaluation.dev_generations=2", "task.max_new_tokens=4"]


def shell_commands(path: Path) -> list[str]:
    """Every command line of the page's bash blocks (continuations joined, heredocs skipped)."""
    out = []
    text = path.read_text()
    for block in re.findall(r"```(?:bash|sh|shell)\n(.*?)```", text, re.S):
        lines, heredoc = [], None
        for raw in block.splitlines():
            if heredoc is not None:
                if raw.strip() == heredoc:
                    heredoc = None
                continue
            m = re.search(r"<<-?'?(\w+)'?", raw)
            if m:
                heredoc = m.group(1)
            if lines and lines[-1].endswith("\\"):
                lines[-1] = lines[-1][:-1] + " " + raw.strip()
            else:
                lines.append(raw)
        out += [l.strip() for l in lines if l.strip() and not l.strip().startswith("#")]
    return out


def _marked(cmd: str) -> bool:
    return NETWORK in cmd or HARDWARE in cmd


def _without_comment(cmd: str) -> str:
    return re.sub(r"\s+#.*$", "", cmd).strip()


def _covered(cmd: str) -> str | None:
    return next((test for prefix, test in COVERED.items() if cmd.startswith(prefix)), None)


def _test_exists(ref: str) -> bool:
    if "::" not in ref.split(" ")[0]:
        return (ROOT / ref.split(" ")[0]).exists()
    file, func = ref.split(" ")[0].split("::")
    return f"def {func}(" in (ROOT / file).read_text()


def header_commands(path: Path) -> list[str]:
    """The fedslice commands a config's header shows (its bench/ scripts are benchmarks)."""
    header = "\n".join(l.lstrip("# ") for l in path.read_text().splitlines() if l.startswith("#"))
    return [m.strip().rstrip(":;,.") for m in re.findall(r"fedslice (?:run|compare|validate) [^(`\n]*",
                                                          header)]


def documented() -> list[tuple[str, str]]:
    """Every command of the pages' shell blocks and of the config headers."""
    return [(p.name, c) for p in PAGES for c in shell_commands(p)] + \
        [(p.name, c) for p in sorted((ROOT / "configs").glob("*.toml")) for c in header_commands(p)]


def test_readme_is_a_front_page():
    text = README.read_text()
    assert len(text.splitlines()) <= 150
    assert "make demo" in text and "make test" in text
    block = text.split("```toml\n", 1)[1].split("```", 1)[0]
    assert len(block.strip().splitlines()) <= 10
    cfg = validate_config(tomllib.loads(block))
    assert cfg.method.name == "heads"
    for link in re.findall(r"\]\((docs/[^)#]+)", text):
        assert (ROOT / link).is_file(), link
    pages = {p.name for p in DOCS.glob("*.md")}
    assert {"quickstart.md", "data.md", "methods.md", "architectures.md", "flower.md",
            "reliability.md", "performance.md", "configuration.md", "cli.md", "results.md"} <= pages


def test_generated_references_are_current():
    from fedslice.cli_doc import main as cli_doc
    from fedslice.config_doc import main as config_doc
    assert config_doc(["--check", str(DOCS / "configuration.md")]) == 0, \
        "run: python -m fedslice.config_doc --write docs/configuration.md"
    assert cli_doc(["--check", str(DOCS / "cli.md")]) == 0, "run: python -m fedslice.cli_doc --write docs/cli.md"


def test_mkdocs_build_strict(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                           str(tmp_path / "site")], cwd=ROOT, capture_output=True, text=True,
                          env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "site" / "results" / "index.html").is_file()


def test_every_command_is_run_or_marked():
    """No documented command is left unaccounted for: fedslice commands are run by
    :func:`test_documented_commands_run`; the others name an existing test."""
    for page, cmd in documented():
        if _marked(cmd) or cmd.startswith(GLUE):
            continue
        if cmd.startswith("fedslice ") and _covered(cmd) is None:
            continue  # run below
        ref = _covered(_without_comment(cmd))
        assert ref is not None, f"{page}: {cmd!r} is neither run by a test nor marked '# {NETWORK}'"
        assert _test_exists(ref), f"{page}: {cmd!r} names {ref}, which does not exist"


def _shrunk(argv: list[str], step_cache: Path | None = None) -> list[str]:
    if argv[0] not in ("run", "compare", "validate", "plan"):
        return argv
    configs = [a for a in argv[1:] if a.endswith((".toml", ".yaml", ".yml"))]
    extra = list(SHRINK)
    methods = {c.method.name for f in configs for c in load_variants(ROOT / f)}
    if methods <= {"fedpft", "fedot"} and methods:
        extra += ["method.distill.steps=1"]
    if methods and methods <= {"raffm", "raffm+heads"}:
        extra += ["method.width_steps=4"]
    if any(c.budgets is not None for f in configs for c in load_variants(ROOT / f)):
        # RaFFM's tiers reach down to 0.25 of a dense client's FLOPs: a grid that holds them
        extra += ["budgets.width_steps=4" if methods and methods <= {"raffm", "raffm+heads"}
                  else "budgets.width_steps=2"]
        if step_cache is not None:  # `plan X` and `run X` plan the same clients: measured once
            extra += [f"budgets.step_cache={json.dumps(str(step_cache))}"]
    if any(c.data.partition == "natural" for f in configs for c in load_variants(ROOT / f)):
        # the clients come from the data (a num_clients that differs is an error)
        extra = [x for x in extra if not x.startswith(("federation.num_clients=",
                                                       "federation.clients_per_round="))]
    kinds = {c.task.kind for f in configs for c in load_variants(ROOT / f)}
    if kinds == {"generation"}:  # each prompt (E2E: a meaning representation) with all its
        # references: 8 prompts are ~100 rows whose dev and test losses take most of the run
        # (SmolLM2's forward passes over them: 245 of the run's 300 s, profiled at load 8, 2
        # prompts each); one prompt each still scores the dev and test splits and generates
        extra += ["data.max_dev_examples=1", "data.max_test_examples=1"]
    return argv + [x for s in extra for x in ("--set", s)]


@functools.cache
def _first_image_files(real: Path, train: int = 200, test: int = 50) -> dict[str, bytes]:
    """The first images of each IDX file of ``real`` (the first rows, as for the tables): file
    name -> bytes. Read once per process (the whole training file is ~26 MB of gzip)."""
    import gzip
    import struct

    from fedslice.data.images.sources import read_idx

    out = {}
    for f in real.iterdir():
        if "idx" not in f.name:
            continue
        array = read_idx(f)[:train if f.name.startswith("train") else test]
        head = bytes([0, 0, 8, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
        out[f.name] = gzip.compress(head + array.tobytes()) if f.suffix == ".gz" else head + array.tobytes()
    return out


def _first_images(real: Path, dest: Path) -> None:
    """The first images of each IDX file of ``real`` written to ``dest``."""
    if not real.is_dir():
        pytest.skip(f"../shared/data/{real.name} is not here")
    dest.mkdir(parents=True)
    for name, data in _first_image_files(real).items():
        (dest / name).write_bytes(data)


@functools.cache
def _first_rows(real: Path, rows: int) -> dict[str, str]:
    """The header and first ``rows`` rows of each table of ``real``: file name -> text (once
    per process)."""
    return {f.name: "".join(f.read_text().splitlines(keepends=True)[:rows + 1])
            for f in real.iterdir() if f.suffix in (".tsv", ".csv", ".txt")}


def _scratch(tmp_path: Path, monkeypatch) -> Path:
    """A scratch folder with the repository's configs and a small ../shared beside it (each
    data file's first rows, the models), the working directory of the documented commands."""
    work = tmp_path / "repo"
    work.mkdir()
    (work / "configs").symlink_to(ROOT / "configs")
    data = tmp_path / "shared" / "data"
    for name, rows in (("sst2", 48), ("e2e_nlg", 120), ("wikitext2", 200)):  # each file's first rows
        real = ROOT.parent / "shared" / "data" / name
        if not real.is_dir():
            pytest.skip(f"../shared/data/{name} is not here")
        (data / name).mkdir(parents=True)
        for file, text in _first_rows(real, rows).items():
            (data / name / file).write_text(text)
    _first_images(ROOT.parent / "shared" / "data" / "fashion_mnist", data / "fashion_mnist")
    (tmp_path / "shared" / "models").symlink_to(ROOT.parent / "shared" / "models")
    from test_chat import write_chat_jsonl
    write_chat_jsonl(work / "my_chats")  # docs/instruction_tuning.md's conversations (by users)
    (work / "ask.jsonl").write_text(_heredoc(DOCS / "instruction_tuning.md", "ask.jsonl"))
    monkeypatch.setenv("FEDSLICE_DATA_DIR", str(data))
    monkeypatch.chdir(work)
    return work


def _heredoc(page: Path, name: str) -> str:
    """The text a page's ``cat > NAME <<'EOF'`` block writes."""
    m = re.search(rf"cat > {re.escape(name)} <<'?(\w+)'?\n(.*?)\n\1\n", page.read_text(), re.S)
    assert m, f"{page.name}: no heredoc writing {name}"
    return m.group(2) + "\n"


def _argv(cmd: str) -> list[str]:
    """A command's arguments after ``fedslice``, without its verbosity."""
    return [a for a in shlex.split(cmd)[1:] if a not in ("-q", "-v", "-vv")]


def documented_fedslice() -> list[tuple[str, str]]:
    """The fedslice commands of the docs and config headers this file runs (not marked, not run
    by another test; each once, its verbosity aside), in page order, without their comments."""
    order = ["quickstart.md", "architectures.md", "results.md", "README.md"]
    cmds = sorted(documented(), key=lambda pc: order.index(pc[0]) if pc[0] in order else 99)
    out, seen = [], set()
    for page, cmd in cmds:
        if _marked(cmd):  # the mark is in the command's comment
            continue
        cmd = _without_comment(cmd)
        if not cmd.startswith("fedslice ") or _covered(cmd) or tuple(_argv(cmd)) in seen:
            continue
        seen.add(tuple(_argv(cmd)))
        out.append((page, cmd))
    return out


def _writes(argv: list[str]) -> str | None:
    """The run folder a ``fedslice run`` writes (``--out`` or output.dir, then the run's name);
    None for other commands and for a config that does not load (its test then fails)."""
    from fedslice.cli import build_parser
    from fedslice.run.session import folder_name

    if argv[0] != "run":
        return None
    args = build_parser().parse_args(argv)
    if args.config is None or args.dry_run:  # --resume continues a folder; --dry-run writes none
        return None
    try:
        cfg = load_config(ROOT / args.config, args.overrides)  # what `fedslice run` loads
    except Exception:  # noqa: BLE001 (reported by the command itself, when it runs)
        return None
    return os.path.normpath(Path(args.out or cfg.output.dir) / folder_name(cfg))


def documented_tests() -> list[list[tuple[str, str]]]:
    """The commands of :func:`documented_fedslice` as tests: each command a test of its own, but
    for one that names the folder an earlier ``fedslice run`` writes (report, export, predict,
    evaluate): it runs after that run (the first that writes it), in the run's test."""
    tests: list[list[tuple[str, str]]] = []
    writers: dict[str, list[tuple[str, str]]] = {}
    for page, cmd in documented_fedslice():
        argv = _argv(cmd)
        reader = next((writers[os.path.normpath(a)] for a in argv[1:]
                       if os.path.normpath(a) in writers), None)
        if reader is not None:
            reader.append((page, cmd))
            continue
        tests.append([(page, cmd)])
        folder = _writes(argv)
        if folder is not None:
            writers.setdefault(folder, tests[-1])
    return tests


DOCUMENTED = documented_tests()


def test_documented_commands_are_found():
    """The commands are found (the pages' and headers' parsing still works), the demo's run with
    the commands that read its folder among them."""
    assert len(DOCUMENTED) >= 15
    demo = next(t for t in DOCUMENTED if t[0][1] == "fedslice run configs/fedpetuning_sst2.toml")
    assert {_argv(c)[0] for _, c in demo} >= {"run", "report", "export", "predict", "evaluate"}


@pytest.fixture(scope="session")
def step_cache(tmp_path_factory) -> Path:
    """The planner's measured steps (``budgets.step_cache``) of this session's documented
    commands, one folder for all its xdist workers: a step measured for `fedslice plan
    configs/budgets_sst2.toml` is the same step in `fedslice run configs/budgets_sst2.toml` (the
    cache keys a step by everything it depends on; tests/test_step_cache.py), so the second
    command reads what the first measured instead of measuring it again."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the session's folder, above each worker's own
    return root / "docs-step-cache"


def _run(page: str, cmd: str, capsys, step_cache: Path | None = None) -> None:
    argv = _shrunk(_argv(cmd), step_cache)
    try:
        code = main(argv)
    except SystemExit as e:  # --version, --help
        code = e.code
    out = capsys.readouterr()
    assert code == 0, f"{page}: `{cmd}` exited {code}: {out.err[-2000:]}"


@pytest.mark.slow
@pytest.mark.parametrize("commands", DOCUMENTED, ids=[t[0][1].removeprefix("fedslice ") for t in DOCUMENTED])
def test_documented_commands_run(commands, tmp_path, monkeypatch, capsys, step_cache):
    """A fedslice command of the docs or of a config header (with the commands that read the
    folder it writes, after it, in page order), in a scratch folder with the repository's
    configs and a small ../shared beside it: each exits 0, and each run leaves its folder."""
    work = _scratch(tmp_path, monkeypatch)
    for page, cmd in commands:
        _run(page, cmd, capsys, step_cache)
        folder = _writes(_argv(cmd))
        if folder is not None:
            assert (work / folder / "summary.json").is_file(), f"{page}: `{cmd}` wrote no {folder}"
    if commands[0][1] == "fedslice run configs/fedpetuning_sst2.toml":
        assert (work / "runs" / "fedpetuning-sst2-demo" / "report.html").is_file()


def _not_ignored(paths: list[Path]) -> list[Path]:
    """The files git does not ignore (a benchmark's run folders under bench/results hold the
    config.toml each run writes: results, not configs); all of them outside a git checkout."""
    import subprocess

    try:
        out = subprocess.run(["git", "check-ignore", "--stdin"], cwd=ROOT, capture_output=True,
                             text=True, input="\n".join(str(p.relative_to(ROOT)) for p in paths))
    except OSError:
        return paths
    if out.returncode not in (0, 1):  # 128: not a git checkout
        return paths
    ignored = set(out.stdout.split())
    return [p for p in paths if str(p.relative_to(ROOT)) not in ignored]


CONFIGS = _not_ignored(sorted([*(ROOT / "configs").glob("*.toml"), *(ROOT / "bench").rglob("*.toml")]))


def config_header(path: Path) -> str:
    """The comment lines a config file starts with."""
    lines = []
    for line in path.read_text().splitlines():
        if not line.startswith("#"):
            break
        lines.append(line.lstrip("# "))
    return "\n".join(lines)


@pytest.mark.parametrize("path", CONFIGS, ids=[str(p.relative_to(ROOT)) for p in CONFIGS])
def test_every_config_says_what_it_runs_and_the_command(path):
    """Like torchtune's configs: the first lines say what the experiment is and the command
    that runs it (`fedslice run|compare|validate <this file>`, or the bench/ script that does)."""
    header = config_header(path)
    rel = re.escape(str(path.relative_to(ROOT)))
    assert len(header.split()) >= 8, f"{path.name}: no header saying what it runs"
    assert re.search(rf"fedslice (run|compare|validate)\b[^\n]*{rel}|bench/[\w/]+\.py", header), \
        f"{path.name}: its header names no command that runs it"
