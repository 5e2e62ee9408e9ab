"""``task.kind = 'chat'`` (issue 57, part 1) and natural client splits (part 2).

What is checked: the trained tokens are exactly the assistant turns (content + end-of-turn token,
not the newline a ChatML template writes after it) for SmolLM2's template, a LLaMA-3-style and a
Qwen2-style one, and equal HF's ``return_assistant_tokens_mask`` where a template marks its
``{% generation %}`` blocks; the layouts (messages JSONL, a JSON column in CSV, Parquet,
ShareGPT, Alpaca) give the same tokens; truncation never leaves a conversation without an
assistant token (dropped, counted); bad rows are one-line errors naming file and line, or
skipped and counted; a model without a template needs ``task.chat_template_file``; a chat round
trains with packing (the same loss as padded batches), on tiny LLaMA / Qwen2 / GPT-2, over an
int8 base, under every planning stage; ``predict`` answers the last user turn; natural client
splits equal flwr-datasets' ``NaturalIdPartitioner``.
"""

from __future__ import annotations

import csv
import json
import logging
import random
from pathlib import Path

import pytest
import torch
from conftest import smollm2_tokenizer

from fedslice.api import setup
from fedslice.data.packing import IGNORE
from fedslice.errors import ConfigError, DataError
from fedslice.experiment import validate_config
from fedslice.run.engine import Simulation
from fedslice.tasks.chat_template import tokenize_conversation

# --- templates --------------------------------------------------------------------------------

#: LLaMA-3's template (its header tokens, the trimmed content, <|eot_id|>; bos first)
LLAMA3 = ("{% set loop_messages = messages %}{% for message in loop_messages %}{% set content = "
          "'<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] "
          "| trim + '<|eot_id|>' %}{% if loop.index0 == 0 %}{% set content = bos_token + content "
          "%}{% endif %}{{ content }}{% endfor %}{% if add_generation_prompt %}{{ "
          "'<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")
#: Qwen2's (ChatML with a default system prompt)
QWEN2 = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
         "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
         "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
         "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
LLAMA3_TOKENS = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
END = {"smollm2": "<|im_end|>", "llama3": "<|eot_id|>", "qwen2": "<|im_end|>"}


def with_generation_marks(template: str, name: str) -> str:
    """The same template with HF's ``{% generation %}`` around what the assistant writes."""
    if name == "llama3":
        return template.replace(
            "{{ content }}", "{% if message['role'] == 'assistant' %}{{ content[:content.index("
            "'<|end_header_id|>\n\n') + 19] }}{% generation %}{{ content[content.index("
            "'<|end_header_id|>\n\n') + 19:] }}{% endgeneration %}{% else %}{{ content }}"
            "{% endif %}")
    return template.replace(
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}",
        "{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\n' }}{% generation %}"
        "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}{{ '\n' }}{% else %}"
        "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
        "{% endif %}")


@pytest.fixture(scope="module")
def tokenizers():
    out = {"smollm2": smollm2_tokenizer()}
    llama3 = smollm2_tokenizer()
    llama3.add_special_tokens({"additional_special_tokens": LLAMA3_TOKENS})
    llama3.bos_token = "<|begin_of_text|>"
    llama3.chat_template = LLAMA3
    qwen2 = smollm2_tokenizer()
    qwen2.chat_template = QWEN2
    return {**out, "llama3": llama3, "qwen2": qwen2}


CONVERSATION = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "It is 4."},
    {"role": "user", "content": "And  3 + 3 ?"},
    {"role": "assistant", "content": "6, of course:\nsix."},
    {"role": "user", "content": "Thanks!"},
    {"role": "assistant", "content": "You're welcome."},
]


