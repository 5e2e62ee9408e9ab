"""A planner's step measured on the model cut to a few blocks and extrapolated per block
(fedslice.slicing.block_steps): exact on identical blocks, plans as the whole model's."""

from __future__ import annotations

import itertools
import logging
from dataclasses import replace

import pytest
import torch

from conftest import save_tiny_model, smollm2_tokenizer, tiny_lm_config
from fedslice.experiment import validate_config


@pytest.fixture(scope="module")
def deep_llama(tmp_path_factory):
    """The tiny LLaMA with 12 blocks."""
    import transformers as T

    folder = tmp_path_factory.mktemp("deep-llama")
    tok = smollm2_tokenizer()
    config = tiny_lm_config("llama", len(tok), tok.pad_token_id, tok.eos_token_id)
    config.num_hidden_layers = 12
    torch.manual_seed(0)
    T.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def chat_data(tmp_path_factory):
    from test_chat import write_chat_jsonl

    return write_chat_jsonl(tmp_path_factory.mktemp("chat"))


KNOBS = {"adapter_depths": [1.0, 0.5], "checkpointing": True, "precisions": ["none", "int8"]}


def _llama_cfg(deep_llama, chat_data, tmp_path, **budgets) -> dict:
    from test_chat import chat_cfg

    tiers = [{"share": 1.0, "name": "all", "memory_share": 1.0}]
    return chat_cfg(chat_data, deep_llama, tmp_path, lora={"ranks": [2, 4]},
                    budgets={"tiers": tiers, **KNOBS, **budgets})


def test_the_extrapolation_is_the_cheapest_that_saves_half_the_blocks():
    from fedslice.slicing.block_steps import extrapolation

    assert extrapolation([30]).counts == ((1,), (2,)) and extrapolation([30]).weights == (29,)
    half = extrapolation([15, 15])  # adapters in the top half: one block of each, then two
    assert half.counts == ((1, 1), (2, 2)) and half.weights == (14,)
    odd = extrapolation([7, 23])  # no common factor: one more block of each run in turn
    assert odd.counts == ((1, 1), (2, 1), (1, 2)) and odd.weights == (6, 22)
    assert extrapolation([2]) is None and extrapolation([4, 4]) is None  # measured whole


def _steps(method, batch, knobs, packed: bool = False):
    """(whole, extrapolated, the cut models' blocks) steps of ``knobs``' planned model."""
    from contextlib import nullcontext

    from fedslice.data.packing import packed_training
    from fedslice.fl.client import gradient_checkpointing
    from fedslice.measure.flops import head_segments
    from fedslice.slicing.block_steps import extrapolated_step, plan_for
    from fedslice.slicing.planner import measure_step

    with method.planned_model(knobs) as planned, gradient_checkpointing(planned.model, knobs.checkpointing), \
            (packed_training(planned.model) if packed else nullcontext()):
        head = head_segments(planned.model)
        blocks = []

        def step(model):
            blocks.append(len(method.arch.blocks(model)))
            return measure_step(model, batch, method.task.loss, True, head)

        whole = step(planned.model)
        how = plan_for(planned.model, method.arch)
        return whole, extrapolated_step(planned.model, method.arch, step, how), blocks[1:], how


def test_flops_and_saved_memory_extrapolate_exactly_from_cut_models(deep_llama, chat_data, tmp_path):
    """Over ranks, precisions, adapter depths and checkpointing of a 12-block LLaMA, the step
    extrapolated from the model cut to one and two blocks of each kind equals the whole
    model's, every field exactly (FLOPs, attention's and the head's, saved bytes, training
    state, parameter counts), measuring at most half the blocks; FLOPs grow by the same amount
    with each identical block."""
    from fedslice.api import setup
    from fedslice.methods.plan_records import Knobs
    from fedslice.slicing.block_steps import cut_to
    from fedslice.slicing.planner import measure_step

    method, _ = setup(validate_config(_llama_cfg(deep_llama, chat_data, tmp_path)))
    batch = method.task.profile_batch(method.model.config, 2, 32, 0)
    for rank, precision, depth, ckpt in itertools.product([2, 4], ["none", "int8"], [1.0, 0.5], [False, True]):
        knobs = Knobs(rank=rank, precision=precision, depth=depth, checkpointing=ckpt)
        whole, extrapolated, blocks, how = _steps(method, batch, knobs)
        assert extrapolated == whole, knobs
        assert whole.flops > 0 and whole.saved_mb > 0 and whole.attention > 0 and whole.head > 0
        assert [n for _, n in how[0]] == ([12] if depth == 1.0 else [6, 6]), knobs
        assert sum(blocks) <= 6, (knobs, blocks)
    flops = []
    for n in range(1, 5):
        with cut_to(method.model, method.arch, range(n)):
            flops.append(measure_step(method.model, batch, method.task.loss, True).flops)
    assert len({b - a for a, b in zip(flops, flops[1:])}) == 1 and flops[1] > flops[0]
    assert len(method.arch.blocks(method.model)) == 12  # put back


