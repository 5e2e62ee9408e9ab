"""``fedavg``: full fine-tuning of every parameter, example-weighted FedAvg (McMahan et al. 2017)."""

from fedslice.methods.base import Method


class FedAvg(Method):
    """The base method unchanged: every parameter trains, FedAvg with server lr eta (Eq. 5)."""

    name = "fedavg"
