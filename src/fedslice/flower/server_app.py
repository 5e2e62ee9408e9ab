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
from collections.abc import Iterable
from contextlib import contextmanager
from pathlib import Path

from flwr.app import ArrayRecord, Context, Message, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fedslice.errors import ConfigError, FedsliceError
from fedslice.flower.settings import RunSettings

log = logging.getLogger(__name__)

app = ServerApp()

#: How often the ServerApp asks the SuperLink for the replies it waits for (a round's, the
#: partition query's, the end of the run's). Flower 1.41's ``send_and_receive`` asks every 3 s
#: (``HttpGrid``, fixed), so each of those waits went on up to 3 s after its last reply.
REPLY_POLL_S = 0.25


class PromptGrid(Grid):
    """``grid`` whose ``send_and_receive`` pulls the replies every ``REPLY_POLL_S`` s (Flower's
    own ``push_messages`` and ``pull_messages``, the same replies and timeout) instead of every
    3 s (a grid that pulls more often, the in-memory one at 0.1 s, keeps its interval);
    everything else is ``grid``'s."""

    def __init__(self, grid: Grid, poll: float = REPLY_POLL_S):
        self.grid, self.poll = grid, min(poll, getattr(grid, "pull_interval", poll))

    def set_run(self, run) -> None:
        self.grid.set_run(run)

    @property
    def run(self):
        return self.grid.run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None) -> Message:
        return self.grid.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self.grid.get_node_ids()

    def get_nodes(self):
        return self.grid.get_nodes()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.grid.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.grid.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *,
                         timeout: float | None = None) -> Iterable[Message]:
        """Push ``messages``; their replies, once all are in or ``timeout`` (``None``: no limit)
        has passed (at least one pull), as Flower's ``send_and_receive``."""
        waiting = set(self.grid.push_messages(messages))
        deadline = None if timeout is None else time.monotonic() + timeout
        replies: list[Message] = []
        while True:
            got = list(self.grid.pull_messages(waiting))
            replies += got
            waiting -= {m.metadata.reply_to_message_id for m in got}
            if got:
                log.debug("pulled %d replies, %d awaited", len(got), len(waiting))
            if not waiting or (deadline is not None and time.monotonic() >= deadline):
                return replies
            time.sleep(self.poll if deadline is None else
                       max(0.0, min(self.poll, deadline - time.monotonic())))


def _show_logs() -> None:
    """Send fedslice's INFO logs where Flower's go (the run's log, `flwr log`); its DEBUG logs
    too when Flower's are shown (``FLWR_LOG_LEVEL=DEBUG``, time-stamped)."""
    ours, flwr = logging.getLogger("fedslice"), logging.getLogger("flwr")
    if flwr.handlers and not ours.handlers:
        for h in flwr.handlers:
            ours.addHandler(h)
        ours.setLevel(min([logging.INFO] + [h.level for h in flwr.handlers if h.level]))
        ours.propagate = False


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Entry point of ``flwr run``: a user error is logged as one line, then fails the run."""
    _show_logs()
    try:
        path = run(PromptGrid(grid), RunSettings.from_run_config(dict(context.run_config)))
    except FedsliceError as e:
        log.error("fedslice: error: %s", e)
        raise
    log.info("results: %s", path)


def run(grid: Grid, settings: RunSettings) -> Path:
    """Load the experiment, find the SuperNodes, train, write the run folder; return its path.
    With ``settings.resume`` (run config ``resume``), continue that run from its checkpoint."""
    from fedslice.experiment import load_config
    from fedslice.flower.codec import record_to_state, state_to_record
    from fedslice.flower.discovery import PartitionMap
    from fedslice.flower.strategy import FlowerAdapter
    from fedslice.methods.plan_records import too_few_eligible
    from fedslice.run.checkpoint import (check_same_config, check_same_data, data_changes,
                                         find_resumable, read_checkpoint)
    from fedslice.run.session import RunSession
    from fedslice.run.setup import setup

    cfg = load_config(settings.config, settings.overrides)
    wait = reply_wait(cfg, settings.round_timeout)  # before anything is loaded
    out = Path(settings.out_dir) if settings.out_dir else \
        settings.check_path(cfg.output.dir, "output.dir (of the experiment config)")
    ckpt = staging = None
    if settings.resume:
        staging = find_resumable(settings.resume)
        ckpt = read_checkpoint(staging)
        check_same_config(ckpt.config, cfg.model_dump(mode="json"), staging)
    method, data = setup(cfg, role="server")
    if note := too_few_eligible(method.plans, cfg.federation.clients_per_round):
        log.warning("%s", note)
    if ckpt is not None:  # the server's data as the checkpoint recorded it
        check_same_data(data_changes(ckpt.data, data.sources), staging)
    done = ckpt.round if ckpt else 0
    adapter_cls, ask = FlowerAdapter, None
    if cfg.privacy.secure_aggregation:  # the SecAgg stages around each round's training
        from fedslice.flower.secagg import SecureFlowerAdapter
        adapter_cls, ask = SecureFlowerAdapter, SecureFlowerAdapter.first_keys_request(done + 1)
    partitions = PartitionMap(cfg.federation.num_clients)
    partitions.discover(grid, settings.connect_timeout, ask=ask)
    adapter = adapter_cls(cfg, method, data, partitions, wait, offset=done)
    command = lambda path: resume_command(settings, path)  # noqa: E731
    if ckpt is None:
        session = RunSession.create(cfg, method, data, out, command)
    else:
        session = RunSession.reopen(cfg, method, staging, ckpt, command, data.sources)

    if cfg.federation.round_policy == "async":  # FedBuff over push/pull per node
        return _run_async(grid, settings, cfg, method, data, partitions, session, wait, done)

    def train():
        state = session.initial_state(adapter.selector)
        if ckpt is not None:
            for c in range(cfg.federation.num_clients):  # a new Flower run: nodes kept nothing
                method.strategy.forget(c)
        with _ending_run(grid):
            evaluate = _central_evaluation(cfg, method, data, adapter, session)
            result = _with_dp(cfg, method, adapter).start(
                grid, state_to_record(state), num_rounds=cfg.federation.rounds - done,
                timeout=wait, evaluate_fn=evaluate)
            state = record_to_state(result.arrays)
            return state, _flower_summary(cfg, method, data, state, session)

    return _run_session(session, train, settings)


def _flower_summary(cfg, method, data, state, session) -> dict:
    """The run's summary (:func:`fedslice.run.engine.finalize`) with Flower's own entries."""
    from fedslice.run.engine import finalize
    summary = finalize(cfg, method, data, state, session.records, session.t_start)
    summary["engine"] = "flower"
    summary["failed_nodes"] = sum(r.get("failed_nodes", 0) for r in session.records)
    return summary


def _run_session(session, train, settings) -> Path:
    """``session.run(train)``; the finished run folder's path, also written to the run
    config's result file when it names one."""
    path = session.run(train)
    if settings.result_file:
        settings.result_file.write_text(str(path) + "\n")
    return path


