"""Benchmark (issue 24): the malformed-reply matrix, cases x methods x (simulation, Flower).

One round of every method on the test suite's tiny BERT (4 clients, each fitted once); for each
way of breaking a reply (tests/malformed.py: REPLY_CASES, and CONTENT_CASES for Flower message
contents) one client's reply is broken and the round is aggregated by the method's strategy (the
simulation) and by the ServerApp's FlowerAdapter (the reply as a Flower message). A cell is
``rejected`` when the round completed with that reply rejected and counted and exactly the other
replies averaged; ``ACCEPTED`` or ``RAISED: ...`` otherwise; ``n/a`` where the case does not apply
(another method's report) or cannot be sent as a message (e.g. an object that is not a reply).

    .venv/bin/python bench/malformed_matrix.py --out bench/results/malformed
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import sys
import tempfile
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

from conftest import save_tiny_model, write_sentiment_tsv  # noqa: E402
from malformed import CONTENT_CASES, REPLY_CASES, FlowerHarness, fit_round  # noqa: E402

from fedslice.methods import METHODS  # noqa: E402


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _encode(reply):
    from flwr.app import ConfigRecord, RecordDict

    from fedslice.flower.codec import ARRAYS, META, state_to_record
    meta = ConfigRecord({"metrics": json.dumps(reply.metrics), "num_examples": reply.num_examples})
    return RecordDict({ARRAYS: state_to_record(reply.arrays), META: meta})


def simulation_cell(f, bad: int, broken) -> str:
    try:
        result = f.aggregate({**f.replies, bad: broken})
    except Exception as e:  # noqa: BLE001 - what the matrix is about
        return f"RAISED: {type(e).__name__}"
    reference = f.aggregate({c: r for c, r in f.replies.items() if c != bad})
    ok = result.invalid == [bad] and result.rejected == 1 and _same(result.state, reference.state)
    return "rejected" if ok else "ACCEPTED"


def flower_cell(f, flower: FlowerHarness, bad: int, content) -> str:
    contents = {c: flower.content(c) for c in f.clients}
    contents[bad] = content
    try:
        state, record = flower.round(contents)
    except Exception as e:  # noqa: BLE001
        return f"RAISED: {type(e).__name__}"
    reference = f.aggregate({c: r for c, r in f.replies.items() if c != bad})
    ok = record["rejected"] == 1 and _same(state, reference.state)
    return "rejected" if ok else "ACCEPTED"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "malformed")
    args = p.parse_args()
    logging.disable(logging.WARNING)  # every rejection is logged: thousands of lines
    torch.set_num_threads(1)
    tmp = Path(tempfile.mkdtemp(prefix="fedslice-malformed-"))
    model, data = save_tiny_model(tmp / "model"), write_sentiment_tsv(tmp / "data")
    methods = sorted(METHODS)
    cells: dict[str, dict[str, dict[str, str]]] = {}
    for method in methods:
        (tmp / method).mkdir()
        f = fit_round(method, "mean", data, model, tmp / method)
        flower = FlowerHarness(f)
        bad = f.clients[-1]
        zero = lambda n: 0  # noqa: E731
        for name, fn in REPLY_CASES.items():
            broken = fn(f.replies[bad], f.context(bad), zero)
            row = cells.setdefault(name, {})
            if broken is None:
                row[method] = {"simulation": "n/a", "flower": "n/a"}
                continue
            try:
                content = _encode(broken)
            except Exception:  # noqa: BLE001 - no client can send it as a message
                content = None
            row[method] = {"simulation": simulation_cell(f, bad, broken),
                           "flower": "n/a" if content is None else flower_cell(f, flower, bad, content)}
        for name, fn in CONTENT_CASES.items():
            content = fn(flower.content(bad), f.context(bad), zero)
            cells.setdefault(f"message: {name}", {})[method] = {
                "simulation": "n/a", "flower": flower_cell(f, flower, bad, content)}
    args.out.mkdir(parents=True, exist_ok=True)
    counts = {"rejected": 0, "other": 0, "n/a": 0}
    lines = ["| case | " + " | ".join(methods) + " |", "|---|" + "---|" * len(methods)]
    for name, row in cells.items():
        shown = []
        for m in methods:
            sim, fl = row[m]["simulation"], row[m]["flower"]
            for v in (sim, fl):
                counts["rejected" if v == "rejected" else "n/a" if v == "n/a" else "other"] += 1
            shown.append(f"{_short(sim)} / {_short(fl)}")
        lines.append(f"| {name} | " + " | ".join(shown) + " |")
    summary = {"machine": platform.platform(), "cases": len(cells), "methods": methods, **counts}
    (args.out / "matrix.json").write_text(json.dumps({"summary": summary, "cells": cells}, indent=2))
    (args.out / "matrix.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    print(json.dumps(summary))
    return 0 if counts["other"] == 0 else 1


def _short(v: str) -> str:
    return {"rejected": "R", "n/a": "-"}.get(v, v)


if __name__ == "__main__":
    sys.exit(main())
