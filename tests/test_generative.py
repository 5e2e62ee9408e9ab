"""Generative models (llama, gpt2, t5, bart) and tasks (generation, text-to-text classification)
on tiny random configs: the architecture table, LoRA on every attention family, the target-only
loss, collation, metrics, end-to-end runs and bad input."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import GENERATIVE, method_options, write_sentiment_tsv

from fedslice.api import run_experiment, setup
from fedslice.config import ModelConfig
from fedslice.peft import LoraConfig
from fedslice.experiment import validate_config
from fedslice.data.pairs import IGNORE, PairSplit
from fedslice.errors import ConfigError, DataError
from fedslice.run.engine import Simulation
from fedslice.models.arch import arch_for
from fedslice.models.loading import load_model
from fedslice.peft import apply_lora, lora_module_names
from fedslice.tasks import lm
from fedslice.tasks.metrics import bleu, generation_scores, rouge


def _load(path, model_type):
    head = "causal_lm" if model_type in ("llama", "gpt2") else "seq2seq_lm"
    return load_model(ModelConfig(name=str(path)), None, seed=0, head=head)


# --- the architecture table ---------------------------------------------------------------------

#: modules of q and v per model: (stacks x layers x attention families), fused q|k|v named once
EXPECTED_QV = {"llama": 2 * 2, "gpt2": 2, "t5": 2 * 2 + 2 * 2 * 2, "t5-gated": 12, "bart": 12}


@pytest.mark.parametrize("model_type", GENERATIVE)
def test_table_names_exist_and_dims_match(tiny_lm_dirs, model_type):
    loaded = _load(tiny_lm_dirs[model_type], model_type)
    arch, model = loaded.arch, loaded.model
    names = dict(model.named_modules())
    for part in ("q", "k", "v", "o", "ffn_in", "ffn_out"):
        for n in arch.module_names(model, [part]):
            assert n in names, n
    assert len(arch.module_names(model, ["q", "v"])) == EXPECTED_QV[model_type]
    d = arch.dims(model.config)
    assert (d["num_layers"], d["num_heads"], d["hidden"]) == (2, 4, 32)
    assert d["num_kv_heads"] == (2 if model_type == "llama" else 4)
    assert d["head_dim"] == 8
    assert arch.part(model, 0, "q").weight.shape[0 if arch.weight_layout == "linear" else 1] \
        == (96 if model_type == "gpt2" else 32)  # gpt2: fused q|k|v, Conv1D (in, out)
    if model_type == "llama":  # grouped-query attention: k/v have num_kv_heads * head_dim rows
        assert arch.part(model, 0, "k").weight.shape == (16, 32)
    assert arch.stacks[-1].ffn.gated == (model_type in ("llama", "t5-gated"))
    assert len(arch.stacks) == (2 if model_type in ("t5", "t5-gated", "bart") else 1)
    assert not arch.is_simple_encoder


@pytest.mark.parametrize("model_type", GENERATIVE)
def test_lora_covers_every_attention_family(tiny_lm_dirs, model_type):
    loaded = _load(tiny_lm_dirs[model_type], model_type)
    model = apply_lora(loaded.model, loaded.arch, LoraConfig(r=2, targets=["q", "v"]))
    wrapped = [n.removeprefix("base_model.model.") for n in lora_module_names(model)]
    assert sorted(wrapped) == sorted(loaded.arch.module_names(loaded.model, ["q", "v"]))
    if model_type in ("t5", "bart"):
        assert any("EncDecAttention" in n or "encoder_attn" in n for n in wrapped)  # cross
        assert any(n.startswith(("encoder.", "model.encoder.")) for n in wrapped)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)  # no classifier on an LM head
    every = apply_lora(_load(tiny_lm_dirs[model_type], model_type).model, loaded.arch,
                       LoraConfig(r=2, targets=["all-linear"]))
    assert len(lora_module_names(every)) == len(loaded.arch.module_names(
        loaded.model, ["q", "k", "v", "o", "ffn_in", "ffn_out"]))


def test_qwen2_and_mistral_use_the_llama_entry():
    import transformers as T
    assert arch_for(T.Qwen2Config()).model_type == "llama"
    assert arch_for(T.MistralConfig()).kv_heads_attr == "num_key_value_heads"


# --- collation and the target-only loss -----------------------------------------------------------

def _pairs(layout: str, start: int | None = None) -> PairSplit:
    prompts = [torch.tensor([5, 6, 7]), torch.tensor([8])]
    targets = [torch.tensor([9, 10]), torch.tensor([11, 12, 13])]
    return PairSplit(prompts, targets, torch.zeros(2, dtype=torch.int64), torch.arange(2),
                     ["a", "b"], pad_token_id=0, layout=layout, decoder_start_token_id=start)


def test_causal_collation_masks_prompt_and_padding():
    b = _pairs("causal").collate([0, 1])
    assert b["input_ids"].tolist() == [[5, 6, 7, 9, 10], [8, 11, 12, 13, 0]]
    assert b["labels"].tolist() == [[IGNORE, IGNORE, IGNORE, 9, 10], [IGNORE, 11, 12, 13, IGNORE]]
    assert b["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 1, 0]]
    left = _pairs("causal").prompt_batch([0, 1])
    assert left["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]  # left padding for generation
    assert left["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]


def test_seq2seq_collation_shifts_targets_behind_the_start_token():
    b = _pairs("seq2seq", start=1).collate([0, 1])
    assert b["input_ids"].tolist() == [[5, 6, 7], [8, 0, 0]]
    assert b["labels"].tolist() == [[9, 10, IGNORE], [11, 12, 13]]
    assert b["decoder_input_ids"].tolist() == [[1, 9, 10], [1, 11, 12]]
    assert b["decoder_attention_mask"].tolist() == [[1, 1, 0], [1, 1, 1]]


@pytest.mark.parametrize("model_type", GENERATIVE)
def test_target_only_logits_give_hf_loss_and_scores(tiny_lm_dirs, model_type):
    """The LM head applied at target positions only gives exactly HF's full-logits loss."""
    loaded = _load(tiny_lm_dirs[model_type], model_type)
    model = loaded.model.eval()
    layout = "causal" if model_type in ("llama", "gpt2") else "seq2seq"
    pairs = _pairs(layout, start=getattr(model.config, "decoder_start_token_id", None))
    batch = pairs.collate([0, 1])
    hf = model(**batch).loss
    assert lm.lm_loss(model, batch, layout).item() == pytest.approx(hf.item(), abs=1e-5)
    # per-example sums of target log-probabilities, from full logits as reference
    sums, counts = lm.sequence_logprobs(model, batch, layout)
    logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    labels = batch["labels"]
    if layout == "causal":
        logits, labels = logits[:, :-1], labels[:, 1:]
    lp = torch.log_softmax(logits, -1)
    ref = [float(lp[i][labels[i] != IGNORE].gather(1, labels[i][labels[i] != IGNORE][:, None]).sum())
           for i in range(2)]
    assert sums.tolist() == pytest.approx(ref, abs=1e-4)
    assert counts.tolist() == [2, 3]


