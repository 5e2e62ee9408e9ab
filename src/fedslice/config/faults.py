"""The ``[faults]`` section: injected failures and stragglers.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from fedslice.config.base import Section


class FaultsConfig(Section):
    """Faults injected into the in-process simulation (`fedslice run`; never on Flower), drawn
    per round from the seed: a run with faults is as reproducible as one without."""

    dropout: float = Field(0.0, ge=0, lt=1, description="Probability that a selected client "
                           "drops out of a round (never replies; nothing of it is counted).")
    stragglers: float = Field(0.0, ge=0, le=1, description="Probability that a selected client "
                              "replies `straggler_delay_s` late (it trains; the reply is used "
                              "only if it arrives before `deadline_s`).")
    straggler_delay_s: float = Field(60.0, gt=0, description="Simulated delay of a straggler's "
                                     "reply (the others arrive at 0 s: local training time is "
                                     "not simulated, so runs stay reproducible).")
    deadline_s: float | None = Field(None, gt=0, description="Round deadline in simulated "
                                     "seconds: later replies are discarded. None: wait for all.")
    nan: float = Field(0.0, ge=0, le=1, description="Probability that a client's update is NaN.")
    overreport: float = Field(0.0, ge=0, le=1, description="Probability that a client reports "
                              "`overreport_factor` x its number of examples.")
    overreport_factor: float = Field(10.0, gt=1)
    attack: Literal["none", "sign_flip", "gaussian"] = Field(
        "none", description="What the attackers send: sign_flip = global - scale x their update; "
        "gaussian = global + N(0, scale^2) noise.")
    attackers: float = Field(0.0, ge=0, lt=0.5, description="Fraction of each round's clients "
                             "that attack: round(fraction x selected) of them, drawn per round.")
    attack_scale: float = Field(1.0, gt=0, description="Sign flip: the update's multiplier "
                                "(-scale); gaussian: the noise's standard deviation.")

    @model_validator(mode="after")
    def _attack(self) -> "FaultsConfig":
        if (self.attack == "none") != (self.attackers == 0):
            raise ValueError(f"attack={self.attack!r} with attackers={self.attackers}: set both "
                             "(an attack and a fraction > 0) or neither")
        return self