def test_an_encoder_extrapolates_exactly_too(tiny_cfg_dict, tmp_path):
    """A 6-block BERT classifier (its head trains): the extrapolated step is the whole one."""
    from fedslice.api import setup
    from fedslice.methods.plan_records import Knobs

    d = {**tiny_cfg_dict, "model": {"name": str(save_tiny_model(tmp_path / "bert6", num_layers=6))},
         "budgets": {"tiers": [{"share": 1.0, "name": "all", "memory_share": 1.0}], "checkpointing": True}}
    method, _ = setup(validate_config(d))
    batch = method.task.profile_batch(method.model.config, 2, 16, 0)
    for ckpt in (False, True):
        whole, extrapolated, blocks, _ = _steps(method, batch, Knobs(rank=4, checkpointing=ckpt))
        assert extrapolated == whole and blocks == [1, 2]


def _plans(monkeypatch, d: dict, whole: bool):
    """Every client's plan of ``d`` and the blocks the planner's measured steps ran (``whole``:
    every step on the whole model, as before extrapolation)."""
    import fedslice.methods.plan_costs as planner
    from fedslice.api import setup

    from fedslice.models.arch import arch_for

    blocks, step = [], planner.measure_step

    def counted(model, *args, **kwargs):
        blocks.append(len(arch_for(model).blocks(model)))
        return step(model, *args, **kwargs)

    with monkeypatch.context() as m:
        m.setattr(planner, "measure_step", counted)
        if whole:
            m.setattr(planner, "plan_for", lambda model, arch: None)
        method, _ = setup(validate_config(d))
        return {c: p.to_dict() for c, p in method.plans.items()}, sum(blocks)


@pytest.mark.parametrize("pack", [True, False])
def test_a_planner_extrapolating_plans_as_one_measuring_whole_models(deep_llama, chat_data, tmp_path,
                                                                     monkeypatch, pack):
    """Three tiers of a chat model of 12 blocks over ranks, precisions, adapter depths, local
    work, micro-batches and checkpointing, packed or not: every plan, its predicted costs and
    its reason equal those of the planner measuring whole models, its steps running fewer
    blocks (the plans chosen verified whole included)."""
    tiers = [{"share": s, "name": n, "memory_share": m, "flops_share": f} for n, s, m, f in
             (("a", 0.34, 1.0, 1.0), ("b", 0.33, 0.8, 0.5), ("c", 0.33, 0.6, 0.3))]
    d = _llama_cfg(deep_llama, chat_data, tmp_path, tiers=tiers, local_work=[1.0, 0.75, 0.5, 0.25],
                   micro_batches=[1, 2, 4])
    d["federation"]["pack"] = pack
    by_blocks, few = _plans(monkeypatch, d, whole=False)
    whole, every = _plans(monkeypatch, d, whole=True)
    assert by_blocks == whole
    assert len({p["reason"] for p in whole.values()}) == 3
    assert few < every, (few, every)  # 12 blocks: 3 or 6 a step; the plans chosen are verified whole


def test_an_extrapolation_the_whole_model_disproves_is_dropped(deep_llama, chat_data, tmp_path, monkeypatch,
                                                               caplog):
    """Extrapolated memory below the truth (a model whose blocks did not add up): the plan
    chosen is measured whole, the difference is said, and the search runs again on whole
    models: the plans are those of a planner measuring whole models."""
    import fedslice.methods.plan_costs as planner

    tiers = [{"share": 0.5, "name": n, "memory_share": m} for n, m in (("a", 1.0), ("b", 0.7))]
    d = _llama_cfg(deep_llama, chat_data, tmp_path, tiers=tiers, local_work=[1.0, 0.5])
    whole, _ = _plans(monkeypatch, d, whole=True)
    step = planner.extrapolated_step
    monkeypatch.setattr(planner, "extrapolated_step", lambda *a, **k: replace(step(*a, **k), saved_mb=0.0))
    with caplog.at_level(logging.WARNING, logger="fedslice.methods.planner"):
        wrong, _ = _plans(monkeypatch, d, whole=False)
    assert wrong == whole
    assert "differ from the whole model's" in caplog.text
