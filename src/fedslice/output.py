"""The run folder, written atomically.

A run writes into a hidden staging folder ``<out_dir>/.<name>.partial-<pid>`` and, when it finishes,
:meth:`RunDir.commit` renames it in one step to ``<out_dir>/<name>`` (or ``<name>-2``,
``<name>-3``, ... if that exists: a run never overwrites another). A crashed or interrupted run
therefore never leaves a folder that looks finished; one that finished a round keeps its staging
folder (metrics so far, the latest weights, a checkpoint: nothing finished is lost), one that
never trained leaves nothing. A committed run folder holds::

    config.json                  the resolved experiment config
    config.toml                  the same, if tomli_w is installed
    metrics.jsonl                one JSON object per round
    summary.json                 final numbers (test accuracy, costs, ...)
    final_trainable.safetensors  the trained (trainable) weights

plus whatever else the caller puts in :attr:`RunDir.path` (plots from :mod:`fedslice.report`).
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import re
import shutil
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import IO, Any

from fedslice.errors import ENVIRONMENT_ERRNOS, EnvironmentFault, FedsliceError

__all__ = ["RunDir", "reserve_folder", "read_run", "read_jsonl", "to_jsonable", "dumps_json",
           "write_json_atomic"]

CONFIG_JSON = "config.json"
CONFIG_TOML = "config.toml"
METRICS = "metrics.jsonl"
SUMMARY = "summary.json"
WEIGHTS = "final_trainable.safetensors"
#: The class names of a classification run and their ids (``{"names": [...], "ids": {...}}``)
LABELS = "labels.json"
#: The weights after the last finished round, written into the staging folder of a failed run
LATEST_WEIGHTS = "latest_trainable.safetensors"
#: lm-evaluation-harness scores of the run's model, by task (``fedslice evaluate --harness``)
HARNESS = "harness.json"

_PARTIAL_RE = re.compile(r"^\.(?P<name>.+)\.partial-(?P<pid>\d+)(?:-\d+)?$")
_BAD_NAME_RE = re.compile(r"[/\\\x00]")


def is_staging(path: str | os.PathLike) -> bool:
    """Whether ``path`` names the staging folder of an unfinished run (``.<name>.partial-<pid>``)."""
    return _PARTIAL_RE.match(Path(path).name) is not None


# --------------------------------------------------------------------------------------------
# JSON
# --------------------------------------------------------------------------------------------


def to_jsonable(obj: Any) -> Any:
    """Convert ``obj`` to plain JSON types.

    Handles numpy and torch scalars and arrays, NaN/±inf (→ ``None``), :class:`~pathlib.Path`
    (→ str), dataclasses, pydantic models, enums, tuples and sets (→ lists); mapping keys become
    strings. Unknown objects are written as ``str(obj)``.
    """
    if obj is None or isinstance(obj, (bool, str)):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj) if math.isfinite(obj) else None
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, enum.Enum):
        return to_jsonable(obj.value)
    if isinstance(obj, Mapping):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, (set, frozenset)):
        return [to_jsonable(v) for v in sorted(obj, key=repr)]
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return to_jsonable(dataclasses.asdict(obj))
    if hasattr(obj, "model_dump") and callable(obj.model_dump):  # pydantic v2
        return to_jsonable(obj.model_dump())
    # numpy / torch, without importing them unless they are already in use
    mod = type(obj).__module__ or ""
    if mod.startswith("numpy"):
        import numpy as np

        if isinstance(obj, np.generic):
            return to_jsonable(obj.item())
        if isinstance(obj, np.ndarray):
            return to_jsonable(obj.tolist())
    if mod.startswith("torch"):
        import torch

        if isinstance(obj, torch.Tensor):
            t = obj.detach().cpu()
            return to_jsonable(t.item() if t.numel() == 1 and t.dim() == 0 else t.tolist())
        if isinstance(obj, (torch.dtype, torch.device)):
            return str(obj)
    if hasattr(obj, "item") and callable(obj.item):
        try:
            return to_jsonable(obj.item())
        except Exception:
            pass
    return str(obj)


def dumps_json(obj: Any, *, indent: int | None = 2) -> str:
    """Strict JSON text of ``obj`` after :func:`to_jsonable` (NaN is written as ``null``)."""
    return json.dumps(to_jsonable(obj), indent=indent, allow_nan=False, ensure_ascii=False)


def file_mode() -> int:
    """The mode ``open()`` gives a new file (0o666 less the umask; 0o644 under umask 022)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return 0o666 & ~mask


