"""``task.kind = "preference"``: DPO against the frozen base (adapters off), on the tiny LLaMA
with SmolLM2's tokenizer and chat template: the loss against Eq. 7 by hand and against trl's
DPOTrainer, the reference is the base, batched clients and packing agree with the plain pass,
the planner's measured step holds the reference forward, bad rows, and a DPO round on Flower."""

from __future__ import annotations

import json
import logging
import math
import re
from pathlib import Path

import pytest
import torch

from fedslice.api import setup
from fedslice.errors import ConfigError, DataError
from fedslice.experiment import validate_config
from fedslice.run.engine import Simulation
from fedslice.tasks.preference import dpo_loss, pair_logps, response, response_logps

ITEMS = ["lamp", "chair", "kettle", "bicycle", "violin", "garden", "window", "teapot"]


def write_pairs(folder: Path, sizes=(("train", 24), ("dev", 6), ("test", 6))) -> Path:
    """JSONL splits of prompt / chosen / rejected: the chosen answer is polite, the rejected
    curt (a preference a tiny model learns in a few steps)."""
    folder.mkdir(parents=True, exist_ok=True)
    k = 0
    for split, n in sizes:
        with (folder / f"{split}.jsonl").open("w") as f:
            for _ in range(n):
                item = ITEMS[k % len(ITEMS)]
                f.write(json.dumps({"prompt": f"Tell me about the {item} number {k}.",
                                    "chosen": f"Gladly: the {item} is lovely.",
                                    "rejected": f"No. Go away, {item}."}) + "\n")
                k += 1
    return folder


@pytest.fixture
def pref_cfg(tiny_lm_dirs, tmp_path) -> dict:
    return {
        "seed": 0, "threads": 1,
        "data": {"path": str(write_pairs(tmp_path / "pairs")), "max_length": 64},
        "model": {"name": str(tiny_lm_dirs["llama"])},
        "task": {"kind": "preference", "dpo_beta": 0.5, "max_target_length": 12},
        "lora": {"r": 4, "alpha": 8, "targets": ["q", "v"]},
        "federation": {"num_clients": 3, "clients_per_round": 2, "rounds": 2, "local_steps": 3,
                       "batch_size": 4, "lr": 2e-2, "pack": False},
        "method": {"name": "fedpetuning"},
        "evaluation": {"every": 1, "batch_size": 8},
        "output": {"dir": str(tmp_path / "runs"), "progress": False, "plots": False},
    }


def _run(cfg_dict):
    cfg = validate_config(cfg_dict)
    method, data = setup(cfg)
    state, records, summary = Simulation(cfg, method, data).run()
    return method, data, state, records, summary


# -- the loss ----------------------------------------------------------------------------------

def test_dpo_loss_is_eq7_on_hand_computed_values():
    """Rafailov et al. 2023, Eq. 7: pair 1 log-ratios +1 (chosen) and -1 (rejected) at beta 0.5:
    rewards +0.5 / -0.5, loss -log sigmoid(1) = log(1 + e^-1); pair 2 the other way round."""
    pc, pr = torch.tensor([-10.0, -12.0]), torch.tensor([-12.0, -10.0])
    rc, rr = torch.tensor([-11.0, -11.0]), torch.tensor([-11.0, -11.0])
    losses, chosen, rejected = dpo_loss(pc, pr, rc, rr, 0.5)
    assert chosen.tolist() == [0.5, -0.5] and rejected.tolist() == [-0.5, 0.5]
    assert losses.tolist() == pytest.approx([math.log1p(math.exp(-1.0)), math.log1p(math.exp(1.0))],
                                            abs=1e-7)
    # equal log-ratios: log 2, whatever beta
    assert dpo_loss(pc, pc, rc, rc, 3.0)[0].tolist() == pytest.approx([math.log(2)] * 2)