def runs(mask: torch.Tensor) -> list[tuple[int, int]]:
    """``[start, stop)`` of each run of True."""
    out, start = [], None
    for i, m in enumerate(mask.tolist() + [False]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            out.append((start, i))
            start = None
    return out


@pytest.mark.parametrize("name", ["smollm2", "llama3", "qwen2"])
@pytest.mark.parametrize("turns", [CONVERSATION, CONVERSATION[1:3], CONVERSATION[1:5]])
def test_trained_tokens_are_exactly_the_assistant_turns(tokenizers, name, turns):
    tok = tokenizers[name]
    ids, trained, prompt_ids = tokenize_conversation(tok, turns)
    # the template's own tokens: apply_chat_template(tokenize=True)
    assert ids.tolist() == list(tok.apply_chat_template(turns, tokenize=True, return_dict=True)["input_ids"])
    answers = [t["content"] for t in turns if t["role"] == "assistant"]
    spans = runs(trained)
    assert len(spans) == len(answers)
    for (a, b), text in zip(spans, answers):  # content + the end-of-turn token, nothing else
        assert tok.decode(ids[a:b]) == text.strip() + END[name]
    # everything else is the template's: system and user turns and headers
    rest = tok.decode(ids[~trained])
    assert all(t["content"].strip() in rest for t in turns if t["role"] != "assistant")
    assert not any(a in rest for a in answers)
    # the prompt is the conversation before the last answer, ready for it, as the template
    # renders it to ask for an answer
    prompt = tok.apply_chat_template(turns[:-1], tokenize=True, add_generation_prompt=True,
                                     return_dict=True)["input_ids"]
    assert prompt_ids.tolist() == list(prompt)


@pytest.mark.parametrize("name", ["smollm2", "llama3", "qwen2"])
def test_spans_equal_hf_assistant_mask_where_the_template_marks_generation(tokenizers, name):
    tok = tokenizers[name]
    saved = tok.chat_template
    base = QWEN2 if name == "smollm2" else saved  # SmolLM2's is ChatML like Qwen2's
    tok.chat_template = with_generation_marks(base, name)
    try:
        hf = tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True,
                                     return_assistant_tokens_mask=True)
        ids, trained, _ = tokenize_conversation(tok, CONVERSATION)
    finally:
        tok.chat_template = saved
    assert ids.tolist() == list(hf["input_ids"])
    assert trained.tolist() == [bool(m) for m in hf["assistant_masks"]]


# --- data layouts -----------------------------------------------------------------------------

