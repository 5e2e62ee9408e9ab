"""bench/llm_instruct.py's bookkeeping (issue 57, part 5), without a model: rows scored at
different limits pair up question by question at every limit both hold, and the planner rows'
step cache sits beside the results (``--out``) unless ``--step-cache`` names one."""

from __future__ import annotations

import argparse
import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench" / "llm_instruct.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("llm_instruct", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def scored(limit: int, arc: list[float], mmlu: list[float]) -> dict:
    per = {"arc_easy_local": {"acc": arc}, "mmlu_local": {"acc": mmlu}}
    return {"harness_per_example": per, "harness_limit": limit}


def test_rows_pair_at_every_limit_both_were_scored_at(bench):
    base100 = scored(100, [1.0] * 50 + [0.0] * 50, [0.0] * 100)
    dense50 = scored(50, [1.0] * 48 + [0.0] * 2, [0.0] * 50)
    dense100 = scored(100, [1.0] * 48 + [0.0] * 2 + [1.0] * 4 + [0.0] * 46, [1.0] + [0.0] * 99)
    rows = {
        "base": {**base100, "harness_by_limit": {"50": {"harness": {}}, "100": base100}},
        "dense": {**dense100, "harness_by_limit": {"50": dense50, "100": dense100}},
        "p30": {**scored(50, [1.0] * 49 + [0.0], [0.0] * 50),
                "harness_by_limit": {"50": scored(50, [1.0] * 49 + [0.0], [0.0] * 50)}},
        "natural-base": {}, "alone": {},
    }
    assert sorted(bench.per_example_at(rows["dense"])) == [50, 100]
    assert sorted(bench.per_example_at(rows["base"])) == [100]  # the 50 kept no questions
    lines = [x for x in bench.paired_lines(rows, ["arc_easy_local", "mmlu_local"]) if x.startswith("- ")]
    assert lines == [
        # dense − base at 100: arc +2 questions right (-2 of the first 50, +4 after), mmlu +1
        "- dense − base (at 100): arc_easy_local acc +2.00 ± 2.45 pt (6 of 100 answers differ); "
        "mmlu_local acc +1.00 ± 1.00 pt (1 of 100 answers differ)",
        # p30 was scored at 50 only: it pairs with dense's 50, not with base (no 50 kept)
        "- p30 − dense (at 50): arc_easy_local acc +2.00 ± 2.00 pt (1 of 50 answers differ); "
        "mmlu_local acc +0.00 ± 0.00 pt (0 of 50 answers differ)",
    ]


def test_the_planner_rows_share_a_step_cache_beside_the_results(bench, tmp_path):
    args = argparse.Namespace(out=tmp_path / "out", step_cache=None)
    assert bench.step_cache(args) == (tmp_path / "out" / "plan_steps").resolve()
    b = bench.budgets([{"name": "30%"}], bench.PLANNER, bench.step_cache(args))
    assert b["step_cache"] == str((tmp_path / "out" / "plan_steps").resolve())
    assert b["precisions"] == ["none", "int8"] and "ranks" not in b
    args.step_cache = tmp_path / "cache"
    assert bench.step_cache(args) == (tmp_path / "cache").resolve()
