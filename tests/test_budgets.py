"""Client budgets and the planner (issue 34, part 2): ``[budgets]``, :mod:`fedslice.methods.planner`.

What is checked: bad budgets are refused at load naming the row and field; tiers are placed as
their shares say; the two memory savings a plan may switch on (micro-batches, gradient
checkpointing) leave the update unchanged; a planned run trains every client at its plan, and
each client's measured peak memory is within 10% of the prediction, its upload exactly the
predicted bytes (at most, for the head stage: the prediction is the most a client of that
sparsity sends), its FLOPs within 2% on data of one length; a budget no plan fits is a
ConfigError naming the client, its budget and the cheapest plan's cost; ``fedslice plan``.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from fedslice.api import run_experiment
from fedslice.errors import ConfigError
from fedslice.experiment import validate_config
from fedslice.fl.client import is_checkpointing
from fedslice.methods.budgets import client_budgets, read_budget_csv


def _cfg(tiny_cfg_dict, budgets, method="fedpetuning", **extra) -> dict:
    d = json.loads(json.dumps(tiny_cfg_dict))
    d["federation"] = {**d["federation"], "num_clients": 4, "clients_per_round": 4, "rounds": 1,
                       "local_steps": 2, "pack": False}
    d["method"] = {"name": method}
    d["budgets"] = budgets
    for k, v in extra.items():
        d[k] = {**d.get(k, {}), **v}
    return d


# -- bad input ----------------------------------------------------------------------------------
@pytest.mark.parametrize("budgets,field", [
    ({"tiers": [{"share": 1.0}]}, "budgets.tiers.0"),
    ({"tiers": [{"share": 1.0, "memory_mb": -5}]}, "budgets.tiers.0.memory_mb"),
    ({"tiers": [{"share": 1.0, "gflops_per_round": 0}]}, "budgets.tiers.0.gflops_per_round"),
    ({"tiers": [{"share": 0.5, "memory_mb": 10}]}, "budgets.tiers"),
    ({"tiers": [{"share": 1.0, "memory_mb": 10}], "csv": "x.csv"}, "budgets"),
    ({}, "budgets"),
    ({"tiers": [{"share": 1.0, "memory_mb": 10}], "sparsities": [1.0]}, "budgets.sparsities"),
    ({"tiers": [{"share": 1.0, "memory_mb": 10}], "micro_batches": [3]}, "micro_batches"),
])
def test_bad_budgets_are_refused_at_load_naming_the_field(tiny_cfg_dict, budgets, field):
    with pytest.raises(ConfigError) as e:
        validate_config(_cfg(tiny_cfg_dict, budgets))
    assert field in str(e.value), str(e.value)


def test_budgets_refuse_a_method_that_does_not_plan_and_method_tiers(tiny_cfg_dict):
    tiers = {"tiers": [{"share": 1.0, "memory_mb": 100}]}
    with pytest.raises(ConfigError, match="budgets: method fedavg does not plan"):
        validate_config(_cfg(tiny_cfg_dict, tiers, method="fedavg"))
    d = _cfg(tiny_cfg_dict, tiers, method="raffm")
    d["method"]["tiers"] = [{"share": 1.0, "flops": 0.5}]
    with pytest.raises(ConfigError, match="method.tiers and budgets"):
        validate_config(d)


@pytest.mark.parametrize("text,message", [
    ("client,memory_mb\n0,100\n1,100\n7,100\n3,100\n", "row 4, client: 7 is not a client"),
    ("client,memory_mb\n0,100\n1,abc\n2,100\n3,100\n", "row 3, memory_mb: 'abc' is not a number"),
    ("client,memory_mb\n0,100\n1,-1\n2,100\n3,100\n", "row 3, memory_mb: -1 is not a positive"),
    ("client,memory_mb\n0,100\n0,100\n2,100\n3,100\n", "row 3, client: client 0 has a second row"),
    ("client,memory_mb\n0,100\n1,100\n2,100\n", "no row for client(s) [3]"),
    ("id,memory_mb\n0,100\n", "no `client` column"),
    ("client,ram\n0,100\n", "no budget column"),
    ("client,memory_mb,disk\n0,100,1\n", "unknown column(s) ['disk']"),
    ("client,memory_mb,upload_mb_per_round\n0,100,\n1,,\n2,1,1\n3,1,1\n", "row 3: no budget"),
])
def test_a_bad_budget_csv_names_the_row_and_field(tmp_path, text, message):
    path = tmp_path / "budgets.csv"
    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        read_budget_csv(path, 4)
    assert message in str(e.value) and str(path) in str(e.value), str(e.value)


def test_csv_budgets_are_per_client_and_empty_cells_are_no_limit(tmp_path):
    path = tmp_path / "b.csv"
    path.write_text("client,memory_mb,upload_mb_per_round\n1,200,\n0,100,0.5\n")
    b = read_budget_csv(path, 2)
    assert b[0].limits() == {"memory_mb": 100.0, "upload_mb_per_round": 0.5}
    assert b[1].limits() == {"memory_mb": 200.0} and b[1].field == "budgets.csv row 2"


def test_tiers_get_their_shares_of_the_clients_reproducibly(tiny_cfg_dict):
    cfg = validate_config(_cfg(tiny_cfg_dict, {"tiers": [
        {"share": 0.3, "memory_mb": 1}, {"share": 0.7, "memory_mb": 2, "name": "big"}]}))
    a = client_budgets(cfg.budgets, 10, seed=0)
    assert sorted(t for t, _ in a.values()) == [0] * 3 + [1] * 7
    assert a == client_budgets(cfg.budgets, 10, seed=0)
    assert {b.name for t, b in a.values() if t == 1} == {"big"}


# -- what a plan switches on leaves the update unchanged -----------------------------------------
def _tiny_model(tiny_model_dir):
    from transformers import AutoModelForSequenceClassification
    model = AutoModelForSequenceClassification.from_pretrained(tiny_model_dir, num_labels=2)
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def _trainable(model):
    for n, p in model.named_parameters():
        # not the key bias: softmax ignores it, its gradient is rounding noise that AdamW scales up
        p.requires_grad = ("classifier" in n or "layer.1." in n) and "key.bias" not in n
    return model, {n: p for n, p in model.named_parameters() if p.requires_grad}


def _train(tiny_model_dir, tiny_data_dir, **cfg):
    from fedslice.data.batching import TokenizedSplit
    from fedslice.fl.client import train_local
    from transformers import AutoTokenizer

    model, params = _trainable(_tiny_model(tiny_model_dir))
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    lines = (tiny_data_dir / "train.tsv").read_text().splitlines()[1:25]
    enc = tok([line.split("\t")[0] for line in lines], truncation=True, max_length=16)
    data = TokenizedSplit([torch.tensor(x) for x in enc["input_ids"]], None,
                          torch.tensor([int(line.split("\t")[1]) for line in lines]), tok.pad_token_id)
    result = train_local(model, params, data, {"lr": 1e-2, "batch_size": 8, "local_steps": 3, **cfg}, seed=0)
    return model, params, result


def _grads(model, params, batch, parts=1, ckpt=False):
    from fedslice.compute import CPU
    from fedslice.fl.client import _accumulate, _hf_loss, gradient_checkpointing
    from fedslice.fl.memory_hold import split_batch

    model.train()
    for p in params.values():
        p.grad = None
    with gradient_checkpointing(model, ckpt):
        if parts == 1:
            loss = _hf_loss(model, batch)
            loss.backward()
        else:
            loss, _ = _accumulate(model, params, split_batch(batch, parts), _hf_loss, CPU, None, None, 0.0)
    return float(loss), {n: p.grad.clone() for n, p in params.items()}


def test_micro_batches_and_checkpointing_give_the_batch_gradient(tiny_model_dir, tiny_data_dir):
    """The gradient of a batch split into micro-batches (each loss weighted by its share of the
    batch), or under gradient checkpointing, is the whole batch's (fp32 rounding)."""
    model, params = _trainable(_tiny_model(tiny_model_dir))
    ids = torch.randint(1000, 2000, (8, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(8, 12, dtype=torch.long)
    mask[5:, 9:] = 0  # rows of different lengths
    batch = {"input_ids": ids, "attention_mask": mask, "labels": torch.tensor([0, 1] * 4)}
    loss, ref = _grads(model, params, batch)
    for parts, ckpt in ((2, False), (4, False), (3, False), (1, True), (2, True)):
        got_loss, got = _grads(model, params, batch, parts, ckpt)
        assert got_loss == pytest.approx(loss, abs=1e-6)
        for n in ref:
            torch.testing.assert_close(got[n], ref[n], rtol=1e-5, atol=1e-7, msg=f"{parts} {ckpt} {n}")
        assert not is_checkpointing(model)  # switched back off after
    from fedslice.measure import count_flops
    with count_flops() as after:  # nothing left behind (transformers' input-grad hook)
        _grads(model, params, batch)
    with count_flops() as fresh:
        _grads(*_trainable(_tiny_model(tiny_model_dir)), batch)
    assert after.total == fresh.total


def test_train_local_honours_the_plans_savings(tiny_model_dir, tiny_data_dir):
    _, _, r0 = _train(tiny_model_dir, tiny_data_dir)
    _, _, split = _train(tiny_model_dir, tiny_data_dir, micro_batches=4)
    _, _, ckpt = _train(tiny_model_dir, tiny_data_dir, checkpointing=True)
    assert split.activation_mb < r0.activation_mb  # one micro-batch's activations at a time
    assert ckpt.activation_mb < r0.activation_mb  # block inputs only
    assert split.loss == pytest.approx(r0.loss, abs=1e-3) and ckpt.loss == pytest.approx(r0.loss, abs=1e-3)


# -- planned runs -------------------------------------------------------------------------------
def _plans(run) -> list[dict]:
    return json.loads((run / "summary.json").read_text())["plans"]


@pytest.mark.parametrize("pack", [False, True])
def test_a_planned_run_meets_its_predictions(tiny_cfg_dict, one_length_data_dir, tmp_path, pack):
    """fedpetuning with LoRA ranks: a generous tier trains rank 4 whole, a tight one a smaller
    rank or split batches; per group, the measured peak memory is within 10% of the predicted,
    the upload exactly the predicted bytes, the FLOPs within 2% (every example one length);
    packed batches (a plan of one micro-batch) are predicted on a packed profile batch."""
    d = _cfg(tiny_cfg_dict, {"tiers": [{"share": 0.5, "memory_mb": 1000, "name": "big"},
                                       {"share": 0.5, "memory_mb": 3.95, "name": "small"}]},
             data={"path": str(one_length_data_dir)}, lora={"ranks": [2, 4]},
             federation={"pack": pack})
    run = run_experiment(validate_config(d), tmp_path / "planned", progress=False)
    groups = {g["budget_name"]: g for g in _plans(run)}
    assert groups["big"]["plan"]["rank"] == 4 and groups["big"]["plan"]["micro_batches"] == 1
    small = groups["small"]["plan"]
    assert (small["rank"], small["micro_batches"], small["checkpointing"]) != (4, 1, False)
    assert "needs" in groups["small"]["why"] and "> 3.95" in groups["small"]["why"]
    per_client = json.loads((run / "plans.json").read_text())
    assert sorted(per_client) == ["0", "1", "2", "3"]
    assert {c: p["rank"] for c, p in per_client.items()} == \
        {str(c): g["plan"]["rank"] for g in groups.values() for c in g["clients"]}
    from fedslice.html_report import write_run_report
    html = write_run_report(run).read_text()
    assert "Client plans ([budgets])" in html and "the next larger plan" in html
    for g in groups.values():
        pred, meas = g["predicted"], g["measured"]
        assert meas["client_rounds"] == len(g["clients"])
        assert meas["memory_mb_max"] == pytest.approx(pred["memory_mb"], rel=0.10)
        assert meas["memory_mb_max"] <= g["budget"].get("memory_mb", 1e9)
        assert meas["upload_mb_mean"] == pytest.approx(pred["upload_mb"], rel=1e-9)
        assert meas["gflops_per_round_mean"] == pytest.approx(pred["gflops_per_round"], rel=0.02)


@pytest.mark.parametrize("method", ["heads", "raffm+heads"])
def test_the_head_and_sub_model_stages_plan_within_budget(tiny_cfg_dict, tmp_path, method):
    """An upload budget below the dense adapter buys a sparsity (and, with raffm, a narrower
    sub-model under a memory budget too); the replies are accepted at the client's own sparsity
    and every measured cost is within its budget."""
    tight = {"share": 0.5, "name": "tight", "upload_mb_per_round": 0.003}
    if method == "raffm+heads":
        tight["memory_mb"] = 4.05
    d = _cfg(tiny_cfg_dict, {"tiers": [{"share": 0.5, "memory_mb": 1000, "name": "big"}, tight]},
             method=method)
    run = run_experiment(validate_config(d), tmp_path / method, progress=False)
    groups = {g["budget_name"]: g for g in _plans(run)}
    assert groups["big"]["plan"]["sparsity"] == 0.0
    assert groups["tight"]["plan"]["sparsity"] > 0
    for g in groups.values():
        meas = g["measured"]
        assert meas["client_rounds"] == len(g["clients"])  # no reply refused
        assert meas["upload_mb_mean"] <= g["predicted"]["upload_mb"] + 1e-12
        assert meas["upload_mb_mean"] <= g["budget"].get("upload_mb_per_round", 1e9)
        assert meas["memory_mb_max"] == pytest.approx(g["predicted"]["memory_mb"], rel=0.10)
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    kept = {m["client"]: sum(m["head_kept"]) for r in metrics for m in r.get("client_metrics", [])
            if "head_kept" in m}
    by_client = {c: g["plan"]["sparsity"] for g in groups.values() for c in g["clients"]}
    for c, n in kept.items():  # 2 layers x 4 heads, global scope
        assert n == round((1 - by_client[c]) * 8) or (method == "raffm+heads" and n >= 1)


def test_a_budget_no_plan_fits_names_the_client_and_the_cheapest_plan(tiny_cfg_dict, tmp_path):
    d = _cfg(tiny_cfg_dict, {"tiers": [{"share": 0.5, "memory_mb": 1000},
                                       {"share": 0.5, "memory_mb": 1.0, "name": "watch"}]},
             lora={"ranks": [2, 4]})
    with pytest.raises(ConfigError) as e:
        run_experiment(validate_config(d), tmp_path / "no", progress=False)
    msg = str(e.value)
    assert "client" in msg and "budgets.tiers[1], watch" in msg and "budget 1 MiB" in msg
    assert "the cheapest plan (2 examples per step, rank 2) needs" in msg and "MiB" in msg
    assert not (tmp_path / "no").exists()  # nothing trained, no run folder


def test_fedslice_plan_prints_each_tier_and_writes_every_client(tiny_cfg_dict, tmp_path, capsys):
    import tomli_w

    from fedslice.cli import main
    d = _cfg(tiny_cfg_dict, {"tiers": [{"share": 0.5, "memory_mb": 1000, "gflops_per_round": 1000,
                                        "name": "big"},
                                       {"share": 0.5, "upload_mb_per_round": 0.003, "name": "thin"}]},
             method="heads")
    path = tmp_path / "c.toml"
    path.write_bytes(tomli_w.dumps(d).encode())
    out = tmp_path / "plans.json"
    assert main(["plan", str(path), "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "big (1000 MiB, 1000 GFLOPs/round): 2 client(s)" in text
    assert "thin (0.003 MB up/round): 2 client(s)" in text
    assert "plan: sparsity 0.75" in text and "why: the next larger plan" in text
    assert text.count("enforced: at most 1000 GFLOPs/round as it trains") == 1
    plans = json.loads(out.read_text())
    assert sorted(plans) == ["0", "1", "2", "3"]
    assert {p["budget_name"]: p["flops_budget"] for p in plans.values()} == {"big": 1e12, "thin": None}
    assert all(p["predicted"]["upload_mb"] <= p["budget"].get("upload_mb_per_round", 1e9) for p in plans.values())


def test_a_sub_model_is_skipped_only_when_no_overhead_brings_it_within_budget(tiny_cfg_dict):
    """Checkpointing saves memory and costs FLOPs: a budget that the least-memory point
    (checkpointing + the most micro-batches) misses on FLOPs, but micro-batches alone meet, is
    planned with micro-batches and no checkpointing, not refused."""
    from fedslice.methods.budgets import ClientBudget
    from fedslice.methods.planner import BudgetPlanner
    from fedslice.methods.plan_records import Knobs
    from fedslice.run.setup import load_inputs

    cfg = validate_config(_cfg(tiny_cfg_dict, {"tiers": [{"share": 1.0, "memory_mb": 1000}]},
                               federation={"pack": False}))
    method = load_inputs(cfg, "both").method(cfg, "both")
    planner = BudgetPlanner(method, cfg.budgets, method.task.profile_batch(method.model.config, 8, 16, 0))
    split = planner.predicted(Knobs(rank=4, micro_batches=4), 16, 0)
    ckpt = planner.predicted(Knobs(rank=4, checkpointing=True, micro_batches=4), 16, 0)
    whole = planner.predicted(Knobs(rank=4), 16, 0)
    assert ckpt["gflops_per_round"] > split["gflops_per_round"] and whole["memory_mb"] > split["memory_mb"]
    budget = ClientBudget(memory_mb=(split["memory_mb"] + whole["memory_mb"]) / 2,
                          gflops_per_round=(split["gflops_per_round"] + ckpt["gflops_per_round"]) / 2)
    plan = planner.plan(0, 0, budget, 16)
    assert plan is not None and not plan.knobs.checkpointing and plan.knobs.micro_batches > 1


@pytest.mark.parametrize("method", ["heads", "raffm+heads"])
def test_the_head_stage_trains_each_clients_lora_rank(tiny_cfg_dict, tmp_path, method):
    """With lora.ranks the head stage takes the planner's rank too: an upload budget met by a
    lower rank keeps every head (the planner's order: most heads before highest rank); a
    tighter one prunes heads as well. Replies come back at the client's rank and kept heads (no
    reply refused) and the upload is within the budget."""
    tiers = [{"share": 0.5, "memory_mb": 1000, "name": "big"},
             {"share": 0.25, "name": "tight", "upload_mb_per_round": 0.0042},
             {"share": 0.25, "name": "tighter", "upload_mb_per_round": 0.0018}]
    d = _cfg(tiny_cfg_dict, {"tiers": tiers, "sparsities": [0.0, 0.5, 0.75]}, method=method,
             lora={"ranks": [2, 4]}, federation={"rounds": 2})
    run = run_experiment(validate_config(d), tmp_path / method, progress=False)
    groups = {g["budget_name"]: g for g in _plans(run)}
    big, tight, tighter = (groups[k]["plan"] for k in ("big", "tight", "tighter"))
    assert (big["rank"], big["sparsity"]) == (4, 0.0)
    assert (tight["rank"], tight["sparsity"]) == (2, 0.0)  # a lower rank before pruning heads
    assert tighter["rank"] == 2 and tighter["sparsity"] > 0
    for g in groups.values():
        meas = g["measured"]
        assert meas["client_rounds"] == 2 * len(g["clients"])  # no reply refused
        assert meas["upload_mb_mean"] <= g["predicted"]["upload_mb"] + 1e-12
        assert meas["upload_mb_mean"] <= g["budget"].get("upload_mb_per_round", 1e9)


def test_rank_components_no_client_holds_keep_their_values_under_the_head_stage(tiny_cfg_dict, tmp_path):
    """Every client at rank 2 of 4, some heads pruned: the global LoRA A rows and B columns past
    rank 2 end exactly where they started (no holder: the lora_ranks rule's holders average),
    the components within it moved."""
    from safetensors.torch import load_file

    from fedslice.api import setup

    d = _cfg(tiny_cfg_dict, {"tiers": [{"share": 1.0, "upload_mb_per_round": 0.0018}],
                             "sparsities": [0.5, 0.75]}, method="heads", lora={"ranks": [2, 4]})
    cfg = validate_config(d)
    start = setup(cfg)[0].initial_state()
    run = run_experiment(cfg, tmp_path / "r2", progress=False)
    end = load_file(run / "final_trainable.safetensors")
    lora = [k for k in end if "lora_A" in k or "lora_B" in k]
    assert lora
    for k in lora:
        a, b = (end[k], start[k]) if "lora_A" in k else (end[k].T, start[k].T)  # rank first
        assert torch.equal(a[2:], b[2:]), k
    assert any(not torch.equal(end[k], start[k]) for k in lora)


def test_forward_mode_refuses_per_client_ranks(tiny_cfg_dict):
    """A forward-mode client's sub-model is cut from the full-rank adapter: refused at load."""
    d = _cfg(tiny_cfg_dict, {"tiers": [{"share": 1.0, "upload_mb_per_round": 0.004}]}, method="heads",
             lora={"ranks": [2, 4]})
    d["method"]["prune"] = "forward"
    with pytest.raises(ConfigError, match="lora.ranks.*forward"):
        validate_config(d)


def test_a_flops_budget_the_pass_does_not_fit_takes_importance_from_the_first_step(tiny_cfg_dict, tmp_path):
    """The head stage's importance pass costs FLOPs its sparsity does not save: a client whose
    FLOPs budget fits training but not the pass gets ``importance_source = "first_step"`` (no
    pass: its flops_importance is 0) while a generous tier keeps the pass; with
    ``budgets.importance_sources = ["pass"]`` that budget fits no plan."""
    from fedslice.api import setup

    def plans(tiers, **extra):
        d = _cfg(tiny_cfg_dict, {"tiers": tiers, **extra}, method="heads")
        method, _ = setup(validate_config(d))
        return d, {p.budget.name: p for p in method.plans.values()}

    _, probe = plans([{"share": 0.5, "name": "pass", "memory_mb": 1e4},
                      {"share": 0.5, "name": "first", "memory_mb": 1e3}],
                     importance_sources=["pass"])
    with_pass = probe["pass"].gflops_per_round
    _, probe = plans([{"share": 1.0, "name": "first", "memory_mb": 1e4}], importance_sources=["first_step"])
    without = probe["first"].gflops_per_round
    assert without < with_pass
    middle = round((with_pass + without) / 2, 6)
    tiers = [{"share": 0.5, "name": "big", "memory_mb": 1e4},
             {"share": 0.5, "name": "tight", "gflops_per_round": middle}]
    d, got = plans(tiers)
    assert got["big"].knobs.importance == "pass" and got["tight"].knobs.importance == "first_step"
    assert "importance from the first step" in got["tight"].knobs.describe()
    assert "the importance pass" in got["big"].knobs.describe()
    # the plan passed over is named as such, not in words that read like the chosen plan
    assert "the importance pass" in got["tight"].reason, got["tight"].reason
    run = run_experiment(validate_config(d), tmp_path / "fs", progress=False)
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    by_client = {c: g["budget_name"] for g in _plans(run) for c in g["clients"]}
    imp = {by_client[m["client"]]: m["flops_importance"] for r in metrics for m in r.get("client_metrics", [])}
    assert imp["tight"] == 0 and imp["big"] > 0
    with pytest.raises(ConfigError, match="no plan fits"):
        plans(tiers, importance_sources=["pass"])


# -- the base's precision per client (budgets.precisions) --------------------------------------
@pytest.mark.parametrize("method,extra,message", [
    ("fedpetuning", {"model": {"quantize": "int8"}}, "model.quantize = 'int8' quantizes the base of every client"),
    ("raffm", {"model": {"quantize": "int8"}}, "model.quantize = 'int8' quantizes the base of every client"),
    ("heads", {"prune": "forward"}, "prune = 'forward' cuts each client's sub-model"),
])
def test_planned_precisions_are_refused_where_a_quantized_copy_cannot_train(tiny_cfg_dict, method, extra, message):
    options = {k: extra.pop(k) for k in list(extra) if not isinstance(extra[k], dict)}
    d = _cfg(tiny_cfg_dict, {"tiers": [{"share": 1.0, "memory_mb": 1000}], "precisions": ["none", "int8"]},
             method=method, **extra)
    d["method"].update(options)
    with pytest.raises(ConfigError, match="budgets.precisions") as e:
        validate_config(d)
    assert message in str(e.value)


def test_a_quantized_copy_shares_the_frozen_fp32_tensors_and_leaves_the_model_alone(tiny_cfg_dict):
    from fedslice.models.quantize import base_linears, is_quantized
    from fedslice.run.setup import load_inputs

    cfg = validate_config(_cfg(tiny_cfg_dict, {"tiers": [{"share": 1.0, "memory_mb": 1000}],
                                               "precisions": ["none", "int8"]}))
    method = load_inputs(cfg, "both").method(cfg, "both")
    before = {n: p.detach().clone() for n, p in method.model.named_parameters()}
    twin = method.base_at("int8")
    assert method.base_at("int8") is twin and method.base_at("none") is method.model  # once per process
    assert all(torch.equal(before[n], p) for n, p in method.model.named_parameters())
    assert not any(is_quantized(p) for p in method.model.parameters())
    linears = base_linears(twin, method.arch)
    assert linears and all(is_quantized(m.weight) for m in linears.values())
    ours = {id(p) for p in method.model.parameters()}
    for n, p in twin.named_parameters():
        quantized = is_quantized(p)
        assert (id(p) in ours) == (not p.requires_grad and not quantized), n  # shared: frozen fp32 only


def test_a_memory_budget_the_fp32_base_misses_trains_over_an_int8_copy(tiny_cfg_dict, one_length_data_dir,
                                                                      tmp_path):
    """Just under the fp32 base's predicted memory (rank 4, no other saving), the planner keeps
    rank 4 over an int8 copy (the base's precision before the rank); the client trains it, its
    reply is accepted and its measured memory is the prediction (10%), under the fp32 client's."""
    budgets = {"tiers": [{"share": 1.0, "memory_mb": 1000, "name": "big"}], "precisions": ["none"],
               "micro_batches": [1], "checkpointing": False}
    extra = {"data": {"path": str(one_length_data_dir)}, "lora": {"ranks": [2, 4]}}
    run = run_experiment(validate_config(_cfg(tiny_cfg_dict, budgets, **extra)), tmp_path / "fp32", progress=False)
    fp32 = _plans(run)[0]["predicted"]["memory_mb"]
    budgets["precisions"] = ["none", "int8"]
    budgets["tiers"] = [{"share": 0.5, "memory_mb": 1000, "name": "big"},
                        {"share": 0.5, "memory_mb": 0.997 * fp32, "name": "small"}]
    run = run_experiment(validate_config(_cfg(tiny_cfg_dict, budgets, **extra)), tmp_path / "p", progress=False)
    groups = {g["budget_name"]: g for g in _plans(run)}
    assert groups["big"]["plan"]["precision"] in (None, "none") and groups["big"]["plan"]["rank"] == 4
    assert groups["small"]["plan"]["precision"] == "int8" and groups["small"]["plan"]["rank"] == 4
    assert "rank 4" in groups["small"]["why"] and f"> {0.997 * fp32:g}" in groups["small"]["why"]
    for g in groups.values():
        meas = g["measured"]
        assert meas["client_rounds"] == len(g["clients"])  # every reply accepted
        assert meas["memory_mb_max"] == pytest.approx(g["predicted"]["memory_mb"], rel=0.10)
    assert groups["small"]["measured"]["memory_mb_max"] < groups["big"]["measured"]["memory_mb_max"]


@pytest.mark.parametrize("method", ["raffm", "raffm+heads"])
def test_a_raffm_client_under_its_fp32_slice_trains_an_int8_copy_of_the_slice(tiny_cfg_dict, one_length_data_dir,
                                                                             tmp_path, method, monkeypatch):
    """Sub-model stage over a quantized copy: just under the full-width fp32 client's predicted
    memory, the planner keeps the full width over int8 (the precision before a narrower slice);
    the client's reply is accepted, its measured memory is the prediction (10%) and under the
    fp32 client's; the slice is quantized once per order of the base, not per round (as many
    quantizations over 3 rounds as over 1, counted in every process: clients train in forked
    workers, which inherit the copies the round's preparation made)."""
    import fedslice.models.quantize as quantize

    log = tmp_path / "quantized.log"
    real = quantize.quantized_copy

    def counted(*a, **k):
        with open(log, "a") as f:
            f.write(f"{os.getpid()}\n")
        return real(*a, **k)

    monkeypatch.setattr(quantize, "quantized_copy", counted)
    budgets = {"tiers": [{"share": 1.0, "memory_mb": 1000, "name": "big"}], "precisions": ["none"],
               "micro_batches": [1], "checkpointing": False, "width_steps": 4}
    extra = {"data": {"path": str(one_length_data_dir)},
             "compute": {"workers": 2, "batched_clients": False}}
    run = run_experiment(validate_config(_cfg(tiny_cfg_dict, budgets, method=method, **extra)),
                         tmp_path / "fp32", progress=False)
    fp32 = _plans(run)[0]["predicted"]["memory_mb"]
    budgets["precisions"] = ["none", "int8"]
    budgets["tiers"] = [{"share": 0.5, "memory_mb": 1000, "name": "big"},
                        {"share": 0.5, "memory_mb": 0.997 * fp32, "name": "small"}]
    counts = {}
    for rounds in (1, 3):
        log.unlink(missing_ok=True)
        d = _cfg(tiny_cfg_dict, budgets, method=method, federation={"rounds": rounds}, **extra)
        run = run_experiment(validate_config(d), tmp_path / f"p{rounds}", progress=False)
        pids = log.read_text().split()
        counts[rounds] = len(pids)
        assert set(pids) == {str(os.getpid())}  # no worker quantized
    assert counts[1] == counts[3] > 0
    groups = {g["budget_name"]: g for g in _plans(run)}
    assert groups["big"]["plan"]["precision"] in (None, "none")
    assert groups["small"]["plan"]["precision"] == "int8" and groups["small"]["plan"]["width"] == 1.0
    for g in groups.values():
        meas = g["measured"]
        assert meas["client_rounds"] == 3 * len(g["clients"])  # every reply accepted
        assert meas["memory_mb_max"] == pytest.approx(g["predicted"]["memory_mb"], rel=0.10)
    assert groups["small"]["measured"]["memory_mb_max"] < groups["big"]["measured"]["memory_mb_max"]


def test_an_int8_raffm_client_trains_the_quantized_slice_the_server_sent(tiny_cfg_dict):
    """The int8 copy of a client's slice is the payload's frozen fp32 slice quantized (each
    weight within half its row's scale), in the server's salience order; its LoRA tensors are
    the payload's; a second payload of the same order reuses the copy, a new order makes another."""
    from fedslice.api import setup
    from fedslice.fl.strategy import Payload
    from fedslice.models.quantize import dequantize, is_quantized
    from fedslice.slicing.state import extract_state

    d = _cfg(tiny_cfg_dict, {"tiers": [{"share": 1.0, "memory_mb": 1000}], "precisions": ["int8"],
                             "width_steps": 4}, method="raffm")
    method, _ = setup(validate_config(d))
    state = method.initial_state()
    sent = method.strategy.configure_train(1, state, [0])[0]
    assert sent.config["base_precision"] == "int8"
    assert sent.config["base_order"] == method.slices.perm.digest
    narrow = method.sizes.candidates[1]  # a narrower slice
    assert not narrow.is_full
    narrowed = Payload(extract_state(state, narrow, method.arch), {**sent.config, "spec": narrow.to_dict()})
    for payload in (narrowed, sent):
        model, params = method.client_model(payload)
        named = dict(model.named_parameters())
        quantized = {k for k, p in named.items() if is_quantized(p)}
        assert quantized and quantized <= set(payload.arrays)
        for k in quantized:
            w, frozen = named[k], payload.arrays[k]
            assert w.shape == frozen.shape, k
            err = (dequantize(w) - frozen).abs().amax(dim=1)  # (out,)
            assert bool((err <= w.scale.reshape(-1) / 2 + 1e-7).all()), k
        for k, p in params.items():
            assert torch.equal(p, payload.arrays[k]), k
    assert method.client_model(payload)[0] is model  # the same order: the same copy
    other = Payload(payload.arrays, {**payload.config, "base_order": "another"})
    assert method.client_model(other)[0] is not model


def test_int8_raffm_clients_at_a_lower_rank_train_ffa_lora(tiny_cfg_dict):
    """FFA-LoRA's A is frozen but is the adapter's, sent at each client's rank: the int8 copy of a
    slice is made from the base's frozen slices only, and a rank-2 client loads its rank-2 A
    (regression: the copy tried to load that A into the rank-4 sub-model)."""
    from fedslice.api import setup
    from fedslice.run.engine import Simulation

    base = _cfg(tiny_cfg_dict, None, method="raffm", lora={"r": 4, "aggregation": "ffa"})
    method0, _ = setup(validate_config(base))
    sent = method0.trainable()  # under FFA: B and the classifier
    b_bytes = sum(p.numel() * 4 for k, p in sent.items() if ".lora_B." in k)
    assert b_bytes and not any(".lora_A." in k for k in sent)
    up = {r: (sum(p.numel() * 4 for p in sent.values()) - b_bytes * (4 - r) / 4) / 1e6 for r in (2, 4)}  # MB
    d = _cfg(tiny_cfg_dict, {"tiers": [{"share": 0.5, "upload_mb_per_round": up[2] * 1.01},
                                       {"share": 0.5, "upload_mb_per_round": up[4] * 1.01}],
                             "precisions": ["int8"]},
             method="raffm", lora={"r": 4, "ranks": [2, 4], "aggregation": "ffa"})
    cfg = validate_config(d)
    method, data = setup(cfg)
    state = method.initial_state()
    payloads = method.strategy.configure_train(1, state, [0, 1, 2, 3])
    assert {p.config["lora_rank"] for p in payloads.values()} == {2, 4}
    for p in sorted(payloads.values(), key=lambda p: p.config["lora_rank"]):  # rank 2 first
        assert p.config["base_precision"] == "int8"
        model, _ = method.client_model(p)
        named = dict(model.named_parameters())
        for k, a in p.arrays.items():
            if ".lora_A." in k:
                assert a.shape[0] == p.config["lora_rank"] and torch.equal(named[k], a), k
    _, records, _ = Simulation(cfg, method, data).run()
    assert records[-1]["train_loss"] is not None


# -- partial local work (budgets.local_work) -----------------------------------------------------
def test_a_budget_between_two_shares_gets_the_most_examples_that_fit(tiny_cfg_dict, one_length_data_dir):
    """budgets.local_work_fill (the default): a FLOPs budget at 0.8x the whole round, between
    the shares 1.0 (out of reach) and 0.5 (4 of 8 examples per step), gets the largest batch in
    between that fits: one more example is out of reach (the plain grid [1, (n+1)/8, 0.5] skips
    it) and the plan's "why" names it; without the fill, the grid's 4 examples."""
    from fedslice.api import setup

    def plan(gflops, **more):
        d = _cfg(tiny_cfg_dict, {"tiers": [{"share": 1.0, "name": "t", **gflops}], "micro_batches": [1],
                                 "checkpointing": False, **more},
                 method="fedpetuning", data={"path": str(one_length_data_dir)}, federation={"pack": False})
        method, _ = setup(validate_config(d))
        return next(iter(method.plans.values()))

    full = plan({"memory_mb": 1e4})
    assert full.knobs.batch is None
    budget = {"gflops_per_round": round(0.8 * full.gflops_per_round, 6)}
    got = plan(budget, local_work=[1.0, 0.5])
    n = got.knobs.batch
    assert 4 < n < 8 and got.gflops_per_round <= budget["gflops_per_round"]
    assert f"{n + 1} examples per step" in got.reason
    assert plan(budget, local_work=[1.0, (n + 1) / 8, 0.5], local_work_fill=False).knobs.batch == 4
    assert plan(budget, local_work=[1.0, n / 8, 0.5], local_work_fill=False).knobs.batch == n
    assert plan(budget, local_work=[1.0, 0.5], local_work_fill=False).knobs.batch == 4


def _raffm_plans(tiny_cfg_dict, data_dir, tiers, federation=None, **budgets) -> tuple[dict, dict]:
    """raffm's config over ``data_dir`` with these tiers (one micro-batch, no checkpointing) and
    its plans by budget name."""
    from fedslice.api import setup

    d = _cfg(tiny_cfg_dict, {"tiers": tiers, "micro_batches": [1], "checkpointing": False, **budgets},
             method="raffm", data={"path": str(data_dir)}, federation=federation or {})
    method, _ = setup(validate_config(d))
    return d, {p.budget.name: p for p in method.plans.values()}


@pytest.mark.parametrize("by,pack", [("batch", False), ("batch", True), ("steps", False)])
def test_a_flops_budget_takes_partial_local_work_before_a_narrower_sub_model(tiny_cfg_dict, one_length_data_dir,
                                                                            tmp_path, by, pack):
    """A FLOPs budget between half and all of the full model's round: with ``local_work = [1.0]``
    the sub-model stage narrows the model; with ``local_work = [1.0, 0.5]`` the client keeps the full
    width and trains half its round (the planner's order: width before local work): every step
    on half the batch (``by = "batch"``) or half the steps (``"steps"``). Its measured FLOPs are
    the prediction (2%, every example one length; packed: on a packed profile batch of the
    plan's rows), its steps and memory what the plan says."""
    def plans(tiers, **more):
        return _raffm_plans(tiny_cfg_dict, one_length_data_dir, tiers, federation={"pack": pack}, **more)

    _, probe = plans([{"share": 1.0, "name": "all", "memory_mb": 1e4}])
    full = probe["all"]
    assert full.knobs.width == 1.0 and full.knobs.steps is None and full.knobs.batch is None
    tiers = [{"share": 0.5, "name": "big", "memory_mb": 1e4},
             {"share": 0.5, "name": "tight", "gflops_per_round": round(0.6 * full.gflops_per_round, 6)}]
    _, narrowed = plans(tiers, local_work=[1.0])
    assert narrowed["tight"].knobs.width < 1.0
    d, got = plans(tiers, local_work=[0.5, 1.0], local_work_by=by, local_work_fill=False)
    tight, batch = got["tight"], d["federation"]["batch_size"]
    assert tight.knobs.width == 1.0 and got["big"].knobs == full.knobs
    assert (tight.knobs.batch, tight.knobs.steps) == ((batch // 2, None) if by == "batch" else (None, 1))
    if not pack:  # (packed rows of half the examples are laid out otherwise: not exactly half)
        assert tight.gflops_per_round == pytest.approx(full.gflops_per_round / 2, rel=0.02)
    assert ("per step" if by == "batch" else "1 local step") in tight.knobs.describe()
    if by == "batch":  # half the rows per step: less activation memory
        assert tight.memory_mb < full.memory_mb
    run = run_experiment(validate_config(d), tmp_path / "work", progress=False)
    groups = {g["budget_name"]: g for g in _plans(run)}
    for g in groups.values():
        assert g["measured"]["client_rounds"] == len(g["clients"])
        assert g["measured"]["gflops_per_round_mean"] == pytest.approx(g["predicted"]["gflops_per_round"], rel=0.02)
        assert g["measured"]["memory_mb_max"] == pytest.approx(g["predicted"]["memory_mb"], rel=0.10)
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    steps = {m["client"]: m["steps"] for r in metrics for m in r.get("client_metrics", [])}
    assert {steps[c] for c in groups["tight"]["clients"]} == {2 if by == "batch" else 1}
    assert {steps[c] for c in groups["big"]["clients"]} == {2}


def test_local_work_by_steps_cuts_the_batch_below_the_fewest_steps():
    """The local work ladder: by batch, fewer examples per step; by steps, fewer steps, and below
    the fewest steps the shares give, those steps on fewer examples (one local step: the batch
    only, as by batch)."""
    from fedslice.methods.planner import local_works
    shares = [1.0, 0.75, 0.5, 0.375, 0.25]
    assert local_works(shares, "batch", 8, 2) == [{}, {"batch": 6}, {"batch": 4}, {"batch": 3}, {"batch": 2}]
    assert local_works(shares, "steps", 8, 2) == [
        {}, {"steps": 1}, {"steps": 1, "batch": 6}, {"steps": 1, "batch": 4}, {"steps": 1, "batch": 3},
        {"steps": 1, "batch": 2}]
    assert local_works(shares, "steps", 4, 8) == [
        {}, {"steps": 6}, {"steps": 4}, {"steps": 3}, {"steps": 2}, {"steps": 2, "batch": 3},
        {"steps": 2, "batch": 2}, {"steps": 2, "batch": 1}]
    assert local_works([0.5, 1.0], "steps", 4, 1) == [{}, {"batch": 2}]
    assert local_works([1.0], "steps", 4, 2) == [{}]


def test_a_flops_budget_below_one_whole_step_trains_one_step_of_fewer_examples(tiny_cfg_dict, one_length_data_dir,
                                                                              tmp_path):
    """``local_work_by = "steps"``: a FLOPs budget of 0.3 of the whole round (two steps) fits no
    whole step; the client trains one step of the examples that fit (the fill's bisection: the
    most that fit), at full width, its predicted FLOPs within the budget, each example measured at
    the whole model's cost. (Before, "steps" had no plan below one whole step: the sub-model
    narrowed instead.)"""
    def plans(tiers, **more):
        return _raffm_plans(tiny_cfg_dict, one_length_data_dir, tiers, **more)

    _, probe = plans([{"share": 1.0, "name": "all", "memory_mb": 1e4}])
    full = probe["all"]
    budget = round(0.3 * full.gflops_per_round, 6)
    tiers = [{"share": 0.5, "name": "big", "memory_mb": 1e4},
             {"share": 0.5, "name": "tight", "gflops_per_round": budget}]
    d, got = plans(tiers, local_work=[1.0, 0.5, 0.25], local_work_by="steps")
    tight, batch = got["tight"], d["federation"]["batch_size"]
    assert tight.knobs.width == 1.0 and tight.knobs.steps == 1
    assert batch == 8 and tight.knobs.batch in (4, 5)  # ~0.6 of a step's examples, as many as fit
    assert tight.gflops_per_round <= budget
    assert "1 local step" in tight.knobs.describe() and "per step" in tight.knobs.describe()
    # the plan passed over: one more example in the one step
    assert f"1 local step, {tight.knobs.batch + 1} examples per step" in tight.reason, tight.reason
    run = run_experiment(validate_config(d), tmp_path / "work", progress=False)
    groups = {g["budget_name"]: g for g in _plans(run)}
    metrics = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    trained = {m["client"]: m for r in metrics for m in r.get("client_metrics", [])}
    # one step of at most the plan's examples (a pass over a client's 16 in batches of 5 ends with
    # a batch of 1: the prediction is the mean over the batches a client may draw), each example
    # at the whole model's cost (every example one length)
    (per_example,) = {trained[c]["flops_measured"] / trained[c]["examples_trained"] for c in groups["big"]["clients"]}
    for c in groups["tight"]["clients"]:
        assert trained[c]["steps"] == 1 and 1 <= trained[c]["examples_trained"] <= tight.knobs.batch
        assert trained[c]["flops_measured"] / trained[c]["examples_trained"] == pytest.approx(per_example, rel=1e-9)


@pytest.mark.parametrize("budgets,extra,message", [
    ({"local_work": [0.0]}, {}, "budgets.local_work"),
    ({"local_work": [1.5]}, {}, "budgets.local_work"),
    ({"local_work": [1.0, 0.5], "local_work_by": "steps"}, {"federation": {"local_steps": None, "local_epochs": 1}},
     "federation.local_steps, which is not set"),
    ({"local_work_by": "rows"}, {}, "budgets.local_work_by"),
])
def test_bad_local_work_is_refused_at_load(tiny_cfg_dict, budgets, extra, message):
    with pytest.raises(ConfigError) as e:
        validate_config(_cfg(tiny_cfg_dict, {"tiers": [{"share": 1.0, "memory_mb": 10}], **budgets}, **extra))
    assert message in str(e.value), str(e.value)


# -- FLOPs budgets enforced as clients train (budgets.enforce_flops) ----------------------------
def _one_length_split(one_length_data_dir, tiny_model_dir, n=32):
    from fedslice.data.batching import TokenizedSplit
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    lines = (one_length_data_dir / "train.tsv").read_text().splitlines()[1:n + 1]
    enc = tok([line.split("\t")[0] for line in lines], truncation=True, max_length=16)
    return TokenizedSplit([torch.tensor(x) for x in enc["input_ids"]], None,
                          torch.tensor([int(line.split("\t")[1]) for line in lines]), tok.pad_token_id)


def test_a_flops_budget_stops_local_training_before_the_step_that_would_pass_it(tiny_model_dir,
                                                                                one_length_data_dir):
    """Every step costs the same (one length): a budget of 2.5 steps trains exactly the first 2
    steps of the unbudgeted run (the same tensors as ``local_steps = 2``), records 2 cut, and
    its measured FLOPs are 2 steps'; FLOPs spent before training (an importance pass) come off
    the budget; the first step always runs; without a budget nothing is cut or recorded."""
    from fedslice.fl.client import train_local

    data = _one_length_split(one_length_data_dir, tiny_model_dir)
    cfg = {"lr": 1e-2, "batch_size": 8, "local_steps": 4}

    def run(**more):
        model, params = _trainable(_tiny_model(tiny_model_dir))
        torch.manual_seed(0)
        result = train_local(model, params, data, {**cfg, **more.pop("cfg", {})}, seed=3, **more)
        return {n: p.detach().clone() for n, p in params.items()}, result

    _, whole = run()
    assert whole.steps == 4 and whole.steps_cut is None
    step = whole.flops_measured / 4
    two, ref = run(cfg={"local_steps": 2})
    got, cut = run(cfg={"flops_budget": 2.5 * step})
    assert (cut.steps, cut.steps_cut) == (2, 2) and cut.flops_measured == pytest.approx(2 * step, rel=1e-9)
    assert cut.flops_measured <= 2.5 * step and cut.examples == ref.examples == 16
    for n in two:
        assert torch.equal(got[n], two[n]), n
    _, spent = run(cfg={"flops_budget": 2.5 * step}, flops_spent=1.2 * step)
    assert (spent.steps, spent.steps_cut) == (1, 3)
    _, first = run(cfg={"flops_budget": 0.1 * step})
    assert (first.steps, first.steps_cut) == (1, 3)
    _, room = run(cfg={"flops_budget": 4 * step * (1 + 1e-9)})
    assert (room.steps, room.steps_cut) == (4, 0)


@pytest.mark.parametrize("batched", [False, True])
def test_a_planned_run_holds_every_client_round_to_its_flops_budget(tiny_cfg_dict, tmp_path, batched):
    """On data of many lengths the planner's prediction (the mean length) is off for clients
    whose batches run longer: at 0.8x the whole round's FLOPs the filled plan's clients pass
    the budget in some rounds unless ``budgets.enforce_flops``; enforced, every client-round
    is within it, the steps it cut are recorded (per client and in the plans' report), and a
    client-round it did not cut trains exactly as unenforced. The batched pass (clients that
    share a training config) cuts the same steps as training one after another."""
    from fedslice.api import setup

    def cfg(limits, **more):
        d = _cfg(tiny_cfg_dict, {"tiers": [{"share": 1.0, "name": "t", **limits}], "micro_batches": [1],
                                 "checkpointing": False, **more},
                 federation={"pack": False, "rounds": 2, "local_steps": 3},
                 compute={"workers": 1, "batched_clients": batched})
        return d

    full, _ = setup(validate_config(cfg({"memory_mb": 1e4})))
    budget = round(0.8 * next(iter(full.plans.values())).gflops_per_round, 6)

    def client_rounds(enforce):
        run = run_experiment(validate_config(cfg({"gflops_per_round": budget}, enforce_flops=enforce)),
                             tmp_path / f"{enforce}", progress=False)
        records = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
        rounds = [r for r in records if r.get("client_metrics")]
        assert {r["client_mode"] for r in rounds} == {"batched" if batched else "sequential"}
        return {(r["round"], m["client"]): m for r in rounds for m in r["client_metrics"]}, _plans(run)[0]

    free, _ = client_rounds(False)
    held, plans = client_rounds(True)
    assert any(m["flops_measured"] > budget * 1e9 for m in free.values())
    assert all("steps_cut" not in m for m in free.values())
    assert all(m["flops_measured"] <= budget * 1e9 for m in held.values())
    assert all(m["steps"] + m["steps_cut"] == 3 for m in held.values())
    cut = [k for k, m in held.items() if m["steps_cut"]]
    assert cut and plans["measured"]["rounds_cut"] == len(cut)
    assert plans["measured"]["steps_cut"] == sum(m["steps_cut"] for m in held.values())
    for k, m in held.items():
        if k not in cut:
            assert m["flops_measured"] == free[k]["flops_measured"] and m["examples_trained"] == \
                free[k]["examples_trained"]
    if batched:
        assert all(m.get("batched_clients", 1) > 1 for m in held.values())


def test_a_packed_plan_out_of_reach_by_its_memory_has_no_flops_measured(tiny_lm_dirs, tmp_path, monkeypatch):
    """A packed plan's memory and FLOPs are two steps (the layout every batch fits in, the
    packed profile): the planner weighs a packed plan by its memory first and runs no FLOPs
    step for one its memory rules out, nor for a plan weighed at its least by its memory;
    every plan and its reason equal those of a planner that measures every plan whole, with
    fewer steps and fewer counted FLOPs (a chat model, conversations of many lengths)."""
    import fedslice.methods.plan_costs as plan_costs
    from test_chat import chat_cfg, write_chat_jsonl

    tiers = [{"share": s, "name": n, "memory_share": m, "flops_share": f} for n, s, m, f in
             (("a", 0.34, 1.0, 1.0), ("b", 0.33, 0.8, 0.5), ("c", 0.33, 0.6, 0.3))]
    d = chat_cfg(write_chat_jsonl(tmp_path / "chat"), tiny_lm_dirs["llama"], tmp_path, lora={"ranks": [2, 4]},
                 budgets={"tiers": tiers, "local_work": [1.0, 0.75, 0.5, 0.25], "micro_batches": [1, 2, 4],
                          "adapter_depths": [1.0, 0.5], "checkpointing": True, "precisions": ["none", "int8"]})
    plans = _counting_plans(monkeypatch, d)
    kept, measured = plans()

    def whole(self, knobs, need="all"):  # every cost measured whole
        knobs = self.same_step(knobs)
        if knobs not in self._costs:
            self._costs[knobs] = self._measure(knobs)
        return self._costs[knobs]

    monkeypatch.setattr(plan_costs.StepCosts, "cost", whole)
    every_plan, every = plans()
    assert kept == every_plan
    assert len({p["reason"] for p in kept.values()}) == 3 and len({p["batch"] for p in kept.values()}) > 1
    assert measured[0] < every[0] and measured[1] < every[1], (measured, every)  # (steps, with FLOPs)


@pytest.mark.parametrize("pack", [False, True])
def test_the_planner_measures_each_model_and_rows_once_and_plans_as_before(tiny_cfg_dict, one_length_data_dir,
                                                                          monkeypatch, pack):
    """The planner keeps each measured step by (the planned model, the measured rows): plans
    that differ only in rows per step or micro-batches measure the same first rows of the
    profile batch (scaled), once. Every client's plan and predicted costs are exactly those of
    a planner that measures every plan afresh, with fewer steps measured; a step measured with
    the FLOP counter saves what one without it saves (the reuse of its memory)."""
    import fedslice.methods.plan_costs as plan_costs
    from fedslice.api import setup
    from fedslice.slicing.planner import measure_step

    tiers = [{"share": 0.25, "name": f"t{i}", "flops_share": f} for i, f in enumerate([1.0, 0.7, 0.5, 0.3])]
    d = _cfg(tiny_cfg_dict, {"tiers": tiers, "local_work": [1.0, 0.75, 0.5, 0.25], "micro_batches": [1, 2, 4],
                             "checkpointing": True, "precisions": ["none", "int8"]},
             data={"path": str(one_length_data_dir)}, federation={"pack": pack}, lora={"ranks": [2, 4]})
    plans = _counting_plans(monkeypatch, d)
    kept, measured = plans()
    monkeypatch.setattr(plan_costs.StepCosts, "_step_of", lambda self, knobs, model, packed, flops, head, memory=True:
                        lambda rows: plan_costs.measure_step(model, rows, self.method.task.loss, flops, head))
    fresh, every = plans()
    assert kept == fresh
    assert len({p["rank"] for p in kept.values()}) > 1 or len({p["batch"] for p in kept.values()}) > 1
    assert measured[0] < every[0] and measured[1] < every[1], (measured, every)  # (steps, with FLOPs)

    method, _ = setup(validate_config(d))
    batch = method.task.profile_batch(method.model.config, 2, 16, 0)
    with_flops = measure_step(method.model, batch, method.task.loss, True)
    without = measure_step(method.model, batch, method.task.loss, False)
    assert with_flops.saved_mb == without.saved_mb and with_flops.static_bytes == without.static_bytes
    assert with_flops.flops > 0 == without.flops
    with method.planned_model(plan_costs.Knobs(precision="int8")) as planned:  # the FLOPs lent across precisions
        int8 = measure_step(planned.model, batch, method.task.loss, True)
    assert int8.flops == with_flops.flops and int8.static_bytes < with_flops.static_bytes


def _counting_plans(monkeypatch, d: dict):
    """A function that builds ``d``'s method and returns every client's plan and (steps the
    planner measured, of those with the FLOP counter), counted through ``plan_costs.measure_step``
    (patched here, around the function it stands for now)."""
    import fedslice.methods.plan_costs as plan_costs
    from fedslice.api import setup

    calls, step = [], plan_costs.measure_step

    def counted(*args, **kwargs):
        calls.append(bool(args[3] if len(args) > 3 else kwargs.get("flops", True)))
        return step(*args, **kwargs)

    def plans():
        calls.clear()
        method, _ = setup(validate_config(d))
        return {c: p.to_dict() for c, p in method.plans.items()}, (len(calls), sum(calls))

    monkeypatch.setattr(plan_costs, "measure_step", counted)
    return plans


def test_fit_rounds_holds_a_flops_budget_a_one_step_round_would_pass(tiny_cfg_dict):
    """One local step per round: the guard cannot cut a round's only step, so under a FLOPs
    budget at the plan's mean round the rounds of longer batches overshoot it. With
    ``budgets.fit_rounds`` (no devices, no time limit) those rounds are sent with fewer
    examples: every client-round's measured FLOPs within the budget, the fitted ones recorded."""
    from fedslice.api import setup
    from fedslice.run.engine import Simulation

    def run(fit: bool, budget: dict):
        d = _cfg(tiny_cfg_dict, {"tiers": [{"share": 1.0, **budget}], "micro_batches": [1],
                                 "checkpointing": False, "local_work": [1.0, 0.5], "fit_rounds": fit},
                 federation={"local_steps": 1, "batch_size": 4, "rounds": 4})
        cfg = validate_config(d)
        method, data = setup(cfg)
        _, records, _ = Simulation(cfg, method, data).run()
        return method.plans, records

    plans, _ = run(False, {"memory_mb": 1e4})
    mean = max(p.gflops_per_round for p in plans.values())
    budget = {"gflops_per_round": mean}
    plans, plain = run(False, budget)
    assert all(p.knobs.batch is None and p.knobs.steps is None for p in plans.values())  # the whole round
    over = [m for r in plain for m in r["client_metrics"] if m["flops_measured"] > mean * 1e9 * (1 + 1e-9)]
    assert over  # the longer rounds pass the budget: the only step runs
    _, fitted = run(True, budget)
    ms = [m for r in fitted for m in r["client_metrics"]]
    assert len(ms) == 4 * 4
    assert all(m["flops_measured"] <= mean * 1e9 * (1 + 1e-9) for m in ms)
    sent = {(r["round"], f["client"]): f["batch_size"] for r in fitted for f in r.get("rounds_fitted", [])}
    assert {(r["round"], m["client"]) for r in plain for m in r["client_metrics"] if m in over} == set(sent)
    assert all(0 < b < 4 for b in sent.values())
