"""Checkpoints of a running experiment, written kill-safe, and the checks for resuming one.

A checkpoint is one file, ``checkpoint.safetensors`` in the (staging) run folder, holding:

- ``state/<key>``: the global state after round ``round``;
- ``meta``: a JSON document (as a uint8 tensor) with the round, the resolved config and its hash,
  the metrics records so far, the elapsed time, the RNG states and the server-side state of the
  strategy, the method and the selector (nested JSON whose tensors are stored beside it as
  ``t/<n>`` and referenced by ``{"__tensor__": "t/<n>"}``).

It is written like NVFlare persists: the bytes go to a temporary file in the same folder, which is
fsync'ed, renamed over the previous checkpoint with :func:`os.replace` (atomic on POSIX) and the
folder fsync'ed. A process killed at any point leaves either the previous checkpoint or the new
one, never a torn file; a stale ``.checkpoint.safetensors.tmp-*`` is ignored and removed by the
next write.

Resuming restores everything a round depends on, so the rest of the run is bit-identical to an
uninterrupted one; a config that differs from the checkpoint's (outside ``output``, which does not
change the result) is refused, naming the fields.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedslice.config import FederationConfig

from fedslice.errors import ConfigError, DataError, FedsliceError

CHECKPOINT = "checkpoint.safetensors"
FORMAT = 1
#: Config sections that do not change what a run computes (may differ on resume).
NEUTRAL_SECTIONS = ("output",)
_CHUNK = 1 << 20

State = dict[str, torch.Tensor]


@dataclass
class Checkpoint:
    round: int
    config: dict[str, Any]
    state: State
    server: dict[str, Any]  # {"strategy": ..., "method": ..., "selector": ...}
    rng: dict[str, Any]
    records: list[dict[str, Any]]
    elapsed_s: float
    #: the model the state belongs to (:func:`architecture_of`); None in older checkpoints
    architecture: dict[str, Any] | None = None
    #: each data split read: ``{split: {"source", "fingerprint"}}`` (``data.data_sources``);
    #: None in older checkpoints and Flower's
    data: dict[str, dict[str, str]] | None = None


# --------------------------------------------------------------------------------------------
# Config identity
# --------------------------------------------------------------------------------------------

def result_config(config: dict[str, Any]) -> dict[str, Any]:
    """The part of a config (``model_dump(mode="json")``) that determines the results."""
    return {k: v for k, v in config.items() if k not in NEUTRAL_SECTIONS}


def config_hash(config: dict[str, Any]) -> str:
    text = json.dumps(result_config(config), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest()


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(d, dict):
        out: dict[str, Any] = {}
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}{k}."))
        return out or {prefix[:-1]: {}}
    return {prefix[:-1]: d}


def config_diff(saved: dict[str, Any], given: dict[str, Any]) -> list[str]:
    """``field: checkpoint value -> given value`` for every result-relevant field that differs
    (a field the checkpoint does not record, unset now, is a field added since: no difference)."""
    a, b = _flatten(result_config(saved)), _flatten(result_config(given))
    missing = object()
    return [f"{k}: {a.get(k, missing)!r} in the checkpoint, {b.get(k, missing)!r} now".replace(
            repr(missing), "<absent>")
            for k in sorted(set(a) | set(b)) if a.get(k, missing) != b.get(k, missing)
            and not (k not in a and b[k] is None)]


#: federation fields a natural partition derives from the data (``run.setup.natural_split``):
#: the checkpoint records the derived values, a config that leaves them unset has the defaults
_FROM_NATURAL_CLIENTS = ("num_clients", "clients_per_round", "min_replies")


def _with_derived_clients(saved: dict[str, Any], given: dict[str, Any]) -> dict[str, Any]:
    """``given`` with the checkpoint's derived client counts where ``given`` has the defaults
    (a natural partition's; the data check then tells whether the clients changed)."""
    if (saved.get("data") or {}).get("partition") != "natural" or "federation" not in given:
        return given
    fed = dict(given["federation"])
    for k in _FROM_NATURAL_CLIENTS:
        if fed.get(k) == FederationConfig.model_fields[k].default and k in saved.get("federation", {}):
            fed[k] = saved["federation"][k]
    return {**given, "federation": fed}


def check_same_config(saved: dict[str, Any], given: dict[str, Any], where: Path) -> None:
    diff = config_diff(saved, _with_derived_clients(saved, given))
    if diff:
        raise ConfigError(f"cannot resume {where}: the config differs from the checkpoint's in "
                          f"{len(diff)} field(s):\n  " + "\n  ".join(diff))


# --------------------------------------------------------------------------------------------
# Model identity
# --------------------------------------------------------------------------------------------

def architecture_of(method) -> dict[str, Any]:
    """The model a method's global state belongs to: model path, type and shape."""
    arch, dims = getattr(method, "arch", None), getattr(method, "dims", None) or {}
    cfg = getattr(method, "cfg", None)
    return {"model": getattr(getattr(cfg, "model", None), "name", None),
            "model_type": getattr(arch, "model_type", None),
            **{k: int(v) for k, v in dims.items()}}


def describe_architecture(a: dict[str, Any] | None) -> str:
    if not a:
        return "an architecture the checkpoint does not record"
    shape = ", ".join(f"{v} {k.replace('num_', '').replace('_', ' ')}" for k, v in a.items()
                      if k not in ("model", "model_type"))
    return f"{a.get('model_type')} ({shape}) from model.name={a.get('model')!r}"


def check_same_architecture(ckpt: Checkpoint, method, where: Path | str = "the checkpoint") -> None:
    """A :class:`ConfigError` naming both architectures when the checkpoint's global state was
    trained on another model than the one ``method`` was built on (its recorded model type and
    shape differ, or its tensors' names or shapes do not match the method's global state)."""
    now = architecture_of(method)
    ident = lambda a: {k: v for k, v in (a or {}).items() if k != "model"}  # noqa: E731
    saved = ckpt.architecture
    if saved is not None and ckpt.config.get("model", {}).get("name") is not None:
        saved = {**saved, "model": saved.get("model") or ckpt.config["model"]["name"]}
    differs = saved is not None and ident(saved) != ident(now)
    # the model's parameters (and a proxy's, FedPFT) as named in global states; every trainable
    # one must be in the checkpoint (initial_state() is not used: RaFFM's re-orders the model)
    shapes = {k: tuple(p.shape) for k, p in method.model.named_parameters()}
    shapes.update({k: tuple(p.shape) for k, p in (getattr(method, "proxy_params", None) or {}).items()})
    got = {k: tuple(t.shape) for k, t in ckpt.state.items()}
    diff = [f"{k}: {got.get(k, '<absent>')} in the checkpoint, {shapes.get(k, '<absent>')} now"
            for k in sorted(set(got) | set(method.trainable())) if shapes.get(k) != got.get(k)]
    if not differs and not diff:
        return
    lines = "".join(f"\n  {d}" for d in diff[:5]) + (f"\n  ... {len(diff) - 5} more" if len(diff) > 5 else "")
    raise ConfigError(f"cannot resume {where}: the checkpoint's architecture differs from the "
                      f"config's: checkpoint {describe_architecture(saved)}; config "
                      f"{describe_architecture(now)}" + (f"; global-state tensors differ:{lines}" if diff else ""))


# --------------------------------------------------------------------------------------------
# Data identity
# --------------------------------------------------------------------------------------------

def data_changes(saved: dict[str, dict[str, str]] | None,
                 now: dict[str, dict[str, str]] | None) -> list[dict[str, str]]:
    """Each data split whose content differs from the checkpoint's (or that one of the two
    lacks): ``{"split", "source", "checkpoint", "now"}`` (fingerprints); none when the
    checkpoint records no data (older checkpoints, Flower's)."""
    if saved is None or now is None:
        return []
    out = []
    for split in sorted(set(saved) | set(now)):
        a, b = saved.get(split, {}), now.get(split, {})
        if a.get("fingerprint") != b.get("fingerprint"):
            out.append({"split": split, "source": b.get("source") or a.get("source", ""),
                        "checkpoint": a.get("fingerprint", "<absent>"),
                        "now": b.get("fingerprint", "<absent>")})
    return out


def check_same_data(changes: list[dict[str, str]], where: Path) -> None:
    """A :class:`DataError` naming each changed data file (``--allow-data-change`` accepts)."""
    if changes:
        files = "; ".join(f"{c['split']} split from {c['source']}" for c in changes)
        raise DataError(f"cannot resume {where}: the data changed since the checkpoint ({files}: "
                        "its content differs); restore the data the run started on, or resume "
                        "with --allow-data-change to go on with the new data (recorded in "
                        "metrics.jsonl)")


# --------------------------------------------------------------------------------------------
# Nested JSON with tensors
# --------------------------------------------------------------------------------------------

def _pack(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, torch.Tensor):
        name = f"t/{len(tensors)}"
        tensors[name] = obj.detach().cpu().contiguous().clone()
        return {"__tensor__": name}
    if isinstance(obj, np.ndarray):
        return {"__ndarray__": _pack(torch.from_numpy(np.ascontiguousarray(obj)), tensors),
                "dtype": str(obj.dtype)}
    if isinstance(obj, dict):
        if not all(isinstance(k, str) for k in obj):
            raise TypeError(f"checkpoint state keys must be strings, got {list(obj)[:3]}")
        return {k: _pack(v, tensors) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_pack(v, tensors) for v in obj]
    if isinstance(obj, (np.integer, np.floating, np.bool_)):
        return obj.item()
    return obj


def _unpack(obj: Any, tensors: dict[str, torch.Tensor]) -> Any:
    if isinstance(obj, dict):
        if set(obj) == {"__tensor__"}:
            return tensors[obj["__tensor__"]]
        if set(obj) == {"__ndarray__", "dtype"}:
            return _unpack(obj["__ndarray__"], tensors).numpy().astype(obj["dtype"])
        return {k: _unpack(v, tensors) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_unpack(v, tensors) for v in obj]
    return obj


# --------------------------------------------------------------------------------------------
# RNG states
# --------------------------------------------------------------------------------------------

def capture_rng() -> dict[str, Any]:
    """The process-wide RNG states (torch, numpy's legacy global, Python's)."""
    kind, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"torch": torch.get_rng_state(),
            "numpy": {"kind": kind, "keys": keys.astype(np.int64), "pos": int(pos),
                      "has_gauss": int(has_gauss), "gauss": float(gauss)},
            "python": random.getstate()}