def test_dpo_loss_equals_trls_dpo_trainer(pref_cfg):
    """trl's DPOTrainer (its loss_type 'sigmoid', PEFT model, no ref_model: the adapter disabled
    as reference) on the same collated pairs and the same LoRA weights: the same loss and
    reward metrics."""
    trl = pytest.importorskip("trl")
    from datasets import Dataset

    pref_cfg["data"]["max_length"] = 256
    method, data = setup(validate_config(pref_cfg))
    model = method.model
    torch.manual_seed(1)
    with torch.no_grad():  # a non-zero adapter: policy and reference differ
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    split = data.train.subset(range(4))
    batch = split.collate(range(4))
    ours_c, ours_r, ref_c, ref_r = pair_logps(model, batch)
    losses, chosen, rejected = dpo_loss(ours_c, ours_r, ref_c, ref_r, 0.5)

    # trl's inputs: each response as prompt + completion ids, as its collator pads them
    seqs, masks = [], []
    for which in ("chosen", "rejected"):
        part = response(batch, which)
        for ids, lab, att in zip(part["input_ids"], part["labels"], part["attention_mask"]):
            n = int(att.sum())
            seqs.append(ids[:n])
            masks.append((lab[:n] != -100).long())
    width = max(len(s) for s in seqs)
    pad = split.pad_token_id
    inputs = {"input_ids": torch.stack([torch.nn.functional.pad(s, (0, width - len(s)), value=pad) for s in seqs]),
              "attention_mask": torch.stack([torch.nn.functional.pad(torch.ones_like(s), (0, width - len(s)))
                                             for s in seqs]),
              "completion_mask": torch.stack([torch.nn.functional.pad(m, (0, width - len(m))) for m in masks])}
    args = trl.DPOConfig(output_dir=str(Path(pref_cfg["output"]["dir"]) / "trl"), beta=0.5,
                         loss_type=["sigmoid"], report_to=[], use_cpu=True, bf16=False,
                         precompute_ref_log_probs=False)
    ds = Dataset.from_list([{"prompt": "a", "chosen": "b", "rejected": "c"}])
    trainer = trl.DPOTrainer(model=model, args=args, train_dataset=ds,
                             processing_class=method.task.tokenizer)
    # trl copies an existing adapter as its reference ("ref"); without one the reference is
    # the model with its adapters disabled: the frozen base, as here
    trainer.model.delete_adapter("ref")
    model.eval()
    with torch.no_grad():
        loss = trainer._compute_loss(trainer.model, inputs, return_outputs=False)
    got = trainer._metrics["train"] if trainer._metrics["train"] else trainer._metrics["eval"]
    assert float(loss) == pytest.approx(float(losses.mean()), rel=1e-4, abs=1e-5)
    assert got["rewards/chosen"][-1] == pytest.approx(float(chosen.mean()), rel=1e-4, abs=1e-5)
    assert got["rewards/rejected"][-1] == pytest.approx(float(rejected.mean()), rel=1e-4, abs=1e-5)
    assert got["rewards/margins"][-1] == pytest.approx(float((chosen - rejected).mean()), rel=1e-4, abs=1e-5)
    assert got["rewards/accuracies"][-1] == pytest.approx(float((chosen > rejected).float().mean()))


# -- the reference is the frozen base ----------------------------------------------------------

def test_reference_is_the_base_and_training_raises_reward_accuracy(pref_cfg, tiny_lm_dirs):
    """After training, the reference log-probabilities equal the untrained base model's (no
    LoRA at all), the adapter's gradients flags are as before, and the held-out reward accuracy
    of an easy preference goes from 0 (all rewards 0) to 1."""
    from transformers import AutoModelForCausalLM

    method, data, state, records, summary = _run(pref_cfg)
    assert summary["primary_metric"] == "reward_accuracy"
    assert summary["test_reward_accuracy"] == 1.0 and summary["test_reward_margin"] > 0
    assert records[-1]["dev_reward_accuracy"] == 1.0
    trainable = {n for n, p in method.model.named_parameters() if p.requires_grad}
    batch = data.test.collate(range(len(data.test)))
    method.load_model(method.model, state)
    _, _, ref_c, ref_r = pair_logps(method.model, batch)
    assert {n for n, p in method.model.named_parameters() if p.requires_grad} == trainable
    base = AutoModelForCausalLM.from_pretrained(tiny_lm_dirs["llama"], dtype=torch.float32).eval()
    with torch.no_grad():
        want_c, _ = response_logps(base, response(batch, "chosen"))
        want_r, _ = response_logps(base, response(batch, "rejected"))
    assert torch.allclose(ref_c, want_c, atol=1e-5) and torch.allclose(ref_r, want_r, atol=1e-5)
    pol_c, _, _, _ = pair_logps(method.model, batch)
    assert not torch.allclose(pol_c, ref_c, atol=1e-3)  # the policy moved away from it
    # before training: every reward 0, the base's own preference reported
    fresh, fdata = setup(validate_config(pref_cfg))
    ev = fresh.task.evaluate(fresh.model, fdata.test, 8)
    assert ev["reward_accuracy"] == 0.0 and ev["reward_margin"] == 0.0
    assert ev["loss"] == pytest.approx(math.log(2))
    assert ev["base_accuracy"] == ev["accuracy"] == summary["test_base_accuracy"]