# --- metrics --------------------------------------------------------------------------------------

def test_bleu_uses_every_reference_and_scores_empty_outputs():
    import sacrebleu
    hyps = ["the cat sat on the mat today", ""]
    refs = [["the cat sat on the mat", "a cat sat on the mat today"], ["a dog barks loudly here"]]
    expected = sacrebleu.corpus_bleu(hyps, [["the cat sat on the mat", "a dog barks loudly here"],
                                            ["a cat sat on the mat today", None]]).score
    assert bleu(hyps, refs) == pytest.approx(expected)
    assert bleu(hyps[:1], refs[:1]) > bleu(hyps[:1], [refs[0][:1]])  # the 2nd reference counts
    r = rouge(hyps, refs)
    assert r["rougeL"] == pytest.approx(50.0 * rouge(hyps[:1], refs[:1])["rougeL"] / 100.0)  # empty = 0
    best = rouge(["a cat sat on the mat today"], [refs[0]])
    assert best["rouge1"] == pytest.approx(100.0)  # best of the references
    assert set(generation_scores(hyps, refs)) == {"bleu", "rouge1", "rouge2", "rougeL"}


# --- end to end -----------------------------------------------------------------------------------

@pytest.mark.parametrize("model_type", GENERATIVE)
@pytest.mark.parametrize("method", ["fedpetuning", "fedavg"])
def test_generation_runs_on_every_generative_model(tiny_gen_cfg_dict, tiny_lm_dirs, model_type, method):
    if method == "fedavg" and model_type in ("t5-gated", "gpt2"):
        pytest.skip("fedavg: one decoder and one encoder-decoder suffice")
    tiny_gen_cfg_dict["model"]["name"] = str(tiny_lm_dirs[model_type])
    tiny_gen_cfg_dict["method"]["name"] = method
    cfg = validate_config(tiny_gen_cfg_dict)
    method_obj, data = setup(cfg)
    init = method_obj.initial_state()
    state, records, summary = Simulation(cfg, method_obj, data).run()
    assert summary["primary_metric"] == "rougeL" and summary["task"] == "generation"
    for k in ("bleu", "rouge1", "rouge2", "rougeL", "loss", "perplexity"):
        assert summary[f"test_{k}"] is not None and summary[f"test_{k}"] == summary[f"test_{k}"]
        assert f"dev_{k}" in records[-1]
    assert summary["test_perplexity"] == pytest.approx(torch.tensor(summary["test_loss"]).exp().item(), rel=1e-5)
    assert any((state[k] - init[k]).abs().max() > 0 for k in state)  # training moved the weights
    rec = records[-1]["client_metrics"][0]
    assert rec["flops_measured"] > 0 and rec["bytes_up"] == rec["bytes_down"] > 0
    assert rec["peak_rss_mb"] > 0


