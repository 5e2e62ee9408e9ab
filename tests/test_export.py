"""``fedslice export`` (issue 25, part 1): the exported model, loaded with plain transformers or
peft, computes what fedslice evaluated at the end of the run (within 1e-4), on every
architecture of the table and for every method (tiny configs, one round)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import transformers
from peft import PeftModel

from conftest import method_options
from fedslice.api import run_experiment, setup
from fedslice.cli import main
from fedslice.experiment import validate_config
from fedslice.errors import ConfigError, FedsliceError
from fedslice.export import export_run
from fedslice.models.loading import AUTO_CLASSES
from fedslice.tasks import evaluate_classifier
from test_matrix import ENCODERS, GENERATIVE

TOL = 1e-4


def _cfg(arch, method, model_dirs, tiny_cfg_dict, tiny_gen_cfg_dict, tmp_path, **method_kw):
    d = dict(tiny_gen_cfg_dict if arch in GENERATIVE else tiny_cfg_dict)
    d["model"] = {"name": str(model_dirs[arch])}
    d["lora"] = {"r": 4, "alpha": 8, "targets": ["q", "v"] if method == "fedpft" else ["q", "v", "ffn_out"]}
    d["federation"] = {**d["federation"], "num_clients": 2, "clients_per_round": 2, "rounds": 1,
                       "local_steps": 2, "lr": 5e-2}
    d["method"] = {"name": method, **method_kw}
    return validate_config(d)


def _train(cfg):
    """Run ``cfg``; return the run folder, the method (its model holds the final state: what
    fedslice evaluated last) and the data."""
    method, data = setup(cfg)
    return run_experiment(cfg, setup_result=(method, data)), method, data


def _outputs(model, batch):
    model.eval()
    with torch.no_grad():
        return model(**batch).logits


def _batch(data):
    return data.dev.collate(list(range(min(6, len(data.dev)))))


def _auto(head):
    return getattr(transformers, AUTO_CLASSES[head])


@pytest.mark.parametrize("arch", [*ENCODERS, *GENERATIVE])
def test_lora_run_exports_merged_and_peft_on_every_architecture(arch, model_dirs, tiny_cfg_dict,
                                                                 tiny_gen_cfg_dict, tmp_path):
    cfg = _cfg(arch, "fedpetuning", model_dirs, tiny_cfg_dict, tiny_gen_cfg_dict, tmp_path)
    run, method, data = _train(cfg)
    batch = _batch(data)
    ref = _outputs(method.model, batch)
    head = method.task.head
    merged = export_run(run, "merged")
    assert (merged / "config.json").is_file() and (merged / "model.safetensors").is_file()
    assert (merged / "tokenizer_config.json").is_file()
    plain = _auto(head).from_pretrained(merged)
    assert "peft" not in type(plain).__module__
    assert (_outputs(plain, batch) - ref).abs().max() < TOL
    adapter = export_run(run, "peft")
    conf = json.loads((adapter / "adapter_config.json").read_text())
    assert conf["peft_type"] == "LORA" and conf["r"] == 4
    base = _auto(head).from_pretrained(model_dirs[arch], **(
        {"num_labels": 2} if head == "sequence_classification" else {}))
    tuned = PeftModel.from_pretrained(base, adapter)
    assert (_outputs(tuned, batch) - ref).abs().max() < TOL
    if head == "sequence_classification":  # the run's own test accuracy, from the export alone
        summary = json.loads((run / "summary.json").read_text())
        assert evaluate_classifier(plain, data.test, 32)["accuracy"] == summary["test_accuracy"]


@pytest.mark.parametrize("method_name", ["fedavg", "heads", "raffm", "fedpft", "fedot"])
def test_every_method_exports_what_it_evaluates(method_name, model_dirs, tiny_cfg_dict,
                                                 tiny_gen_cfg_dict, tmp_path):
    opts = method_options(method_name, tmp_path)
    arch = "bert"
    cfg = _cfg(arch, method_name, model_dirs, tiny_cfg_dict, tiny_gen_cfg_dict, tmp_path, **opts)
    run, method, data = _train(cfg)
    batch = _batch(data)
    ref = _outputs(method.model, batch)
    plain = transformers.AutoModelForSequenceClassification.from_pretrained(export_run(run, "merged"))
    assert (_outputs(plain, batch) - ref).abs().max() < TOL
    if method_name == "fedavg":  # full fine-tuning is not an adapter: said, pointing to merged
        with pytest.raises(FedsliceError, match="not train an adapter.*--format merged"):
            export_run(run, "peft")
        return
    # LoRA over the unchanged base: raffm's global state is saved un-permuted; fedpft's LoRA
    # plugs into the full model; fedot's adapter layers carry it
    base = transformers.AutoModelForSequenceClassification.from_pretrained(model_dirs[arch], num_labels=2)
    tuned = PeftModel.from_pretrained(base, export_run(run, "peft"))
    assert (_outputs(tuned, batch) - ref).abs().max() < TOL


def _elastic_reference(method, size):
    plan = method.sizes.at(size)
    return method.submodel(plan.spec), plan.spec


@pytest.mark.parametrize("arch", ["bert", "llama", "t5"])
def test_raffm_elastic_size_is_a_smaller_standalone_checkpoint(arch, model_dirs, tiny_cfg_dict,
                                                               tiny_gen_cfg_dict, tmp_path):
    kw = {"tiers": [{"share": 0.5, "flops": 0.5 if arch == "bert" else 0.99},
                    {"share": 0.5, "flops": 1.0}], "reorder_every": 1, "width_steps": 4,
          "tuning": "full" if arch == "t5" else "lora"}
    if arch != "bert":  # a tiny LM's FLOPs are mostly its output layer
        kw["elastic_sizes"] = [0.98, 1.0]
    cfg = _cfg(arch, "raffm", model_dirs, tiny_cfg_dict, tiny_gen_cfg_dict, tmp_path, **kw)
    run, method, data = _train(cfg)
    sizes = json.loads((run / "raffm_elastic.json").read_text())["sizes"]
    size = min(e["size"] for e in sizes)
    assert size < 1
    sub, spec = _elastic_reference(method, size)
    batch = _batch(data)
    ref = _outputs(sub, batch)
    out = export_run(run, "merged", size=size)
    small = _auto(method.task.head).from_pretrained(out, trust_remote_code=True)
    assert (_outputs(small, batch) - ref).abs().max() < TOL
    full = method.model.config
    whole = _auto(method.task.head).from_pretrained(export_run(run, "merged"))
    assert sum(p.numel() for p in small.parameters()) < sum(p.numel() for p in whole.parameters())
    conf = json.loads((out / "config.json").read_text())
    dims = method.arch.dims(full)
    kept = spec.stacks[0] if hasattr(spec, "stacks") else spec
    ffn_attr = method.arch.stacks[0].ffn_attr
    assert conf[ffn_attr] == len(kept.neurons[0]) < dims["ffn"]
    heads_attr = method.arch.stacks[0].num_heads_attr
    if arch == "bert":  # head size = hidden / heads: the heads are narrowed by the folder's code
        assert (out / "fedslice_elastic.py").is_file() and conf["auto_map"]
        assert all(len(h) == conf["fedslice_elastic"]["stacks"][0]["attention"][0]["width"] // 8
                   for h in kept.heads)
    else:  # LLaMA's head_dim / T5's d_kv: fewer heads in the stock config
        assert not (out / "fedslice_elastic.py").exists()
        assert conf[heads_attr] == len(kept.heads[0]) < dims["num_heads"]


def test_export_refuses_bad_input(model_dirs, tiny_cfg_dict, tiny_gen_cfg_dict, tmp_path, capsys,
                                  monkeypatch):
    cfg = _cfg("bert", "fedpetuning", model_dirs, tiny_cfg_dict, tiny_gen_cfg_dict, tmp_path)
    run, method, data = _train(cfg)
    with pytest.raises(ConfigError, match="method .fedpetuning. has no elastic sizes"):
        export_run(run, "merged", size=0.5)
    assert main(["export", str(run), "--format", "merged", "--size", "0.5"]) == 2
    assert "has no elastic sizes (those of raffm, raffm+heads" in capsys.readouterr().err
    # an interrupted run (a staging folder with a checkpoint): refused naming what is missing,
    # exported from its checkpoint with --allow-partial
    import fedslice.run.session as session

    def crash(*a, **k):
        raise RuntimeError("killed")
    monkeypatch.setattr(session, "save_results", crash)
    cfg2 = validate_config({**cfg.model_dump(mode="json"),
                            "federation": {**cfg.federation.model_dump(), "rounds": 2},
                            "output": {**cfg.output.model_dump(), "checkpoint_every": 1,
                                       "name": "cut"}})
    with pytest.raises(RuntimeError, match="killed"):
        run_experiment(cfg2)
    (staging,) = (tmp_path / "runs").glob(".cut.partial-*")
    with pytest.raises(FedsliceError, match="summary.json, final_trainable.safetensors missing.*"
                                            "--allow-partial"):
        export_run(staging, "merged")
    out = export_run(staging, "peft", tmp_path / "adapter", allow_partial=True)
    note = json.loads((out / "fedslice_export.json").read_text())
    assert note["partial"].startswith("checkpoint after round 2 of 2")
    assert main(["export", str(tmp_path / "nope"), "--format", "peft"]) == 2
    assert "not a run folder" in capsys.readouterr().err
    assert main(["export", str(run), "--format", "merged", "--out", str(tmp_path / "adapter")]) == 2
    assert "not empty" in capsys.readouterr().err
    assert math.isfinite(float(_outputs(method.model, _batch(data)).sum()))


def test_a_composition_exports_sizes_with_its_sub_model_stages_hook():
    from fedslice.registry import METHODS

    hook = METHODS.get("raffm").elastic_export
    assert hook is not None and METHODS.get("raffm+heads").elastic_export is hook
    assert all(METHODS.get(n).elastic_export is None for n in ("fedpetuning", "heads", "fedavg"))
