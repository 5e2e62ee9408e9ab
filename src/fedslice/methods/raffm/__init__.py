"""``raffm``: resource-aware sub-models of a salience-ordered foundation model (Yu et al. 2023).

1. Salience (L1/L2) of every head and FFN neuron; the global model is permuted so the most salient
   come first (function-preserving, re-applied every R rounds, tracked for un-permuting on export).
2. Each client's budget (device tier: FLOPs fraction or memory limit) is mapped by the planner to a
   leading-slice :class:`SliceSpec`, checked by measuring the real sub-model. A client whose budget
   is below the smallest sub-model sits out (recorded in the round's ``excluded``).
3. The client trains the leading slice (full fine-tuning or LoRA on the sub-model).
4. Slice aggregation: every element is the example-weighted mean over the clients whose slice
   holds it; an element nobody held keeps its value (exactly FedAvg when all hold the full model).
   ``size_weight = p`` multiplies a client's weight by f^p, f its sub-model's FLOPs fraction (the
   per-configuration step of RaFFM Eq. 7), so shared leading elements lean toward larger models.
   Unlike the public code, we do not divide by all clients, and heads are sliced whole.
5. Elastic inference: the global model is evaluated at several sizes after training, and
   ``fedslice export --size`` writes one of them as a smaller checkpoint (:mod:`.export`, the
   export hook this package registers).

The server state holds the trainable tensors plus the frozen q/k/v/o/ffn tensors (with LoRA), so
that permutations and slices are pure functions over it; the shared model is a scratch buffer.
"""

from fedslice.methods.raffm.options import RaFFMMethod
from fedslice.methods.raffm.strategy import RaFFMStrategy
from fedslice.methods.raffm.report import plot_elastic
from fedslice.methods.raffm.method import ELASTIC, RaFFM
from fedslice.methods.raffm.export import ElasticSizes
from fedslice.registry import register_method

register_method(name="raffm", options_cls=RaFFMMethod, method_cls=RaFFM, stage="submodel",
                elastic_export=ElasticSizes())

__all__ = ["ELASTIC", "plot_elastic", "RaFFM", "RaFFMMethod", "RaFFMStrategy"]
