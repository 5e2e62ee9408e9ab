"""The Flower ServerApp: ``fedslice run`` with the clients on SuperNodes.

The run config (``flwr run APP CONNECTION --run-config 'config="/abs/exp.toml"'``) names the
experiment config file on the SuperLink's machine (every path inside the operator's server root:
:mod:`fedslice.flower.settings`); the ServerApp loads it like ``fedslice run``,
builds the method and data (for the initial state and central evaluation), finds which partition
each connected SuperNode holds, runs the rounds with :class:`FlowerAdapter` through Flower's
``Strategy.start`` and writes the usual run folder (config, partition, metrics.jsonl, summary.json,
weights). Every wait is bounded: ``connect-timeout`` for SuperNodes to show up, ``round-timeout``
for the replies of a round.
"""

from __future__ import annotations

import logging
import shlex
import time
from contextlib import contextmanager
from pathlib import Path

from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedslice.errors import FedsliceError
from fedslice.flower.settings import RunSettings

log = logging.getLogger(__name__)

app = ServerApp()


def _show_logs() -> None:
    """Send fedslice's INFO logs where Flower's go (the run's log, `flwr log`)."""
    ours, flwr = logging.getLogger("fedslice"), logging.getLogger("flwr")
    if flwr.handlers and not ours.handlers:
        for h in flwr.handlers:
            ours.addHandler(h)
        ours.setLevel(logging.INFO)
        ours.propagate = False


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point of ``flwr run``: a user error is logged as one line, then fails the run."""
    _show_logs()
    try:
        path = run(grid, RunSettings.from_run_config(dict(context.run_config)))
    except FedsliceError as e:
        log.error("fedslice: error: %s", e)
        raise
    log.info("results: %s", path)


def run(grid: Grid, settings: RunSettings) -> Path:
    """Load the experiment, find the SuperNodes, train, write the run folder; return its path.
    With ``settings.resume`` (run config ``resume``), continue that run from its checkpoint."""
    from fedslice.api import folder_name, keep_failed_run, save_results, setup, start_run_folder
    from fedslice.checkpoint import check_same_config, find_resumable, read_checkpoint, restore
    from fedslice.experiment import load_config
    from fedslice.fl.engine import finalize
    from fedslice.flower.codec import record_to_state, state_to_record
    from fedslice.flower.discovery import PartitionMap
    from fedslice.flower.strategy import FlowerAdapter
    from fedslice.output import RunDir
    from fedslice.trackers import Trackers

    cfg = load_config(settings.config, settings.overrides)
    out = Path(settings.out_dir) if settings.out_dir else \
        settings.check_path(cfg.output.dir, "output.dir (of the experiment config)")
    ckpt = staging = None
    if settings.resume:
        staging = find_resumable(settings.resume)
        ckpt = read_checkpoint(staging)
        check_same_config(ckpt.config, cfg.model_dump(mode="json"), staging)
    method, data = setup(cfg)
    partitions = PartitionMap(cfg.federation.num_clients)
    partitions.discover(grid, settings.connect_timeout)
    adapter = FlowerAdapter(cfg, method, data, partitions, settings.round_timeout)
    if ckpt is None:
        run_dir = RunDir.create(out, folder_name(cfg))
        state, t_start = method.initial_state(), time.perf_counter()
    else:
        run_dir = RunDir.reopen(staging)
        run_dir.rewrite_metrics(ckpt.records)
        state, t_start = restore(ckpt, method, adapter.selector), time.perf_counter() - ckpt.elapsed_s
        adapter.records, adapter.offset = list(ckpt.records), ckpt.round
        for c in range(cfg.federation.num_clients):  # a new Flower run: nodes kept nothing
            method.strategy.forget(c)
        log.warning("resuming %s after round %d of %d", staging, ckpt.round, cfg.federation.rounds)
    latest: list[tuple[int, dict]] = [] if ckpt is None else [(ckpt.round, state)]
    trackers = Trackers(cfg, run_dir.staging_path, folder_name(cfg))
    try:
        with run_dir, _ending_run(grid):  # kept on a failure after a round, else removed
            try:
                if ckpt is None:
                    start_run_folder(run_dir, cfg, method, data)
                evaluate = _central_evaluation(cfg, method, data, adapter, run_dir, t_start,
                                               latest, trackers)
                result = _with_dp(cfg, method, adapter).start(
                    grid, state_to_record(state), num_rounds=cfg.federation.rounds - adapter.offset,
                    timeout=settings.round_timeout, evaluate_fn=evaluate)
                state = record_to_state(result.arrays)
                summary = finalize(cfg, method, data, state, adapter.records, t_start)
                summary["engine"] = "flower"
                summary["failed_nodes"] = sum(r.get("failed_nodes", 0) for r in adapter.records)
                save_results(run_dir, cfg, method, state, summary)
                trackers.finish(summary)
            except BaseException as e:
                if run_dir.trained:
                    keep_failed_run(run_dir, method, latest[-1] if latest else None, e,
                                    resume_command(settings, run_dir.staging_path))
                raise
    finally:
        trackers.finish(None)  # failed: closes them (no-op when finished)
    path = run_dir.final_path
    if cfg.output.plots:
        from fedslice.html_report import write_run_report
        from fedslice.report import plot_run
        plot_run(path)
        write_run_report(path)
    if settings.result_file:
        settings.result_file.write_text(str(path) + "\n")
    return path


@contextmanager
def _ending_run(grid: Grid):
    """When the run is over (done or failed; not on Ctrl-C), the SuperNodes remove its files."""
    from fedslice.flower.discovery import end_run

    try:
        yield
    except KeyboardInterrupt:
        raise
    except BaseException:
        end_run(grid)
        raise
    end_run(grid)


def resume_command(settings: RunSettings, staging: Path) -> str:
    """How to continue a Flower run kept in ``staging``: ``fedslice deploy local``'s command (the
    run's config and overrides), and the run config key for ``deploy simulation`` / ``flwr run``."""
    sets = "".join(f" --set {shlex.quote(o)}" for o in settings.overrides)
    return (f"fedslice deploy local {shlex.quote(str(settings.config))}{sets} --resume "
            f"{shlex.quote(str(staging))} (or add resume=\"{staging}\" to the run config of "
            "`fedslice deploy simulation` / `flwr run`)")