TOPICS = ["the sea", "a cat", "bread", "rain", "maps", "music", "tea", "stars"]


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    """``n`` conversations of 1-3 exchanges, some with a system turn."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        turns = [{"role": "system", "content": "Be brief."}] if i % 3 == 0 else []
        for _ in range(rng.randint(1, 3)):
            topic = rng.choice(TOPICS)
            turns.append({"role": "user", "content": f"Tell me about {topic}."})
            turns.append({"role": "assistant", "content": f"{topic.capitalize()} is nice."})
        out.append(turns)
    return out


USERS = ["ann", "bob", "cy", "dee", "eve"]


def write_chat_jsonl(folder: Path, sizes=(40, 8, 8), seed: int = 0, users=USERS) -> Path:
    """train/dev/test JSONL files of conversations in the ``messages`` layout, with a ``user``
    column (users of skewed sizes in train)."""
    folder.mkdir(parents=True, exist_ok=True)
    for k, (split, n) in enumerate(zip(("train", "dev", "test"), sizes)):
        rows = [{"user": users[min(i % 7, len(users) - 1)], "messages": m}
                for i, m in enumerate(conversations(n, seed + k))]
        (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def chat_cfg(path: Path, model_path: Path, tmp_path: Path, **sections) -> dict:
    d = {"seed": 0, "threads": 1, "data": {"path": str(path), "max_length": 64},
         "model": {"name": str(model_path)},
         "task": {"kind": "chat", "max_new_tokens": 4},
         "lora": {"r": 4, "alpha": 8, "targets": ["q", "v"]},
         "federation": {"num_clients": 3, "clients_per_round": 2, "rounds": 1, "local_steps": 2,
                        "batch_size": 4, "lr": 5e-3},
         "method": {"name": "fedpetuning"},
         "evaluation": {"every": 1, "batch_size": 8, "dev_generations": 3},
         "output": {"dir": str(tmp_path / "runs"), "progress": False, "plots": False}}
    for k, v in sections.items():
        d[k] = {**d.get(k, {}), **v}
    return d


@pytest.fixture(scope="module")
def chat_dir(tmp_path_factory) -> Path:
    return write_chat_jsonl(tmp_path_factory.mktemp("chat"))


def _encoded(cfg_dict, carve_missing: bool = False):
    from fedslice.run.setup import check_method
    from fedslice.models.loading import load_model

    cfg = validate_config(cfg_dict)
    _, task = check_method(cfg)
    raw = task.load_raw(carve_missing=carve_missing)
    loaded = load_model(cfg.model, None, 0, head=task.head)
    return task, task.encode(raw, loaded)


def test_layouts_give_the_same_tokens(tmp_path, tiny_lm_dirs):
    convs = conversations(6)
    share = [[{"from": {"system": "system", "user": "human", "assistant": "gpt"}[t["role"]],
               "value": t["content"]} for t in c] for c in convs]
    layouts = tmp_path / "layouts"
    for name in ("messages", "csv", "parquet", "sharegpt"):
        (layouts / name).mkdir(parents=True)
    lines = "".join(json.dumps({"messages": c}) + "\n" for c in convs)
    (layouts / "messages" / "train.jsonl").write_text(lines)
    with (layouts / "csv" / "train.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["id", "messages"])
        w.writerows([i, json.dumps(c)] for i, c in enumerate(convs))
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"messages": convs}), layouts / "parquet" / "train.parquet")
    (layouts / "sharegpt" / "train.jsonl").write_text(
        "".join(json.dumps({"conversations": c}) + "\n" for c in share))
    got = {}
    for name in ("messages", "csv", "parquet", "sharegpt"):
        _, enc = _encoded(chat_cfg(layouts / name, tiny_lm_dirs["llama"], tmp_path,
                                   data={"max_length": 256}))
        got[name] = enc["train"]
    ref = got["messages"]
    assert len(ref) == 6
    for name, split in got.items():
        assert [x.tolist() for x in split.ids] == [x.tolist() for x in ref.ids], name
        assert [x.tolist() for x in split.targets] == [x.tolist() for x in ref.targets], name


def test_alpaca_rows_are_a_user_turn_and_the_answer(tmp_path, tiny_lm_dirs):
    folder = tmp_path / "alpaca"
    folder.mkdir()
    rows = [{"instruction": "Name a colour.", "input": "", "output": "Blue."},
            {"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"}]
    (folder / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    task, enc = _encoded(chat_cfg(folder, tiny_lm_dirs["llama"], tmp_path,
                                  task={"preset": "alpaca"}))
    tok = task.tokenizer
    split = enc["train"]
    assert tok.decode(split.prompts[1]).endswith("<|im_start|>user\nAdd the numbers.\n\n2 and 3"
                                                 "<|im_end|>\n<|im_start|>assistant\n")
    trained = split.targets[1] != IGNORE
    assert tok.decode(split.ids[1][trained]) == "5<|im_end|>"
    assert split.references == ["Blue.", "5"]


# --- truncation ---------------------------------------------------------------------------------

def test_truncation_never_leaves_a_conversation_without_an_assistant_token(tmp_path, tiny_lm_dirs,
                                                                         caplog):
    folder = tmp_path / "long"
    folder.mkdir()
    long_user = [{"role": "user", "content": "word " * 80}, {"role": "assistant", "content": "ok"}]
    long_answer = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yes " * 80}]
    short = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    rows = [long_user, long_answer, short, long_user]
    (folder / "train.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    with caplog.at_level(logging.INFO, logger="fedslice"):
        _, enc = _encoded(chat_cfg(folder, tiny_lm_dirs["llama"], tmp_path, data={"max_length": 48}))
    split = enc["train"]
    assert len(split) == 2  # both long-user rows dropped
    assert all(len(x) <= 48 for x in split.ids)
    assert all(bool((t[1:] != IGNORE).any()) for t in split.targets)
    assert split.references == ["yes " * 80, "hello"]
    msgs = [r.getMessage() for r in caplog.records]
    assert sum("dropped 2 of 4 conversation(s)" in m for m in msgs) == 1
    assert sum("truncated 1 of 4 conversation(s)" in m for m in msgs) == 1


# --- bad input ----------------------------------------------------------------------------------

BAD = {
    "not-json": ("messages", '[{"role": "user", "content": "hi"}', "is not JSON"),
    "no-role": ("messages", [{"content": "hi"}, {"role": "assistant", "content": "x"}], "turn 1 has no 'role'"),
    "no-content": ("messages", [{"role": "user"}, {"role": "assistant", "content": "x"}], "turn 1 has no 'content'"),
    "unknown-role": ("messages", [{"role": "bot", "content": "hi"}], "turn 1 has an unknown role 'bot'"),
    "empty-turn": ("messages", [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}],
                   "turn 2 (assistant) is empty"),
    "no-assistant": ("messages", [{"role": "user", "content": "hi"}], "no assistant turn"),
    "empty-list": ("messages", [], "non-empty list of turns"),
    "sharegpt-role": ("conversations", [{"from": "robot", "value": "hi"}], "unknown role 'robot'"),
    "no-user-value": ("user", None, "client column 'user'"),
}


def _write_with_bad_row(folder: Path, bad: str) -> Path:
    column, cell, _ = BAD[bad]
    folder.mkdir(parents=True)
    good = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    key = "conversations" if column == "conversations" else "messages"
    if key == "conversations":
        good = [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "hello"}]
    rows = [{"user": "a", key: good} for _ in range(5)]
    rows[3] = {**rows[3], column: cell} if column != "user" else {key: good}
    # train with the bad row; dev and test of good rows (a run reads the three)
    for split, part in (("train", rows), ("dev", rows[:2]), ("test", rows[:2])):
        if bad == "not-json":  # a CSV with a JSON string column
            with (folder / f"{split}.csv").open("w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["user", "messages"])
                w.writerows([r["user"], r["messages"] if isinstance(r["messages"], str)
                             else json.dumps(r["messages"])] for r in part)
        else:
            (folder / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in part))
    return folder / ("train.csv" if bad == "not-json" else "train.jsonl")


@pytest.mark.parametrize("bad", sorted(BAD))
def test_a_bad_row_is_one_line_naming_file_and_line_or_skipped(tmp_path, tiny_lm_dirs, bad, caplog):
    path = _write_with_bad_row(tmp_path / "bad", bad)
    split = {"partition": "natural", "client_column": "user"} if bad == "no-user-value" else {}
    cfg = chat_cfg(path.parent, tiny_lm_dirs["llama"], tmp_path, data=split)
    with pytest.raises(DataError) as e:
        _encoded(cfg, carve_missing=True)
    msg = str(e.value)
    line = 5 if bad == "not-json" else 4  # the CSV's header is line 1
    assert "\n" not in msg and f"{path}, line {line}:" in msg and BAD[bad][2] in msg, msg
    assert 'data.bad_rows = "skip"' in msg
    cfg["data"]["bad_rows"] = "skip"
    with caplog.at_level(logging.WARNING, logger="fedslice"):
        _, enc = _encoded(cfg, carve_missing=True)
    assert len(enc["train"]) == 4
    assert sum("skipped 1 conversation(s)" in r.getMessage() for r in caplog.records) == 1


def test_a_conversation_column_the_data_lacks_names_the_layouts(tmp_path, tiny_lm_dirs):
    folder = tmp_path / "plain"
    folder.mkdir()
    (folder / "train.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    with pytest.raises(DataError, match="'messages' column.*conversations.*preset = 'alpaca'"):
        _encoded(chat_cfg(folder, tiny_lm_dirs["llama"], tmp_path))


def test_chat_config_refuses_templates_of_other_kinds(chat_dir, tiny_lm_dirs, tmp_path):
    from conftest import assert_refused_naming

    base = chat_cfg(chat_dir, tiny_lm_dirs["llama"], tmp_path)
    assert_refused_naming(base, {"task": {"target": "{x}"}}, ["target", "chat"])
    assert_refused_naming(base, {"task": {"kind": "generation", "target": "{x}",
                                          "messages_column": "m"}}, ["messages_column"])
    assert_refused_naming(base, {"data": {"partition": "natural"}}, ["client_column"])
    assert_refused_naming(base, {"data": {"client_column": "user"}}, ["natural"])
    from fedslice.run.setup import check_method
    with pytest.raises(ConfigError, match="'natural' is implemented for task.kind = 'chat' and "
                                          "'generation', not 'classification'"):
        check_method(validate_config({**base, "task": {}, "data": {
            **base["data"], "partition": "natural", "client_column": "user"}}))
    with pytest.raises(ConfigError, match="data.partition = 'dirichlet'.*'iid'.*'natural'"):
        check_method(validate_config({**base, "data": {**base["data"], "partition": "dirichlet"}}))


def test_a_model_without_a_chat_template_needs_chat_template_file(chat_dir, tiny_lm_dirs, tmp_path):
    from transformers import AutoTokenizer

    model = tmp_path / "no-template"
    import shutil
    shutil.copytree(tiny_lm_dirs["llama"], model)
    tok = AutoTokenizer.from_pretrained(model)
    tok.chat_template = None
    for f in model.glob("chat_template.*"):
        f.unlink()
    cfgfile = model / "tokenizer_config.json"
    conf = json.loads(cfgfile.read_text())
    conf.pop("chat_template", None)
    cfgfile.write_text(json.dumps(conf))
    with pytest.raises(ConfigError, match="task.chat_template_file"):
        _encoded(chat_cfg(chat_dir, model, tmp_path))
    template = tmp_path / "llama3.jinja"
    template.write_text(LLAMA3)
    task, enc = _encoded(chat_cfg(chat_dir, model, tmp_path,
                                  task={"chat_template_file": str(template)}))
    assert "<|start_header_id|>" in task.tokenizer.decode(enc["train"].ids[0])
    with pytest.raises(ConfigError, match="chat_template_file.*cannot read"):
        _encoded(chat_cfg(chat_dir, model, tmp_path,
                          task={"chat_template_file": str(tmp_path / "missing.jinja")}))


# --- training -------------------------------------------------------------------------------------

def save_tiny_qwen2(folder: Path) -> Path:
    import transformers as T

    tok = smollm2_tokenizer()
    tok.chat_template = QWEN2
    config = T.Qwen2Config(vocab_size=len(tok), hidden_size=32, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                           max_position_embeddings=256, tie_word_embeddings=True,
                           pad_token_id=tok.pad_token_id, bos_token_id=tok.eos_token_id,
                           eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    T.AutoModelForCausalLM.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory) -> Path:
    return save_tiny_qwen2(tmp_path_factory.mktemp("tiny-qwen2"))


def _model(name, tiny_lm_dirs, tiny_qwen2):
    return tiny_qwen2 if name == "qwen2" else tiny_lm_dirs[name]


@pytest.mark.parametrize("model", ["llama", "qwen2", "gpt2"])
def test_a_chat_round_trains_and_evaluates(chat_dir, tiny_lm_dirs, tiny_qwen2, tmp_path, model):
    cfg = validate_config(chat_cfg(chat_dir, _model(model, tiny_lm_dirs, tiny_qwen2), tmp_path))
    method, data = setup(cfg)
    init = method.initial_state()
    state, records, summary = Simulation(cfg, method, data).run()
    assert summary["task"] == "chat" and summary["primary_metric"] == "rougeL"
    for k in ("loss", "perplexity", "rougeL", "bleu"):
        assert summary[f"test_{k}"] == summary[f"test_{k}"]
    assert summary["test_perplexity"] == pytest.approx(torch.tensor(summary["test_loss"]).exp().item(), rel=1e-5)
    assert any((state[k] - init[k]).abs().max() > 0 for k in state)
    samples = method.task.last_samples
    assert samples and all(s["prompt"].endswith("assistant\n") for s in samples)


def test_held_out_loss_is_the_mean_over_assistant_tokens(chat_dir, tiny_lm_dirs, tmp_path):
    """The evaluation loss equals HF's loss with the labels on the assistant tokens only."""
    import torch.nn.functional as F

    cfg = validate_config(chat_cfg(chat_dir, tiny_lm_dirs["llama"], tmp_path))
    method, data = setup(cfg)
    model = method.model
    split = data.test
    total = count = 0.0
    with torch.no_grad():
        for i in range(len(split)):
            ids, labels = split.ids[i][None], split.targets[i][None]
            logits = model(input_ids=ids).logits[0, :-1]
            lab = labels[0, 1:]
            keep = lab != IGNORE
            total += float(F.cross_entropy(logits[keep].float(), lab[keep], reduction="sum"))
            count += int(keep.sum())
    ev = method.task.evaluate(model, split, 4, max_generations=1)
    assert ev["loss"] == pytest.approx(total / count, rel=1e-5)


