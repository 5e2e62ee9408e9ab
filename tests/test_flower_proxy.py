"""FedPFT's premise on Flower: a fedpft or fedot client never reads or receives the full model.

The client role builds the model from its HF config on the meta device and gets the tensors of
the smaller model it trains (FedPFT's proxy, FedOT's adapter + emulator) from the server at first
contact (``Payload.model``, a ``model`` ArrayRecord on Flower). Checked here: without the weight
file, with the full-model loader forbidden; the bytes of the first message; the ServerApp over an
in-process grid; and a SuperLink + SuperNodes deployment whose nodes' model folder has no weight
file at all (their Python processes audited for every file they open).
"""

from __future__ import annotations

import copy
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from conftest import save_tiny_model
from fedslice import measure
from fedslice.api import setup
from fedslice.experiment import validate_config
from fedslice.flower.client_app import CLIENT_STATE, KEPT_MODEL, load_kept, store_kept
from fedslice.flower.codec import MODEL
from fedslice.flower.server_app import run as server_run
from fedslice.output import read_run

from test_flower import (InProcessGrid, _assert_same_state, _check_deployed_run, _in_process,
                         _nodes, _run_on, _settings, _weights, _write_config, needs_flower)
from test_flower import flwr_home  # noqa: F401  (fixture: a private FLWR_HOME)

PROXY_METHODS = ("fedpft", "fedot")
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack")


def _weightless_copy(model_dir: Path, dest: Path) -> Path:
    """The model folder as a client of these methods needs it: config and tokenizer, no weights."""
    dest.mkdir(parents=True, exist_ok=True)
    for f in model_dir.iterdir():
        if not f.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy(f, dest / f.name)
    assert not any(f.name.endswith(WEIGHT_SUFFIXES) for f in dest.iterdir())
    return dest


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A 4-layer tiny BERT: deep enough for a proxy smaller than the model (FedOT keeps 3 of 4
    layers, FedPFT compresses the FFNs of the 2 middle ones)."""
    return save_tiny_model(tmp_path_factory.mktemp("tiny-bert4"), num_layers=4)


def _cfg(tiny_cfg_dict: dict, model_dir: Path, method: str, tmp_path: Path, **fed) -> dict:
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"a plot about {i} actors in a film" for i in range(50)))
    distill = {"corpus": str(corpus), "steps": 2, "batch_size": 4, "max_length": 16, "cache_dir": ""}
    options = {"fedot": {"bottom_layers": 1, "top_layers": 1, "emulator_layers": 1,
                         "distill_emulator": True, "distill": distill},
               "fedpft": {"keep_ratio": 0.25, "align_every": 1, "align_steps": 2, "distill": distill}}
    tiny_cfg_dict["model"]["name"] = str(model_dir)
    tiny_cfg_dict["method"] = {"name": method, **options[method]}
    tiny_cfg_dict["federation"].update(num_clients=2, clients_per_round=2, **fed)
    return tiny_cfg_dict


def _model_bytes(model: torch.nn.Module) -> int:
    """Bytes of every parameter and buffer of ``model`` (each tensor once)."""
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def _full_model_bytes(method) -> int:
    """The full model's own tensors (LoRA excluded), as the checkpoint holds them."""
    base = method.model.get_base_model() if hasattr(method.model, "get_base_model") else method.model
    return sum(t.numel() * t.element_size() for n, t in [*base.named_parameters(), *base.named_buffers()]
               if "lora_" not in n)


def _client_model(method) -> torch.nn.Module:
    return method.proxy if method.name == "fedpft" else method.sub


