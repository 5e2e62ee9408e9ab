"""What a run is built from, the one way every entry point builds it: ``fedslice run`` and
``--resume``, Flower's ServerApp and ClientApp, and ``fedslice validate``'s plan.

:func:`load_inputs` reads the model's config (the architecture, checked before any weight is
read), makes the task, reads and encodes the data and partitions it; the model comes with the
``weights`` asked for. :func:`setup` adds the method (model, strategy) on top.

``weights``:

- ``"pretrained"``: the model's weight files are read (the default);
- ``"shapes"``: built from its config on PyTorch's ``meta`` device, no weight file read (a
  fedpft/fedot Flower client, whose tensors come from the server; ``validate``'s sizes);
- ``"random"``: built from its config with random values (``validate`` where sizes need values).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Literal

import torch

from fedslice import heap
from fedslice.config import ExperimentConfig
from fedslice.errors import ConfigError
from fedslice.data import data_sources, partition_indices, partition_report
from fedslice.data.partition import natural_partitions, size_spread
from fedslice.data.federated import FederatedData
from fedslice.methods import Method, Role, build_method, method_class
from fedslice.models.arch import ArchSpec, arch_for
from fedslice.models.loading import LoadedModel, build_from_config, load_model
from fedslice.models.loading import load_config as load_model_config
from fedslice.models.quantize import check_architecture, quantize_base
from fedslice.tasks import Task, make_task

log = logging.getLogger(__name__)

Weights = Literal["pretrained", "shapes", "random"]


@dataclass
class Inputs:
    """The task, the raw splits (their sources), the model and the federated data of a run."""

    task: Task
    raw: dict[str, Any]
    loaded: LoadedModel
    data: FederatedData

    def method(self, cfg: ExperimentConfig, role: Role = "both",
               loaded: LoadedModel | None = None) -> Method:
        """The method of ``cfg`` over this model (or ``loaded``), sized for these clients."""
        sizes = {c: len(p) for c, p in enumerate(self.data.partitions)}
        return build_method(cfg, loaded or self.loaded, self.task, role, client_sizes=sizes,
                            token_lengths=self.data.train.lengths,
                            head_lengths=getattr(self.data.train, "head_lengths", None))


def configure_process(cfg: ExperimentConfig) -> None:
    """The process-wide settings of a run: torch's threads, the heap policy."""
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    if cfg.compute.release_memory:
        heap.release_freed_memory(heap.RELEASE_THRESHOLD)


def default_weights(cfg: ExperimentConfig, role: Role) -> Weights:
    """A client of a method whose clients get their model from the server (fedpft, fedot) reads no
    weight file; everyone else reads the pretrained weights."""
    return "shapes" if role == "client" and method_class(cfg.method.name).client_model_from_server \
        else "pretrained"


def load_inputs(cfg: ExperimentConfig, role: Role = "both", weights: Weights | None = None) -> Inputs:
    """Check the method against the model's architecture and the task (config files only), then
    read the data and the model with ``weights`` (default: :func:`default_weights`), encode and
    partition the data."""
    _, task = check_method(cfg)
    raw = task.load_raw()
    k = task.num_labels(raw)
    weights = weights or default_weights(cfg, role)
    if weights == "pretrained":
        loaded = load_model(cfg.model, k, cfg.seed, head=task.head)
    else:
        loaded = build_from_config(cfg.model, k, head=task.head,
                                   device="meta" if weights == "shapes" else "cpu", seed=cfg.seed)
    if weights != "shapes" and not method_class(cfg.method.name).quantizes_slices:
        # once per process, before the method applies its adapter (peft wraps the quantized
        # layers) and before client workers fork (they share it): never per client or round
        # (a method that quantizes each client's slice keeps the fp32 model it slices)
        quantize_base(loaded.model, cfg.model.quantize, loaded.arch)
    data = prepare_data(cfg, task, task.encode(raw, loaded))
    data.sources = data_sources(raw)  # what checkpoints record: a resume checks its data
    return Inputs(task, raw, loaded, data)