def test_generation_groups_references_by_prompt(tiny_gen_cfg_dict):
    cfg = validate_config(tiny_gen_cfg_dict)
    method, data = setup(cfg)
    assert len(data.test) == 9 and len(set(data.test.groups.tolist())) == 3  # 3 MRs x 3 refs
    # the loss is on the target only: the first label is the first target token
    b = data.test.collate([0])
    first = (b["labels"][0] != IGNORE).nonzero()[0, 0]
    assert first == len(data.test.prompts[0])
    assert b["input_ids"][0, -1] == method.task.tokenizer.eos_token_id  # learns to stop


def test_generation_run_folder_and_dev_generation_cap(tiny_gen_cfg_dict):
    tiny_gen_cfg_dict["evaluation"]["dev_generations"] = 2
    path = run_experiment(validate_config(tiny_gen_cfg_dict), progress=False)
    summary = json.loads((path / "summary.json").read_text())
    assert summary["primary_metric"] == "rougeL" and "test_bleu" in summary
    metrics = [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]
    assert metrics[-1]["dev_rougeL"] is not None


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "t5", "bart"])
def test_text_to_text_classification_by_label_words(tmp_path, tiny_lm_dirs, model_type):
    data = write_sentiment_tsv(tmp_path / "sst", sizes=(40, 12, 12))
    cfg = validate_config({
        "seed": 0, "threads": 1, "data": {"path": str(data), "max_length": 24},
        "model": {"name": str(tiny_lm_dirs[model_type])},
        "task": {"prompt": "Review: {sentence}\nSentiment:",
                 "label_words": {"0": " negative", "1": " very positive"}},
        "lora": {"r": 2, "alpha": 4},
        "federation": {"num_clients": 2, "clients_per_round": 2, "rounds": 1, "local_steps": 2,
                       "batch_size": 8},
        "output": {"dir": str(tmp_path / "runs"), "progress": False, "plots": False}})
    method, fed = setup(cfg)
    assert method.task.head == ("causal_lm" if model_type in ("llama", "gpt2") else "seq2seq_lm")
    assert len(method.task.candidates[1]) > 1  # a label word of several tokens works
    _, records, summary = Simulation(cfg, method, fed).run()
    assert summary["primary_metric"] == "accuracy" and 0 <= summary["test_accuracy"] <= 1
    # the prediction is the more likely label word: check one example by hand
    model = method.eval_model(method.initial_state()).eval()
    ev = method.task.evaluate(model, fed.test.subset([0]), 8)
    scores = []
    for c in range(2):
        pair = fed.test.with_targets([0], [method.task.candidates[c]])
        scores.append(float(lm.sequence_logprobs(model, pair.collate([0]), method.task.layout)[0]))
    assert ev["accuracy"] == float(int(torch.tensor(scores).argmax()) == int(fed.test.labels[0]))


# --- bad input ------------------------------------------------------------------------------------

def test_template_field_the_data_lacks_is_a_config_error(tiny_gen_cfg_dict):
    tiny_gen_cfg_dict["task"]["prompt"] = "Describe: {meaning}\n"
    # at load, before any training, naming the field, the column and the columns found
    with pytest.raises(ConfigError, match=r"task.prompt: column\(s\) \['meaning'\].*\['mr', 'ref'\]"):
        setup(validate_config(tiny_gen_cfg_dict))
    tiny_gen_cfg_dict["task"]["prompt"] = "{mr}"
    tiny_gen_cfg_dict["task"]["target"] = "{reference}"
    with pytest.raises(ConfigError, match=r"task.target: column\(s\) \['reference'\]"):
        setup(validate_config(tiny_gen_cfg_dict))


