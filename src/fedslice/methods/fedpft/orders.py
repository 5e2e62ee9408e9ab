"""FedPFT's own entries of a client's orders (:attr:`fedslice.fl.orders.Orders.extra`): which
proxy version a payload brings the client to, and whether it reports APoZ this round."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from fedslice.fl.orders import Orders


@dataclass(frozen=True)
class ProxyOrders:
    """What FedPFT's strategy tells a client beyond :class:`~fedslice.fl.orders.Orders`."""

    version: int | None = None  # the proxy version the payload brings the client's copy to
    base: int | None = None  # the version an incremental update starts from (None: whole proxy)
    report_apoz: bool = False  # an alignment round: report APoZ of the local data
    apoz_tau: float | None = None  # the near-zero threshold of that report

    #: the wire keys (a payload config's entries) of the fields
    KEYS: ClassVar[dict[str, str]] = {"version": "proxy_version", "base": "proxy_base", "report_apoz": "report_apoz",
            "apoz_tau": "apoz_tau"}

    @classmethod
    def of(cls, orders: Orders | dict[str, Any]) -> ProxyOrders:
        extra = Orders.of(orders).extra
        v, b, tau = (extra.get(cls.KEYS[k]) for k in ("version", "base", "apoz_tau"))
        return cls(version=None if v is None else int(v), base=None if b is None else int(b),
                   report_apoz=bool(extra.get(cls.KEYS["report_apoz"])),
                   apoz_tau=None if tau is None else float(tau))

    @classmethod
    def entries(cls, **fields: Any) -> dict[str, Any]:
        """``fields`` (names of this record) as a payload config's entries."""
        return {cls.KEYS[k]: v for k, v in fields.items()}
