"""FedOT (Offsite-Tuning with FedAvg): layer layout, emulator, adapter training, end to end."""

import pytest
import torch

from conftest import save_tiny_model
from fedslice.experiment import validate_config
from fedslice.errors import ConfigError
from fedslice.api import setup
from fedslice.run.engine import Simulation
from fedslice.methods.fedot import emulator_indices, fedot_layout


@pytest.fixture(scope="module")
def model4_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny-bert4"), num_layers=4)


@pytest.fixture
def ot_cfg(tiny_cfg_dict, model4_dir, tmp_path):
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "a.txt").write_text("\n".join(f"a plot about {i} actors in a film" for i in range(100)))
    tiny_cfg_dict["model"]["name"] = str(model4_dir)
    tiny_cfg_dict["method"] = {"name": "fedot", "distill_emulator": True,
                               "distill": {"corpus": str(corpus), "steps": 3, "batch_size": 4,
                                           "max_length": 16, "cache_dir": ""}}
    return tiny_cfg_dict


def test_emulator_indices_uniform_drop():
    assert emulator_indices(list(range(2, 10)), 3) == [2, 6, 9]  # 8 middle -> 3 (paper, BERT-base)
    assert emulator_indices(list(range(4)), 3) == [0, 2, 3]  # stride 1.5: round(1.5) = 2
    assert emulator_indices(list(range(4)), 2) == [0, 3]  # first and last middle layer
    assert emulator_indices(list(range(6)), 3) == [0, 2, 5]  # round(2.5) = 2 (half to even)
    assert emulator_indices(list(range(5)), 1) == [2]
    assert emulator_indices(list(range(3)), 3) == [0, 1, 2]


def test_layout_defaults_scale_with_depth():
    assert fedot_layout(12, None, None, None) == ([0, 1], [2, 6, 9], [10, 11])
    assert fedot_layout(6, None, None, None) == ([0], [1, 4], [5])  # MiniLM
    assert fedot_layout(4, None, None, None) == ([0], [1], [3])
    assert fedot_layout(6, 2, 1, 1) == ([0, 1], [3], [5])


@pytest.mark.parametrize("args, field", [((4, 2, 2, None), "method.bottom_layers"),
                                         ((2, None, None, None), "method.bottom_layers"),
                                         ((6, 1, 1, 5), "method.emulator_layers"),
                                         ((6, 0, 0, None), "method.bottom_layers")])
def test_layout_errors_name_the_field(args, field):
    with pytest.raises(ConfigError, match=field):
        fedot_layout(*args)


def test_no_emulator_left_fails_at_setup(ot_cfg):
    ot_cfg["method"].update(bottom_layers=2, top_layers=2)
    with pytest.raises(ConfigError, match="leave no emulator"):
        setup(validate_config(ot_cfg))


def test_end_to_end_adapter_only_and_emulator_frozen(ot_cfg):
    cfg = validate_config(ot_cfg)
    method, data = setup(cfg)
    arch = method.arch
    assert (method.bottom_layers, method.emulator, method.top_layers) == ([0], [1], [3])
    emulator = arch.blocks(method.sub)[1]
    assert emulator is not arch.blocks(method.model)[1]  # distilled copy, the full model untouched
    emu_before = {n: p.clone() for n, p in emulator.named_parameters()}
    mid_before = {n: p.clone() for n, p in arch.blocks(method.model)[2].named_parameters()}
    sent = []
    real = method.strategy.configure_train
    method.strategy.configure_train = lambda *a: sent.append(real(*a)) or sent[-1]
    state, records, summary = Simulation(cfg, method, data).run()
    # payloads use the sub-model's names: the top adapter layer 3 is layer 2 of the client model
    keys = {k for p in sent[0].values() for k in p.arrays if not k.startswith("emulator.")}
    assert any("layer.2." in k for k in keys) and not any("layer.3." in k for k in keys)
    assert all("lora_" in k or "classifier" in k for k in keys)
    # the distilled emulator (layer 1 of the client model) goes to each client once, whole
    emu_keys = {f"emulator.{n}" for n in method.emulator_params}
    assert emu_keys and all(".layer.1." in k for k in emu_keys)
    got = [(c, set(p.arrays) & emu_keys) for rnd in sent for c, p in sorted(rnd.items())]
    first = {}
    for c, ks in got:
        assert ks == (emu_keys if c not in first else set()), c
        first.setdefault(c, True)
    # the global state uses the full model's names and only the adapter layers 0 and 3 train
    layers = {int(k.split("layer.")[1].split(".")[0]) for k in state if "lora_" in k}
    assert layers == {0, 3}
    for n, p in emulator.named_parameters():
        assert torch.equal(p, emu_before[n]), n
    for n, p in arch.blocks(method.model)[2].named_parameters():
        assert torch.equal(p, mid_before[n]), n
    assert summary["emulator_distilled"] and summary["kd_before_steps"] == 3
    assert summary["proxy_transformer_params"] == 3 * summary["full_transformer_params"] // 4
    assert 0 <= summary["proxy_test_accuracy"] <= 1 and 0 <= summary["test_accuracy"] <= 1


