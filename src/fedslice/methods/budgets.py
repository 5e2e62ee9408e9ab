"""Client budgets: a client's limits (:class:`ClientBudget`) from ``[budgets]`` tiers, a CSV
or a drawn share, and its device and time limit on the simulated clock.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from fedslice.config import BUDGET_LIMITS, DEVICE_FIELDS, BudgetsConfig, read_utf8
from fedslice.errors import ConfigError
from fedslice.fl.tiers import tier_of_clients


BUDGET_FIELDS = BUDGET_LIMITS
UNITS = {"memory_mb": "MiB", "gflops_per_round": "GFLOPs/round", "upload_mb_per_round": "MB up/round",
         "flops_share": "x dense's FLOPs", "memory_share": "x dense's memory",
         "seconds_per_round": "s/round"}


@dataclass(frozen=True)
class ClientBudget:
    """One client's limits (None: no limit) and where they come from (for messages)."""

    memory_mb: float | None = None
    gflops_per_round: float | None = None
    upload_mb_per_round: float | None = None
    flops_share: float | None = None  # of a dense client's FLOPs per round (the whole model)
    memory_share: float | None = None  # of a dense client's peak memory
    seconds_per_round: float | None = None  # simulated seconds of a client-round on its device
    name: str = ""  # the tier's name, or 'csv'
    field: str = "budgets"  # 'budgets.tiers[1]' / 'budgets.csv row 4'
    #: the client's device on the simulated clock (:class:`fedslice.fl.devices.Device`; None:
    #: no devices), what a plan's seconds are predicted on
    device: Any = None

    def describe(self) -> str:
        return ", ".join(f"{v:g} {UNITS[k]}" for k, v in self.limits().items())

    def relative(self) -> bool:
        """Some limit is a share of a dense client's cost (the planner predicts dense's too)."""
        return self.flops_share is not None or self.memory_share is not None

    def limits(self) -> dict[str, float]:
        return {k: v for k in BUDGET_FIELDS if (v := getattr(self, k)) is not None}

    def key(self) -> tuple:
        """What a plan depends on: the limits and the device."""
        return tuple(sorted(self.limits().items())), self.device


def read_budget_csv(path: Path, num_clients: int) -> dict[int, ClientBudget]:
    """Client -> budget from a CSV with a ``client`` column and any of :data:`BUDGET_FIELDS`
    (an empty cell: no limit); every client of the federation once. UTF-8, with or without a
    byte-order mark. Errors name the file, the row (its line in the file: the header's is 1)
    and the field."""
    where = f"budgets.csv {path}"
    if path.is_dir():
        raise ConfigError(f"budgets.csv = {str(path)!r} is a folder: give a CSV file")
    try:
        text = read_utf8(path, "budgets.csv").removeprefix("\ufeff")
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    lines = _csv_rows(text, where)
    if not lines:
        raise ConfigError(f"{where}: the file is empty (give a header: client,memory_mb,...)")
    head_line, header = lines[0]
    columns = [c.strip() for c in header]
    for k, c in enumerate(columns):
        if not c:
            raise ConfigError(f"{where} row {head_line}: column {k + 1} has no name (columns: "
                              f"{','.join(columns)})")
        if c in columns[:k]:
            raise ConfigError(f"{where} row {head_line}: column {c!r} appears twice (columns "
                              f"{columns.index(c) + 1} and {k + 1})")
    if "client" not in columns:
        raise ConfigError(f"{where}: no `client` column (columns: {columns})")
    limits = [c for c in columns if c in BUDGET_FIELDS]
    if not limits:
        raise ConfigError(f"{where}: no budget column: give at least one of {', '.join(BUDGET_FIELDS)}")
    # a client's device may sit in the same file (fedslice.fl.devices reads those columns)
    known = (*BUDGET_FIELDS, *DEVICE_FIELDS)
    if unknown := [c for c in columns if c not in known and c != "client"]:
        raise ConfigError(f"{where}: unknown column(s) {unknown} (known: client, {', '.join(known)})")
    if len(lines) == 1:
        raise ConfigError(f"{where}: no rows after the header (give one row per client, ids "
                          f"0..{num_clients - 1})")
    out: dict[int, ClientBudget] = {}
    for i, cells in lines[1:]:
        if len(cells) != len(columns):
            raise ConfigError(f"{where} row {i}: {len(cells)} cells, the header has {len(columns)} "
                              f"({','.join(columns)}; an empty cell is no limit)")
        row = dict(zip(columns, (c.strip() for c in cells)))
        out[_client_id(row["client"], f"{where} row {i}", num_clients, out)] = ClientBudget(
            **_row_limits(row, limits, f"{where} row {i}"), name="csv", field=f"budgets.csv row {i}")
    if missing := sorted(set(range(num_clients)) - set(out)):
        raise ConfigError(f"{where}: no row for client(s) {missing[:10]}{' ...' if len(missing) > 10 else ''}")
    return out