def _write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_json_atomic(path: str | os.PathLike, obj: Any) -> Path:
    """Write ``obj`` as JSON to ``path`` via a temporary file and :func:`os.replace`."""
    path = Path(path)
    _write_text_atomic(path, dumps_json(obj) + "\n")
    return path


def _toml_safe(obj: Any) -> Any:
    """TOML has no null: drop ``None`` values from tables, write them as "" inside arrays."""
    if isinstance(obj, dict):
        return {k: _toml_safe(v) for k, v in obj.items() if v is not None}
    if isinstance(obj, list):
        return ["" if v is None else _toml_safe(v) for v in obj]
    return obj


# --------------------------------------------------------------------------------------------
# RunDir
# --------------------------------------------------------------------------------------------


def _check_name(name: str) -> None:
    if not isinstance(name, str) or not name or name in (".", "..") or _BAD_NAME_RE.search(name) or name.startswith("."):
        raise FedsliceError(
            f"invalid run name {name!r}: use a non-empty name without '/', '\\' or a leading '.'"
        )


def _make_out_dir(out_dir: str | os.PathLike) -> Path:
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # no permission, a full disk: the machine's; else the path given
        kind = EnvironmentFault if e.errno in ENVIRONMENT_ERRNOS else FedsliceError
        raise kind(f"cannot create output folder {out}: {e.strerror or e}") from e
    if not out.is_dir():
        raise FedsliceError(f"output path {out} exists and is not a folder")
    return out