@pytest.mark.parametrize("method", PROXY_METHODS)
def test_client_builds_from_the_config_and_the_first_payload(tiny_cfg_dict, model_dir, tmp_path,
                                                             monkeypatch, method):
    """The client role never calls the full-model loader and works from a model folder without
    any weight file; the tensors of its first payload are exactly its proxy's (LoRA included),
    fewer than the full model's; it trains bit-identically to the in-process engine's client;
    what it received is kept as node state for a fresh process."""
    import fedslice.run.setup
    import fedslice.models.loading

    cfg = validate_config(_cfg(tiny_cfg_dict, model_dir, method, tmp_path))
    server, data = setup(cfg)  # the server: full model, distillation
    client_cfg = copy.deepcopy(tiny_cfg_dict)
    client_cfg["model"]["name"] = str(_weightless_copy(model_dir, tmp_path / "node-model"))

    def forbidden(*args, **kw):
        raise AssertionError("a fedpft/fedot client loaded the full model")
    monkeypatch.setattr(fedslice.run.setup, "load_model", forbidden)
    monkeypatch.setattr(fedslice.models.loading, "load_model", forbidden)
    client, _ = setup(validate_config(client_cfg), role="client")
    proxy = _client_model(client)
    assert not any(t.is_meta for t in [*proxy.parameters(), *proxy.buffers()])
    full_only = [n for n, p in client.model.named_parameters() if p.is_meta]
    assert full_only, "the full model's own tensors (outside the proxy) stay shapes only"

    state = server.initial_state()
    first = server.strategy.configure_train(1, state, [0])[0]
    assert first.model, "the first payload carries the client's model"
    reply = client.fit(first, data.client(0), seed=3)
    ref = server.fit(first, data.client(0), seed=3)
    assert reply.arrays.keys() == ref.arrays.keys()
    for k in ref.arrays:
        torch.testing.assert_close(reply.arrays[k], ref.arrays[k], rtol=0, atol=0)
    for n, t in client.client_base.tensors.items():  # the server's values arrived
        assert torch.equal(t, server.client_base.tensors[n])

    # bytes: what the client received at first contact is its proxy (LoRA and classifier
    # included), each tensor once, and less than the full model
    received = reply.metrics["bytes_down"]
    assert received == measure.tensor_bytes(first.arrays) + measure.tensor_bytes(first.model)
    assert received == _model_bytes(proxy) == _model_bytes(_client_model(server))
    assert received < _full_model_bytes(server)
    second = server.strategy.configure_train(2, state, [0])[0]
    assert not second.model and measure.tensor_bytes(second.arrays) < received / 20

    # a fresh ClientApp process of the same node: the kept state replaces the first payload
    fresh, _ = setup(validate_config(client_cfg), role="client")
    fresh.restore_state("client", client.kept_state("client"))
    torch.testing.assert_close(fresh.fit(second, data.client(0), seed=5).arrays,
                               client.fit(second, data.client(0), seed=5).arrays, rtol=0, atol=0)
    lost, _ = setup(validate_config(client_cfg), role="client")
    lost.restore_state("client", {})
    with pytest.raises(RuntimeError, match="not on this node|no distilled emulator|holds version None"):
        lost.fit(second, data.client(0), seed=5)


@pytest.mark.parametrize("method", PROXY_METHODS)
def test_received_model_must_fit_the_model_built_from_the_config(tiny_cfg_dict, model_dir, tmp_path,
                                                                 method):
    """A first payload whose model tensors do not fit the client's (a config mismatch) fails
    with a clear error instead of training garbage."""
    cfg = validate_config(_cfg(tiny_cfg_dict, model_dir, method, tmp_path))
    server, data = setup(cfg)
    client, _ = setup(cfg, role="client")
    first = server.strategy.configure_train(1, server.initial_state(), [0])[0]
    name = next(iter(first.model))
    bad = copy.copy(first)
    bad.model = {**first.model, name: first.model[name][..., :1].clone()}
    with pytest.raises(RuntimeError, match=f"received {name}"):
        client.fit(bad, data.client(0), seed=0)
    bad.model = {k: t for k, t in first.model.items() if k != name}
    with pytest.raises(RuntimeError, match="missing"):
        client.fit(bad, data.client(0), seed=0)


