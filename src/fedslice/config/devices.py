"""The ``[devices]`` section: client devices on the simulated clock (docs/time.md).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from fedslice.config.budgets import DeviceFields


class DeviceTierConfig(DeviceFields):
    """A tier of ``[devices]``: a share of the clients with one device."""

    name: str | None = Field(None, description="Shown in records (default: tier<i>).")
    share: float = Field(gt=0, le=1, description="Fraction of the clients in this tier.")


class DevicesConfig(DeviceFields):
    """Client devices on a simulated clock (docs/time.md): each client-round takes its measured
    FLOPs / the device's speed + its bytes / the device's link; the round policy
    (``federation.round_policy``) says what a round waits for. Given as tiers, a CSV row per
    client, or drawn from a distribution; the fields of this section are the distribution's
    medians (``distribution = 'lognormal'``)."""

    tiers: list[DeviceTierConfig] | None = Field(None, min_length=1, description="Tiers with "
                                                 "shares summing to 1, placed at random among "
                                                 "the clients (seeded, as budgets.tiers are).")
    csv: str | None = Field(None, description="A CSV file (UTF-8), one row per client: a `client` "
                            "column and any of gflops_per_s, speed, upload_mb_per_s, "
                            "download_mb_per_s, availability (an empty cell: no limit). Relative "
                            "paths as budgets.csv's. Read when the config loads.")
    distribution: Literal["none", "lognormal"] = Field(
        "none", description="'lognormal': each client's speed and links drawn (seeded) from "
        "log-normals whose medians are this section's gflops_per_s (or speed), upload_mb_per_s "
        "and download_mb_per_s, with log-standard deviations `speed_sigma` and `link_sigma` "
        "(docs/time.md says where the defaults come from).")
    speed_sigma: float = Field(0.9, ge=0, description="Log-standard deviation of the speeds "
                               "(0.9: the 5th-95th percentile spread is 19x).")
    link_sigma: float = Field(0.8, ge=0, description="Log-standard deviation of the links.")
    trace: str | None = Field(None, description="An availability trace: a CSV with columns "
                              "client, online_from_s, online_to_s (simulated seconds, "
                              "non-overlapping per client): a client is online inside its "
                              "intervals; a client absent from the trace is always online. "
                              "Replaces the availability shares. A client whose reply would "
                              "arrive after its interval ends is dropped (its work wasted).")
    host_gflops_per_s: float | None = Field(None, gt=0, description="This host's GFLOP/s that "
                                            "`speed` factors multiply (unset: measured once at "
                                            "the run's start when a speed factor is used).")

    @field_validator("csv", "trace")
    @classmethod
    def _path(cls, v):
        if v is not None and not v.strip():
            raise ValueError("an empty path: give the CSV file's (or leave the field out)")
        return v

    @field_validator("tiers")
    @classmethod
    def _shares(cls, v):
        if v is not None:
            total = sum(t.share for t in v)
            if abs(total - 1.0) > 1e-6:
                raise ValueError(f"tier shares sum to {total:g}, they must sum to 1")
        return v

    @model_validator(mode="after")
    def _one_source(self) -> "DevicesConfig":
        given = [n for n, on in (("devices.tiers", self.tiers is not None),
                                 ("devices.csv", self.csv is not None),
                                 ("devices.distribution", self.distribution != "none")) if on]
        if len(given) > 1:
            raise ValueError(f"{' and '.join(given)}: give the devices one way")
        if given and given[0] != "devices.distribution" and self.device_fields():
            raise ValueError(f"devices.{next(iter(self.device_fields()))} with {given[0]}: the "
                             "section's own device fields are one device for every client (or "
                             "a distribution's medians); give them in the tiers or the file")
        if not given and not self.device_fields() and self.trace is None:
            raise ValueError("give the devices: tiers, a csv file, a distribution, or one "
                             "device for every client (gflops_per_s, ...)")
        if self.distribution != "none" and self.gflops_per_s is None and self.speed is None:
            raise ValueError("devices.distribution = 'lognormal' needs the median speed: "
                             "devices.gflops_per_s (or devices.speed)")
        return self
