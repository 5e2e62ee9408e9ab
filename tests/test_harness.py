"""``fedslice evaluate RUN --harness`` (issue 57, part 3): lm-evaluation-harness through its
Python API on the run's model equals ``lm_eval``'s own CLI on the merged export (tiny LLaMA,
tiny task YAMLs and data the test writes: no network); the shipped local tasks load and score;
bad input is one line naming the task, and loses nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

from fedslice.api import run_experiment  # noqa: E402
from fedslice.cli import main  # noqa: E402
from fedslice.experiment import validate_config  # noqa: E402
from fedslice.export import export_run  # noqa: E402

WORDS = ("red", "blue", "green", "cat", "dog", "tree", "river", "stone", "light", "bread")


def write_tiny_tasks(folder: Path) -> Path:
    """Two task YAMLs over JSONL files (absolute paths): a 3-way multiple choice (acc, acc_norm)
    and a rolling log-likelihood one (word/byte perplexity, bits per byte: continuous)."""
    folder.mkdir(parents=True, exist_ok=True)
    mc, text = folder / "mc.jsonl", folder / "text.jsonl"
    with open(mc, "w") as f:
        for i in range(12):
            a, b, c = WORDS[i % 10], WORDS[(i + 3) % 10], WORDS[(i + 7) % 10]
            f.write(json.dumps({"q": f"The {a} is next to the", "choices": [b, c, f"{a} {b}"],
                                "gold": i % 3}) + "\n")
    with open(text, "w") as f:
        for i in range(10):
            f.write(json.dumps({"text": " ".join(WORDS[(i * j) % 10] for j in range(1, 9))
                                + "."}) + "\n")
    (folder / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {mc}
output_type: multiple_choice
test_split: test
doc_to_text: "{{{{q}}}}"
doc_to_target: "{{{{gold}}}}"
doc_to_choice: "{{{{choices}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
  - metric: acc_norm
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
""")
    (folder / "tiny_ppl.yaml").write_text(f"""task: tiny_ppl
dataset_path: json
dataset_kwargs:
  data_files:
    test: {text}
output_type: loglikelihood_rolling
test_split: test
doc_to_text: ""
doc_to_target: "{{{{text}}}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
metadata:
  version: 1.0
""")
    return folder


@pytest.fixture
def lora_run(tiny_gen_cfg_dict, tmp_path) -> Path:
    d = dict(tiny_gen_cfg_dict)
    d["federation"] = {**d["federation"], "num_clients": 2, "clients_per_round": 2, "rounds": 1,
                       "local_steps": 2, "lr": 5e-2}
    return Path(run_experiment(validate_config(d)))


def _printed(out: str) -> dict[tuple[str, str], str]:
    """``task: metric VALUE ...`` lines of ``fedslice evaluate --harness`` as {(task, metric): VALUE}."""
    found = {}
    for line in out.splitlines():
        if ": " in line and not line.startswith("results:"):
            task, rest = line.split(": ", 1)
            metric, value = rest.split(" ")[:2]
            found[(task, metric)] = value
    return found