class RecordingGrid(InProcessGrid):
    """The in-process grid, recording the bytes of every train message per node."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.sent: list[tuple[int, int, int]] = []  # (node, bytes of "arrays", bytes of "model")
        self.kept_files: set[Path] = set()  # the model files the nodes said they keep

    def _handle(self, msg):
        if msg.metadata.message_type == "train":
            records = msg.content.array_records
            size = {k: sum(a.numpy().nbytes for a in r.values()) for k, r in records.items()}
            self.sent.append((msg.metadata.dst_node_id, size.get("arrays", 0), size.get(MODEL, 0)))
        reply = super()._handle(msg)
        for state in self._states.values() if msg.metadata.message_type == "train" else ():
            if KEPT_MODEL in state.config_records:
                path = Path(str(state.config_records[KEPT_MODEL]["path"]))
                assert path.is_file()
                self.kept_files.add(path)
        return reply


@pytest.mark.parametrize("method", PROXY_METHODS)
def test_serverapp_sends_the_proxy_once_and_clients_load_no_model(tiny_cfg_dict, model_dir, tmp_path,
                                                                  monkeypatch, flwr_home, method):
    """The ServerApp over an in-process grid: the full-model loader runs once (the server's), each
    node's first train message carries its model once (later ones only LoRA and the classifier,
    plus re-distilled neurons), and the weights equal the in-process engine's."""
    import fedslice.run.setup

    cfg_dict = _cfg(tiny_cfg_dict, model_dir, method, tmp_path, rounds=3)
    state, records, _ = _in_process(cfg_dict)
    calls = []
    real = fedslice.run.setup.load_model
    monkeypatch.setattr(fedslice.run.setup, "load_model", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    grid = RecordingGrid(_nodes(2))
    run_dir = server_run(grid, _settings(_write_config(cfg_dict, tmp_path / "exp.json"), tmp_path / "fl"))
    assert len(calls) == 1  # the ServerApp's; the ClientApp built its model from the config
    _assert_same_state(_weights(run_dir), state)
    server, _ = setup(validate_config(cfg_dict))
    model_bytes = server.client_base.nbytes()
    for node in (100, 101):
        sent = [(a, m) for n, a, m in grid.sent if n == node]
        assert len(sent) == 3 and sent[0][1] == model_bytes and all(m == 0 for _, m in sent[1:])
    _, metrics, _ = read_run(run_dir)
    first = [c["bytes_down"] for c in metrics[0]["client_metrics"]]
    assert first == [r["bytes_down"] for r in records[0]["client_metrics"]]  # counted the same
    assert all(b == _model_bytes(_client_model(server)) < _full_model_bytes(server) for b in first)
    # each node kept the model it received in a file on its disk (not in Context.state), and
    # removed it when the ServerApp said the run was over
    for state in grid._states.values():
        assert not any(k.startswith("base.") for k in state.array_records[CLIENT_STATE])
        assert KEPT_MODEL not in state.config_records
    assert sorted(p.name for p in grid.kept_files) == ["node-100.safetensors", "node-101.safetensors"]
    assert all(p.is_relative_to(flwr_home) and not p.exists() for p in grid.kept_files)
    assert not (flwr_home / "fedslice-node-state" / "run-1").exists()


def test_node_keeps_the_received_model_on_its_disk(tiny_cfg_dict, model_dir, tmp_path, flwr_home):
    """The model a node received is written once to ``$FLWR_HOME`` (or the node config's
    ``state-dir``) and read back exactly; a file that is missing or another run's leaves the node
    without a model (the method then fails the round clearly, and the server re-sends it)."""
    from flwr.app import Context, RecordDict

    cfg = validate_config(_cfg(tiny_cfg_dict, model_dir, "fedpft", tmp_path))
    server, data = setup(cfg)
    client, _ = setup(cfg, role="client")
    first = server.strategy.configure_train(1, server.initial_state(), [0])[0]
    client.fit(first, data.client(0), seed=0)
    state = client.kept_state("client")
    ctx = Context(run_id=7, node_id=3, node_config={}, state=RecordDict(), run_config={})
    store_kept(ctx, state, received_model=True)
    path = Path(str(ctx.state.config_records[KEPT_MODEL]["path"]))
    assert path == flwr_home / "fedslice-node-state" / "run-7" / "node-3.safetensors"
    back = load_kept(ctx)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)
    mtime = path.stat().st_mtime_ns
    store_kept(ctx, state, received_model=False)  # nothing new arrived: not rewritten
    assert path.stat().st_mtime_ns == mtime
    other = Context(run_id=8, node_id=3, node_config={"state-dir": str(tmp_path / "node")},
                    state=RecordDict(), run_config={})
    store_kept(other, state, received_model=True)
    assert Path(str(other.state.config_records[KEPT_MODEL]["path"])).is_relative_to(tmp_path / "node")
    ctx.state[KEPT_MODEL]["token"] = "another run's"
    assert not any(k.startswith("base.") for k in load_kept(ctx))
    path.unlink()
    lost = load_kept(ctx)
    assert "proxy_version" in lost and not any(k.startswith("base.") for k in lost)
    fresh, _ = setup(cfg, role="client")
    fresh.restore_state("client", lost)
    second = server.strategy.configure_train(2, server.initial_state(), [0])[0]
    with pytest.raises(RuntimeError, match="not on this node"):
        fresh.fit(second, data.client(0), seed=0)


