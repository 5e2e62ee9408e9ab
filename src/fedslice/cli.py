"""``fedslice run | compare | report | deploy``.

User errors (config, data, model) print one message and exit with code 2, no traceback.
"""

from __future__ import annotations

import argparse
import logging
import sys
import warnings

from fedslice.errors import FedsliceError


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedslice", description=__doc__.splitlines()[0])
    p.add_argument("-v", "--verbose", action="count", default=0, help="-v info, -vv debug logs")
    sub = p.add_subparsers(dest="command", required=True)

    run = sub.add_parser("run", help="run one experiment from a TOML/YAML config")
    run.add_argument("config", nargs="?", help="the experiment config (optional with --resume)")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run from its "
                     "checkpoint (output.checkpoint_every); RUN_DIR is its .NAME.partial-PID "
                     "folder or its final path")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config field, e.g. --set federation.rounds=5 (repeatable)")
    run.add_argument("--out", help="parent folder of the run folder (default: output.dir)")
    run.add_argument("--no-progress", action="store_true")

    cmp = sub.add_parser("compare", help="run several configs on the same partition and seed")
    cmp.add_argument("configs", nargs="+", help="config files, or one file with [[variants]]")
    cmp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    cmp.add_argument("--out")
    cmp.add_argument("--name", help="name of the compare folder")
    cmp.add_argument("--no-progress", action="store_true")

    rep = sub.add_parser("report", help="re-render the table and plots of finished runs")
    rep.add_argument("run_dirs", nargs="+")

    from fedslice.flower.deploy import add_parser as add_deploy_parser
    add_deploy_parser(sub)
    return p


def _configure_logging(verbosity: int) -> None:
    level = [logging.WARNING, logging.INFO, logging.DEBUG][min(verbosity, 2)]
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    if verbosity == 0:
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning)


def _main(args: argparse.Namespace) -> int:
    from fedslice.config import load_config, load_variants

    if args.command == "report":
        from fedslice.report import report
        print(report(args.run_dirs))
        return 0
    if args.command == "deploy":
        from fedslice.flower.deploy import main as deploy_main
        return deploy_main(args)
    from fedslice.api import compare_experiments, run_experiment

    progress = False if args.no_progress else None
    if args.command == "run":
        if args.resume:
            from fedslice.api import resume_experiment
            path = resume_experiment(args.resume, args.config, args.overrides, progress=progress)
        elif args.config is None:
            raise FedsliceError("fedslice run needs a config file (or --resume RUN_DIR)")
        else:
            cfg = load_config(args.config, args.overrides)
            path = run_experiment(cfg, args.out, progress=progress)
        from fedslice.report import report
        print(report(path, plots=False))
        print(f"results: {path}")
        return 0
    cfgs = [c for f in args.configs for c in load_variants(f, args.overrides)]
    path, table = compare_experiments(cfgs, args.out, progress=progress, name=args.name)
    print(table)
    print(f"results: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    _configure_logging(args.verbose)
    try:
        return _main(args)
    except FedsliceError as e:
        print(f"fedslice: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedslice: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
