"""``fedslice run | validate | compare | report | export | predict | evaluate | deploy``.

User errors (config, data, model) print one message and exit with code 2, environment faults
(a full disk, a read-only folder) one message and code 1; no traceback unless ``--debug``.
"""

from __future__ import annotations

import argparse
import errno
import logging
import os
import signal
import sys
import warnings

from fedslice import __version__
from fedslice.errors import EnvironmentFault, FedsliceError
from fedslice.interrupt import terminate_as_interrupt


def _output_options(suppress: bool) -> argparse.ArgumentParser:
    """-q/-v, accepted before and after the subcommand (``fedslice run -q CONFIG``)."""
    p = argparse.ArgumentParser(add_help=False)
    default = {"default": argparse.SUPPRESS} if suppress else {}
    p.add_argument("-v", "--verbose", action="count", **({"default": 0} | default),
                   help="more detail: -v per-client round details and debug logs of fedslice, "
                        "-vv debug logs of every library")
    p.add_argument("-q", "--quiet", action="store_true", **({"default": False} | default),
                   help="no progress and no informational logs: warnings, errors and results only")
    p.add_argument("--debug", action="store_true", **({"default": False} | default),
                   help="show the traceback of an error (a bad input, a full disk, ...)")
    return p


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="fedslice", description=__doc__.splitlines()[0],
                                parents=[_output_options(False)])
    p.add_argument("--version", action="version", version=f"fedslice {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    common = [_output_options(True)]

    run = sub.add_parser("run", help="run one experiment from a TOML/YAML config", parents=common)
    run.add_argument("config", nargs="?", help="the experiment config (optional with --resume)")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue an interrupted run from its "
                     "checkpoint (output.checkpoint_every); RUN_DIR is its .NAME.partial-PID "
                     "folder or its final path")
    run.add_argument("--allow-data-change", action="store_true",
                     help="with --resume: go on although a data file changed since the "
                          "checkpoint (recorded in metrics.jsonl); refused otherwise")
    run.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                     help="override a config field, e.g. --set federation.rounds=5 (repeatable)")
    run.add_argument("--out", help="parent folder of the run folder (default: output.dir)")
    run.add_argument("--no-progress", action="store_true",
                     help="no bars (terminal) or per-round lines (otherwise)")
    run.add_argument("--dry-run", action="store_true",
                     help="check everything and print the plan, as `fedslice validate`; no training")

    val = sub.add_parser("validate", parents=common,
                         help="load the config, data and model config (no weights); print the plan")
    val.add_argument("config")
    val.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    val.add_argument("--no-timing", action="store_true",
                     help="skip timing one training step of a randomly initialised model")

    pln = sub.add_parser("plan", parents=common,
                         help="each client's plan under the config's [budgets]: predicted peak "
                              "memory, GFLOPs and upload per round, and why it was chosen")
    pln.add_argument("config")
    pln.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    pln.add_argument("--json", metavar="FILE", help="also write every client's plan to FILE")

    cmp = sub.add_parser("compare", help="run several configs on the same partition and seed",
                         parents=common)
    cmp.add_argument("configs", nargs="+", help="config files, or one file with [[variants]]")
    cmp.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    cmp.add_argument("--out")
    cmp.add_argument("--name", help="name of the compare folder")
    cmp.add_argument("--no-progress", action="store_true")

    rep = sub.add_parser("report", help="re-render the table, plots and HTML reports of finished runs",
                         parents=common)
    rep.add_argument("run_dirs", nargs="+")

    exp = sub.add_parser("export", parents=common,
                         help="export a run's trained model: a peft adapter or a merged "
                              "transformers folder (--size: RaFFM's elastic sub-model)")
    exp.add_argument("run_dir")
    exp.add_argument("--format", required=True, choices=("peft", "merged"),
                     help="peft: adapter for PeftModel.from_pretrained(base, DIR); merged: a "
                          "standard transformers folder (no fedslice needed to load it)")
    exp.add_argument("--out", help="folder to write (default: RUN_DIR/export/FORMAT)")
    exp.add_argument("--size", type=float, help="raffm: the elastic sub-model at this FLOPs "
                     "fraction (one of method.elastic_sizes), as a smaller checkpoint")
    exp.add_argument("--allow-partial", action="store_true",
                     help="export an unfinished run from its latest checkpoint (or the "
                          "latest weights a failed run kept)")

    pred = sub.add_parser("predict", parents=common,
                          help="predictions of a run's trained model for a CSV/TSV/JSONL file")
    pred.add_argument("run_dir")
    pred.add_argument("--input", required=True, help="rows to predict, read as the run's data")
    pred.add_argument("--output", help="a .jsonl, .csv or .tsv file (default: JSONL on stdout)")
    pred.add_argument("--batch-size", type=int, help="default: evaluation.batch_size")

    ev = sub.add_parser("evaluate", parents=common,
                        help="the task's metrics of a run's trained model on another dataset, "
                             "or its lm-evaluation-harness scores (--harness)")
    ev.add_argument("run_dir")
    ev.add_argument("--data", help="a file (all its rows), a folder (each "
                    "train/dev/test file) or a hub id, as data.path")
    ev.add_argument("--set", dest="overrides", action="append", default=[], metavar="data.KEY=VALUE",
                    help="change a data.* option for this dataset, e.g. --set data.header=false")
    ev.add_argument("--name", help="written as RUN_DIR/eval-NAME.json (default: the data's name)")
    ev.add_argument("--batch-size", type=int, help="default: evaluation.batch_size (--harness: 1)")
    ev.add_argument("--harness", metavar="TASK[,TASK...]", action="append",
                    help="lm-evaluation-harness tasks instead of --data: lm_eval's names, or "
                         "the local ones fedslice ships (arc_easy_local, ...; docs/harness.md)")
    ev.add_argument("--harness-include", metavar="DIR", action="append", default=[],
                    help="with --harness: a folder of further lm_eval task YAMLs (repeatable)")
    ev.add_argument("--limit", type=float, help="with --harness: at most N examples per task "
                    "(a number below 1: that fraction)")
    ev.add_argument("--num-fewshot", type=int, metavar="K",
                    help="with --harness: K examples in each prompt (default: the task's own)")
    ev.add_argument("--baseline", action="store_true",
                    help="with --harness: also score the untrained model on the same tasks")

    from fedslice.flower.deploy import add_parser as add_deploy_parser
    add_deploy_parser(sub)
    return p


