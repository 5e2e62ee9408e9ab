"""``fedslice deploy local|simulation``: run an experiment on Flower, on this machine.

``local`` starts a SuperLink and one SuperNode per partition on loopback (Flower's Deployment
Engine); ``simulation`` starts a SuperLink with Flower's simulation engine (Ray), one virtual
SuperNode per partition. Either way the fedslice Flower app is submitted with ``flwr run``, the
run is awaited (bounded), and the result is the run folder the ServerApp wrote (the layout of
``fedslice run``), with Flower's logs in its ``flower/`` subfolder.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import tempfile
from pathlib import Path

from fedslice.errors import ConfigError
from fedslice.flower.nodes import DeploymentError
from fedslice.flower.settings import RUN_CONFIG_DEFAULTS
from fedslice.interrupt import terminate_as_interrupt

log = logging.getLogger(__name__)

APP_COMPONENTS = {"serverapp": "fedslice.flower.server_app:app",
                  "clientapp": "fedslice.flower.client_app:app"}


def app_pyproject() -> dict:
    """The Flower app's pyproject as a dict; its code is the installed fedslice package."""
    from importlib.metadata import version

    from fedslice import __version__

    return {
        "project": {"name": "fedslice-app", "version": __version__,
                    "description": "fedslice experiments on Flower (fedslice deploy local)",
                    "dependencies": ["fedslice", f"flwr=={version('flwr')}"]},
        "tool": {"flwr": {"app": {"publisher": "fedslice", "components": dict(APP_COMPONENTS),
                                  "config": dict(RUN_CONFIG_DEFAULTS)}}},
    }


def write_app(folder: Path) -> Path:
    """A Flower app folder for ``flwr run`` (just its ``pyproject.toml``); returns ``folder``."""
    import tomli_w

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "pyproject.toml").write_text(tomli_w.dumps(app_pyproject()))
    return folder


def _run_config(path: Path, values: dict) -> Path:
    import tomli_w

    unknown = set(values) - set(RUN_CONFIG_DEFAULTS)
    assert not unknown, unknown
    path.write_text(tomli_w.dumps(values))
    return path


def _collect_logs(fed_dir: Path, run_dir: Path) -> None:
    """Copy Flower's logs (run log, SuperLink, SuperNodes) into ``run_dir/flower``."""
    dest = run_dir / "flower"
    dest.mkdir(exist_ok=True)
    for f in [fed_dir / "run.log", *sorted((fed_dir / "logs").glob("*.log"))]:
        if f.is_file():
            shutil.copy2(f, dest / f.name)


def deploy_local(config: str | Path, *, nodes: int | None = None, overrides: list[str] | None = None,
                 out_dir: str | Path | None = None, tls: bool = False, auth: bool = False,
                 round_timeout: float = 600.0, connect_timeout: float = 120.0,
                 timeout: float | None = None, workdir: str | Path | None = None,
                 simulation: dict | None = None, resume: str | Path | None = None) -> Path:
    """Run one experiment through Flower on loopback; return the run folder.

    ``nodes`` must equal ``federation.num_clients`` (one partition per SuperNode). With
    ``simulation`` (``flwr run --federation-config`` values, e.g.
    ``{"client-resources-num-cpus": 1}``) the SuperNodes are virtual, in Flower's simulation engine (Ray). Flower's files (certificates,
    keys, logs, state) go to ``workdir`` (a temporary folder, removed after a successful run;
    kept and named in the error after a failed one). ``resume``: the staging folder of a run
    that failed or was stopped, continued from its checkpoint (the config must be the run's).
    """
    from fedslice.experiment import load_config
    from fedslice.flower.local import LocalFederation

    overrides = list(overrides or [])
    config = Path(config).absolute()
    cfg = load_config(config, overrides)  # fail on a bad config before starting anything
    if cfg.data.partition == "natural" and "num_clients" not in cfg.federation.model_fields_set:
        raise ConfigError("data.partition = 'natural' takes the number of clients from the data, "
                          "but a deployment starts one SuperNode per client before reading it: "
                          "add --set federation.num_clients=N (the clients `fedslice validate` "
                          "reports)")
    n = nodes or cfg.federation.num_clients
    if n != cfg.federation.num_clients:
        raise ConfigError(
            f"--nodes {n} but federation.num_clients={cfg.federation.num_clients}: in a deployment "
            f"each SuperNode holds one partition; add --set federation.num_clients={n} (and "
            f"federation.clients_per_round <= {n})")
    if cfg.federation.selection == "loss_gap" and cfg.federation.cold_start == "probe":
        raise ConfigError("federation.cold_start='probe' runs in the in-process simulation only "
                          "(fedslice run); on Flower use 'unseen_first'")
    if simulation is not None:
        _check_ray()
    tmp = workdir is None
    work = Path(tempfile.mkdtemp(prefix="fedslice-deploy-") if tmp else workdir).absolute()
    work.mkdir(parents=True, exist_ok=True)
    result_file = work / "result.txt"
    result_file.unlink(missing_ok=True)
    out = Path(out_dir or cfg.output.dir).absolute()
    run_config = _run_config(work / "run_config.toml", {
        "config": str(config), "overrides": ";".join(overrides),
        "out-dir": str(out), "result-file": str(result_file),
        "round-timeout": float(round_timeout), "connect-timeout": float(connect_timeout),
        **({"resume": str(Path(resume).absolute())} if resume else {})})
    limit = timeout or connect_timeout + cfg.federation.rounds * round_timeout + 600.0
    # the ServerApp may read and write only where this command points it (the operator's choice)
    roots = [config.parent, out, work] + ([Path(resume).absolute().parent] if resume else [])
    with terminate_as_interrupt(), LocalFederation(work, n, tls=tls, auth=auth, simulation=simulation,
                                                    server_roots=roots) as fed:
        run_id = fed.submit(write_app(work / "app"), run_config)
        log.info("submitted run %d to %s", run_id, fed.address)
        try:
            status = fed.wait(run_id, limit, finished_hint=result_file.exists)
        finally:
            _save_run_log(fed, run_id, work / "run.log")
    if status != "finished:completed" or not result_file.is_file():
        raise DeploymentError(f"run {run_id} ended with status {status}; logs in {work}:\n"
                              f"{_tail(work / 'run.log')}")
    run_dir = Path(result_file.read_text().strip())
    _collect_logs(work, run_dir)
    if tmp:
        shutil.rmtree(work, ignore_errors=True)
    return run_dir


