"""One module per federated method; ``build_method`` maps ``method.name`` to its class."""

from __future__ import annotations

from fedslice.config import ExperimentConfig
from fedslice.methods.base import Method, Role
from fedslice.methods.fedavg import FedAvg
from fedslice.methods.fedpetuning import FedPETuning
from fedslice.methods.fedot import FedOT
from fedslice.methods.fedpft import FedPFT
from fedslice.methods.heads import Heads
from fedslice.methods.raffm import RaFFM
from fedslice.models.loading import LoadedModel
from fedslice.tasks import Task

METHODS: dict[str, type[Method]] = {m.name: m for m in (FedAvg, FedPETuning, RaFFM, Heads, FedPFT, FedOT)}


def build_method(cfg: ExperimentConfig, loaded: LoadedModel, task: Task,
                 role: Role = "both") -> Method:
    return METHODS[cfg.method.name](cfg, loaded, task, role)


__all__ = ["METHODS", "Method", "Role", "build_method"]