# --------------------------------------------------------------------------------------------
# A deployment whose SuperNodes have no weight file
# --------------------------------------------------------------------------------------------

REPO_ID = "fedslice-test/tiny-bert"

#: Installed in the SuperNodes' Python processes (SuperNode, ClientApps): every path they open
#: under the audited folder is appended to the audit log (os.write: no recursion).
AUDIT_SITECUSTOMIZE = '''
import os, sys
_root, _log = os.environ["FEDSLICE_AUDIT_ROOT"], os.environ["FEDSLICE_AUDIT_LOG"]
_fd = os.open(_log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
_who = os.path.basename(sys.argv[0]) if sys.argv and sys.argv[0] else "python"

def _hook(event, args):
    if event == "open" and isinstance(args[0], (str, bytes, os.PathLike)):
        path = os.fsdecode(os.path.abspath(os.fspath(args[0])))
        if path.startswith(_root):
            os.write(_fd, f"{os.getpid()}\\t{_who}\\t{path}\\n".encode())

sys.addaudithook(_hook)
'''


def _hub_cache(root: Path, model_dir: Path, weights: bool) -> Path:
    """A Hugging Face hub cache holding ``REPO_ID`` = the files of ``model_dir`` (with or
    without its weight files), as `huggingface-cli download` leaves it."""
    repo = root / f"models--{REPO_ID.replace('/', '--')}"
    snapshot = repo / "snapshots" / ("0" * 40)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    for f in model_dir.iterdir():
        if weights or not f.name.endswith(WEIGHT_SUFFIXES):
            shutil.copy(f, snapshot / f.name)
    return root