def test_packed_and_padded_batches_give_the_same_loss(chat_dir, tiny_lm_dirs, tmp_path):
    cfg = validate_config(chat_cfg(chat_dir, tiny_lm_dirs["llama"], tmp_path))
    method, data = setup(cfg)
    idx = list(range(8))
    padded, packed = data.train.collate(idx), data.train.collate_packed(idx)
    assert int((padded["labels"] != IGNORE).sum()) == int((packed["labels"] != IGNORE).sum())
    with torch.no_grad():
        a = method.task.loss(method.model, padded)
        b = method.task.loss(method.model, packed)
    assert float(a) == pytest.approx(float(b), abs=1e-5)


def test_a_chat_round_over_an_int8_base(chat_dir, tiny_lm_dirs, tmp_path):
    pytest.importorskip("torchao")
    cfg = validate_config(chat_cfg(chat_dir, tiny_lm_dirs["llama"], tmp_path,
                                   model={"quantize": "int8"}))
    method, data = setup(cfg)
    state, records, summary = Simulation(cfg, method, data).run()
    assert summary["test_loss"] == summary["test_loss"]
    assert records[-1]["client_metrics"][0]["trainable_params"] > 0


@pytest.mark.parametrize("method,tight", [
    ("fedpetuning", {"memory_mb": None}),
    ("heads", {"upload_mb_per_round": 0.002}),
    ("raffm+heads", {"memory_mb": None, "upload_mb_per_round": 0.002}),
])
def test_every_planning_stage_plans_a_chat_run(chat_dir, tiny_lm_dirs, tmp_path, method, tight):
    from fedslice.api import run_experiment

    d = chat_cfg(chat_dir, tiny_lm_dirs["llama"], tmp_path, method={"name": method},
                 federation={"num_clients": 4, "clients_per_round": 4, "pack": True},
                 lora={"ranks": [2, 4]} if method == "fedpetuning" else {})
    if "memory_mb" in tight:  # just below what the most-training plan needs
        from fedslice.api import setup
        d["budgets"] = {"tiers": [{"share": 1.0, "memory_mb": 1000}]}
        free, _ = setup(validate_config(json.loads(json.dumps(d))))
        tight = {**tight, "memory_mb": round(0.95 * next(iter(free.plans.values())).memory_mb, 4)}
    d["budgets"] = {"tiers": [{"share": 0.5, "memory_mb": 1000, "name": "big"},
                              {"share": 0.5, "name": "tight", **tight}]}
    run = run_experiment(validate_config(d), tmp_path / method.replace("+", "-"), progress=False)
    summary = json.loads((run / "summary.json").read_text())
    groups = {g["budget_name"]: g for g in summary["plans"]}
    assert set(groups) == {"big", "tight"}
    assert not groups["big"]["plan"]["sparsity"] and groups["big"]["plan"]["width"] == 1.0
    assert groups["tight"]["plan"] != groups["big"]["plan"]  # the tight budget bought a saving
    for g in groups.values():
        assert g["measured"]["client_rounds"] == len(g["clients"])
        for key, budget in (("memory_mb_max", "memory_mb"), ("upload_mb_mean", "upload_mb_per_round")):
            assert g["measured"][key] <= g["budget"].get(budget, 1e9)