def test_label_words_with_the_same_tokens_are_refused(tmp_path, tiny_lm_dirs):
    with pytest.raises(ConfigError, match="label words must differ"):
        validate_config({"task": {"label_words": {"0": "no", "1": "no"}}})
    data = write_sentiment_tsv(tmp_path / "sst", sizes=(20, 4, 4))
    # different words, the same tokens once cut to max_target_length = 1: " very"
    cfg = validate_config({"data": {"path": str(data)}, "model": {"name": str(tiny_lm_dirs["llama"])},
                           "task": {"label_words": {"0": " very bad", "1": " very good"},
                                    "max_target_length": 1},
                           "federation": {"num_clients": 2, "clients_per_round": 1}})
    with pytest.raises(ConfigError, match="two label words have the same tokens"):
        setup(cfg)


def test_label_missing_from_label_words_names_the_row(tmp_path, tiny_lm_dirs):
    data = write_sentiment_tsv(tmp_path / "sst", sizes=(20, 4, 4))
    cfg = validate_config({"data": {"path": str(data)}, "model": {"name": str(tiny_lm_dirs["llama"])},
                           "task": {"label_words": {"0": " bad", "7": " good"}},
                           "federation": {"num_clients": 2, "clients_per_round": 1}})
    with pytest.raises(DataError, match=r"train.tsv, row \d+: label .1. has no word"):
        setup(cfg)


def test_unsupported_pairs_fail_at_config_load(tiny_gen_cfg_dict, tiny_lm_dirs, tiny_model_dir, tiny_data_dir):
    cfg = dict(tiny_gen_cfg_dict, model={"name": str(tiny_lm_dirs["t5"])},
               method={"name": "raffm", "elastic_depth": True})
    with pytest.raises(ConfigError, match="method.elastic_depth.*t5 has 2 stack"):
        setup(validate_config(cfg))
    enc = dict(tiny_gen_cfg_dict, model={"name": str(tiny_model_dir)})
    with pytest.raises(ConfigError, match="needs a generative model.*bert encoder"):
        setup(validate_config(enc))
    t5_head = dict(tiny_gen_cfg_dict, model={"name": str(tiny_lm_dirs["t5"])},
                   data={"path": str(tiny_data_dir)}, task={"kind": "classification"})
    with pytest.raises(ConfigError, match="t5 model classifies text-to-text.*label_words"):
        setup(validate_config(t5_head))
    skew = dict(tiny_gen_cfg_dict, data={**tiny_gen_cfg_dict["data"], "partition": "dirichlet"})
    with pytest.raises(ConfigError, match="data.partition.*generation"):
        setup(validate_config(skew))
    with pytest.raises(ConfigError, match="generation needs a target template"):
        validate_config({"task": {"kind": "generation"}})


@pytest.mark.parametrize("model_type", ["gpt2", "llama"])
def test_generative_models_with_a_classification_head(tmp_path, tiny_lm_dirs, tiny_data_dir, model_type):
    """A decoder with a sequence-classification head (``score``, read at the last non-pad
    token) trains like an encoder; the pad id the head needs is set. (BART's head reads the
    end token its own tokenizer appends; the tiny test models use SmolLM2's tokenizer.)"""
    cfg = validate_config({"seed": 0, "threads": 1, "data": {"path": str(tiny_data_dir), "max_length": 16},
                           "model": {"name": str(tiny_lm_dirs[model_type])},
                           "federation": {"num_clients": 2, "clients_per_round": 2, "rounds": 1,
                                          "local_steps": 2, "batch_size": 8},
                           "output": {"dir": str(tmp_path), "progress": False, "plots": False}})
    method, data = setup(cfg)
    assert method.model.get_base_model().config.pad_token_id is not None
    head = method.arch.classifier[0]
    assert any(f"{head}." in n for n in method.trainable())  # the head trains
    _, _, summary = Simulation(cfg, method, data).run()
    assert 0 <= summary["test_accuracy"] <= 1


# --- prompts: chat template, Alpaca instruction data, truncation, padding ----------------------------