def _with_dp(cfg, method, adapter):
    """The adapter, inside Flower's central-DP wrapper when ``dp.enabled`` (DP-FedAvg on Flower:
    Flower clips and adds noise; numpy's global RNG, which it draws from, is seeded here)."""
    from fedslice.fl.rules import DPFedAvg, find_rule

    dp = find_rule(method.strategy, DPFedAvg)
    if dp is None:
        return adapter
    import numpy as np

    from fedslice.flower.strategy import CentralDP
    privacy = dp.privacy
    np.random.seed(cfg.seed)
    privacy.external_noise = True
    return CentralDP(adapter, privacy.z, privacy.clip, privacy.n)


def _central_evaluation(cfg, method, data, adapter, run_dir, t_start: float, latest: list,
                        trackers=None):
    """Flower's ``evaluate_fn``: the dev metrics after the rounds ``fedslice run`` evaluates, the
    round's finished record to metrics.jsonl (``latest``: its round and state appended), and a
    checkpoint every ``output.checkpoint_every`` rounds."""
    import psutil

    from fedslice.checkpoint import capture, write_checkpoint
    from fedslice.fl.engine import finish_round
    from fedslice.flower.codec import record_to_state

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round == 0:
            return None  # fedslice run does not evaluate the initial state
        server_round += adapter.offset
        record = adapter.records[-1]
        state = record_to_state(arrays)
        finish_round(cfg, method, data, adapter.selector, server_round, state, record)
        record["elapsed_s"] = time.perf_counter() - t_start
        record["server_rss_mb"] = psutil.Process().memory_info().rss / 2**20  # a leak shows here
        run_dir.append_metrics(record)
        latest[:] = [(server_round, state)]
        if trackers is not None:
            trackers.round(record)
        every = cfg.output.checkpoint_every
        if every and server_round % every == 0:
            write_checkpoint(run_dir.path, capture(server_round, cfg.model_dump(mode="json"), method,
                                                   adapter.selector, state, adapter.records,
                                                   time.perf_counter() - t_start))
        primary = method.task.primary_metric
        value = record[f"dev_{primary}"]
        log.info("round %d: train loss %s, dev %s %s", server_round, record["train_loss"], primary,
                 value)
        if value is None:
            return None
        return MetricRecord({f"dev-{primary}": value, "dev-loss": record["dev_loss"]})

    return evaluate