@pytest.fixture(scope="module")
def weightless_nodes(tmp_path_factory, model_dir):
    """SuperLink + 2 SuperNodes on loopback, shared by the proxy methods' deployments (one run
    each; starting a federation costs more than a tiny run). The model is the hub id
    ``REPO_ID``, resolved offline from each machine's own hub cache: the server's holds the
    weights, the nodes' only config and tokenizer; the nodes' Python processes (SuperNode,
    ClientApps) append every file they open under the folder to an audit log. Every process
    and its descendants are checked gone at the end."""
    import psutil

    from fedslice.flower import local

    root = tmp_path_factory.mktemp("weightless")
    server_cache = _hub_cache(root / "server-hub", model_dir, weights=True)
    node_cache = _hub_cache(root / "node-hub", model_dir, weights=False)
    audit_dir, audit_log = root / "audit", root / "opened.tsv"
    audit_dir.mkdir()
    (audit_dir / "sitecustomize.py").write_text(AUDIT_SITECUSTOMIZE)
    start = local.start_process

    def start_node_without_weights(name, argv, env, log_dir):
        if name.startswith("supernode"):
            env = {**env, "HF_HUB_CACHE": str(node_cache), "FEDSLICE_AUDIT_ROOT": str(root),
                   "FEDSLICE_AUDIT_LOG": str(audit_log),
                   "PYTHONPATH": os.pathsep.join([str(audit_dir), env.get("PYTHONPATH", "")])}
        return start(name, argv, env, log_dir)

    # the processes take their environment when they start: only the start is patched
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("HF_HUB_OFFLINE", "1")
        mp.setenv("HF_HUB_CACHE", str(server_cache))
        mp.setattr(local, "start_process", start_node_without_weights)
        fed = local.LocalFederation(root / "work", nodes=2,
                                    server_roots=[tmp_path_factory.getbasetemp()])
        fed.__enter__()
    try:
        family = [psutil.Process(p.pid) for p in fed.processes]
        yield SimpleNamespace(fed=fed, server_cache=server_cache, node_cache=node_cache,
                              audit_log=audit_log)
        family += [c for p in fed.processes for c in local.descendants(p.pid)]
    finally:
        fed.__exit__(None, None, None)
    alive = local.running(family)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    assert not alive, f"processes left running: {alive}"


@needs_flower
@pytest.mark.parametrize("method", PROXY_METHODS)
def test_deployed_supernodes_never_open_the_full_model(tiny_cfg_dict, model_dir, tmp_path,
                                                       weightless_nodes, method):
    """SuperLink + 2 SuperNodes whose hub cache holds the model's config and tokenizer only
    (``weightless_nodes``). The run completes with the in-process engine's weights; the nodes'
    processes opened the config and tokenizer and nothing else of a model; each client received
    exactly its proxy once, less than the full model."""
    nodes = weightless_nodes
    cfg_dict = _cfg(tiny_cfg_dict, model_dir, method, tmp_path)
    cfg_dict["model"]["name"] = REPO_ID
    path = _write_config(cfg_dict, tmp_path / f"{method}.json")
    run_dir = _run_on(nodes.fed, tmp_path, path, timeout=300, round_timeout=120)
    node_cache, server_cache, audit_log = nodes.node_cache, nodes.server_cache, nodes.audit_log

    local_cfg = copy.deepcopy(cfg_dict)  # this process resolved its hub cache at import: a path
    local_cfg["model"]["name"] = str(model_dir)
    _check_deployed_run(run_dir, local_cfg, logs=False)

    opened = [line.split("\t") for line in audit_log.read_text().splitlines()]
    clientapps = {(pid, who) for pid, who, _ in opened if "clientapp" in who}
    assert clientapps, f"no ClientApp process was audited: {sorted({w for _, w, _ in opened})}"
    node_files = {Path(p).name for _, who, p in opened if "clientapp" in who and p.startswith(str(node_cache))}
    assert "config.json" in node_files  # the hook saw the ClientApps read the node's model folder
    assert not any(p.startswith(str(server_cache)) for _, _, p in opened), "a node read the server's model"
    assert not any(p.endswith(WEIGHT_SUFFIXES) and "hub" in p for _, _, p in opened)
    assert not any(f.name.endswith(WEIGHT_SUFFIXES) for f in node_cache.rglob("*"))

    server, _ = setup(validate_config(local_cfg))
    proxy_bytes, full_bytes = _model_bytes(_client_model(server)), _full_model_bytes(server)
    _, metrics, _ = read_run(run_dir)
    first = [c["bytes_down"] for c in metrics[0]["client_metrics"]]
    assert len(first) == 2 and all(b == proxy_bytes < full_bytes for b in first)
    later = [c["bytes_down"] for m in metrics[1:] for c in m["client_metrics"]]
    assert later and all(b < proxy_bytes / 20 for b in later)


