"""The CLI reference (docs/cli.md), generated from the argument parser so that it cannot drift:
``python -m fedslice.cli_doc --write docs/cli.md``; ``--check`` (and a test) fails when it is
out of date."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

HEADER = """# CLI reference

Generated from the parser (`python -m fedslice.cli_doc --write docs/cli.md`; a test fails when
it is out of date). Every command takes `-q` (warnings, errors and results only) and `-v`/`-vv`
(more detail). A bad input (config, data, model, run folder) prints one line and exits with code
2; an environment fault (a full disk, a folder without write permission) one line and code 1;
`--debug` shows the traceback ([reliability.md](reliability.md#every-bad-input-is-one-line)).
"""


def _subparsers(p: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in p._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def markdown() -> str:
    from fedslice.cli import build_parser

    old = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = "100"  # argparse wraps at the terminal width: fix it
    try:
        parts = [HEADER]
        for name, sub in _subparsers(build_parser()).items():
            parts.append(f"\n## fedslice {name}\n\n```text\n{sub.format_help().rstrip()}\n```\n")
            for child, p in _subparsers(sub).items():
                parts.append(f"\n### fedslice {name} {child}\n\n```text\n{p.format_help().rstrip()}\n```\n")
    finally:
        if old is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = old
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m fedslice.cli_doc", description=__doc__)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--write", metavar="FILE")
    g.add_argument("--check", metavar="FILE")
    args = p.parse_args(argv)
    text = markdown()
    if args.write:
        Path(args.write).write_text(text)
        return 0
    if Path(args.check).read_text() != text:
        print(f"{args.check} is out of date: run python -m fedslice.cli_doc --write {args.check}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