def restore_rng(rng: dict[str, Any]) -> None:
    torch.set_rng_state(rng["torch"])
    n = rng["numpy"]
    np.random.set_state((n["kind"], np.asarray(n["keys"]).astype(np.uint32), n["pos"],
                         n["has_gauss"], n["gauss"]))
    version, internal, gauss = rng["python"]
    random.setstate((version, tuple(internal), gauss))


# --------------------------------------------------------------------------------------------
# Writing and reading
# --------------------------------------------------------------------------------------------

def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """``data`` to ``path``: temporary file, fsync, rename over ``path``, fsync the folder."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    for stale in path.parent.glob(f".{path.name}.tmp-*"):
        stale.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        view = memoryview(data)
        while view:
            written = os.write(fd, view[:_CHUNK])
            view = view[written:]
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def write_checkpoint(folder: Path, ckpt: Checkpoint) -> Path:
    from safetensors.torch import save

    tensors: dict[str, torch.Tensor] = {}
    meta = {"format": FORMAT, "round": ckpt.round, "config": ckpt.config,
            "config_hash": config_hash(ckpt.config), "records": ckpt.records,
            "elapsed_s": ckpt.elapsed_s, "state_keys": list(ckpt.state),
            "architecture": ckpt.architecture, "data": ckpt.data,
            "server": _pack(ckpt.server, tensors), "rng": _pack(ckpt.rng, tensors)}
    from fedslice.output import dumps_json
    text = dumps_json(meta, indent=None).encode()
    for k, t in ckpt.state.items():
        tensors[f"state/{k}"] = t.detach().cpu().contiguous().clone()
    tensors["meta"] = torch.frombuffer(bytearray(text), dtype=torch.uint8)
    path = Path(folder) / CHECKPOINT
    write_bytes_atomic(path, save(tensors, metadata={"fedslice": "checkpoint"}))
    return path


def read_checkpoint(folder: Path) -> Checkpoint:
    """The checkpoint of a run folder; a missing or unreadable one is a :class:`FedsliceError`."""
    from safetensors.torch import load

    path = Path(folder) / CHECKPOINT
    if not path.is_file():
        raise FedsliceError(f"{folder} has no checkpoint ({CHECKPOINT}): was the run started "
                            "with output.checkpoint_every > 0?")
    try:
        tensors = load(path.read_bytes())
        meta = json.loads(bytes(tensors.pop("meta").numpy()).decode())
    except Exception as e:  # a file that is not ours / damaged on disk
        raise FedsliceError(f"{path} cannot be read: {e}") from None
    if meta.get("format") != FORMAT:
        raise FedsliceError(f"{path}: checkpoint format {meta.get('format')} (expected {FORMAT})")
    if meta["config_hash"] != config_hash(meta["config"]):
        raise FedsliceError(f"{path}: the config hash does not match the saved config")
    state = {k: tensors[f"state/{k}"] for k in meta["state_keys"]}
    return Checkpoint(round=meta["round"], config=meta["config"], state=state,
                      server=_unpack(meta["server"], tensors), rng=_unpack(meta["rng"], tensors),
                      records=meta["records"], elapsed_s=meta["elapsed_s"],
                      architecture=meta.get("architecture"), data=meta.get("data"))


# --------------------------------------------------------------------------------------------
# Capturing and restoring a run (duck-typed: method, its strategy, the selector)
# --------------------------------------------------------------------------------------------

def capture(server_round: int, config: dict[str, Any], method, selector, state: State,
            records: list[dict[str, Any]], elapsed_s: float, clock=None) -> Checkpoint:
    """``clock``: the simulated clock of a run with devices (an asynchronous run's holds what
    is in flight), kept under ``server["clock"]``."""
    server = {"strategy": method.strategy.state_dict(), "method": method.kept_state("server"),
              "selector": selector.state_dict()}
    if clock is not None:
        server["clock"] = clock.state_dict()
    return Checkpoint(server_round, config, dict(state), server, capture_rng(),
                      [json.loads(json.dumps(r, default=str)) for r in records], elapsed_s,
                      architecture_of(method))


def restore(ckpt: Checkpoint, method, selector, clock=None) -> State:
    """Put the server-side state, the simulated clock and the RNGs of ``ckpt`` back; return
    the global state."""
    check_same_architecture(ckpt, method)
    method.strategy.load_state_dict(ckpt.server["strategy"])
    method.restore_state("server", ckpt.server["method"])
    selector.load_state_dict(ckpt.server["selector"])
    if clock is not None and "clock" in ckpt.server:
        clock.load_state_dict(ckpt.server["clock"])
    restore_rng(ckpt.rng)
    state = {k: t.clone() for k, t in ckpt.state.items()}
    # the shared model holds the global state, as after the round (FedPFT's simulated clients
    # patch the proxy they hold with the re-distilled neurons only)
    method.eval_model(state)
    return state


def find_resumable(path: Path) -> Path:
    """The staging folder to resume: ``path`` itself, or the unfinished run of that name."""
    path = Path(path)
    if path.is_dir() and (path / CHECKPOINT).is_file():
        if (path / "summary.json").is_file():
            raise FedsliceError(f"{path} is a finished run: nothing to resume")
        return path
    partial = sorted((p for p in path.parent.glob(f".{path.name}.partial-*")
                      if (p / CHECKPOINT).is_file()), key=lambda p: p.stat().st_mtime)
    if partial:
        return partial[-1]
    if path.is_dir() and (path / "summary.json").is_file():
        raise FedsliceError(f"{path} is a finished run: nothing to resume")
    raise FedsliceError(f"no checkpoint to resume in {path} (nor an unfinished run of that name)")