@pytest.mark.parametrize("model_type", ["roberta", "distilbert"])
def test_client_role_on_other_encoders(tiny_cfg_dict, tmp_path, model_type):
    """The model built from the config takes the first payload exactly on the other encoder
    families too (their buffers included): the client trains as the in-process one does."""
    folder = save_tiny_model(tmp_path / model_type, model_type, num_layers=4)
    for method in PROXY_METHODS:
        server, client = _check_client_role(validate_config(
            _cfg(copy.deepcopy(tiny_cfg_dict), folder, method, tmp_path)))
        assert _model_bytes(_client_model(client)) < _full_model_bytes(server)


def _check_client_role(cfg):
    """The client role's first fit equals the in-process client's, and what it received at
    first contact is exactly its model; returns (server, client)."""
    server, data = setup(cfg)
    client, _ = setup(cfg, role="client")
    first = server.strategy.configure_train(1, server.initial_state(), [0])[0]
    reply, ref = client.fit(first, data.client(0), seed=3), server.fit(first, data.client(0), seed=3)
    assert reply.arrays.keys() == ref.arrays.keys()
    assert all(torch.equal(reply.arrays[k], ref.arrays[k]) for k in ref.arrays), cfg.method.name
    assert reply.metrics["bytes_down"] == _model_bytes(_client_model(client))
    return server, client


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "t5", "bart"])
def test_client_role_on_generative_models(tiny_gen_cfg_dict, tiny_lm_dirs, tmp_path, model_type):
    """Decoders (GQA + SwiGLU, fused Conv1D) and encoder-decoders (both stacks sliced): the
    client built from the config takes the first payload exactly and trains as the in-process
    client does."""
    from test_matrix import method_opts

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"a plot about {i} actors in a film of {i % 5} acts" for i in range(64)))
    for method in PROXY_METHODS:
        d = copy.deepcopy(tiny_gen_cfg_dict)
        d["model"] = {"name": str(tiny_lm_dirs[model_type])}
        d["lora"] = {"r": 4, "alpha": 8, "targets": ["q", "k", "v", "o"]}
        d["method"] = {"name": method, **method_opts(method, corpus, tmp_path / "cache", model_type)}
        if method == "fedpft":  # 2 layers per stack: compress the second
            d["method"]["whole_layers"] = [0]
        # (on these 2-layer, 49k-word models LoRA outweighs the dropped neurons, so "less than
        # the full model" is asserted on the encoders above)
        _check_client_role(validate_config(d))


@pytest.mark.parametrize("model_type", ["vit", "deit", "dinov2"])
def test_client_role_on_image_backbones(tiny_img_cfg_dict, tmp_path, model_type):
    """Image backbones: the client built from the config and its image processor only (a model
    folder without weights) takes the first payload exactly and trains as the in-process client
    does; its proxy / emulator is smaller than the full model. The server distils on the images
    it keeps apart, which no client holds."""
    from conftest import save_tiny_vision
    from test_matrix import method_opts

    folder = save_tiny_vision(tmp_path / model_type, model_type, num_layers=4)
    weightless = _weightless_copy(folder, tmp_path / f"{model_type}-config-only")
    for method in PROXY_METHODS:
        d = copy.deepcopy(tiny_img_cfg_dict)
        d["model"] = {"name": str(folder)}
        d["data"]["server_holdout"] = 0.1
        d["lora"] = {"r": 4, "alpha": 8, "targets": ["q", "k", "v", "o"]}
        d["method"] = {"name": method, **method_opts(method, "unused", tmp_path / "cache", model_type)}
        server, client = _check_client_role(validate_config(d))
        assert _model_bytes(_client_model(client)) < _full_model_bytes(server)
        d["model"] = {"name": str(weightless)}
        client, data = setup(validate_config(d), role="client")
        assert len(data.train) == 43  # 48 minus the 5 the server keeps
