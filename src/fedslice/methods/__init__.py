"""One module per federated method; each registers itself (:func:`fedslice.registry.register_method`)
when imported here, and :func:`build_method` builds the one ``method.name`` names."""

from __future__ import annotations

from collections.abc import Mapping

from fedslice.config import ExperimentConfig
# each module registers its method on import; registration order is the order of the docs
from fedslice.methods import fedavg, fedpetuning  # noqa: F401
from fedslice.methods import raffm, heads  # noqa: F401
from fedslice.methods import fedpft, fedot  # noqa: F401
# the compositions of the methods above (raffm+heads) and the pairs that do not compose
from fedslice.methods import compose  # noqa: F401
from fedslice.methods.base import Method, Role
from fedslice.models.loading import LoadedModel
from fedslice.registry import METHODS
from fedslice.tasks import Task


def method_class(name: str) -> type[Method]:
    """The registered method class of ``name`` (a ConfigError listing the known ones)."""
    return METHODS.get(name).method_cls


def build_method(cfg: ExperimentConfig, loaded: LoadedModel, task: Task,
                 role: Role = "both", client_sizes: Mapping[int, int] | None = None,
                 token_lengths=None, head_lengths=None) -> Method:
    return method_class(cfg.method.name)(cfg, loaded, task, role, client_sizes=client_sizes,
                                         token_lengths=token_lengths, head_lengths=head_lengths)


__all__ = ["METHODS", "Method", "Role", "build_method", "method_class"]
