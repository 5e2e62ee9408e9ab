"""The ``[privacy]`` section: secure aggregation.
"""

from __future__ import annotations

from pydantic import Field

from fedslice.config.base import Section


class PrivacyConfig(Section):
    """Secure aggregation (SecAgg, Bell et al. 2020, on Flower's own primitives): the server
    learns only the sum of the round's updates, never one client's (docs/security.md)."""

    secure_aggregation: bool = Field(False, description="Clients send their weighted update and "
                                     "weights masked (pairwise masks, Shamir shares); the server "
                                     "unmasks only their sum. Rules that need individual updates "
                                     "are refused.")
    secagg_threshold: int | None = Field(None, ge=2, description="Shamir threshold t: a round "
                                         "needs t clients' shares to unmask; dropouts after "
                                         "masking are recovered while t clients remain, below it "
                                         "the round is skipped (default: a majority of "
                                         "federation.clients_per_round, at least 2).")
    secagg_clip_range: float = Field(1.0, gt=0, description="c: every coordinate of a client's "
                                     "update (its change, times its weight over the round's "
                                     "largest possible weight) is clipped to [-c, c] (clipped "
                                     "coordinates are counted, the count summed under the mask) "
                                     "and quantized to L levels, the largest power of two with "
                                     "n L < 2^32 for a round of n clients (2^29 for 4, 2^21 for "
                                     "1024): error at most 2c / L per client and coordinate.")

    def threshold(self, clients_per_round: int) -> int:
        """t for a round of ``clients_per_round`` clients."""
        return self.secagg_threshold or max(2, clients_per_round // 2 + 1)
