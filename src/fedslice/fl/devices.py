"""Client devices on the simulated clock: each client's speed, link and availability, from the
config (``[devices]``, or the device fields of ``budgets.tiers``), and an availability trace.

A :class:`Device` answers how long a client-round takes (:meth:`Device.seconds`: measured FLOPs
/ speed + bytes / link); a :class:`Population` answers who is online when (a seeded draw per
round and client from the availability share, or the trace's intervals). Both are pure: the
same config and seed give the same devices and the same availability, so a run with devices
is reproducible and resumes bit-identically without storing them. The round policies that use
them are in :mod:`fedslice.fl.clock`.

``devices.distribution = 'lognormal'``: speeds and links drawn from log-normals around the
section's medians; docs/time.md states the defaults and where they come from.
"""

from __future__ import annotations

import bisect
import csv
import io
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedslice.config import DEVICE_FIELDS, DeviceFields, ExperimentConfig, read_utf8
from fedslice.errors import ConfigError

_MB = 1e6
_TAG = 0xC10C  # the availability draws' stream, apart from every other seeded draw


@dataclass(frozen=True)
class Device:
    """One client's device. ``gflops_per_s`` or ``speed`` (a factor of the host's GFLOP/s);
    a link without a rate (None) takes no time; ``availability``: share of rounds online."""

    gflops_per_s: float | None = None
    speed: float | None = None
    upload_mb_per_s: float | None = None
    download_mb_per_s: float | None = None
    availability: float = 1.0
    where: str = "devices"  # where it was set, for messages ('devices.csv row 3')

    def __post_init__(self):
        for k in DEVICE_FIELDS:
            v = getattr(self, k)
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ConfigError(f"{self.where}, {k}: {v!r} is not a positive number")
        if self.availability > 1:
            raise ConfigError(f"{self.where}, availability: {self.availability:g} is not a share "
                              "in (0, 1]")
        if self.gflops_per_s is None and self.speed is None:
            raise ConfigError(f"{self.where}: no speed (give gflops_per_s or speed)")
        if self.gflops_per_s is not None and self.speed is not None:
            raise ConfigError(f"{self.where}: gflops_per_s and speed both given (one of them)")

    def rate(self, host_gflops_per_s: float | None) -> float:
        """Training FLOP/s of this device (``speed`` needs the host's GFLOP/s)."""
        if self.gflops_per_s is not None:
            return self.gflops_per_s * 1e9
        if host_gflops_per_s is None:
            raise ValueError(f"{self.where}: speed is a factor of the host's GFLOP/s, not given")
        return self.speed * host_gflops_per_s * 1e9

    def compute_seconds(self, flops: float, host_gflops_per_s: float | None = None) -> float:
        return float(flops) / self.rate(host_gflops_per_s)

    def link_seconds(self, bytes_down: float, bytes_up: float) -> float:
        down = 0.0 if self.download_mb_per_s is None else bytes_down / (self.download_mb_per_s * _MB)
        up = 0.0 if self.upload_mb_per_s is None else bytes_up / (self.upload_mb_per_s * _MB)
        return down + up

    def flops_within(self, seconds: float, bytes_down: float, bytes_up: float,
                     host_gflops_per_s: float | None = None) -> float:
        """The training FLOPs this device can spend in a client-round of ``seconds`` that also
        moves these bytes (<= 0: the transfers alone take longer): a time budget as the FLOPs
        budget a plan is checked against."""
        return (seconds - self.link_seconds(bytes_down, bytes_up)) * self.rate(host_gflops_per_s)

    def seconds(self, flops: float, bytes_down: float, bytes_up: float,
                host_gflops_per_s: float | None = None) -> float:
        """One client-round: download + training + upload, in simulated seconds."""
        return self.link_seconds(bytes_down, bytes_up) + self.compute_seconds(flops, host_gflops_per_s)


def _device(fields: DeviceFields | Mapping[str, float], where: str) -> Device:
    values = fields.device_fields() if isinstance(fields, DeviceFields) else dict(fields)
    if values.get("availability") is None:
        values.pop("availability", None)
    return Device(**values, where=where)


