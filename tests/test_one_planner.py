"""One planner (issue 58 part 1): ``method.tiers`` (raffm's sub-model tiers, fedpetuning's rank
tiers) and ``method.budget_distribution`` are spellings of ``[budgets]``, planned by the one
budget planner (:mod:`fedslice.methods.planner`), with the same results as the separate tier
planner gave for the same budgets.

``tests/data/one_planner_digests.json`` holds what the tier planner (``slicing/planner.py``'s
``Planner``, retired after 2093b5f) gave from the old spellings on AVX2: every client's plan and
the run's digest (as tests/test_digest.py takes it). Each case now runs the equivalent
``[budgets]`` table.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from conftest import method_options
from test_digest import digest
from fedslice.api import run_experiment
from fedslice.experiment import validate_config

DIGESTS = Path(__file__).parent / "data" / "one_planner_digests.json"

DEFAULT_TIERS = [{"share": 0.25, "flops_share": f} for f in (0.25, 0.5, 0.75, 1.0)]
#: what the tier planner never varied: every client trains the whole round as one batch
FIXED = {"local_work": [1.0], "micro_batches": [1], "checkpointing": False}
RAFFM = {**FIXED, "width_steps": 48, "on_infeasible": "sit_out"}

#: case -> (method options, lora options, the equivalent [budgets] table)
CASES = {
    # raffm's default tiers (four of 0.25 .. 1.0 of the full model's FLOPs), 48 widths
    "raffm-default": ({"reorder_every": 1}, {}, {"tiers": DEFAULT_TIERS, **RAFFM}),
    # width and rank together
    "raffm-ranks": ({"reorder_every": 1, "width_steps": 4}, {"ranks": [2, 4]},
                    {"tiers": [{"share": 0.5, "flops_share": 0.4}, {"share": 0.5, "flops_share": 1.0}],
                     **RAFFM, "width_steps": 4}),
    "fedpetuning-ranks": ({}, {"ranks": [2, 4]},
                          {"tiers": [{"share": 0.5, "flops_share": 0.98}, {"share": 0.5, "flops_share": 1.0}],
                           **FIXED}),
    # every client draws its FLOPs share
    "raffm-drawn": ({"reorder_every": 1}, {}, {"flops_share_range": [0.3, 1.0], **RAFFM}),
    "raffm+heads-default": ({"sparsity": 0.5}, {}, {"tiers": DEFAULT_TIERS, **RAFFM, "sparsities": [0.5],
                                                    "importance_sources": ["pass"]}),
}
OLD = {  # the same budgets as the tier planner read them (the spellings)
    "raffm-default": {},
    "raffm-ranks": {"tiers": [{"share": 0.5, "flops": 0.4}, {"share": 0.5, "flops": 1.0}]},
    "fedpetuning-ranks": {"tiers": [{"share": 0.5, "flops": 0.98}, {"share": 0.5, "flops": 1.0}]},
    "raffm-drawn": {"budget_distribution": {"low": 0.3, "high": 1.0}},
    "raffm+heads-default": {},
}


def case_config(case: str, tiny_cfg_dict, tmp_path, spelling: str) -> dict:
    opts, lora, budgets = CASES[case]
    method = case.split("-")[0]
    d = json.loads(json.dumps(tiny_cfg_dict))
    d["federation"] = {**d["federation"], "num_clients": 4, "clients_per_round": 2, "rounds": 2,
                       "local_steps": 2, "pack": False}
    d["lora"] = {**d["lora"], **lora}
    base = method_options("raffm" if method.startswith("raffm") else method, tmp_path)
    base = {k: v for k, v in base.items() if k not in ("tiers", "width_steps")}
    d["method"] = {"name": method, **base, **opts}
    if spelling == "old":
        d["method"].update(OLD[case])
    else:
        d["budgets"] = budgets
    d["name"] = f"one-planner-{case}"
    return d


@pytest.fixture(scope="module")
def stored():
    return json.loads(DIGESTS.read_text())


def client_plans(run: Path) -> dict[str, dict]:
    """Client -> its sub-model's mean heads and FFN units and its LoRA rank (the run's plans)."""
    out = {}
    for group in json.loads((run / "summary.json").read_text())["plans"]:
        plan = group["plan"]
        for c in group["clients"]:
            out[str(c)] = {"heads_mean": plan.get("heads_mean"), "ffn_mean": plan.get("ffn_mean"),
                           "rank": plan.get("rank")}
    return out


@pytest.mark.parametrize("case", list(CASES))
def test_the_budgets_table_trains_as_the_tier_planner_did(case, tiny_cfg_dict, stored, tmp_path):
    """Where the one planner gives every client the tier planner's plan, the run is
    bit-identical. The one planner predicts a plan's FLOPs on the data's batches, the tier
    planner measured a synthetic batch of data.max_length tokens: on a grid of 48 widths the two
    can rank a client's budget one width apart (a client's FFN units within 64/48 of the
    other's; said in docs/planner.md), and only there may the plans differ."""
    from safetensors.torch import load_file

    cfg = validate_config(case_config(case, tiny_cfg_dict, tmp_path, "new"))
    run = run_experiment(cfg, tmp_path / "runs", progress=False)
    got, sums = digest(load_file(str(run / "final_trainable.safetensors")))
    plans, old = client_plans(run), stored["plans"][case]
    # the tier planner sent no rank where lora.ranks is unset: every client trained at lora.r
    old = {c: {**p, "rank": p["rank"] or cfg.lora.r} for c, p in old.items()}
    plans = {c: {**p, "rank": p["rank"] or cfg.lora.r} for c, p in plans.items()}
    if plans != old:
        assert CASES[case][2].get("width_steps") == 48, (case, plans, old)
        for c, p in plans.items():
            assert p["heads_mean"] == old[c]["heads_mean"] and p["rank"] == old[c]["rank"], (c, p, old[c])
            assert abs(p["ffn_mean"] - old[c]["ffn_mean"]) <= math.ceil(64 / 48), (c, p, old[c])
        return
    kinds = stored["digests"][case]
    capability = torch.backends.cpu.get_cpu_capability()
    want = kinds.get(capability) or next(iter(kinds.values()))
    assert sorted(sums) == sorted(want["sums"]), "the trained tensors' names changed"
    if capability in kinds:
        assert got == want["sha256"], (
            f"{case}: differs from the tier planner's run; largest sum difference "
            f"{max(abs(sums[k] - want['sums'][k]) for k in sums):.3g}")
    else:
        for k, v in want["sums"].items():
            assert sums[k] == pytest.approx(v, rel=1e-5, abs=1e-6), k


@pytest.mark.parametrize("case", list(CASES))
def test_a_spelling_reads_as_its_budgets_table(case, tiny_cfg_dict, tmp_path):
    """The old spelling's config holds the [budgets] table it means and nothing of the old
    options, and a config written back reads the same."""
    old = validate_config(case_config(case, tiny_cfg_dict, tmp_path, "old"))
    new = validate_config(case_config(case, tiny_cfg_dict, tmp_path, "new"))
    assert old.budgets.model_dump() == new.budgets.model_dump()
    assert getattr(old.method, "tiers", None) is None
    assert getattr(old.method, "budget_distribution", None) is None
    again = validate_config(old.model_dump())
    assert again.budgets.model_dump() == new.budgets.model_dump()


def test_a_spelling_and_a_budgets_table_together_are_refused(tiny_cfg_dict, tmp_path):
    from fedslice.errors import ConfigError

    d = case_config("raffm-ranks", tiny_cfg_dict, tmp_path, "old")
    d["budgets"] = {"tiers": [{"share": 1.0, "flops_share": 0.5}]}
    with pytest.raises(ConfigError, match=r"method\.tiers and budgets.*remove method\.tiers"):
        validate_config(d)