def _cli_results(model_dir: Path, tasks: Path, limit: int, out: Path) -> dict:
    """What ``lm_eval``'s own CLI reports for a model folder (its results JSON)."""
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run([sys.executable, "-m", "lm_eval", "--model", "hf", "--model_args",
                           f"pretrained={model_dir},dtype=float32", "--device", "cpu",
                           "--tasks", "tiny_mc,tiny_ppl", "--include_path", str(tasks),
                           "--limit", str(limit), "--output_path", str(out)],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (file,) = out.rglob("results_*.json")
    return json.loads(file.read_text())["results"], proc.stdout


def test_harness_equals_lm_eval_cli_on_the_merged_export(lora_run, tiny_lm_dirs, tmp_path,
                                                          capsys):
    tasks = write_tiny_tasks(tmp_path / "tasks")
    assert main(["evaluate", str(lora_run), "--harness", "tiny_mc,tiny_ppl", "--harness-include",
                 str(tasks), "--limit", "8", "--baseline"]) == 0
    printed = _printed(capsys.readouterr().out)
    saved = json.loads((lora_run / "harness.json").read_text())["tasks"]
    merged = export_run(lora_run, "merged")
    cli, table = _cli_results(merged, tasks, 8, tmp_path / "cli")
    compared = 0
    for task in ("tiny_mc", "tiny_ppl"):
        for key, value in cli[task].items():
            if "," not in key or not isinstance(value, float):
                continue
            metric, filt = key.split(",")
            if filt != "none" or metric.endswith("_stderr"):
                continue
            assert printed[(task, metric)] == f"{value:.4f}", (task, metric)
            assert saved[task]["metrics"][metric] == pytest.approx(value, abs=1e-9)
            compared += 1
        assert saved[task]["samples"] == 8 and saved[task]["baseline"] is not None
    assert compared == 5
    # the CLI's own printed table shows the same numbers
    assert f"{cli['tiny_ppl']['bits_per_byte,none']:.4f}" in table
    # the baseline is the untrained model: the base folder, loaded by lm_eval as its CLI does
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager
    base = simple_evaluate(model="hf", model_args=f"pretrained={tiny_lm_dirs['llama']},dtype=float32",
                           device="cpu", tasks=["tiny_ppl"], limit=8, log_samples=False,
                           task_manager=TaskManager(include_path=str(tasks),
                                                    include_defaults=False))["results"]
    b = saved["tiny_ppl"]["baseline"]["metrics"]["bits_per_byte"]
    assert b == pytest.approx(base["tiny_ppl"]["bits_per_byte,none"], abs=1e-9)
    assert b != pytest.approx(saved["tiny_ppl"]["metrics"]["bits_per_byte"], abs=1e-7)
    # in the run's reports
    html = (lora_run / "report.html").read_text()
    assert "lm-evaluation-harness" in html and "tiny_ppl" in html
    assert main(["report", str(lora_run)]) == 0
    assert "lm-evaluation-harness" in capsys.readouterr().out


def _local_rows() -> dict[str, dict[str, list[dict]]]:
    """A few rows in the layout bench/data/build_harness_tasks.py writes, per data set."""
    arc = [{"id": f"q{i}", "question": f"Which is {w}?", "answerKey": "B",
            "choices": {"text": ["a rock", f"the {w}", "a cloud"], "label": ["A", "B", "C"]}}
           for i, w in enumerate(WORDS[:3])]
    mmlu = [{"question": f"What is {w}?", "subject": "high_school_biology",
             "choices": ["a", "b", "c", "d"], "answer": i % 4} for i, w in enumerate(WORDS[:5])]
    tqa = [{"question": f"Is the {w} real?",
            "mc1_targets": {"choices": ["Yes.", "No.", "Maybe."], "labels": [1, 0, 0]},
            "mc2_targets": {"choices": ["Yes.", "It is.", "No."], "labels": [1, 1, 0]}}
           for w in WORDS[:2]]
    gsm = [{"question": f"Tom has {i} apples and buys 2. How many?",
            "answer": f"He has {i}+2={i + 2}.\n#### {i + 2}"} for i in range(6)]
    hsw = [{"ctx": f"Cooking: A man cuts the {w}. he", "label": 0,
            "endings": ["puts it in a pan.", "flies away.", "sings.", "is blue."]} for w in WORDS[:2]]
    return {"arc_easy": {"train": arc, "validation": arc}, "arc_challenge": {"train": arc,
            "validation": arc}, "mmlu": {"test": mmlu, "dev": mmlu},
            "truthfulqa": {"validation": tqa}, "gsm8k": {"train": gsm, "test": gsm},
            "hellaswag": {"validation": hsw}}


def test_shipped_local_tasks_load_and_score(tiny_lm_dirs, tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fedslice.harness import run_harness, task_manager
    from fedslice.harness_tasks import TASKS_DIR
    for name, splits in _local_rows().items():
        for split, rows in splits.items():
            f = tmp_path / "data" / name / f"{split}.jsonl"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    monkeypatch.setenv("FEDSLICE_HARNESS_DATA", str(tmp_path / "data"))
    local = sorted(p.stem for p in TASKS_DIR.glob("*_local.yaml"))
    assert len(local) == 7
    tm = task_manager(names=local)
    from transformers import AutoConfig
    config = AutoConfig.from_pretrained(tiny_lm_dirs["llama"])
    config.max_position_embeddings = 2048  # gsm8k's 5 shots and 256 new tokens (RoPE: no weights)
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dirs["llama"], config=config).eval()
    tok = AutoTokenizer.from_pretrained(tiny_lm_dirs["llama"])
    res = run_harness(model, tok, local, tm, limit=2, num_fewshot=None)
    for name in local:
        metrics = {k: v for k, v in res["results"][name].items() if "_stderr" not in k and "," in k}
        assert metrics and all(0.0 <= v <= 1.0 for v in metrics.values()), (name, metrics)
        assert res["n-samples"][name]["effective"] == 2
    assert res["configs"]["gsm8k_local"]["num_fewshot"] == 5  # the task's own shots


def test_harness_bad_input_is_one_line_naming_the_task(lora_run, tiny_cfg_dict, tmp_path,
                                                       monkeypatch, capsys):
    before = sorted(p.name for p in lora_run.iterdir())

    def refused(args, *words):
        assert main(["evaluate", str(lora_run), *args]) == 2
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        for w in words:
            assert w in err, (w, err)

    refused(["--harness", "no_such_task"], "'no_such_task'", "does not exist")
    refused(["--harness", "arc_easy_lcal"], "did you mean arc_easy_local")
    # lm_eval's own names are there unchanged (their data come from the hub)
    from fedslice.harness import task_manager
    hub = set(task_manager(names=["arc_easy"]).all_tasks)
    assert {"arc_easy", "hellaswag", "mmlu", "gsm8k", "truthfulqa_mc2", "arc_easy_local"} <= hub
    monkeypatch.setenv("FEDSLICE_HARNESS_DATA", str(tmp_path / "empty"))
    refused(["--harness", "arc_easy_local"], "'arc_easy_local'", "arc_easy/train.jsonl is missing",
            "build_harness_tasks.py", "FEDSLICE_HARNESS_DATA")
    refused(["--harness", "tiny_mc", "--harness-include", str(tmp_path / "nope")],
            "--harness-include", "no such folder")
    refused(["--limit", "5", "--data", "x.csv"], "--limit go with --harness")
    refused([], "--data FILE or --harness TASKS")
    # a classification run: refused naming its head; the run folder is as it was
    cls_run = Path(run_experiment(validate_config(tiny_cfg_dict)))
    cls_before = sorted(p.name for p in cls_run.iterdir())
    assert main(["evaluate", str(cls_run), "--harness", "arc_easy_local"]) == 2
    err = capsys.readouterr().err.strip()
    assert "'sequence_classification'" in err and "generation run" in err and "\n" not in err
    assert sorted(p.name for p in cls_run.iterdir()) == cls_before
    assert sorted(p.name for p in lora_run.iterdir()) == before


def test_harness_on_an_int8_base_scores_the_adapter_over_it(tiny_gen_cfg_dict, tmp_path, capsys):
    """Over an int8 base the adapter stays applied to the int8 weights it trained over (no merge):
    the trained model is that PeftModel, and --baseline the int8 base alone."""
    from fedslice.export import read_run
    from fedslice.harness import harness_model
    d = dict(tiny_gen_cfg_dict)
    d["model"] = {**d["model"], "quantize": "int8"}
    d["federation"] = {**d["federation"], "num_clients": 2, "clients_per_round": 2, "rounds": 1,
                       "local_steps": 2, "lr": 5e-2}
    run = Path(run_experiment(validate_config(d)))
    model, _, what = harness_model(read_run(run))
    assert what == "trained, adapter over the int8 base"
    from peft import PeftModel
    assert isinstance(model, PeftModel)  # not merged into the int8 weights
    tasks = write_tiny_tasks(tmp_path / "tasks")
    assert main(["evaluate", str(run), "--harness", "tiny_ppl", "--harness-include", str(tasks),
                 "--limit", "4", "--baseline"]) == 0
    entry = json.loads((run / "harness.json").read_text())["tasks"]["tiny_ppl"]
    assert "int8 base" in entry["model"] and entry["samples"] == 4
    trained, base = entry["metrics"]["bits_per_byte"], entry["baseline"]["metrics"]["bits_per_byte"]
    assert trained > 0 and base > 0 and trained != pytest.approx(base, abs=1e-7)
    assert "tiny_ppl: bits_per_byte" in capsys.readouterr().out


def test_per_example_scores_pair_up_and_average_to_the_task_score(tiny_lm_dirs, tmp_path):
    """``run_harness(log_samples=True)`` + ``per_example``: each example's score in document
    order, averaging exactly to lm_eval's score; a perplexity's non-numeric pairs left out."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from fedslice.harness import per_example, run_harness, task_manager
    tasks = write_tiny_tasks(tmp_path / "tasks")
    tm = task_manager([tasks], ["tiny_mc", "tiny_ppl"])
    model = AutoModelForCausalLM.from_pretrained(tiny_lm_dirs["llama"]).eval()
    tok = AutoTokenizer.from_pretrained(tiny_lm_dirs["llama"])
    res = run_harness(model, tok, ["tiny_mc", "tiny_ppl"], tm, limit=9, log_samples=True)
    got = per_example(res)
    assert set(got["tiny_mc"]) == {"acc", "acc_norm"} and got["tiny_ppl"] == {}
    for metric, values in got["tiny_mc"].items():
        assert len(values) == 9 and set(values) <= {0.0, 1.0}
        assert sum(values) / 9 == pytest.approx(res["results"]["tiny_mc"][f"{metric},none"], abs=1e-12)
    again = per_example(run_harness(model, tok, ["tiny_mc"], tm, limit=9, log_samples=True))
    assert again["tiny_mc"] == got["tiny_mc"]  # same documents, same order
    with pytest.raises(ValueError, match="log_samples=True"):
        per_example(run_harness(model, tok, ["tiny_mc"], tm, limit=2))