@dataclass
class Population:
    """Every client's device and when it is online (the trace's intervals, else a seeded draw
    per (seed, round, client) against its availability share)."""

    devices: dict[int, Device]
    seed: int = 0
    #: client -> its online intervals [from, to), sorted and disjoint (clients absent: always on)
    trace: dict[int, list[tuple[float, float]]] | None = None
    _starts: dict[int, list[float]] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        self._starts = {c: [a for a, _ in iv] for c, iv in (self.trace or {}).items()}

    @property
    def uses_speed_factors(self) -> bool:
        return any(d.speed is not None for d in self.devices.values())

    def _interval(self, client: int, t: float) -> tuple[float, float] | None:
        iv = self.trace[client]
        i = bisect.bisect_right(self._starts[client], t) - 1
        return iv[i] if i >= 0 and iv[i][0] <= t < iv[i][1] else None

    def online(self, client: int, server_round: int, t: float) -> bool:
        """Whether ``client`` is online at simulated time ``t`` of round ``server_round``."""
        if self.trace is not None and client in self.trace:
            return self._interval(client, t) is not None
        share = self.devices[client].availability
        if share >= 1:
            return True
        u = np.random.default_rng(np.random.SeedSequence([self.seed, server_round, _TAG, client])).random()
        return bool(u < share)

    def online_until(self, client: int, t: float) -> float:
        """When ``client``, online at ``t``, goes offline (inf without a trace interval)."""
        if self.trace is None or client not in self.trace:
            return math.inf
        iv = self._interval(client, t)
        return iv[1] if iv is not None else t

    def next_online(self, t: float) -> float | None:
        """The first time after ``t`` a traced client comes online (None: never again)."""
        if self.trace is None:
            return None
        later = [a for starts in self._starts.values() for a in starts if a > t]
        return min(later) if later else None


# --------------------------------------------------------------------------------------------
# From the config
# --------------------------------------------------------------------------------------------

def has_devices(cfg: ExperimentConfig) -> bool:
    """The config puts its clients on the simulated clock ([devices], device fields in
    budgets.tiers, or device columns in budgets.csv)."""
    tiers = (cfg.budgets.tiers if cfg.budgets is not None else None) or []
    return cfg.devices is not None or any(t.device_fields() for t in tiers) or \
        bool(budget_csv_device_columns(cfg))


def budget_csv_device_columns(cfg: ExperimentConfig) -> list[str]:
    """The device columns of ``budgets.csv`` (its header; [] without one or without the file:
    reading it is :func:`fedslice.methods.budgets.read_budget_csv`'s, which names its errors)."""
    if cfg.budgets is None or cfg.budgets.csv is None:
        return []
    try:
        with open(cfg.budgets.csv, encoding="utf-8-sig", newline="") as f:
            header = next(csv.reader(f), [])
    except (OSError, UnicodeDecodeError, csv.Error):
        return []
    return [c.strip() for c in header if c.strip() in DEVICE_FIELDS]


def population(cfg: ExperimentConfig, num_clients: int | None = None) -> Population | None:
    """Every client's device from the config (None: no devices, no simulated time). Files are
    read here; their errors name the file, the row and the field."""
    if not has_devices(cfg):
        return None
    n = cfg.federation.num_clients if num_clients is None else num_clients
    d = cfg.devices
    if d is None and cfg.budgets.csv is not None:  # device columns of budgets.csv
        return Population(read_device_csv(Path(cfg.budgets.csv), n, "budgets.csv"), cfg.seed)
    if d is None:  # device fields of budgets.tiers, placed as the budgets are
        from fedslice.fl.tiers import tier_of_clients
        tiers = cfg.budgets.tiers
        labels = tier_of_clients([t.share for t in tiers], n, cfg.seed)
        return Population({c: _device(tiers[i], f"budgets.tiers[{i}]") for c, i in enumerate(labels)},
                          cfg.seed)
    if d.tiers is not None:
        from fedslice.fl.tiers import tier_of_clients
        labels = tier_of_clients([t.share for t in d.tiers], n, cfg.seed)
        devices = {c: _device(d.tiers[i], f"devices.tiers[{i}]") for c, i in enumerate(labels)}
    elif d.csv is not None:
        devices = read_device_csv(Path(d.csv), n)
    elif d.distribution == "lognormal":
        devices = lognormal_devices(d, n, cfg.seed)
    else:
        devices = {c: _device(d, "devices") for c in range(n)}
    trace = read_trace(Path(d.trace), n) if d.trace is not None else None
    return Population(devices, cfg.seed, trace)


