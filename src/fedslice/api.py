"""Running experiments: one run into a run folder, or several on the same partition and seed."""

from __future__ import annotations

import logging
import shlex
import time
from pathlib import Path
from typing import Any

from fedslice.config import ExperimentConfig, apply_overrides
from fedslice.experiment import load_config, validate_config
from fedslice.errors import ConfigError, FedsliceError
from fedslice.output import reserve_folder, write_json_atomic
from fedslice.progress import activate, make_display
from fedslice.html_report import REPORT, write_compare_report
from fedslice.report import markdown_table, plot_compare, render_table, summary_row
from fedslice.data.federated import FederatedData
from fedslice.run.checkpoint import (Checkpoint, check_same_architecture, check_same_config,
                                     check_same_data, config_diff, data_changes, find_resumable,
                                     read_checkpoint)
from fedslice.run.asynchronous import simulation_for
from fedslice.run.engine import Simulation
from fedslice.run.session import RunSession, folder_name
from fedslice.run.setup import check_method, setup

log = logging.getLogger(__name__)

__all__ = ["compare_experiments", "resume_experiment", "run_experiment", "setup"]


def resume_command(staging: Path) -> str:
    """How to continue an in-process run kept in ``staging``."""
    return f"fedslice run --resume {shlex.quote(str(staging))}"


def run_experiment(cfg: ExperimentConfig, out_dir: str | Path | None = None, *,
                   progress: bool | None = None, setup_result=None, verbose: bool = False) -> Path:
    """Run one experiment into a new run folder and return its path.

    The folder appears only when the run has finished (written in a staging folder first).
    ``progress`` (default ``output.progress``): bars on a terminal, else one line per round on
    stdout (``verbose``: with bytes and each client's loss). A run that fails or is interrupted
    after its first round keeps its staging folder (metrics, the latest weights and, with
    ``output.checkpoint_every``, the last checkpoint, for :func:`resume_experiment`) and says
    the command that resumes it; a run that never trained leaves nothing.
    """
    out = Path(out_dir or cfg.output.dir)
    with _display(cfg, progress, verbose):
        method, data = setup_result or setup(cfg)
        sim = simulation_for(cfg, method, data)
        session = RunSession.create(cfg, method, data, out, resume_command)
        return session.run(lambda: _train(sim, session))


def _train(sim: Simulation, session: RunSession):
    state, _, summary = sim.run(session)
    return state, summary


def _display(cfg: ExperimentConfig, progress: bool | None, verbose: bool):
    show = cfg.output.progress if progress is None else progress
    return activate(make_display(cfg.federation.rounds, cfg.run_name, enabled=show, verbose=verbose))


def resume_experiment(run_dir: str | Path, config: str | Path | None = None,
                      overrides: list[str] | None = None, *, progress: bool | None = None,
                      verbose: bool = False, allow_data_change: bool = False) -> Path:
    """Continue an interrupted run from its checkpoint; return the finished run folder.

    ``run_dir`` is the staging folder (``.NAME.partial-PID``) or the run's final path. The config
    is the checkpoint's (with ``overrides``), or the file ``config``; any difference from the
    checkpoint's config outside ``output`` is refused, naming the fields. Data whose content
    differs from what the checkpoint recorded is refused naming the file, unless
    ``allow_data_change`` (then recorded in the checkpoint round's metrics record).
    """
    staging = find_resumable(Path(run_dir))
    ckpt = read_checkpoint(staging)
    if config is None:
        cfg = validate_config(apply_overrides(ckpt.config, overrides or []), f"(checkpoint of {staging})")
    else:
        cfg = load_config(config, overrides)
    given = cfg.model_dump(mode="json")
    if not any(d.startswith("model.") for d in config_diff(ckpt.config, given)):
        check_same_config(ckpt.config, given, staging)  # before loading anything
    with _display(cfg, progress, verbose):
        method, data = setup(cfg)
        # another model: name both architectures (also when the config names the same path but
        # the files there changed); then any other field that differs
        check_same_architecture(ckpt, method, staging)
        check_same_config(ckpt.config, given, staging)
        _check_data(ckpt, data, staging, allow_data_change)
        sim = simulation_for(cfg, method, data)
        session = RunSession.reopen(cfg, method, staging, ckpt, resume_command, data.sources)
        return session.run(lambda: _train(sim, session))


