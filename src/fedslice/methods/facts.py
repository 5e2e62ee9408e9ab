"""What a method's stages tell the config checks and the rules about a config, before anything
is built (:meth:`fedslice.methods.base.Method.facts`)."""

from __future__ import annotations

from dataclasses import dataclass, replace


@dataclass(frozen=True)
class Facts:
    """Each field: why (named with the option that causes it), or None when it does not hold.

    - ``reorders_state``: the strategy re-orders the elements of the global state between
      rounds (RaFFM's re-ordering every R rounds); a rule holding per-element server state (a
      server optimizer's moments) and asynchronous rounds refuse it.
    - ``client_statistics``: a client sends the server, besides its update, example count and
      costs, something that steers the server's work (FedPFT's APoZ reports); DP-FedAvg refuses
      it (it would reach the server without noise, outside the accountant).
    - ``precision_refusal``: a client's plan cannot pick its base's precision
      (``budgets.precisions``).
    """

    reorders_state: str | None = None
    client_statistics: str | None = None
    precision_refusal: str | None = None

    def but(self, **changes: str | None) -> "Facts":
        """These facts with ``changes`` (a stage above answering for itself)."""
        return replace(self, **changes)