def check_method(cfg: ExperimentConfig) -> tuple[ArchSpec, Task]:
    """The model's architecture (from its config only: no weights) and the task, with the method
    checked against both: what ``compare`` asks of every config before any run trains."""
    arch = arch_for(load_model_config(cfg.model)[0])
    task = make_task(cfg, arch)
    method_class(cfg.method.name).check_supported(arch, task)
    try:
        check_architecture(cfg.model.quantize, arch)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    return arch, task


def setup(cfg: ExperimentConfig, role: Role = "both",
          weights: Weights | None = None) -> tuple[Method, FederatedData]:
    """Build the method (model, strategy) and the federated data of an experiment.

    ``role="client"``: as a Flower ClientApp needs it, without the server-only work;
    ``role="server"``: Flower's ServerApp (clients train elsewhere). ``weights``: see the module.
    """
    configure_process(cfg)
    inputs = load_inputs(cfg, role, weights)
    return inputs.method(cfg, role), inputs.data


def prepare_data(cfg: ExperimentConfig, task: Task, splits: dict) -> FederatedData:
    """Subsample the task's encoded splits if configured, partition the train split."""
    d, seed = cfg.data, cfg.seed
    train = task.limit(splits["train"], d.max_train_examples, seed)
    if d.partition == "natural":
        parts, report = natural_split(cfg, train)
    else:
        parts = partition_indices(train.labels.tolist(), num_partitions=cfg.federation.num_clients,
                                  scheme=d.partition, seed=seed, alpha=d.alpha,
                                  shards_per_partition=d.shards_per_client,
                                  min_partition_size=d.min_partition_size)
        report = partition_report(parts, train.labels.tolist())
    return FederatedData(train=train, dev=task.limit(splits["dev"], d.max_dev_examples, seed),
                         test=task.limit(splits["test"], d.max_test_examples, seed),
                         partitions=parts, report=report, label_names=task.label_names)


def natural_split(cfg: ExperimentConfig, train) -> tuple[list, dict[str, Any]]:
    """``data.partition = 'natural'``: one client per distinct ``data.client_column`` value of
    the train split (:func:`~fedslice.data.partition.natural_partitions`), and
    ``federation.num_clients`` set to their number: a ``num_clients`` given in the config must
    equal it (a ConfigError naming both); ``clients_per_round`` left at its default is capped
    to it."""
    values = getattr(train, "clients", None)
    if values is None:
        raise ConfigError(f"data.partition = 'natural' is implemented for task.kind = 'chat' and "
                          f"'generation'; a {cfg.task.kind} task's data carries no "
                          "data.client_column: use 'iid', 'dirichlet' or 'shards'")
    parts, ids, left = natural_partitions(values, cfg.data.min_partition_size)
    report = partition_report(parts, train.labels.tolist())
    report.update(scheme="natural", client_column=cfg.data.client_column,
                  natural_ids=[str(v) for v in ids], size_spread=size_spread(report["partition_sizes"]),
                  left_out_clients=left["clients"], left_out_rows=left["rows"])
    fed, n = cfg.federation, len(parts)
    if "num_clients" in fed.model_fields_set and fed.num_clients != n:
        raise ConfigError(f"federation.num_clients = {fed.num_clients}, but data.partition = "
                          f"'natural' finds {n} clients (distinct values of "
                          f"{cfg.data.client_column!r} with at least data.min_partition_size = "
                          f"{cfg.data.min_partition_size} rows): remove federation.num_clients "
                          f"or set it to {n}")
    if "clients_per_round" in fed.model_fields_set and fed.clients_per_round > n:
        raise ConfigError(f"federation.clients_per_round = {fed.clients_per_round} is more than "
                          f"the {n} natural clients of {cfg.data.client_column!r}")
    per_round = fed.clients_per_round if "clients_per_round" in fed.model_fields_set else \
        min(fed.clients_per_round, n)
    if (fed.num_clients, fed.clients_per_round) != (n, per_round):
        # in this order, each assignment valid on its own (clients_per_round <= num_clients)
        fed.min_replies = min(fed.min_replies, per_round)
        fed.clients_per_round = per_round
        fed.num_clients = n
        log.info("data.partition = 'natural': %d clients (%s), federation.num_clients = %d, "
                 "clients_per_round = %d", n, cfg.data.client_column, n, per_round)
    return parts, report
