"""The ``fedpetuning`` method: model preparation, a client's local training and the server's round
end. See :mod:`fedslice.methods.fedpetuning`.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np

from fedslice.config import ExperimentConfig
from fedslice.fl.strategy import State, Strategy
from fedslice.methods.base import Method
from fedslice.methods.plan_strategy import PlannedStrategy
from fedslice.methods.fedpetuning.report import mean_of
from fedslice.peft.tuners.lora.aggregate import at_rank
from fedslice.registry import ADAPTERS

log = logging.getLogger(__name__)


class FedPETuning(Method):
    """The adapter (``peft.method``, LoRA by default) on the full model, everything else frozen:
    any registered adapter with tensors of its own (not ``none``: that is fedavg)."""

    name = "fedpetuning"
    #: every client trains the same LoRA tensors of the one shared backbone
    batched_clients = True
    lora_aggregations = ("fedit", "ffa", "fedex", "flora", "svd", "fedsa")
    lora_ranks_per_client = True
    plans_budgets = True

    @classmethod
    def check_config(cls, cfg: ExperimentConfig) -> None:
        super().check_config(cfg)
        name = cls.adapter_name(cfg)
        if ADAPTERS.get(name).adapter_cls.trains_base:
            raise ValueError(f"peft.method={name!r}: method {cfg.method.name} fine-tunes an "
                             "adapter's parameters, not the model's own (use method fedavg)")
        if not cls.lora_ranks_per_client:
            return
        # method.tiers, or the [budgets] table they are read as (config.experiment)
        tiers = getattr(cfg.method, "tiers", None) or \
            (cfg.budgets is not None and cfg.budgets.source == "method.tiers")
        ranks = cfg.lora.ranks if name == "lora" else None
        if tiers and not ranks:
            raise ValueError(f"method.tiers: method {cfg.method.name} uses device tiers to choose "
                             "each client's LoRA rank: set lora.ranks (e.g. [4, 8, 16])")
        if ranks and not tiers and cfg.budgets is None:
            where = "method.tiers (or [budgets])" if hasattr(cfg.method, "tiers") else "[budgets]"
            raise ValueError(f"lora.ranks={ranks}: method {cfg.method.name} takes each client's rank "
                             f"from the budgets of {where}: set one of them")

    # -- heterogeneous ranks -------------------------------------------------------------------
    def make_strategy(self) -> Strategy:
        """FedAvg; under ``[budgets]`` (or the ``method.tiers`` that spell it) every client's
        plan (its LoRA rank, ...) travels in its payload (a client reads its own)."""
        if self.cfg.budgets is None or self.role == "client":
            return Strategy(self.cfg.federation, self.client_sizes)
        return PlannedStrategy(self.cfg.federation, self.make_plans(), self.client_sizes)

    # -- after training --------------------------------------------------------------------
    def final_metrics(self, state: State, data, records: list[dict[str, Any]],
                      batch_size: int) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.personal:
            out.update(self.personalised(state, data, batch_size))
        return out

    def personalised(self, state: State, data, batch_size: int) -> dict[str, Any]:
        """The test metric of the personalised models (the global state with a client's own
        tensors) of ``lora.personal_eval_clients`` clients (seeded sample of those that
        trained), their mean, and the global model's on the same footing. For classification,
        also each model's accuracy weighted by the client's label distribution (its per-class
        test accuracy averaged with its training labels' shares: how it does on its own kind of
        data)."""
        n = self.cfg.lora.personal_eval_clients
        clients = sorted(self.personal)
        if n < len(clients):
            rng = np.random.default_rng([self.cfg.seed, 0x5A])
            clients = sorted(rng.choice(clients, size=n, replace=False).tolist())
        if not clients:
            return {}
        metric, gen = self.task.primary_metric, self.cfg.evaluation.dev_generations
        labels = data.train.labels.numpy() if getattr(data.train, "labels", None) is not None else None
        glob = self.evaluate(state, data.test, batch_size, gen)
        rows = []
        for c in clients:  # the shared state and the client's own tensors, at its rank
            r = self.strategy.client_rank(c)
            self.load_model(self.model, at_rank(state, r), r)
            self.load_state(dict(self.model.named_parameters()), self.personal[c])
            with self.compute.autocast():
                ev = self.task.evaluate(self.model, data.test, batch_size, gen)
            row = {"client": c, metric: ev.get(metric)}
            share = _label_shares(labels, data.partitions[c], len(ev.get("per_class_accuracy") or []))
            if share is not None:
                row["local_accuracy"] = float(np.dot(share, ev["per_class_accuracy"]))
                row["global_local_accuracy"] = float(np.dot(share, glob["per_class_accuracy"]))
            rows.append(row)
        self.top.eval_model(state)  # the shared model holds the global state again
        out = {"personal_clients": rows, f"personal_test_{metric}_mean": mean_of(r[metric] for r in rows),
               f"global_test_{metric}": glob.get(metric)}
        if rows and "local_accuracy" in rows[0]:
            out["personal_local_accuracy_mean"] = mean_of(r["local_accuracy"] for r in rows)
            out["global_local_accuracy_mean"] = mean_of(r["global_local_accuracy"] for r in rows)
        return out


def _label_shares(labels, part, num_classes: int):
    if labels is None or num_classes == 0 or len(part) == 0:
        return None
    counts = np.bincount(labels[np.asarray(part)], minlength=num_classes)[:num_classes]
    return counts / counts.sum()


