"""The planner's measured steps kept across runs (budgets.step_cache)."""

from __future__ import annotations

import torch

from fedslice.experiment import validate_config


def _cfg(tiny_cfg_dict, folder, **budgets) -> dict:
    tiers = [{"share": 0.5, "name": n, "memory_share": m, "flops_share": f} for n, m, f in
             (("a", 1.0, 1.0), ("b", 0.8, 0.5))]
    return {**tiny_cfg_dict, "lora": {**tiny_cfg_dict["lora"], "ranks": [2, 4]},
            "budgets": {"tiers": tiers, "local_work": [1.0, 0.5], "micro_batches": [1, 2],
                        "checkpointing": True, "precisions": ["none", "int8"],
                        "step_cache": None if folder is None else str(folder), **budgets}}


def _plans(monkeypatch, d):
    """Every client's plan of ``d`` and the steps the planner measured."""
    import fedslice.methods.plan_costs as planner
    from fedslice.api import setup

    calls, step = [], planner.measure_step

    def counted(*args, **kwargs):
        calls.append(1)
        return step(*args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(planner, "measure_step", counted)
        method, _ = setup(validate_config(d))
        return {c: p.to_dict() for c, p in method.plans.items()}, len(calls)


def test_a_second_run_takes_every_step_from_the_cache_and_plans_the_same(tiny_cfg_dict, tmp_path, monkeypatch):
    """A run with budgets.step_cache plans as one without it and keeps its steps; a second run
    (another process would do the same: the key holds no object identity) measures none and
    plans the same; an unreadable entry is measured again."""
    plain, measured = _plans(monkeypatch, _cfg(tiny_cfg_dict, None))
    folder = tmp_path / "steps"
    first, n_first = _plans(monkeypatch, _cfg(tiny_cfg_dict, folder))
    kept = sorted(folder.glob("*.json"))
    assert first == plain and n_first == measured > 0 and len(kept) == measured
    second, n_second = _plans(monkeypatch, _cfg(tiny_cfg_dict, folder))
    assert second == plain and n_second == 0
    kept[0].write_text("{not json")
    third, n_third = _plans(monkeypatch, _cfg(tiny_cfg_dict, folder))
    assert third == plain and n_third == 1


def test_the_key_changes_with_what_determines_a_step(tiny_cfg_dict, tmp_path):
    """The planned model's rank, precision, frozen tensors and checkpointing, the rows, the
    FLOP counter, packing, the run's context (task settings, model config) and the threads each change the key; a model
    planned the same way twice has one key."""
    from fedslice.api import setup
    from fedslice.fl.client import gradient_checkpointing
    from fedslice.methods.plan_records import Knobs
    from fedslice.slicing.planner import batch_key
    from fedslice.slicing.step_cache import StepCache

    method, _ = setup(validate_config(_cfg(tiny_cfg_dict, tmp_path)))
    rows = batch_key(method.task.profile_batch(method.model.config, 2, 16, 0))
    store = StepCache(tmp_path, "task")  # (the planner adds the model config)

    def key(knobs=Knobs(rank=4), rows=rows, flops=True, packed=False, store=store):
        with method.planned_model(knobs) as planned, gradient_checkpointing(planned.model, knobs.checkpointing):
            return store.key(planned.model, rows, flops, (), packed, "whole")

    base = key()
    assert key() == base
    others = [key(Knobs(rank=2)), key(Knobs(rank=4, precision="int8")), key(Knobs(rank=4, depth=0.5)),
              key(Knobs(rank=4, checkpointing=True)), key(flops=False), key(packed=True),
              key(rows=batch_key(method.task.profile_batch(method.model.config, 2, 16, 1))),
              key(store=StepCache(tmp_path, "another task"))]
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(threads + 1)
        others.append(key(store=StepCache(tmp_path, "task")))
    finally:
        torch.set_num_threads(threads)
    assert base not in others and len(set(others)) == len(others)
