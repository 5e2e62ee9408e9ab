"""``fedavg``: full fine-tuning of every parameter, example-weighted FedAvg (McMahan et al. 2017)."""

from typing import Literal

from fedslice.config import MethodOptions
from fedslice.methods.base import Method
from fedslice.registry import register_method


class FedAvgMethod(MethodOptions):
    """Full fine-tuning of every parameter, FedAvg aggregation (McMahan et al.)."""

    name: Literal["fedavg"] = "fedavg"


class FedAvg(Method):
    """The base method unchanged: every parameter trains, FedAvg with server lr eta (Eq. 5)."""

    name = "fedavg"
    adapters = ("none",)
    default_adapter = "none"


register_method(name="fedavg", options_cls=FedAvgMethod, method_cls=FedAvg)