def _check_data(ckpt: Checkpoint, data: FederatedData, staging: Path, allow: bool) -> None:
    """Refuse changed data; or (``allow``) say so and record it in the checkpoint round's
    metrics record (``data_changed_on_resume``)."""
    changes = data_changes(ckpt.data, data.sources)
    if not changes:
        return
    if not allow:
        check_same_data(changes, staging)
    log.warning("resuming %s on changed data (--allow-data-change): %s", staging,
                ", ".join(f"{c['split']} split from {c['source']}" for c in changes))
    if ckpt.records:
        ckpt.records[-1]["data_changed_on_resume"] = changes


def _same_setting(cfgs: list[ExperimentConfig]) -> list[ExperimentConfig]:
    """Every compared run uses the first config's data, partition, seed and client counts."""
    base = cfgs[0]
    out = [base]
    for cfg in cfgs[1:]:
        if cfg.data != base.data or cfg.seed != base.seed or \
                cfg.federation.num_clients != base.federation.num_clients:
            log.warning("compare: %s uses the data/seed/num_clients of %s", cfg.run_name, base.run_name)
        fed = cfg.federation.model_copy(update={"num_clients": base.federation.num_clients})
        out.append(cfg.model_copy(update={"data": base.data, "seed": base.seed, "federation": fed}))
    return out


def compare_experiments(cfgs: list[ExperimentConfig], out_dir: str | Path | None = None, *,
                        progress: bool | None = None, name: str | None = None,
                        verbose: bool = False) -> tuple[Path, str]:
    """Run several experiments on the same partition and seed into one folder; return its path
    and the results table.

    Each run lands in its own final folder inside it as soon as it ends, and ``results.md`` /
    ``results.json`` are rewritten after each: a failure of a later run leaves the earlier ones
    intact, and is raised with a note naming the failed run (a :class:`FedsliceError` of the
    run becomes one naming it). The folder is removed only if nothing at all was kept in it."""
    if not cfgs:
        raise ConfigError("compare needs at least one config")
    names = [folder_name(c) for c in cfgs]
    if len(set(names)) != len(names):
        raise ConfigError(f"compare: run names must differ (set `name` in each config): {names}")
    cfgs = _same_setting(cfgs)
    for cfg in cfgs:  # every config's model, before any run trains
        check_method(cfg)
    out = Path(out_dir or cfgs[0].output.dir)
    folder = reserve_folder(out, name or f"compare-{time.strftime('%Y%m%d-%H%M%S')}")
    runs: list[Path] = []
    rows: list[dict[str, Any]] = []
    for i, cfg in enumerate(cfgs):
        try:
            runs.append(run_experiment(cfg, folder, progress=progress, verbose=verbose))
        except BaseException as e:
            failure = _compare_failed(folder, names, i, runs, e)
            if failure is e:
                raise
            raise failure from e
        rows.append(summary_row(_read_summary(runs[-1])))
        (folder / "results.md").write_text(markdown_table(rows) + "\n")
        write_json_atomic(folder / "results.json", rows)
    table = render_table(rows, f"fedslice compare ({len(runs)} runs)")
    plot_compare(runs, folder / "compare.png")
    write_compare_report(runs, folder / REPORT, f"fedslice compare: {folder.name}")
    return folder, table


def _compare_failed(folder: Path, names: list[str], i: int, runs: list[Path],
                    error: BaseException) -> BaseException:
    """The exception a compare raises when its ``i``-th run fails: ``error`` with a note (a
    FedsliceError: a new one whose message names the run), after the log says what is kept."""
    kind = "was interrupted" if isinstance(error, KeyboardInterrupt) else "failed"
    done = ", ".join(r.name for r in runs) or "none"
    message = (f"compare: run {names[i]!r} ({i + 1} of {len(names)}) {kind}; finished runs in "
               f"{folder}: {done}" + (f"; not run: {', '.join(names[i + 1:])}" if i + 1 < len(names) else ""))
    log.error("%s", message)
    if not any(folder.iterdir()):
        folder.rmdir()  # nothing finished, nothing kept
    if isinstance(error, FedsliceError):
        return FedsliceError(f"{message}: {error}")
    error.add_note(message)
    return error


def _read_summary(run: Path) -> dict[str, Any]:
    import json
    return json.loads((run / "summary.json").read_text())
