"""Every method x every architecture of the table, on tiny random configs (issue 15, part 6).

A pair that works runs one round in the simulation and its aggregation keeps two exact
invariants, checked with a marker reply (every element a client sends = the global value it was
given + 1, aggregated alone with server_lr 1): each element it held becomes exactly its value
("one client returns its own weights") and every other element is unchanged ("held by nobody").
Generative pairs report a generation metric. A pair that cannot work fails at config load with a
ConfigError naming the method or the architecture -- never a traceback. ``WORKS`` is the README's
table.
"""

from __future__ import annotations

import math

import pytest
import torch

from conftest import VISION
from fedslice.api import setup
from fedslice.experiment import validate_config
from fedslice.errors import ConfigError
from fedslice.run.engine import Simulation
from fedslice.fl.strategy import Reply

METHODS = ("fedavg", "fedpetuning", "heads", "raffm", "fedpft", "fedot")
ENCODERS = ("bert", "roberta", "distilbert")
GENERATIVE = ("gpt2", "llama", "t5", "bart")
ARCHS = (*ENCODERS, *VISION, *GENERATIVE)
SLICING = ("heads", "raffm", "fedpft", "fedot")
#: the pairs that run today (the README table); every other pair is a ConfigError at load
WORKS = {(m, a) for m in METHODS for a in ENCODERS} | \
        {(m, a) for m in METHODS for a in VISION} | \
        {(m, a) for m in METHODS for a in GENERATIVE}


# model_dirs (conftest, one per session): a tiny model of every architecture of the table

#: raffm's planner grid where tiers are given (the tests' usual 4, as conftest's method_options):
#: the invariants hold for any sub-model; the default 48 widths (the planner bisects them: ~0.2 s
#: a width measured) are planned for the encoders below and in tests/test_one_planner.py
WIDTH_STEPS = 4


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("corpus") / "corpus.txt"
    path.write_text("\n".join(f"a plot about {i} actors in a film of {i % 5} acts" for i in range(64)))
    return path


def method_opts(name: str, corpus, cache, arch: str = "bert") -> dict:
    # image backbones distil on the training images the server keeps apart
    corpus = "server_holdout" if arch in VISION else str(corpus)
    distill = {"corpus": corpus, "steps": 2, "batch_size": 4, "max_length": 16, "cache_dir": str(cache)}
    return {"fedavg": {}, "fedpetuning": {},
            "heads": {"sparsity": 0.5, "importance_max_examples": 8},
            # a tiny LM's FLOPs are mostly its 49k-word output layer: slices save a few percent
            "raffm": {"tiers": [{"share": 0.5, "flops": 0.99}, {"share": 0.5, "flops": 1.0}],
                      "width_steps": WIDTH_STEPS}
            if arch in GENERATIVE else
            # 5 tokens per image: the embeddings and classifier weigh more than on 16-token text
            {"tiers": [{"share": 0.5, "flops": 0.5}, {"share": 0.5, "flops": 1.0}],
             "width_steps": WIDTH_STEPS}
            # RaFFM's default tiers and grid (a 0.25 tier needs a width below 4 steps' smallest)
            if arch in VISION else {}, "fedot": {"distill_emulator": True, "distill": distill,
                                                     # 2 layers per stack: adapter 1 + emulator 1
                                                     **({"bottom_layers": 1, "top_layers": 0}
                                                        if arch in GENERATIVE else {})},
            "fedpft": {"keep_ratio": 0.5, "align_every": 1, "align_steps": 1, "distill": distill},
            }[name]