def lognormal_devices(d: DeviceFields, num_clients: int, seed: int) -> dict[int, Device]:
    """Speeds and links drawn per client from log-normals with the section's medians and
    log-standard deviations (``speed_sigma``, ``link_sigma``), seeded."""
    rng = np.random.default_rng([seed, _TAG, 1])
    z = rng.standard_normal((num_clients, 3))
    out = {}
    for c in range(num_clients):
        v = {"availability": d.availability}
        if d.gflops_per_s is not None:
            v["gflops_per_s"] = d.gflops_per_s * math.exp(d.speed_sigma * z[c, 0])
        else:
            v["speed"] = d.speed * math.exp(d.speed_sigma * z[c, 0])
        for j, k in ((1, "upload_mb_per_s"), (2, "download_mb_per_s")):
            if getattr(d, k) is not None:
                v[k] = getattr(d, k) * math.exp(d.link_sigma * z[c, j])
        out[c] = _device(v, f"devices.distribution client {c}")
    return out


def _rows(path: Path, what: str) -> tuple[str, list[str], list[tuple[int, dict[str, str]]]]:
    """(where, columns, [(line, row)]) of a CSV file; a header, at least one row."""
    where = f"{what} {path}"
    if path.is_dir():
        raise ConfigError(f"{what} = {str(path)!r} is a folder: give a CSV file")
    try:
        text = read_utf8(path, what).removeprefix("\ufeff")
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    reader = csv.reader(io.StringIO(text, newline=""))
    rows, end = [], 0
    try:
        for cells in reader:
            start, end = end + 1, reader.line_num
            if any(c.strip() for c in cells):
                rows.append((start, [c.strip() for c in cells]))
    except csv.Error as e:
        raise ConfigError(f"{where} row {reader.line_num}: {e}") from None
    if not rows:
        raise ConfigError(f"{where}: the file is empty (give a header row)")
    columns = rows[0][1]
    if len(set(columns)) != len(columns) or not all(columns):
        raise ConfigError(f"{where} row {rows[0][0]}: column names must be unique and non-empty "
                          f"(got {columns})")
    if "client" not in columns:
        raise ConfigError(f"{where}: no `client` column (columns: {columns})")
    out = []
    for line, cells in rows[1:]:
        if len(cells) != len(columns):
            raise ConfigError(f"{where} row {line}: {len(cells)} cells, the header has "
                              f"{len(columns)} ({','.join(columns)})")
        out.append((line, dict(zip(columns, cells))))
    if not out:
        raise ConfigError(f"{where}: no rows after the header")
    return where, columns, out


def _client(text: str, where: str, num_clients: int) -> int:
    try:
        c = int(text)
    except ValueError:
        raise ConfigError(f"{where}, client: {text!r} is not a client id") from None
    if not 0 <= c < num_clients:
        raise ConfigError(f"{where}, client: {c} is not a client of this federation (ids "
                          f"0..{num_clients - 1})")
    return c


def _number(row: Mapping[str, str], k: str, where: str) -> float:
    try:
        v = float(row[k])
    except ValueError:
        raise ConfigError(f"{where}, {k}: {row[k]!r} is not a number") from None
    if not math.isfinite(v):
        raise ConfigError(f"{where}, {k}: {row[k]} is not a finite number")
    return v


#: budget columns a devices CSV may hold too (the same file serving budgets.csv), not read here
_BUDGET_COLUMNS = ("memory_mb", "gflops_per_round", "upload_mb_per_round", "seconds_per_round")