def test_alpaca_jsonl_with_the_chat_template(tmp_path, tiny_lm_dirs, caplog):
    folder = tmp_path / "alpaca"
    folder.mkdir()
    rows = [{"instruction": "Name a colour.", "input": "", "output": "Blue."},
            {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5 " * 40}]
    for split in ("train", "dev", "test"):
        (folder / f"{split}.jsonl").write_text("\n".join(json.dumps(r) for r in rows * 4) + "\n")
    cfg = validate_config({"seed": 0, "threads": 1, "data": {"path": str(folder), "max_length": 40},
                           "model": {"name": str(tiny_lm_dirs["llama"])},
                           "task": {"kind": "generation", "preset": "alpaca", "chat_template": True,
                                    "max_target_length": 16, "max_new_tokens": 4},
                           "federation": {"num_clients": 2, "clients_per_round": 2, "rounds": 1,
                                          "local_steps": 1, "batch_size": 4},
                           "output": {"dir": str(tmp_path / "runs"), "progress": False, "plots": False}})
    with caplog.at_level("INFO", logger="fedslice"):
        method, data = setup(cfg)
    tok = method.task.tokenizer
    prompt = tok.decode(data.train.prompts[1])
    assert "### Input:\n2 and 3" in prompt and "<|im_start|>assistant" in prompt  # chat-wrapped
    assert "### Input" not in tok.decode(data.train.prompts[0])  # no input section when empty
    # the long answer is cut to 16 tokens (15 + end token) and counted in the log
    assert len(data.train.targets[1]) == 16 and data.train.targets[1][-1] == tok.eos_token_id
    assert any("truncated 12 of 24 targets" in r.getMessage() for r in caplog.records)
    assert any("truncated" in r.getMessage() and "prompts" in r.getMessage() for r in caplog.records)


def test_a_tokenizer_without_pad_token_gets_eos_logged(caplog):
    from fedslice.models.loading import ensure_pad_token

    tok = __import__("conftest").smollm2_tokenizer()
    tok.pad_token = None
    with caplog.at_level("INFO", logger="fedslice.models.loading"):
        ensure_pad_token(tok)
    assert tok.pad_token_id == tok.eos_token_id
    assert any("no pad token" in r.getMessage() for r in caplog.records)


@pytest.mark.slow
def test_cli_runs_the_e2e_config_unchanged_on_another_data_to_text_csv(tiny_d2t_dir, tmp_path,
                                                                       monkeypatch, capsys):
    """`fedslice run configs/e2e_smollm2.toml --set data.path=...` on real SmolLM2: BLEU and
    ROUGE-L in the evaluation's log line and in summary.json (small overrides for time: one
    round, whose evaluation, the test's and the summary are what the config's task changes).
    The CLI's main in this process (a fresh interpreter imported torch and transformers again:
    ~5 CPU-s; `python -m fedslice.cli` itself: tests/test_cli.py)."""
    from pathlib import Path

    from fedslice.cli import main

    repo = Path(__file__).resolve().parents[1]
    sets = [f"data.path={tiny_d2t_dir}", "threads=1", "federation.rounds=1", "federation.local_steps=1",
            "federation.num_clients=4", "federation.clients_per_round=2", "evaluation.every=1",
            "task.max_new_tokens=8", f"output.dir={tmp_path / 'runs'}", "output.plots=false"]
    monkeypatch.chdir(tmp_path)
    code = main(["run", str(repo / "configs/e2e_smollm2.toml"), *[a for s in sets for a in ("--set", s)]])
    out = capsys.readouterr()
    assert code == 0, out.err[-2000:]
    lines = [l for l in out.out.splitlines() if "round " in l and "/1 |" in l]  # "name: round 1/1 | ..."
    assert len(lines) == 1 and all("dev ROUGE-L" in l and "dev BLEU" in l for l in lines)
    run = next((tmp_path / "runs").iterdir())
    summary = json.loads((run / "summary.json").read_text())
    assert summary["test_rougeL"] >= 0 and summary["test_bleu"] >= 0 and summary["task"] == "generation"


@pytest.mark.parametrize("method, peft", [("fedpetuning", "lora"), ("fedpetuning", "prompt"),
                                          ("heads", "lora"), ("raffm", "lora")])
def test_analytic_flops_count_the_lm_head_at_target_tokens(tiny_gen_cfg_dict, tmp_path, method, peft):
    """A language-model head runs at every target token (the logits are computed only there),
    virtual tokens at every row: the analytic count of each method uses both, so it agrees with
    the measured FLOPs on the tiny LLaMA, whose 49k-word head is ~99% of a step. (heads and raffm
    counted the head once per example: 0.11x the measured FLOPs; fedpetuning counted the virtual
    tokens once per target token: 1.04-1.07x.)"""
    cfg_dict = {**tiny_gen_cfg_dict, "method": {"name": method, **method_options(method, tmp_path)},
                "peft": {"method": peft}}
    if peft == "prompt":
        cfg_dict.pop("lora")
        cfg_dict["prompt"] = {"num_virtual_tokens": 4}
    cfg = validate_config(cfg_dict)
    m, data = setup(cfg)
    _, records, _ = Simulation(cfg, m, data).run()
    trained = [c for c in records[0]["client_metrics"] if not c.get("sat_out")]
    assert trained  # (raffm's half-FLOPs tier cannot fit a model that is ~all LM head: it sits out)
    for c in trained:
        assert c["flops_analytic"] == pytest.approx(c["flops_measured"], rel=0.05), (method, peft)