def config(method: str, arch: str, model_dirs, corpus, tiny_cfg_dict, tiny_gen_cfg_dict, tmp_path,
           tiny_img_cfg_dict=None):
    d = dict(tiny_gen_cfg_dict if arch in GENERATIVE else tiny_img_cfg_dict if arch in VISION
             else tiny_cfg_dict)
    if arch in VISION:
        d["data"] = {**d["data"], "server_holdout": 0.1}
    d["model"] = {"name": str(model_dirs[arch])}
    d["lora"] = {"r": 4, "alpha": 8, "targets": ["q", "k", "v", "o"]}
    d["federation"] = {**d["federation"], "num_clients": 3, "clients_per_round": 1, "rounds": 1,
                       "local_steps": 1, "batch_size": 4}
    d["method"] = {"name": method, **method_opts(method, corpus, tmp_path / "cache", arch)}
    return validate_config(d)


def marker_reply(method, payload, reply: Reply, state=None) -> Reply:
    """The reply with every model tensor = what the client was given there + 1."""
    given = dict(payload.arrays)
    if method.name in ("heads", "raffm+heads"):
        from fedslice.methods.heads import KEPT
        from fedslice.slicing.heads import mask_spec, restrict
        from fedslice.slicing.state import extract_state
        spec = method.strategy.client_slice(payload)
        if spec is not None and KEPT in reply.arrays:  # the sub-model's kept heads
            given = extract_state(state, restrict(spec, reply.arrays[KEPT], method.all_dims),
                                  method.arch)
        elif KEPT in reply.arrays:
            given = extract_state(payload.arrays, mask_spec(reply.arrays[KEPT], method.all_dims),
                                  method.arch)
    arrays = {}
    for k, t in reply.arrays.items():
        base = given.get(k)
        arrays[k] = base.float() + 1.0 if base is not None and base.shape == t.shape and \
            t.is_floating_point() else t
    return Reply(arrays=arrays, num_examples=reply.num_examples, metrics=reply.metrics)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method_name", METHODS)
def test_method_on_architecture(method_name, arch, model_dirs, corpus, tiny_cfg_dict,
                                tiny_gen_cfg_dict, tiny_img_cfg_dict, tmp_path):
    cfg = config(method_name, arch, model_dirs, corpus, tiny_cfg_dict, tiny_gen_cfg_dict, tmp_path,
                 tiny_img_cfg_dict)
    if (method_name, arch) not in WORKS:
        with pytest.raises(ConfigError, match=f"{method_name}|{arch}"):
            setup(cfg)
        return
    one_round_keeps_invariants(cfg, arch)


#: compositions of stages (issue 34, part 0): a round on every architecture of the table
COMPOSED = ("raffm+heads",)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("method_name", COMPOSED)
@pytest.mark.parametrize("prune", ["parameters", "forward"])
def test_composed_method_on_architecture(method_name, prune, arch, model_dirs, corpus, tiny_cfg_dict,
                                         tiny_gen_cfg_dict, tiny_img_cfg_dict, tmp_path):
    """Each client trains the heads it keeps inside its RaFFM sub-model (tiers at two widths);
    the aggregation invariants hold on the composed slices."""
    d = config("raffm", arch, model_dirs, corpus, tiny_cfg_dict, tiny_gen_cfg_dict, tmp_path,
               tiny_img_cfg_dict).model_dump(mode="json", exclude_unset=True)
    d.pop("budgets")  # the table raffm's tiers spelled: these tiers replace them
    d["method"] = {"name": method_name, "sparsity": 0.5, "importance_max_examples": 8, "prune": prune,
                   "width_steps": WIDTH_STEPS, "tiers": [{"share": 0.5, "flops": 0.5 if arch not in GENERATIVE else 0.99},
                             {"share": 0.5, "flops": 1.0}]}
    cfg = validate_config(d)
    if prune == "forward" and arch == "t5":  # a stack-wide bias table (SharedBiasColumns)
        with pytest.raises(ConfigError, match="method.prune='forward'.*t5"):
            setup(cfg)
        return
    method, data = setup(cfg)
    plans = method.slices.plans
    # one client of each width: a sub-model and the full model
    clients = sorted({cp.knobs.spec.is_full: c for c, cp in plans.items() if cp.sits_out is None}.values())
    assert len(clients) == 2
    one_round_keeps_invariants(cfg, arch, (method, data), clients)