def _csv_rows(text: str, where: str) -> list[tuple[int, list[str]]]:
    """(line where the row starts, cells) of every row that is not blank."""
    reader = csv.reader(io.StringIO(text, newline=""))
    out, end = [], 0
    try:
        for cells in reader:
            start, end = end + 1, reader.line_num
            if any(c.strip() for c in cells):
                out.append((start, cells))
    except csv.Error as e:
        raise ConfigError(f"{where} row {reader.line_num}: {e}") from None
    return out


def _client_id(text: str, where: str, num_clients: int, seen: Mapping[int, Any]) -> int:
    try:
        client = int(text)
    except ValueError:
        raise ConfigError(f"{where}, client: {text!r} is not a client id") from None
    if not 0 <= client < num_clients:
        raise ConfigError(f"{where}, client: {client} is not a client of this federation "
                          f"(ids 0..{num_clients - 1})")
    if client in seen:
        raise ConfigError(f"{where}, client: client {client} has a second row")
    return client


def _row_limits(row: Mapping[str, str], limits: list[str], where: str) -> dict[str, float]:
    values = {}
    for k in limits:
        if not row[k]:
            continue
        try:
            values[k] = float(row[k])
        except ValueError:
            raise ConfigError(f"{where}, {k}: {row[k]!r} is not a number") from None
        if math.isinf(values[k]):
            raise ConfigError(f"{where}, {k}: {row[k]} is not a budget (leave the cell empty for "
                              "no limit)")
        if not values[k] > 0:  # nan too
            raise ConfigError(f"{where}, {k}: {row[k]} is not a positive number")
        if k.endswith("_share") and values[k] > 1:
            raise ConfigError(f"{where}, {k}: {row[k]} is not a share in (0, 1]")
    if not values:
        raise ConfigError(f"{where}: no budget (every one of {', '.join(limits)} is empty)")
    return values


def client_budgets(cfg: BudgetsConfig, num_clients: int, seed: int
                   ) -> dict[int, tuple[int | None, ClientBudget]]:
    """Client -> (tier index or None for a CSV row or a drawn share, budget), reproducible from
    ``seed``: tiers placed at random (:func:`tier_of_clients`), or every client's
    ``flops_share`` drawn uniformly from ``budgets.flops_share_range``."""
    if cfg.csv is not None:
        return {c: (None, b) for c, b in read_budget_csv(Path(cfg.csv), num_clients).items()}
    if cfg.flops_share_range is not None:
        rng = np.random.default_rng([seed, 0x7A11])
        draws = rng.uniform(*cfg.flops_share_range, size=num_clients)
        field = cfg.field_of("flops_share_range")
        return {c: (None, ClientBudget(flops_share=float(x), name="drawn", field=field))
                for c, x in enumerate(draws)}
    out = {}
    for c, i in enumerate(tier_of_clients([t.share for t in cfg.tiers], num_clients, seed)):
        t = cfg.tiers[i]
        out[c] = (i, ClientBudget(**{k: getattr(t, k) for k in BUDGET_FIELDS},
                                  name=t.name or f"tier{i}", field=cfg.field_of(f"tiers[{i}]")))
    return out


def client_time_budgets(cfg, budgets: dict[int, tuple[int | None, ClientBudget]]
                        ) -> dict[int, tuple[int | None, ClientBudget]]:
    """Each client's budget with its device on the simulated clock (``[devices]`` or the
    tier's device fields; :func:`fedslice.fl.devices.population`) and its time limit: the
    tier's ``seconds_per_round``, and under ``round_policy = "deadline"`` the round's deadline
    (the smaller). A time limit without a device, or on a device whose speed is a factor of the
    host's without ``devices.host_gflops_per_s`` (the planner plans before the run measures
    the host), is a ConfigError naming the fields."""
    from fedslice.fl.devices import population

    fed = cfg.federation
    deadline = fed.round_deadline_s if fed.round_policy == "deadline" else None
    pop = population(cfg)
    host = cfg.devices.host_gflops_per_s if cfg.devices is not None else None
    out = {}
    for c, (tier, budget) in budgets.items():
        device = pop.devices.get(c) if pop is not None else None
        limit = min((x for x in (budget.seconds_per_round, deadline) if x is not None), default=None)
        if device is not None and device.speed is not None and host is None:
            if limit is not None:
                raise ConfigError(f"{budget.field}: a time limit ({'seconds_per_round' if budget.seconds_per_round else 'federation.round_deadline_s'}) "
                                  f"on a device whose speed is a factor of the host's ({device.where}, "
                                  "speed): the planner needs the host's rate before the run measures it: "
                                  "set devices.host_gflops_per_s (or give the device's gflops_per_s)")
            device = None  # its seconds are the clock's, not predicted
        if budget.seconds_per_round is not None and device is None:
            raise ConfigError(f"{budget.field}: seconds_per_round needs the client's device on the "
                              "simulated clock ([devices], or the tier's gflops_per_s and links)")
        out[c] = (tier, replace(budget, device=device, seconds_per_round=limit if device is not None else None))
    return out