def test_predict_answers_the_last_user_turn(chat_dir, tiny_lm_dirs, tmp_path):
    from fedslice.api import run_experiment
    from fedslice.inference import predict

    run = run_experiment(validate_config(chat_cfg(chat_dir, tiny_lm_dirs["llama"], tmp_path)),
                         tmp_path / "p", progress=False)
    rows = [{"messages": [{"role": "user", "content": "Tell me about tea."}]},
            {"messages": [{"role": "system", "content": "Be brief."},
                          {"role": "user", "content": "Tell me about rain."},
                          {"role": "assistant", "content": "Rain is nice."},
                          {"role": "user", "content": "And maps?"},
                          {"role": "assistant", "content": "(left out)"}]}]
    path = tmp_path / "ask.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    summary = json.loads((run / "summary.json").read_text())
    assert len(summary["samples"]) == 5 and summary["samples"][0]["prompt"].endswith("assistant\n")
    from fedslice.html_report import write_run_report
    html = write_run_report(run).read_text()
    assert "Generations (test sample)" in html and summary["samples"][0]["references"][0] in html
    records = predict(run, path, tmp_path / "answers.jsonl")
    # fedslice evaluate: the held-out metrics of any file of conversations
    from fedslice.inference import evaluate
    held_out = tmp_path / "held_out.jsonl"  # no user column: evaluation needs none
    held_out.write_text("".join(json.dumps({"messages": json.loads(x)["messages"]}) + "\n"
                                for x in (chat_dir / "test.jsonl").read_text().splitlines()))
    _, result = evaluate(run, str(held_out))
    assert result["task"] == "chat" and result["examples"] == {"all": 8}
    assert result["metrics"]["all"]["loss"] > 0
    assert len(records) == 2 and all(isinstance(r["prediction"], str) for r in records)
    assert records[1]["messages"] == rows[1]["messages"]
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"messages": [{"role": "system", "content": "x"}]}) + "\n")
    with pytest.raises(DataError, match="row 1: the conversation has no user turn"):
        predict(run, bad)


