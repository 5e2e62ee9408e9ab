"""Salience, permutations, slice specs, extraction and scatter-aggregation shared by every method."""

from fedslice.slicing.aggregate import aggregate_deltas, client_delta, fedavg, finite_update

__all__ = ["aggregate_deltas", "client_delta", "fedavg", "finite_update"]