def read_device_csv(path: Path, num_clients: int, what: str = "devices.csv") -> dict[int, Device]:
    """Client -> device from a CSV with a ``client`` column and any of the device fields (an
    empty cell: none); every client once. Budget columns are left to the budgets' reader (the
    same file may be ``budgets.csv``, ``what``). Errors name the file, the row (its line) and
    the field."""
    where, columns, rows = _rows(path, what)
    if unknown := [c for c in columns if c not in DEVICE_FIELDS and c != "client"
                   and c not in _BUDGET_COLUMNS]:
        raise ConfigError(f"{where}: unknown column(s) {unknown} (known: client, "
                          f"{', '.join(DEVICE_FIELDS)})")
    out: dict[int, Device] = {}
    for line, row in rows:
        at = f"{where} row {line}"
        c = _client(row["client"], at, num_clients)
        if c in out:
            raise ConfigError(f"{at}, client: client {c} has a second row")
        values = {k: _number(row, k, at) for k in DEVICE_FIELDS if k in row and row[k]}
        out[c] = Device(**values, where=f"{what} row {line}")
    if missing := sorted(set(range(num_clients)) - set(out)):
        raise ConfigError(f"{where}: no row for client(s) {missing[:10]}"
                          f"{' ...' if len(missing) > 10 else ''}")
    return out


TRACE_COLUMNS = ("client", "online_from_s", "online_to_s")


def read_trace(path: Path, num_clients: int) -> dict[int, list[tuple[float, float]]]:
    """Client -> its online intervals, sorted, from a CSV with columns client, online_from_s,
    online_to_s. An unknown client, an empty or negative interval, or intervals of one client
    that overlap: a ConfigError naming the rows."""
    where, columns, rows = _rows(path, "devices.trace")
    if sorted(columns) != sorted(TRACE_COLUMNS):
        raise ConfigError(f"{where}: columns must be {', '.join(TRACE_COLUMNS)} (got {columns})")
    spans: dict[int, list[tuple[float, float, int]]] = {}
    for line, row in rows:
        at = f"{where} row {line}"
        c = _client(row["client"], at, num_clients)
        a, b = _number(row, "online_from_s", at), _number(row, "online_to_s", at)
        if a < 0:
            raise ConfigError(f"{at}, online_from_s: {a:g} is negative")
        if not b > a:
            raise ConfigError(f"{at}, online_to_s: {b:g} is not after online_from_s = {a:g}")
        spans.setdefault(c, []).append((a, b, line))
    out = {}
    for c, iv in spans.items():
        iv.sort()
        for (a0, b0, l0), (a1, _, l1) in zip(iv, iv[1:]):
            if a1 < b0:
                raise ConfigError(f"{where} rows {l0} and {l1}: client {c}'s intervals "
                                  f"[{a0:g}, {b0:g}) and [{a1:g}, ...) overlap")
        out[c] = [(a, b) for a, b, _ in iv]
    return out


def check_devices(cfg: ExperimentConfig) -> None:
    """Read the devices' files (CSV, trace) so their errors come at load, before training."""
    population(cfg)


def describe_clock(cfg: ExperimentConfig) -> str:
    """The round policy and the devices' spread in one line (``fedslice validate``); "" without
    devices."""
    pop = population(cfg)
    if pop is None:
        return ""
    fed = cfg.federation
    if fed.round_policy == "deadline":
        over = f", {fed.overselect:.0%} over-selected" if fed.overselect else ""
        policy = f"'deadline' ({fed.round_deadline_s:g} s{over})"
    elif fed.round_policy == "async":
        policy = "'async' (FedBuff: {} training, {} replies per aggregation)".format(*fed.async_sizes())
    else:
        policy = "'all' (every selected client)"

    def spread(values: list[float], unit: str) -> str:
        lo, mid, hi = np.quantile(values, [0.05, 0.5, 0.95])
        return f"{lo:.3g}-{hi:.3g} {unit} (median {mid:.3g})"

    devs = list(pop.devices.values())
    parts = []
    speeds = [d.gflops_per_s for d in devs if d.gflops_per_s is not None]
    factors = [d.speed for d in devs if d.speed is not None]
    if speeds:
        parts.append("training " + spread(speeds, "GFLOP/s"))
    if factors:
        parts.append("training " + spread(factors, "x the host's speed"))
    for k, name in (("upload_mb_per_s", "up"), ("download_mb_per_s", "down")):
        rates = [getattr(d, k) for d in devs if getattr(d, k) is not None]
        if rates:
            parts.append(f"{name} " + spread(rates, "MB/s"))
    if pop.trace is not None:
        parts.append(f"online by the trace ({len(pop.trace)} clients traced)")
    else:
        parts.append(f"online {np.mean([d.availability for d in devs]):.0%} of rounds (mean)")
    return (f"round policy {policy}; {len(devs)} devices (5th-95th percentile): "
            + ", ".join(parts))