# --- natural client splits ---------------------------------------------------------------------------

def natural_cfg(chat_dir, tiny_lm_dirs, tmp_path, **federation) -> dict:
    d = chat_cfg(chat_dir, tiny_lm_dirs["llama"], tmp_path,
                 data={"partition": "natural", "client_column": "user", "max_length": 256})
    d["federation"] = {k: v for k, v in d["federation"].items()
                       if k not in ("num_clients", "clients_per_round")}
    d["federation"].update(federation)
    return d


def test_natural_split_takes_the_clients_from_the_data(chat_dir, tiny_lm_dirs, tmp_path):
    from fedslice.api import run_experiment
    from fedslice.data.partition import natural_partitions

    cfg = validate_config(natural_cfg(chat_dir, tiny_lm_dirs, tmp_path))
    method, data = setup(cfg)
    assert cfg.federation.num_clients == 5 and cfg.federation.clients_per_round == 5
    users = [json.loads(x)["user"] for x in (chat_dir / "train.jsonl").read_text().splitlines()]
    parts, ids, _ = natural_partitions(users)
    assert [p.tolist() for p in data.partitions] == [p.tolist() for p in parts]
    assert data.report["natural_ids"] == USERS and data.report["partition_sizes"] == [6, 6, 6, 6, 16]
    spread = data.report["size_spread"]
    assert (spread["min"], spread["median"], spread["max"]) == (6, 6.0, 16)
    # every conversation of a client is that user's
    for c, part in enumerate(data.partitions):
        assert {data.train.clients[i] for i in part.tolist()} == {USERS[c]}
    run = run_experiment(validate_config(natural_cfg(chat_dir, tiny_lm_dirs, tmp_path,
                                                     clients_per_round=2)),
                         tmp_path / "natural", progress=False)
    part = json.loads((run / "partition.json").read_text())
    assert part["scheme"] == "natural" and part["num_partitions"] == 5
    from fedslice.html_report import write_run_report
    html = write_run_report(run).read_text()
    assert "natural partition" in html and "eve" in html
    saved = json.loads((run / "config.json").read_text())
    assert saved["federation"]["num_clients"] == 5
    # a resume reads the config again: the derived client counts are no difference
    from fedslice.run.checkpoint import check_same_config
    given = validate_config(natural_cfg(chat_dir, tiny_lm_dirs, tmp_path, clients_per_round=2))
    check_same_config(saved, given.model_dump(mode="json"), run)
    with pytest.raises(ConfigError, match="federation.rounds"):
        check_same_config(saved, {**given.model_dump(mode="json"), "federation": {
            **given.model_dump(mode="json")["federation"], "rounds": 9}}, run)


