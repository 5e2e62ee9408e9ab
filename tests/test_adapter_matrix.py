"""Every adapter on every architecture and task, and with every method (issue 23, part 5 of
the adapters' share), on tiny random configs: one round each.

A pair that works trains one round: a finite loss, an upload of exactly the adapter's tensors
(and the classifier), and one client's reply aggregated alone is the new global state ("one
client returns its own weights"). A pair that cannot work stops before any weight is loaded
with a ConfigError naming both and saying why. ``ADAPTER_ARCH`` is the table of
``docs/adapters.md``; ``ADAPTER_METHOD`` is the adapter x method table of ``docs/methods.md``.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from conftest import save_tiny_model
from fedslice.api import setup
from fedslice.errors import ConfigError
from fedslice.experiment import validate_config
from fedslice.run.engine import Simulation
from fedslice.fl.strategy import Reply

ROOT = Path(__file__).resolve().parents[1]
ADAPTERS = ("lora", "dora", "ia3", "prompt", "ptuning", "prefix")
ENCODERS = ("bert", "roberta", "distilbert")
ARCHS = (*ENCODERS, "gpt2", "llama", "t5", "bart")
#: the tasks each architecture's tiny model runs here (BART's classification head needs an EOS
#: in every example, which the tiny SmolLM2 tokenizer does not add: only its refusals are tested)
TASKS = {**{a: ("classification",) for a in ENCODERS},
         "gpt2": ("classification", "generation", "text-to-text"),
         "llama": ("classification", "generation", "text-to-text"),
         "t5": ("generation", "text-to-text"), "bart": ("generation", "text-to-text")}


def works(adapter: str, arch: str, task: str) -> bool:
    """docs/adapters.md: where each adapter runs."""
    if adapter in ("prompt", "ptuning"):  # virtual tokens as input embeddings
        return task != "classification" or arch in ENCODERS
    if adapter == "prefix":  # keys/values through the model's cache, peft's encoder-decoder split
        return arch not in ("distilbert", "t5", "bart")
    return True


#: docs/methods.md's adapter x method table (✓ runs; ✗ a ConfigError at load)
ADAPTER_METHOD = {
    "fedavg": {"none"},
    "fedpetuning": set(ADAPTERS),
    "heads": set(ADAPTERS),
    "raffm": {"lora", "dora", "ia3", "prompt", "ptuning", "none"},
    "fedpft": {"lora", "dora", "ia3"},
    "fedot": {"lora", "dora", "ia3", "none"},
}
METHODS = tuple(ADAPTER_METHOD)


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tiny_lm_dirs):
    dirs = {a: save_tiny_model(tmp_path_factory.mktemp(f"a-{a}"), a) for a in ENCODERS}
    return {**dirs, **{a: tiny_lm_dirs[a] for a in ("gpt2", "llama", "t5", "bart")}}


def _options(adapter: str) -> dict:
    if adapter in ("lora", "dora"):
        return {"r": 2, "alpha": 4, "targets": ["q", "k", "v", "o"]}
    if adapter == "ia3":
        return {"targets": ["k", "v"]}
    return {"num_virtual_tokens": 3} if adapter != "none" else {}


def config(adapter, arch, task, model_dirs, tiny_cfg_dict, tiny_gen_cfg_dict, method="fedpetuning",
           **method_opts):
    d = dict(tiny_gen_cfg_dict if task == "generation" else tiny_cfg_dict)
    d["model"] = {"name": str(model_dirs[arch])}
    if task == "text-to-text":
        d["task"] = {"kind": "classification", "label_words": {"0": " bad", "1": " good"}}
    d["peft"] = {"method": adapter}
    d.pop("lora", None)
    if adapter != "none":
        d[adapter] = _options(adapter)
    d["federation"] = {**d["federation"], "num_clients": 3, "clients_per_round": 1, "rounds": 1,
                       "local_steps": 1, "batch_size": 4}
    d["method"] = {"name": method, **method_opts}
    return validate_config(d)


def one_round(cfg, generative: bool):
    method, data = setup(cfg)
    sim = Simulation(cfg, method, data)
    state = method.initial_state()
    new, record = sim.run_round(1, state)
    assert math.isfinite(record["train_loss"])
    (client,) = record["clients"]
    payload = method.strategy.configure_train(1, state, [client])[client]
    reply = method.fit(payload, data.client(client), 0)
    return method, data, state, new, payload, reply


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("adapter", ADAPTERS)
def test_adapter_on_architecture(adapter, arch, model_dirs, tiny_cfg_dict, tiny_gen_cfg_dict):
    tasks = TASKS[arch] + (("classification",) if arch == "bart" else ())
    for task in tasks:
        cfg = config(adapter, arch, task, model_dirs, tiny_cfg_dict, tiny_gen_cfg_dict)
        if not works(adapter, arch, task):
            with pytest.raises(ConfigError, match=rf"peft\.method='{adapter}'.*{arch}"):
                setup(cfg)
            continue
        if arch == "bart" and task == "classification":
            continue  # see TASKS
        method, data, state, new, payload, reply = one_round(cfg, task == "generation")
        own = [k for k in state if method.adapter.owns(k)]
        assert own and all(method.adapter.owns(k) or any(c in k for c in method.arch.classifier)
                           for k in state), (task, sorted(state))
        assert set(reply.arrays) == set(state)
        assert reply.metrics["bytes_up"] == sum(t.numel() * t.element_size() for t in reply.arrays.values())
        assert any(not torch.equal(reply.arrays[k], state[k]) for k in own), task  # it trained
        result = method.strategy.aggregate_train(1, state, {0: payload}, {0: reply})
        for k in state:  # one client returns its own weights (server_lr 1)
            torch.testing.assert_close(result.state[k], reply.arrays[k], rtol=0, atol=1e-6)
        if task == "generation":
            ev = method.evaluate(new, data.dev, 8, max_generations=2)
            assert math.isfinite(ev["rougeL"]) and math.isfinite(ev["loss"])


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(f"a plot about {i} actors in a film of {i % 5} acts" for i in range(64)))
    return path


def _method_opts(method: str, corpus) -> dict:
    distill = {"corpus": str(corpus), "steps": 1, "batch_size": 4, "max_length": 16, "cache_dir": ""}
    return {"fedavg": {}, "fedpetuning": {},
            "heads": {"sparsity": 0.5, "importance_max_examples": 8},
            # the tests' usual grid of 4 widths (the default 48: tests/test_one_planner.py)
            "raffm": {"tiers": [{"share": 0.5, "flops": 0.6}, {"share": 0.5, "flops": 1.0}],
                      "width_steps": 4},
            "fedpft": {"keep_ratio": 0.5, "align_every": 1, "align_steps": 1, "distill": distill},
            "fedot": {"bottom_layers": 1, "top_layers": 0, "distill_emulator": True, "distill": distill},
            }[method]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("adapter", (*ADAPTERS, "none"))
def test_adapter_with_method(adapter, method, model_dirs, corpus, tiny_cfg_dict, tiny_gen_cfg_dict):
    """On a tiny BERT: a pair of docs/methods.md's table trains one round; any other is refused at
    config load, naming the adapter (and the method or its field)."""
    def cfg():
        return config(adapter, "bert", "classification", model_dirs, tiny_cfg_dict,
                      tiny_gen_cfg_dict, method, **_method_opts(method, corpus))
    if adapter not in ADAPTER_METHOD[method]:
        with pytest.raises(ConfigError, match=rf"(?s)peft\.method='{adapter}'.*\b{method}\b"):
            cfg()
        return
    method_obj, _, state, _, payload, reply = one_round(cfg(), False)
    result = method_obj.strategy.aggregate_train(1, state, {0: payload}, {0: reply})
    assert result.used == [0] and set(result.state) == set(state)


@pytest.mark.parametrize("adapter", ["prompt", "ptuning", "prefix"])
def test_heads_forward_pruning_refuses_adapters_without_per_head_modules(adapter, model_dirs,
                                                                           tiny_cfg_dict, tiny_gen_cfg_dict):
    with pytest.raises(ConfigError, match=rf"method\.prune='forward' with peft\.method='{adapter}'"):
        config(adapter, "bert", "classification", model_dirs, tiny_cfg_dict, tiny_gen_cfg_dict,
               "heads", prune="forward")


def test_heads_with_prompt_tuning_prunes_nothing_of_it(model_dirs, tiny_cfg_dict, tiny_gen_cfg_dict):
    """Prompt tuning has no per-head parameter: at 75% sparsity the client still trains and sends
    the whole prompt (and its keep-mask and importance); the same bytes of adapter as
    fedpetuning."""
    cfg = config("prompt", "bert", "classification", model_dirs, tiny_cfg_dict, tiny_gen_cfg_dict,
                 "heads", sparsity=0.75, importance_max_examples=8)
    method, _, state, _, _, reply = one_round(cfg, False)
    assert reply.metrics["sparsity"] == pytest.approx(0.75)
    for k, t in state.items():
        assert reply.arrays[k].shape == t.shape
    assert reply.metrics["bytes_up"] == sum(t.numel() * 4 for t in state.values()) + \
        sum(reply.arrays[k].numel() * reply.arrays[k].element_size() for k in ("heads.kept", "heads.alpha"))


def _table(path: Path, heading: str, rows: tuple[str, ...]) -> dict[str, list[str]]:
    text = path.read_text().split(heading, 1)[1]
    out = {}
    for r in rows:
        line = next(l for l in text.splitlines() if l.startswith(f"| `{r}`"))
        out[r] = [c.strip() for c in line.strip("|").split("|")[1:]]
    return out


@pytest.mark.parametrize("doc, heading", [("docs/methods.md", "## Which adapter runs with which method"),
                                          ("README.md", "### Which adapter runs with which method")])
def test_docs_adapter_method_table(doc, heading):
    cols = (*ADAPTERS, "none")
    table = _table(ROOT / doc, heading, METHODS)
    for m, cells in table.items():
        assert [c.startswith("✓") for c in cells] == [a in ADAPTER_METHOD[m] for a in cols], (doc, m)


def test_docs_adapter_architecture_table():
    table = _table(ROOT / "docs" / "adapters.md", "## Which adapter runs on which architecture", ADAPTERS)
    for a, cells in table.items():
        for arch, cell in zip(ARCHS, cells):
            runs = [t for t in TASKS[arch] if works(a, arch, t)]
            if arch == "bart" and works(a, arch, "classification"):
                runs.append("classification")
            assert cell.startswith("✓") == bool(runs), (a, arch)
            assert ("✓" in cell and "✗" in cell) == (bool(runs) and len(runs) < len(TASKS[arch]) +
                                                     (arch == "bart")), (a, arch, cell)


@pytest.mark.parametrize("adapter", ["lora", "dora", "ia3", "prefix"])
def test_heads_sends_only_kept_heads_of_each_adapter(adapter, model_dirs, tiny_cfg_dict, tiny_gen_cfg_dict):
    """One heads round at 50% sparsity on the tiny LLaMA (grouped-query attention): the reply
    holds exactly the kept heads' entries of every head-tied tensor (``heads_state`` of the
    client's keep-mask: LoRA B rows / A columns, DoRA magnitudes, IA3 vector slices, a prefix's
    key/value columns), fewer bytes than the dense adapter, and bytes_up counts what is sent."""
    from fedslice.methods.heads import KEPT
    from fedslice.slicing.head_aggregate import heads_state
    cfg = config(adapter, "llama", "generation", model_dirs, tiny_cfg_dict, tiny_gen_cfg_dict,
                 "heads", sparsity=0.5, importance_max_examples=8)
    method, _, state, _, _, reply = one_round(cfg, True)
    kept = reply.arrays[KEPT].bool()
    assert 0 < kept.sum() < kept.numel()
    want = heads_state(state, kept, method.arch, method.all_dims, method.positions)
    got = {k: t for k, t in reply.arrays.items() if not k.startswith("heads.")}
    assert {k: t.shape for k, t in got.items()} == {k: t.shape for k, t in want.items()}
    tied = [k for k in want if want[k].numel() < state[k].numel()]
    assert tied and all(method.adapter.owns(k) for k in tied)
    if adapter == "prefix":
        assert method.positions
    sent = sum(t.numel() * t.element_size() for t in reply.arrays.values())
    assert reply.metrics["bytes_up"] == sent
    assert sum(t.numel() * 4 for t in got.values()) < sum(t.numel() * 4 for t in state.values())