@pytest.mark.parametrize("adapter", ["dora", "ia3", "prompt", "prefix"])
def test_reference_switches_off_every_adapter_with_a_frozen_base(pref_cfg, tiny_lm_dirs, adapter):
    """Adapters inside the model's modules (DoRA, IA3) and prompt learning (prompt, prefix):
    with the adapter's tensors perturbed, the reference is still the plain base model, the
    policy is not, and no requires_grad flag changed."""
    from transformers import AutoModelForCausalLM

    pref_cfg["peft"] = {"method": adapter}
    method, data = setup(validate_config(pref_cfg))
    model = method.model
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:
                p.add_(torch.randn_like(p) * 0.5)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    batch = data.test.collate(range(len(data.test)))
    pol_c, _, ref_c, ref_r = pair_logps(model, batch)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == trainable
    base = AutoModelForCausalLM.from_pretrained(tiny_lm_dirs["llama"], dtype=torch.float32).eval()
    with torch.no_grad():
        want_c, _ = response_logps(base, response(batch, "chosen"))
        want_r, _ = response_logps(base, response(batch, "rejected"))
    assert torch.allclose(ref_c, want_c, atol=1e-5) and torch.allclose(ref_r, want_r, atol=1e-5)
    assert not torch.allclose(pol_c, ref_c, atol=1e-3)


def test_batched_clients_and_packing_match_the_plain_pass(pref_cfg):
    """The batched multi-client pass (its LoRA forward honours the switched-off adapter) and
    federation.pack = true (pairs are not packed: batches stay padded) give the same weights."""
    _, _, plain, _, _ = _run(pref_cfg)
    pref_cfg["compute"] = {"batched_clients": True, "workers": 1}
    _, _, batched, _, _ = _run(pref_cfg)
    pref_cfg["compute"] = {"batched_clients": False, "workers": 1}
    pref_cfg["federation"]["pack"] = True
    _, _, packed, _, _ = _run(pref_cfg)
    for other in (batched, packed):
        assert sorted(other) == sorted(plain)
        assert max((other[k] - plain[k]).abs().max().item() for k in plain) < 1e-5


def test_planner_measures_the_reference_forward(pref_cfg):
    """The planner's profile step (measure_training_step on the task's profile batch) counts
    the policy's forward and backward of both responses and the reference's forward of both."""
    from fedslice.measure import count_flops
    from fedslice.slicing.planner import measure_training_step

    method, _ = setup(validate_config(pref_cfg))
    task, model = method.task, method.model
    batch = task.profile_batch(model.config, 4, 24, 0)
    assert batch["input_ids"].shape == batch["rejected_input_ids"].shape == (4, 24)
    flops, _, _, _ = measure_training_step(model, batch, loss_fn=task.loss)
    from fedslice.tasks import lm
    lm_flops = 0.0
    for which in ("chosen", "rejected"):
        part = response(batch, which)
        with count_flops() as fc:
            lm.lm_loss(model, part, "causal").backward()
        model.zero_grad(set_to_none=True)
        with count_flops() as fwd, torch.no_grad():
            lm.lm_loss(model, part, "causal")
        lm_flops += fc.total + fwd.total
    assert flops == pytest.approx(lm_flops, rel=0.02)


def test_planner_plans_preference_clients(pref_cfg):
    pref_cfg["budgets"] = {"tiers": [{"share": 1.0, "memory_mb": 1e4}]}
    method, _ = setup(validate_config(pref_cfg))
    assert method.plans and all(p.gflops_per_round > 0 for p in method.plans.values())


# -- bad input ---------------------------------------------------------------------------------

def _rewrite(folder: Path, split: str, row: int, **change) -> None:
    path = folder / f"{split}.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows[row].update(change)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


@pytest.mark.parametrize("change, says", [({"chosen": ""}, "empty field 'chosen'"),
                                          ({"prompt": "  "}, "empty field 'prompt'"),
                                          ({"rejected": None}, "no field 'rejected'"),
                                          ({"rejected": "Gladly: the lamp is lovely. "}, "same response")])
