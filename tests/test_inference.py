"""``fedslice predict`` and ``fedslice evaluate`` (issue 25, part 2) on tiny runs."""

from __future__ import annotations

import csv
import json

import pytest

from fedslice.api import run_experiment, setup
from fedslice.cli import main
from fedslice.experiment import validate_config


@pytest.fixture
def cls_run(tiny_cfg_dict):
    d = json.loads(json.dumps(tiny_cfg_dict))
    d["federation"].update(rounds=1, lr=5e-2)
    return run_experiment(validate_config(d))


def _labels(path):
    return [r["label"] for r in csv.DictReader(path.open(), delimiter="\t")]


def test_predict_classification_in_input_order(cls_run, tiny_data_dir, tmp_path, capsys):
    test = tiny_data_dir / "test.tsv"
    out = tmp_path / "pred.jsonl"
    assert main(["predict", str(cls_run), "--input", str(test), "--output", str(out)]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    rows = list(csv.DictReader(test.open(), delimiter="\t"))
    assert [r["sentence"] for r in recs] == [r["sentence"] for r in rows]  # input order, columns kept
    assert all(set(r["probabilities"]) == {0, 1} or len(r["probabilities"]) == 2 for r in recs)
    assert all(abs(sum(r["probabilities"]) - 1) < 1e-5 for r in recs)  # ids: a list by class id
    right = sum(int(r["prediction"]) == int(r["label"]) for r in recs)
    summary = json.loads((cls_run / "summary.json").read_text())
    assert right / len(recs) == summary["test_accuracy"]  # what fedslice evaluated
    # CSV by extension, and stdout when no --output
    assert main(["predict", str(cls_run), "--input", str(test), "--output", str(tmp_path / "p.csv")]) == 0
    assert next(csv.DictReader((tmp_path / "p.csv").open()))["prediction"] == str(recs[0]["prediction"])
    capsys.readouterr()
    assert main(["predict", str(cls_run), "--input", str(test)]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[0]) == recs[0]
    # evaluate: the run's test split again gives the run's test accuracy
    assert main(["evaluate", str(cls_run), "--data", str(test), "--name", "again"]) == 0
    ev = json.loads((cls_run / "eval-again.json").read_text())
    assert ev["metrics"]["all"]["accuracy"] == summary["test_accuracy"]
    assert ev["examples"] == {"all": len(rows)}
    # bad input: a file without the text column names the columns found
    bad = tmp_path / "bad.tsv"
    bad.write_text("review\tlabel\nfine\t1\n")
    assert main(["predict", str(cls_run), "--input", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "['sentence']" in err and "columns found: ['review', 'label']" in err
    assert main(["predict", str(cls_run), "--input", str(test), "--output", str(tmp_path / "x.txt")]) == 2


def test_predict_and_evaluate_with_label_names_and_data_options(tiny_cfg_dict, tmp_path, capsys):
    """Label names in, names out; evaluate reads another dataset with --set data.* options and
    keeps the run's label ids."""
    data = tmp_path / "named"
    data.mkdir()
    rows = [(f"{'good fun' if i % 2 else 'bad dull'} film {i}", "pos" if i % 2 else "neg") for i in range(60)]
    (data / "train.tsv").write_text("text\tlabel\n" + "".join(f"{t}\t{y}\n" for t, y in rows))
    d = json.loads(json.dumps(tiny_cfg_dict))
    d["data"] = {"path": str(data), "max_length": 16}  # text column: the default ('text')
    d["federation"].update(rounds=2, lr=5e-2)
    run = run_experiment(validate_config(d))
    (tmp_path / "in.jsonl").write_text('{"text": "good fun"}\n{"text": "bad dull"}\n')
    assert main(["predict", str(run), "--input", str(tmp_path / "in.jsonl")]) == 0
    recs = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    for r in recs:  # the label's name; probabilities by name
        assert set(r["probabilities"]) == {"neg", "pos"}
        assert r["prediction"] == max(r["probabilities"], key=r["probabilities"].get)
    other = tmp_path / "other.tsv"  # headerless, labels only 'pos': ids stay the run's
    other.write_text("".join(f"{t}\tpos\n" for t, y in rows if y == "pos"))
    assert main(["evaluate", str(run), "--data", str(other), "--set", "data.header=false",
                 "--set", 'data.columns=["text", "label"]']) == 0
    ev = json.loads((run / "eval-other.json").read_text())
    m = ev["metrics"]["all"]
    assert m["per_class_accuracy"]["neg"] is None  # no 'neg' row: the ids are still the run's
    assert m["per_class_accuracy"]["pos"] == m["accuracy"]
    assert main(["evaluate", str(run), "--data", str(other), "--set", "federation.rounds=3"]) == 2


def test_predict_generation(tiny_gen_cfg_dict, tiny_d2t_dir, tmp_path):
    cfg = validate_config(tiny_gen_cfg_dict)
    method, data = setup(cfg)
    run = run_experiment(cfg, setup_result=(method, data))
    out = tmp_path / "gen.jsonl"
    assert main(["predict", str(run), "--input", str(tiny_d2t_dir / "dev.csv"), "--output", str(out)]) == 0
    recs = [json.loads(x) for x in out.read_text().splitlines()]
    rows = list(csv.DictReader((tiny_d2t_dir / "dev.csv").open()))
    assert [r["mr"] for r in recs] == [r["mr"] for r in rows]
    ref = method.task.generate(method.model, data.dev, [0, 1], 4)  # fedslice's own generations
    assert [r["prediction"] for r in recs[:2]] == ref
    assert main(["evaluate", str(run), "--data", str(tiny_d2t_dir / "test.csv")]) == 0
    ev = json.loads((run / "eval-test.json").read_text())
    assert {"bleu", "rougeL", "loss"} <= set(ev["metrics"]["all"])