def test_full_adapter_tuning_and_lora_rank(ot_cfg):
    ot_cfg["method"].update(adapter_tuning="full", distill_emulator=False)
    ot_cfg["federation"]["rounds"] = 1
    method, data = setup(validate_config(ot_cfg))
    names = list(method.initial_state())
    assert {int(n.split("layer.")[1].split(".")[0]) for n in names if "layer." in n} == {0, 3}
    Simulation(method.cfg, method, data).run()
    ot_cfg["method"].update(adapter_tuning="lora", lora_r=12)
    method, _ = setup(validate_config(ot_cfg))
    a = next(v for k, v in method.initial_state().items() if "lora_A" in k)
    assert a.shape[0] == 12


def test_run_folder_has_distillation_curve(ot_cfg, tmp_path):
    from fedslice.api import run_experiment
    ot_cfg["output"].update(plots=True, dir=str(tmp_path / "runs"))
    ot_cfg["federation"]["rounds"] = 1
    run = run_experiment(validate_config(ot_cfg))
    assert (run / "fedot_distill.json").is_file() and (run / "fedot_distill.png").is_file()


def test_lora_rank_override_keeps_scaling(ot_cfg):
    ot_cfg["method"].update(lora_r=12, distill_emulator=False)
    method, _ = setup(validate_config(ot_cfg))
    layer = method.arch.part(method.model, 0, "q")
    assert layer.r["default"] == 12 and layer.scaling["default"] == pytest.approx(8 / 4)


def test_client_role_receives_the_emulator_instead_of_distilling(ot_cfg):
    """A Flower client (role "client") runs no distillation: the server's distilled emulator
    arrives in its first payload (counted in bytes_down), is kept as client state, and a worker
    without it refuses a payload that assumes it."""
    cfg = validate_config(ot_cfg)
    server, data = setup(cfg)
    client, _ = setup(cfg, role="client")
    assert server.kd_log is not None and client.kd_log is None and not client.emulator_held
    state = server.initial_state()
    first = server.strategy.configure_train(1, state, [0])[0]
    reply = client.fit(first, data.client(0), seed=3)
    ref = server.fit(first, data.client(0), seed=3)
    for k in ref.arrays:  # the client trained on the server's emulator, not its raw copy
        torch.testing.assert_close(reply.arrays[k], ref.arrays[k], rtol=0, atol=0)
    emu_bytes = sum(t.numel() * 4 for k, t in first.arrays.items() if k.startswith("emulator."))
    assert emu_bytes > 0 and reply.metrics["bytes_down"] >= emu_bytes
    kept = client.kept_state("client")
    for k, p in server.emulator_params.items():
        assert torch.equal(kept[f"emulator.{k}"], p)
    again = server.strategy.configure_train(2, state, [0])[0]
    assert not any(k.startswith("emulator.") for k in again.arrays)
    fresh, _ = setup(cfg, role="client")
    fresh.restore_state("client", {})
    with pytest.raises(RuntimeError, match="no distilled emulator"):
        fresh.fit(again, data.client(0), seed=3)
    fresh.restore_state("client", kept)  # what the SuperNode kept in Context.state
    torch.testing.assert_close(fresh.fit(again, data.client(0), seed=3).arrays,
                               client.fit(again, data.client(0), seed=3).arrays, rtol=0, atol=0)