def reply_wait(cfg, round_timeout: float) -> float:
    """How long a round waits for its replies on Flower: ``federation.round_deadline_s`` under
    ``round_policy = 'deadline'`` (real seconds: a reply after it is dropped), else the run
    config's ``round-timeout``. What Flower cannot run yet is a ConfigError naming the field."""
    fed = cfg.federation
    from fedslice.fl.devices import has_devices
    if has_devices(cfg):
        raise ConfigError("[devices] (or device fields in budgets.tiers) put simulated devices on "
                          "the in-process engine's clock (fedslice run); on Flower the nodes' own "
                          "speed and links count: remove them")
    if fed.overselect:
        raise ConfigError(f"federation.overselect = {fed.overselect:g} runs in the in-process "
                          "engine only so far; on Flower the deadline drops late replies")
    return fed.round_deadline_s if fed.round_policy == "deadline" else round_timeout


def _run_async(grid, settings, cfg, method, data, partitions, session, wait, done) -> Path:
    """The run under ``federation.round_policy = 'async'``
    (:class:`fedslice.flower.asynchronous.AsyncServer`)."""
    from fedslice.flower.asynchronous import AsyncServer

    server = AsyncServer(cfg, method, data, partitions, wait, offset=done)

    def train():
        state = session.initial_state(server.selector)
        if done:
            for c in range(cfg.federation.num_clients):  # a new Flower run: nodes kept nothing
                method.strategy.forget(c)
        with _ending_run(grid):
            state = server.run(grid, session, state)
            return state, _flower_summary(cfg, method, data, state, session)

    return _run_session(session, train, settings)


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
    Flower clips and adds noise -- the method was built with ``role="server"``, so its accountant
    adds none; numpy's global RNG, which Flower draws from, is seeded here)."""
    from fedslice.fl.rules import DPFedAvg, find_rule

    dp = find_rule(method.strategy, DPFedAvg)
    if dp is None:
        return adapter
    import numpy as np

    from fedslice.flower.strategy import CentralDP
    privacy = dp.privacy
    np.random.seed(cfg.seed)
    return CentralDP(adapter, privacy.z, privacy.clip, privacy.n)


def _central_evaluation(cfg, method, data, adapter, session):
    """Flower's ``evaluate_fn``: the dev metrics after the rounds ``fedslice run`` evaluates, then
    the round is done for the run session (metrics.jsonl, trackers, checkpoints)."""
    import psutil

    from fedslice.flower.codec import record_to_state
    from fedslice.run.engine import finish_round

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        if server_round == 0:
            return None  # fedslice run does not evaluate the initial state
        server_round += adapter.offset
        record = adapter.record
        state = record_to_state(arrays)
        finish_round(cfg, method, data, adapter.selector, server_round, state, record)
        record["server_rss_mb"] = psutil.Process().memory_info().rss / 2**20  # a leak shows here
        session.round_done(server_round, state, record, adapter.selector)
        primary = method.task.primary_metric
        value = record[f"dev_{primary}"]
        log.info("round %d: train loss %s, dev %s %s", server_round, record["train_loss"], primary,
                 value)
        if value is None:
            return None
        return MetricRecord({f"dev-{primary}": value, "dev-loss": record["dev_loss"]})

    return evaluate