def _check_ray() -> None:
    try:
        import ray  # noqa: F401
    except ImportError:
        raise DeploymentError("Flower's simulation engine needs Ray: "
                              "pip install 'fedslice[simulation]'") from None


def _save_run_log(fed, run_id: int, path: Path) -> None:
    try:
        path.write_text(fed.run_log(run_id))
    except DeploymentError as e:
        log.warning("could not fetch the log of run %d: %s", run_id, e)


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no run log)"


# --------------------------------------------------------------------------------------------
# CLI: `fedslice deploy local ...`
# --------------------------------------------------------------------------------------------

def add_parser(sub) -> None:
    """Add ``deploy local`` and ``deploy simulation`` to the ``fedslice`` subcommands."""
    dep = sub.add_parser("deploy", help="run an experiment on Flower (deployment or simulation "
                         "engine)")
    where = dep.add_subparsers(dest="target", required=True)
    loc = where.add_parser("local", help="a SuperLink and N SuperNodes on this machine (loopback)")
    loc.add_argument("config")
    loc.add_argument("--nodes", type=int, help="SuperNodes, one per partition "
                     "(default and required: federation.num_clients)")
    loc.add_argument("--tls", action="store_true", help="TLS with certificates made by openssl")
    loc.add_argument("--auth", action="store_true", help="SuperNode authentication (needs --tls)")
    sim = where.add_parser("simulation", help="Flower's simulation engine (Ray): one virtual "
                           "SuperNode per partition (needs fedslice[simulation])")
    sim.add_argument("config")
    sim.add_argument("--cpus-per-client", type=int, default=1, metavar="N",
                     help="CPUs Ray gives each virtual SuperNode (default 1)")
    sim.add_argument("--gpus-per-client", type=float, default=0.0, metavar="N")
    for p in (loc, sim):
        p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
        p.add_argument("--out", help="parent folder of the run folder (default: output.dir)")
        p.add_argument("--round-timeout", type=float, default=600.0, metavar="S")
        p.add_argument("--connect-timeout", type=float, default=120.0, metavar="S",
                       help="how long the ServerApp waits for the SuperNodes")
        p.add_argument("--timeout", type=float, metavar="S", help="limit for the whole run")
        p.add_argument("--workdir", help="keep Flower's files (certificates, logs) here")
        p.add_argument("--resume", metavar="RUN_DIR", help="continue a run that failed or was "
                       "stopped from its checkpoint (its .NAME.partial-PID folder)")


def main(args: argparse.Namespace) -> int:
    """Run ``fedslice deploy local|simulation`` and print the results like ``fedslice run``."""
    from fedslice.report import report

    common = dict(overrides=args.overrides, out_dir=args.out, round_timeout=args.round_timeout,
                  connect_timeout=args.connect_timeout, timeout=args.timeout, workdir=args.workdir,
                  resume=args.resume)
    if args.target == "simulation":
        resources = {"client-resources-num-cpus": args.cpus_per_client,
                     "client-resources-num-gpus": args.gpus_per_client}
        path = deploy_local(args.config, simulation=resources, **common)
    else:
        path = deploy_local(args.config, nodes=args.nodes, tls=args.tls, auth=args.auth, **common)
    print(report(path, plots=False))
    print(f"results: {path}")
    return 0