def _configure_logging(verbosity: int, quiet: bool) -> None:
    """fedslice's own messages at INFO (what it does: data carved, distillation started, ...),
    other libraries at WARNING; -q: warnings only; -v: fedslice DEBUG; -vv: everything DEBUG."""
    if quiet:
        verbosity = -1
    root = [logging.WARNING, logging.WARNING, logging.INFO, logging.DEBUG][min(verbosity, 2) + 1]
    own = [logging.WARNING, logging.INFO, logging.DEBUG, logging.DEBUG][min(verbosity, 2) + 1]
    logging.basicConfig(level=root, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("fedslice").setLevel(own)
    if verbosity <= 0:
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=UserWarning)


def _main(args: argparse.Namespace) -> int:
    from fedslice.experiment import load_config, load_variants

    if args.command == "report":
        from fedslice.html_report import write_reports
        from fedslice.report import report
        print(report(args.run_dirs))
        write_reports(args.run_dirs)
        return 0
    if args.command == "export":
        from fedslice.export import export_run
        path = export_run(args.run_dir, args.format, args.out, size=args.size,
                          allow_partial=args.allow_partial)
        print(f"exported: {path}")
        return 0
    if args.command == "predict":
        from fedslice.inference import predict
        records = predict(args.run_dir, args.input, args.output, batch_size=args.batch_size)
        if args.output:
            print(f"{len(records)} predictions: {args.output}")
        return 0
    if args.command == "evaluate" and args.harness:
        if args.data:
            raise FedsliceError("evaluate: give --data or --harness, not both")
        from fedslice.harness import evaluate_harness, summary_lines
        limit = args.limit if args.limit is None or args.limit < 1 else int(args.limit)
        path, entries = evaluate_harness(args.run_dir, args.harness, include=args.harness_include,
                                         limit=limit, num_fewshot=args.num_fewshot,
                                         baseline=args.baseline, batch_size=args.batch_size)
        print("\n".join(summary_lines(entries)))
        print(f"results: {path}")
        return 0
    if args.command == "evaluate":
        harness_only = [f for f, v in (("--harness-include", args.harness_include),
                                       ("--limit", args.limit), ("--num-fewshot", args.num_fewshot),
                                       ("--baseline", args.baseline)) if v not in (None, False, [])]
        if harness_only or not args.data:
            raise FedsliceError(f"evaluate: {', '.join(harness_only)} go with --harness"
                                if harness_only else "evaluate needs --data FILE or --harness TASKS")
        from fedslice.inference import evaluate
        path, result = evaluate(args.run_dir, args.data, args.overrides, name=args.name,
                                batch_size=args.batch_size)
        primary = result["primary_metric"]
        for split, m in result["metrics"].items():
            print(f"{split}: {primary} {m.get(primary)} ({result['examples'][split]} examples)")
        print(f"results: {path}")
        return 0
    if args.command == "deploy":
        from fedslice.flower.deploy import main as deploy_main
        return deploy_main(args)
    if args.command == "run" and args.config is None and not args.resume:
        raise FedsliceError("fedslice run needs a config file (or --resume RUN_DIR)")
    if args.command == "run" and args.allow_data_change and not args.resume:
        raise FedsliceError("--allow-data-change goes with --resume RUN_DIR")
    if args.command == "plan":
        from fedslice.plan import budget_plan
        cfg = load_config(args.config, args.overrides)
        print(budget_plan(cfg, args.json))
        return 0
    if args.command == "validate" or (args.command == "run" and args.dry_run):
        from fedslice.plan import make_plan
        cfg = load_config(args.config, args.overrides)
        print(make_plan(cfg, timing=not getattr(args, "no_timing", False)).render())
        return 0
    from fedslice.api import compare_experiments, run_experiment

    progress = False if args.no_progress or args.quiet else None
    verbose = args.verbose > 0
    if args.command == "run":
        if args.resume:
            from fedslice.api import resume_experiment
            path = resume_experiment(args.resume, args.config, args.overrides, progress=progress,
                                     verbose=verbose, allow_data_change=args.allow_data_change)
        else:
            cfg = load_config(args.config, args.overrides)
            path = run_experiment(cfg, args.out, progress=progress, verbose=verbose)
        from fedslice.report import report
        print(report(path, plots=False))
        print(f"results: {path}")
        return 0
    cfgs = [c for f in args.configs for c in load_variants(f, args.overrides)]
    path, table = compare_experiments(cfgs, args.out, progress=progress, name=args.name,
                                      verbose=verbose)
    print(table)
    print(f"results: {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    # read once, when torch loads (it is not loaded yet): tensors of 2 MB and more get their own
    # page-aligned, huge-page memory. On the SST-2 workload peak memory 0.83x at the same speed
    # (BENCHMARKS.md "Memory"); THP_MEM_ALLOC_ENABLE=0 in the environment keeps torch's default
    os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    # oneDNN's primitive caches, bounded before any primitive exists (fedslice.onednn)
    from fedslice.heap import limit_primitive_caches
    limit_primitive_caches()
    args = build_parser().parse_args(argv)
    _configure_logging(args.verbose, args.quiet)
    try:
        with terminate_as_interrupt():  # `kill PID` unwinds like Ctrl-C: finished work is kept
            return _main(args)
    except KeyboardInterrupt as e:
        if argv is None:  # the process ends: a further Ctrl-C must not interrupt exit handlers
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        print("fedslice: interrupted", file=sys.stderr)
        return 128 + signal.SIGTERM if str(e) == f"signal {signal.SIGTERM}" else 130
    except (FedsliceError, OSError) as e:
        if args.debug:
            raise
        print(f"fedslice: error: {describe_error(e)}", file=sys.stderr)
        return 1 if isinstance(e, (EnvironmentFault, OSError)) else 2


#: what to do about an OSError, by errno
_OS_HINTS = {errno.ENOSPC: "the disk is full: free space (or choose another --out) and run again",
             errno.EDQUOT: "the disk quota is exhausted: free space and run again",
             errno.EACCES: "no permission: choose a folder you can write (--out) or change its "
                           "permissions",
             errno.EPERM: "no permission: choose a folder you can write (--out) or change its "
                          "permissions",
             errno.EROFS: "a read-only file system: choose another folder (--out)"}


def describe_error(e: BaseException) -> str:
    """One line for a user error or an environment fault (an OSError: what, where, what to do)."""
    if isinstance(e, OSError) and not isinstance(e, FedsliceError):
        where = f" ({e.filename})" if e.filename else ""
        what = e.strerror or str(e)
        hint = _OS_HINTS.get(e.errno)
        return f"{what}{where}" + (f": {hint}" if hint else "")
    return str(e)


if __name__ == "__main__":
    sys.exit(main())