def test_natural_split_refuses_another_num_clients_and_leaves_out_small_clients(chat_dir, tiny_lm_dirs,
                                                                                tmp_path):
    with pytest.raises(ConfigError, match="num_clients = 3.*finds 5 clients"):
        setup(validate_config(natural_cfg(chat_dir, tiny_lm_dirs, tmp_path, num_clients=3,
                                          clients_per_round=2)))
    d = natural_cfg(chat_dir, tiny_lm_dirs, tmp_path, num_clients=5, clients_per_round=2)
    setup(validate_config(d))  # the right number, given
    d = natural_cfg(chat_dir, tiny_lm_dirs, tmp_path)
    d["data"]["min_partition_size"] = 7
    method, data = setup(cfg := validate_config(d))
    assert cfg.federation.num_clients == 1 and data.report["natural_ids"] == ["eve"]
    assert data.report["left_out_clients"] == 4 and data.report["left_out_rows"] == 24


def test_natural_split_of_a_generation_task(tiny_gen_cfg_dict, tmp_path):
    """data.partition = 'natural' on prompt -> target data (a `site` column): one client per
    site; the partitions equal NaturalIdPartitioner's over the train rows."""
    from fedslice.data.partition import natural_partitions

    folder = tmp_path / "d2t"
    folder.mkdir()
    sites = ["b", "a", "c", "a", "b", "a"] * 4
    with (folder / "train.csv").open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["mr", "ref", "site"])
        w.writerows([f"name[{i}]", f"Place {i}.", s] for i, s in enumerate(sites))
    (folder / "test.csv").write_text("mr,ref\nname[x],Place x.\n")
    d = tiny_gen_cfg_dict
    d["data"].update(path=str(folder), partition="natural", client_column="site")
    d["federation"] = {k: v for k, v in d["federation"].items() if k != "num_clients"}
    cfg = validate_config(d)
    method, data = setup(cfg)
    assert cfg.federation.num_clients == 3 and data.report["natural_ids"] == ["a", "b", "c"]
    parts, _, _ = natural_partitions(data.train.clients)
    assert [p.tolist() for p in data.partitions] == [p.tolist() for p in parts]
    for c, part in enumerate(data.partitions):
        assert {data.train.clients[i] for i in part.tolist()} == {"abc"[c]}
    Simulation(cfg, method, data).run()