def test_bad_rows_name_file_and_line_or_are_skipped(pref_cfg, change, says, caplog):
    folder = Path(pref_cfg["data"]["path"])
    _rewrite(folder, "train", 0, **change)
    with pytest.raises(DataError) as e:
        setup(validate_config(pref_cfg))
    assert f"{folder / 'train.jsonl'}, line 1" in str(e.value) and says in str(e.value)
    assert "\n" not in str(e.value)
    pref_cfg["data"]["bad_rows"] = "skip"
    with caplog.at_level(logging.WARNING):
        _, data = setup(validate_config(pref_cfg))
    assert len(data.train) == 23
    assert any("skipped 1" in r.getMessage() for r in caplog.records)


def test_config_errors_name_the_field(pref_cfg, tiny_lm_dirs):
    cases = [({"task": {**pref_cfg["task"], "chosen_column": "good"}}, "task.chosen_column"),
             ({"peft": {"method": "none"}}, "peft.method"),
             ({"data": {**pref_cfg["data"], "partition": "dirichlet"}}, "data.partition"),
             ({"model": {"name": str(tiny_lm_dirs["t5"])}}, "encoder-decoder")]
    for change, field in cases:
        with pytest.raises(ConfigError) as e:
            setup(validate_config({**pref_cfg, **change}))
        assert field in str(e.value), str(e.value)
    with pytest.raises(ConfigError, match="label_words/target/preset"):
        validate_config({**pref_cfg, "task": {**pref_cfg["task"], "target": "{chosen}"}})


def test_custom_columns_and_prompt_template(pref_cfg, tmp_path):
    folder = tmp_path / "renamed"
    folder.mkdir()
    for split in ("train", "dev", "test"):
        rows = [json.loads(line) for line in (Path(pref_cfg["data"]["path"]) / f"{split}.jsonl")
                .read_text().splitlines()]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(
            {"question": r["prompt"], "good": r["chosen"], "bad": r["rejected"]}) + "\n" for r in rows))
    pref_cfg["data"]["path"] = str(folder)
    pref_cfg["task"].update(prompt="Q: {question}", chosen_column="good", rejected_column="bad",
                            chat_template=False)
    method, data = setup(validate_config(pref_cfg))
    tok = method.task.tokenizer
    assert tok.decode(data.train.chosen.prompts[0]).startswith("Q: Tell me about")
    assert tok.decode(data.train.chosen.targets[0]) == "Gladly: the lamp is lovely.<|im_end|>"
    assert tok.decode(data.train.rejected.targets[0]) == "No. Go away, lamp.<|im_end|>"
    assert method.task.input_columns() == ["question", "good", "bad"]


def test_prompts_use_the_chat_template_by_default(pref_cfg):
    method, data = setup(validate_config(pref_cfg))
    text = method.task.tokenizer.decode(data.train.chosen.prompts[0])
    assert text.endswith("<|im_start|>user\nTell me about the lamp number 0.<|im_end|>\n"
                         "<|im_start|>assistant\n")


# -- messages-form prompts (issue 57) ----------------------------------------------------------

def _conversational(pref_cfg, tmp_path, layout: str) -> Path:
    """The pairs rewritten with each prompt as a conversation (a system turn, an earlier
    exchange, then the user's turn): TRL's conversational layout (``prompt`` a list of
    ``{role, content}``, answers as assistant turns) or LLaMA-Factory's ShareGPT one
    (``conversations`` of ``{from, value}``, answers as one ``{from, value}`` turn)."""
    folder = tmp_path / layout
    folder.mkdir()
    for split in ("train", "dev", "test"):
        out = []
        for r in (json.loads(line) for line in (Path(pref_cfg["data"]["path"]) / f"{split}.jsonl")
                  .read_text().splitlines()):
            turns = [("system", "Be kind."), ("user", "Hi."), ("assistant", "Hello."),
                     ("user", r["prompt"])]
            if layout == "trl":
                out.append({"prompt": [{"role": a, "content": b} for a, b in turns],
                            "chosen": [{"role": "assistant", "content": r["chosen"]}],
                            "rejected": [{"role": "assistant", "content": r["rejected"]}]})
            else:
                names = {"system": "system", "user": "human", "assistant": "gpt"}
                out.append({"conversations": [{"from": names[a], "value": b} for a, b in turns],
                            "chosen": {"from": "gpt", "value": r["chosen"]},
                            "rejected": {"from": "gpt", "value": r["rejected"]}})
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in out))
    return folder


