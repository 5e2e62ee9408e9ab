"""``fedpetuning``: LoRA on the full model; FedAvg of the LoRA weights and the classifier
(FedPETuning, Zhang et al. 2023; baseline B1 of the heads paper).

With ``[budgets]`` and ``lora.ranks``, each client trains LoRA at the rank its budget affords:
the budget planner (:mod:`fedslice.methods.planner`) measures a training step of the model at
every rank and gives a client the largest rank whose predicted cost fits its budget (``method.tiers``
is an older spelling of the same table); the server pads and averages the factors
(:class:`fedslice.fl.rules.LoraRanks`).

With ``lora.aggregation = "fedsa"`` each client keeps its own ``B`` between participations (here
in the simulation's process, in a Flower node's ``Context.state`` on Flower) and sends only ``A``
(and the classifier); after training the summary reports the global model's metric and the mean
of the clients' personalised ones (docs/lora.md).
"""

from fedslice.methods.fedpetuning.options import FedPETuningMethod
from fedslice.methods.fedpetuning.method import FedPETuning
from fedslice.registry import register_method

register_method(name="fedpetuning", options_cls=FedPETuningMethod, method_cls=FedPETuning)

__all__ = ["FedPETuning", "FedPETuningMethod"]
