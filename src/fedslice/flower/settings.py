"""The run config of the fedslice Flower app (``[tool.flwr.app.config]``), parsed.

- ``config``: the experiment config file (TOML/YAML/JSON), a path on the SuperLink's machine;
  relative paths inside it resolve from the folder the SuperLink was started in;
- ``overrides``: ``--set`` style overrides separated by ``;``, e.g. ``"federation.rounds=5; seed=1"``;
- ``out-dir``: parent folder of the run folder (default: the config's ``output.dir``);
- ``result-file``: if set, the ServerApp writes the run folder's path there;
- ``round-timeout``: seconds to wait for the replies of a round (a missing reply is a failure);
- ``connect-timeout``: seconds to wait at the start for the SuperNode of every partition;
- ``resume``: a run folder to continue from its checkpoint (``output.checkpoint_every``), like
  ``fedslice run --resume``; the config must be the checkpoint's.

Whoever submits a run chooses these values, but the files are read and written on the server's
machine: every path (``config``, ``out-dir``, ``result-file``, ``resume``, and the config's
``output.dir`` when it decides where the run folder goes) must resolve, symbolic links followed,
inside a server root that the operator sets with the environment variable
``FEDSLICE_SERVER_ROOT`` of the SuperLink (several roots separated by ``:``; default: the folder
the SuperLink was started in). Anything outside is refused, naming the key. Relative paths
resolve from the folder the SuperLink was started in.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedslice.errors import FedsliceError

#: The run config keys of the app, with their defaults ([tool.flwr.app.config] of its pyproject).
RUN_CONFIG_DEFAULTS: dict[str, Any] = {
    "config": "",
    "overrides": "",
    "out-dir": "",
    "result-file": "",
    "round-timeout": 600.0,
    "connect-timeout": 120.0,
    "resume": "",
}


#: The operator's setting (environment of the SuperLink, hence of the ServerApp): the folders the
#: run config's paths must lie in, separated by os.pathsep.
SERVER_ROOT_ENV = "FEDSLICE_SERVER_ROOT"


def server_roots() -> tuple[Path, ...]:
    """``$FEDSLICE_SERVER_ROOT`` (resolved), or the working directory when it is unset."""
    raw = os.environ.get(SERVER_ROOT_ENV, "")
    roots = tuple(Path(p).expanduser().resolve() for p in raw.split(os.pathsep) if p.strip())
    return roots or (Path.cwd().resolve(),)


def inside_roots(value: str | os.PathLike, key: str, roots: tuple[Path, ...]) -> Path:
    """``value`` as an absolute path (relative ones from the working directory), if it resolves
    inside one of ``roots``; else a :class:`FedsliceError` naming ``key``."""
    path = Path(value)
    if not path.is_absolute():
        path = Path.cwd() / path
    resolved = path.resolve()
    if not any(resolved == r or resolved.is_relative_to(r) for r in roots):
        where = " or ".join(str(r) for r in roots)
        raise FedsliceError(f"run config {key}={str(value)!r} resolves to {resolved}, outside the "
                            f"server root {where}: the operator of the SuperLink allows other "
                            f"folders with {SERVER_ROOT_ENV}")
    return path


@dataclass
class RunSettings:
    """The ServerApp's run config, parsed."""

    config: Path
    overrides: list[str]
    out_dir: str | None
    result_file: Path | None
    round_timeout: float
    connect_timeout: float
    resume: Path | None = None
    #: the folders every path must lie in (:func:`server_roots`)
    roots: tuple[Path, ...] = field(default_factory=server_roots)

    def check_path(self, value: str | os.PathLike, key: str) -> Path:
        """``value`` as an absolute path inside :attr:`roots` (else an error naming ``key``)."""
        return inside_roots(value, key, self.roots)

    @classmethod
    def from_run_config(cls, run_config: dict[str, Any],
                        roots: tuple[Path, ...] | None = None) -> RunSettings:
        """Parse and check the run config; every path must lie inside ``roots`` (default:
        :func:`server_roots`)."""
        roots = tuple(Path(r).resolve() for r in roots) if roots else server_roots()
        rc = {**RUN_CONFIG_DEFAULTS, **run_config}
        if not rc["config"]:
            raise FedsliceError('no experiment config: pass --run-config \'config="/abs/path.toml"\'')
        overrides = [o.strip() for o in str(rc["overrides"]).split(";") if o.strip()]
        for key in ("round-timeout", "connect-timeout"):
            if not isinstance(rc[key], (int, float)) or rc[key] <= 0:
                raise FedsliceError(f"run config {key}={rc[key]!r} must be a positive number of seconds")
        paths = {}
        for key in ("config", "out-dir", "result-file", "resume"):
            value = rc[key]
            if not isinstance(value, str):
                raise FedsliceError(f"run config {key}={value!r} must be a path (a string)")
            paths[key] = inside_roots(value, key, roots) if value else None
        return cls(config=paths["config"], overrides=overrides,
                   out_dir=str(paths["out-dir"]) if paths["out-dir"] else None,
                   result_file=paths["result-file"], round_timeout=float(rc["round-timeout"]),
                   connect_timeout=float(rc["connect-timeout"]), resume=paths["resume"], roots=roots)