@pytest.mark.parametrize("layout", ["trl", "sharegpt"])
def test_messages_prompts_render_with_the_chat_template(pref_cfg, tmp_path, layout):
    """A conversation prompt is the template's own rendering of its turns with the assistant's
    cue (system turn and earlier exchange kept); the answers are the assistant turns' text; the
    pairs equal those of the same prompts rendered by hand (string prompts, no template)."""
    plain_cfg = json.loads(json.dumps(pref_cfg))
    pref_cfg["data"]["path"] = str(_conversational(pref_cfg, tmp_path, layout))
    method, data = setup(validate_config(pref_cfg))
    tok = method.task.tokenizer
    turns = [{"role": "system", "content": "Be kind."}, {"role": "user", "content": "Hi."},
             {"role": "assistant", "content": "Hello."},
             {"role": "user", "content": "Tell me about the lamp number 0."}]
    expected = tok.apply_chat_template(turns, tokenize=False, add_generation_prompt=True)
    assert tok.decode(data.train.chosen.prompts[0]) == expected
    assert tok.decode(data.train.chosen.targets[0]) == "Gladly: the lamp is lovely.<|im_end|>"
    assert tok.decode(data.train.rejected.targets[0]) == "No. Go away, lamp.<|im_end|>"
    assert method.task.input_columns()[0] == ("prompt" if layout == "trl" else "conversations")
    if layout != "trl":
        return
    # the same texts as string prompts, the template off: identical token ids
    folder = tmp_path / f"{layout}-rendered"
    folder.mkdir()
    for split in ("train", "dev", "test"):
        rows = [json.loads(line) for line in (Path(plain_cfg["data"]["path"]) / f"{split}.jsonl")
                .read_text().splitlines()]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps({**r, "prompt": tok.apply_chat_template(
            [*turns[:3], {"role": "user", "content": r["prompt"]}], tokenize=False,
            add_generation_prompt=True)}) + "\n" for r in rows))
    plain_cfg["data"]["path"] = str(folder)
    plain_cfg["task"]["chat_template"] = False
    _, plain = setup(validate_config(plain_cfg))
    for ours, theirs in ((data.train.chosen, plain.train.chosen), (data.test.rejected, plain.test.rejected)):
        assert len(ours.prompts) == len(theirs.prompts)
        assert all(torch.equal(a, b) for a, b in zip(ours.prompts, theirs.prompts))
        assert all(torch.equal(a, b) for a, b in zip(ours.targets, theirs.targets))