def reserve_folder(out_dir: str | os.PathLike, name: str) -> Path:
    """Create and return ``out_dir/name`` (or ``name-2``, ``name-3``, ... if that exists): a new,
    empty folder that no other run uses (a compare folder, filled run by run)."""
    _check_name(name)
    out = _make_out_dir(out_dir)
    for i in range(1, 100_000):
        candidate = out / (name if i == 1 else f"{name}-{i}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise FedsliceError(f"cannot find a free folder name for {name!r} in {out}")


class RunDir:
    """A run folder that becomes visible only when the run finishes.

    ::

        with RunDir.create(Path("runs"), "sst2-lora") as run:
            run.write_config(cfg)
            for r in rounds:
                run.append_metrics({...})
            run.write_summary({...})
            run.save_weights(trainable_state)
        run.final_path        # runs/sst2-lora (or runs/sst2-lora-2, ...)

    The ``with`` block commits on success; on any exception (re-raised) it keeps the staging
    folder if a round finished (:attr:`trained`: ``metrics.jsonl`` has a record) and deletes it
    otherwise. Without ``with``, call :meth:`commit`, :meth:`keep` or :meth:`abort`.
    """

    def __init__(self, out_dir: Path, name: str, staging: Path) -> None:
        self.out_dir = out_dir
        self.name = name
        self.staging_path = staging
        self.final_path: Path | None = None
        self._metrics_file: IO[str] | None = None
        self._state = "open"  # open | committed | aborted | kept

    @classmethod
    def create(cls, out_dir: str | os.PathLike, name: str) -> RunDir:
        """Start a run named ``name`` under ``out_dir`` (created if missing)."""
        _check_name(name)
        out = _make_out_dir(out_dir)
        staging = out / f".{name}.partial-{os.getpid()}"
        for i in range(2, 100_000):  # another run of this process kept its folder: never reuse it
            try:
                staging.mkdir()
                break
            except FileExistsError:
                staging = out / f".{name}.partial-{os.getpid()}-{i}"
        return cls(out, name, staging)

    @classmethod
    def reopen(cls, staging: str | os.PathLike, name: str | None = None) -> RunDir:
        """Continue writing into the staging folder of an interrupted run (``--resume``);
        ``name``: the final folder's name when it changed (``output.name``)."""
        staging = Path(staging)
        m = _PARTIAL_RE.match(staging.name)
        if not m or not staging.is_dir():
            raise FedsliceError(f"{staging} is not the staging folder of an unfinished run")
        pid = int(m["pid"])
        if pid != os.getpid() and _pid_alive(pid):
            raise FedsliceError(f"{staging} belongs to process {pid}, which is still running")
        if name is not None:
            _check_name(name)
        return cls(staging.parent, name or m["name"], staging)

    # -- state ----------------------------------------------------------------------------

    @property
    def path(self) -> Path:
        """Where files go: the staging folder while open, the final folder once committed."""
        return self.final_path if self.final_path is not None else self.staging_path

    @property
    def committed(self) -> bool:
        return self._state == "committed"

    @property
    def kept(self) -> bool:
        """The run failed after a round: its staging folder was left in place."""
        return self._state == "kept"

    @property
    def trained(self) -> bool:
        """Whether a round finished: ``metrics.jsonl`` holds a record (what a failure keeps)."""
        try:
            return (self.staging_path / METRICS).stat().st_size > 0
        except OSError:
            return False

    def _check_open(self) -> None:
        if self._state != "open":
            raise RuntimeError(f"run folder {self.name!r} is already {self._state}")

    def __repr__(self) -> str:
        return f"RunDir(path={str(self.path)!r}, state={self._state})"

    # -- writing ---------------------------------------------------------------------------

    def write_config(self, config: Mapping[str, Any] | Any) -> Path:
        """Write ``config.json`` (and ``config.toml`` if ``tomli_w`` is installed)."""
        self._check_open()
        data = to_jsonable(config)
        path = write_json_atomic(self.staging_path / CONFIG_JSON, data)
        try:
            import tomli_w
        except ImportError:
            return path
        if isinstance(data, dict):
            try:
                _write_text_atomic(self.staging_path / CONFIG_TOML, tomli_w.dumps(_toml_safe(data)))
            except (TypeError, ValueError):
                pass  # not representable as TOML: config.json is the reference
        return path

    def append_metrics(self, record: Mapping[str, Any]) -> None:
        """Append one JSON line to ``metrics.jsonl`` and flush it."""
        self._check_open()
        line = dumps_json(record, indent=None)
        if self._metrics_file is None:
            self._metrics_file = open(self.staging_path / METRICS, "a", encoding="utf-8")
        self._metrics_file.write(line + "\n")
        self._metrics_file.flush()

    def rewrite_metrics(self, records: list[Mapping[str, Any]]) -> None:
        """Replace ``metrics.jsonl`` by ``records`` (a resumed run drops the rounds after its
        checkpoint)."""
        self._check_open()
        if self._metrics_file is not None:
            self._metrics_file.close()
            self._metrics_file = None
        _write_text_atomic(self.staging_path / METRICS,
                           "".join(dumps_json(r, indent=None) + "\n" for r in records))

    def write_summary(self, summary: Mapping[str, Any]) -> Path:
        """Write ``summary.json`` (temporary file + :func:`os.replace`)."""
        self._check_open()
        return write_json_atomic(self.staging_path / SUMMARY, summary)

    def write_json(self, filename: str, obj: Any) -> Path:
        """Write any other JSON file into the run folder, atomically."""
        self._check_open()
        return write_json_atomic(self.staging_path / _plain_filename(filename), obj)

    def save_weights(
        self,
        state: Mapping[str, Any],
        filename: str = WEIGHTS,
        metadata: Mapping[str, str] | None = None,
    ) -> Path:
        """Save tensors with :func:`safetensors.torch.save_file` (moved to CPU, made contiguous;
        tensors that share storage are cloned, since safetensors refuses shared memory)."""
        import torch
        from safetensors.torch import save_file

        self._check_open()
        filename = _plain_filename(filename)
        tensors: dict[str, torch.Tensor] = {}
        seen: set[int] = set()
        for key, value in state.items():
            if not isinstance(value, torch.Tensor):
                raise TypeError(f"save_weights: {key!r} is a {type(value).__name__}, not a tensor")
            t = value.detach().to("cpu").contiguous()
            ptr = t.untyped_storage().data_ptr()
            full = t.untyped_storage().nbytes() == t.numel() * t.element_size()
            if ptr in seen or not full:
                t = t.clone()
                ptr = t.untyped_storage().data_ptr()
            if t.numel() > 0:
                seen.add(ptr)
            tensors[str(key)] = t
        dest = self.staging_path / filename
        tmp = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
        save_file(tensors, str(tmp), metadata=dict(metadata) if metadata else None)
        os.chmod(tmp, file_mode())  # safetensors writes 0600: the run's other files' mode
        os.replace(tmp, dest)
        return dest

    # -- finishing ---------------------------------------------------------------------------

    def _close(self) -> None:
        if self._metrics_file is not None:
            self._metrics_file.flush()
            os.fsync(self._metrics_file.fileno())
            self._metrics_file.close()
            self._metrics_file = None

    def commit(self) -> Path:
        """Atomically rename the staging folder to ``out_dir/name`` (or ``name-2``, ...) and
        return the final path. Never overwrites an existing folder."""
        if self._state == "committed":
            assert self.final_path is not None
            return self.final_path
        self._check_open()
        self._close()
        for i in range(1, 100_000):
            candidate = self.out_dir / (self.name if i == 1 else f"{self.name}-{i}")
            # Reserve the name with mkdir (atomic: fails if it exists), then rename the staging
            # folder over the empty reservation (atomic on POSIX).
            try:
                candidate.mkdir()
            except FileExistsError:
                continue
            try:
                os.replace(self.staging_path, candidate)
            except OSError:
                # e.g. Windows cannot replace a folder: drop the reservation, then rename.
                candidate.rmdir()
                try:
                    os.rename(self.staging_path, candidate)
                except FileExistsError:
                    continue
            self.final_path = candidate
            self._state = "committed"
            if i > 1:
                _name_in_summary(candidate)
            return candidate
        raise FedsliceError(f"cannot find a free run folder name for {self.name!r} in {self.out_dir}")

    def abort(self) -> None:
        """Delete the staging folder; nothing of the run is left."""
        if self._close_quietly():
            shutil.rmtree(self.staging_path, ignore_errors=True)
            self._state = "aborted"

    def __enter__(self) -> RunDir:
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        if exc_type is None:
            self.commit()
        elif self.trained:
            self.keep()
        else:
            self.abort()
        return False

    def keep(self) -> None:
        """Close the files and leave the staging folder (what a failed run had finished)."""
        if self._close_quietly():
            self._state = "kept"

    def _close_quietly(self) -> bool:
        """Close the open files of an open run (errors ignored); False if it is not open."""
        if self._state != "open":
            return False
        try:
            self._close()
        except OSError:
            pass
        return True

    def __del__(self) -> None:
        f = getattr(self, "_metrics_file", None)
        if f is not None:
            try:
                f.close()
            except Exception:
                pass


def _name_in_summary(folder: Path) -> None:
    """A run committed under another name than its own (``NAME-2``: NAME was taken) is named by
    its folder in its summary, so tables and reports tell the two apart."""
    path = folder / SUMMARY
    try:
        summary = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return
    if isinstance(summary, dict):
        write_json_atomic(path, {**summary, "name": folder.name})


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _plain_filename(filename: str) -> str:
    if not filename or _BAD_NAME_RE.search(filename) or filename in (".", ".."):
        raise ValueError(f"invalid file name {filename!r}: a plain file name is expected")
    return filename


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def read_run(run_dir: str | os.PathLike) -> tuple[dict[str, Any], list[dict[str, Any]], dict[str, Any]]:
    """Read a finished run folder: ``(config, metrics, summary)``.

    ``config`` is ``{}`` if ``config.json`` is absent and ``metrics`` is ``[]`` if
    ``metrics.jsonl`` is absent; a missing folder, a staging (unfinished) folder, a folder without
    ``summary.json``, or malformed JSON raises :class:`~fedslice.errors.FedsliceError`.
    """
    path = Path(run_dir)
    m = _PARTIAL_RE.match(path.name)
    if m:
        raise FedsliceError(
            f"{path} is an unfinished run (the staging folder of process {m['pid']}); "
            "it is renamed to its final name only when the run completes"
        )
    if not path.exists():
        partial = sorted(path.parent.glob(f".{path.name}.partial-*")) if path.parent.is_dir() else []
        hint = f" (an unfinished run is at {partial[0]})" if partial else ""
        raise FedsliceError(f"run folder {path} does not exist{hint}")
    if not path.is_dir():
        raise FedsliceError(f"{path} is not a run folder (not a directory)")
    summary_path = path / SUMMARY
    if not summary_path.is_file():
        raise FedsliceError(f"{path} is not a finished run folder: it has no {SUMMARY}")
    summary = _read_json(summary_path)
    if not isinstance(summary, dict):
        raise FedsliceError(f"{summary_path}: expected a JSON object")
    config_path = path / CONFIG_JSON
    config = _read_json(config_path) if config_path.is_file() else {}
    metrics_path = path / METRICS
    metrics = [r for _, r in read_jsonl(metrics_path)] if metrics_path.is_file() else []
    return config, metrics, summary


def read_jsonl(path: Path, error: type[FedsliceError] = FedsliceError) -> Iterator[tuple[int, dict]]:
    """``(line number, object)`` of every non-blank line of a JSON-lines file (UTF-8, a byte-order
    mark allowed); a line that is not a JSON object raises ``error`` naming the file and line."""
    with open(path, encoding="utf-8-sig", newline="") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise error(f"{path}, line {lineno}: invalid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise error(f"{path}, line {lineno}: expected a JSON object per line")
            yield lineno, record


def _read_json(path: Path) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except json.JSONDecodeError as e:
        raise FedsliceError(f"{path}: invalid JSON ({e.msg} at line {e.lineno})") from e
    except OSError as e:
        raise FedsliceError(f"cannot read {path}: {e}") from e
