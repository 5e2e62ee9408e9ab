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
"""

from __future__ import annotations

from dataclasses import dataclass
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

    @classmethod
    def from_run_config(cls, run_config: dict[str, Any]) -> RunSettings:
        rc = {**RUN_CONFIG_DEFAULTS, **run_config}
        if not rc["config"]:
            raise FedsliceError('no experiment config: pass --run-config \'config="/abs/path.toml"\'')
        overrides = [o.strip() for o in str(rc["overrides"]).split(";") if o.strip()]
        for key in ("round-timeout", "connect-timeout"):
            if not isinstance(rc[key], (int, float)) or rc[key] <= 0:
                raise FedsliceError(f"run config {key}={rc[key]!r} must be a positive number of seconds")
        return cls(config=Path(str(rc["config"])).expanduser(), overrides=overrides,
                   out_dir=str(rc["out-dir"]) or None,
                   result_file=Path(str(rc["result-file"])) if rc["result-file"] else None,
                   round_timeout=float(rc["round-timeout"]),
                   connect_timeout=float(rc["connect-timeout"]),
                   resume=Path(str(rc["resume"])).expanduser() if rc["resume"] else None)