def test_bad_messages_prompts_name_file_and_line(pref_cfg, tmp_path, caplog):
    folder = _conversational(pref_cfg, tmp_path, "trl")
    pref_cfg["data"]["path"] = str(folder)
    pref_cfg["task"]["messages_column"] = "prompt"
    _rewrite(folder, "train", 2, prompt=[{"role": "user", "content": "Hi."},
                                         {"role": "assistant", "content": "Yo."}])
    with pytest.raises(DataError) as e:
        setup(validate_config(pref_cfg))
    assert f"{folder / 'train.jsonl'}, line 3" in str(e.value), str(e.value)
    assert "ends with the assistant's turn" in str(e.value) and "\n" not in str(e.value)
    pref_cfg["data"]["bad_rows"] = "skip"
    with caplog.at_level(logging.WARNING):
        _, data = setup(validate_config(pref_cfg))
    assert len(data.train) == 23 and any("skipped 1" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("cell, says", [
    ([{"role": "user"}], "turn 1 has no 'content'"),
    ([{"role": "robot", "content": "Hi."}], "unknown role 'robot'"),
    ("not json", "is not JSON"),
    ([{"role": "system", "content": "Be kind."}], "ends with the system's turn"),
])
def test_bad_prompt_cells_say_why(cell, says):
    from fedslice.data.conversations import BadConversation
    from fedslice.tasks.preference import prompt_turns

    with pytest.raises(BadConversation, match=re.escape(says)):
        prompt_turns(cell, "prompt")


@pytest.mark.parametrize("cell, text", [
    ("Sure.", "Sure."), ({"role": "assistant", "content": "Sure."}, "Sure."),
    ({"from": "gpt", "value": "Sure."}, "Sure."), ([{"role": "assistant", "content": "Sure."}], "Sure."),
    ([{"role": "user", "content": "Sure."}], None), (3, None),
    ([{"role": "assistant", "content": "A"}, {"role": "assistant", "content": "B"}], None),
])
def test_response_cells_are_the_assistants_text(cell, text):
    from fedslice.data.conversations import BadConversation
    from fedslice.tasks.preference import response_text

    if text is None:
        with pytest.raises(BadConversation, match="'chosen'"):
            response_text(cell, "chosen")
    else:
        assert response_text(cell, "chosen") == text


def test_messages_column_config_checks(pref_cfg):
    with pytest.raises(ConfigError, match="not both"):
        validate_config({**pref_cfg, "task": {**pref_cfg["task"], "prompt": "{prompt}",
                                              "messages_column": "prompt"}})
    with pytest.raises(ConfigError, match="kind = 'chat' or 'preference'"):
        validate_config({**pref_cfg, "task": {"kind": "generation", "target": "{x}",
                                              "messages_column": "m"}})


# -- Flower ------------------------------------------------------------------------------------

def test_dpo_round_on_flower_matches_in_process(pref_cfg, tmp_path):
    from test_flower import InProcessGrid, _in_process, _nodes, _settings, _weights, _write_config
    from fedslice.flower.server_app import run as server_run
    from fedslice.output import read_run

    pref_cfg["federation"]["rounds"] = 1
    state, records, summary = _in_process(pref_cfg)
    path = _write_config(pref_cfg, tmp_path / "exp.json")
    run_dir = server_run(InProcessGrid(_nodes(3)), _settings(path, tmp_path / "fl"))
    got = _weights(run_dir)
    assert sorted(got) == sorted(state)
    assert max((got[k] - state[k]).abs().max().item() for k in got) < 1e-5
    _, metrics, fl_summary = read_run(run_dir)
    assert [m["dev_reward_accuracy"] for m in metrics] == pytest.approx(
        [r["dev_reward_accuracy"] for r in records])
    assert fl_summary["primary_metric"] == "reward_accuracy"
    assert fl_summary["test_reward_margin"] == pytest.approx(summary["test_reward_margin"])


# -- the documented config and the data builder ------------------------------------------------

def test_the_dpo_config_runs(tiny_lm_dirs, tmp_path):
    """configs/dpo_hh_smollm2.toml (docs/preference.md) as it is, on tiny pairs and the tiny
    LLaMA instead of the HH-RLHF pairs and SmolLM2, one round."""
    from fedslice.api import run_experiment
    from fedslice.experiment import load_config

    root = Path(__file__).resolve().parents[1]
    cfg = load_config(root / "configs" / "dpo_hh_smollm2.toml", [
        f"data.path={write_pairs(tmp_path / 'pairs')}", f"model.name={tiny_lm_dirs['llama']}",
        "federation.rounds=1", "federation.num_clients=3", f"output.dir={tmp_path / 'runs'}",
        "output.progress=false"])
    assert cfg.task.kind == "preference" and cfg.data.path != "hh-harmless-single"
    run = run_experiment(cfg, progress=False)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["primary_metric"] == "reward_accuracy" and "test_base_accuracy" in summary
    assert (run / "report.html").is_file()
    from fedslice.inference import predict

    records = predict(run, tmp_path / "pairs" / "test.jsonl", tmp_path / "pred.jsonl")
    assert len(records) == 6 and {r["prediction"] for r in records} <= {"chosen", "rejected"}


def test_hh_builder_keeps_single_turn_pairs():
    """bench/data/hh_harmless_pairs.py: one human turn and two different answers kept; a
    multi-turn transcript, answers after different turns, or the same answer twice dropped."""
    import importlib.util

    path = Path(__file__).resolve().parents[1] / "bench" / "data" / "hh_harmless_pairs.py"
    spec = importlib.util.spec_from_file_location("hh_harmless_pairs", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    h, a = "\n\nHuman:", "\n\nAssistant:"
    records = [{"chosen": f"{h} Hi there?{a} Hello!", "rejected": f"{h} Hi there?{a} Go away."},
               {"chosen": f"{h} A{a} B{h} C{a} D", "rejected": f"{h} A{a} B{h} C{a} E"},
               {"chosen": f"{h} A{a} B", "rejected": f"{h} X{a} C"},
               {"chosen": f"{h} A{a} B", "rejected": f"{h} A{a} B"}]
    pairs, dropped = mod.single_turn_pairs(records)
    assert pairs == [{"prompt": "Hi there?", "chosen": "Hello!", "rejected": "Go away."}]
    assert dropped == {"multi_turn": 1, "prefix_differs": 1, "empty_or_same": 1}