@pytest.mark.parametrize("prune", ["parameters", "forward"])
def test_composed_method_with_elastic_depth(prune, model_dirs, corpus, tiny_cfg_dict,
                                            tiny_gen_cfg_dict, tiny_img_cfg_dict, tmp_path):
    """raffm+heads where the planner also drops layers: the head stage's rows follow the kept
    layers (renumbered in the sub-model, in the full layout on the wire)."""
    d = config("raffm", "bert", model_dirs, corpus, tiny_cfg_dict, tiny_gen_cfg_dict, tmp_path,
               tiny_img_cfg_dict).model_dump(mode="json", exclude_unset=True)
    d.pop("budgets")
    d["method"] = {"name": "raffm+heads", "sparsity": 0.5, "importance_max_examples": 8,
                   "prune": prune, "elastic_depth": True, "width_steps": 4,
                   "tiers": [{"share": 0.5, "flops": 0.4}, {"share": 0.5, "flops": 1.0}]}
    method, data = setup(validate_config(d))
    specs = {c: cp.knobs.spec for c, cp in method.slices.plans.items() if cp.sits_out is None}
    small = next(c for c, s in specs.items() if not s.is_full)
    from fedslice.slicing.spec import stack_list
    assert len(stack_list(specs[small])[0].layers) < 4  # a layer dropped
    one_round_keeps_invariants(method.cfg, "bert", (method, data), [small])


def one_round_keeps_invariants(cfg, arch, built=None, clients=None):
    method, data = built or setup(cfg)
    sim = Simulation(cfg, method, data)
    state = method.initial_state()
    new, record = sim.run_round(1, state)
    assert math.isfinite(record["train_loss"]) and record["bytes_up_mean"] > 0
    for client in clients or record["clients"]:
        marker_round(method, data, state, client)
    if arch in GENERATIVE:
        ev = method.evaluate(new, data.dev, 8, max_generations=2)
        assert {"bleu", "rougeL"} <= set(ev) and all(math.isfinite(ev[m]) for m in ("bleu", "rougeL"))
    return method, data


def marker_round(method, data, state, client):
    """Aggregation invariants with one marker reply."""
    payload = method.strategy.configure_train(1, state, [client])[client]
    reply = method.fit(payload, data.client(client), 0)
    marked = marker_reply(method, payload, reply, state)
    result = method.strategy.aggregate_train(1, state, {client: payload}, {client: marked})
    assert result.used == [client], result.excluded
    sent = sum(t.numel() for k, t in marked.arrays.items() if k in reply.arrays and
               not torch.equal(t, reply.arrays[k]))
    moved = 0
    for k, old in state.items():
        diff = result.state[k].float() - old.float()
        held = (diff - 1.0).abs() <= 1e-5
        assert bool((held | (diff == 0)).all()), k  # held: exactly +1; else unchanged
        moved += int(held.sum())
    assert moved == sent > 0


def test_readme_table_is_works():
    """The method x architecture tables of the README and docs/architectures.md say what
    ``WORKS`` tests (✓ runs, ✗ refused), column by column."""
    from pathlib import Path
    root = Path(__file__).resolve().parents[1]
    for page in (root / "README.md", root / "docs" / "architectures.md"):
        table = page.read_text().split("## Which method runs on which architecture", 1)[1]
        header = next(l for l in table.splitlines() if l.startswith("| method \\ model"))
        assert [c.strip().split(" ")[0] for c in header.strip("|").split("|")[1:]] == list(ARCHS), page
        for m in METHODS:
            row = next(l for l in table.splitlines() if l.startswith(f"| `{m}`"))
            cells = [c.strip() for c in row.strip("|").split("|")[1:]]
            assert [c.startswith("✓") for c in cells] == [(m, a) in WORKS for a in ARCHS], (page, m)
