"""``heads``: FedPETuning with per-client attention-head pruning ("Assortment of Attention Heads").

Runs on every architecture of the table. A head is a query head of one attention family (encoder
self, decoder self, decoder cross) of one layer: the keep-mask is (R, H) with one row per
(family, layer) (:func:`fedslice.slicing.heads.mask_rows`). Under grouped-query attention query
heads are scored and pruned one by one and a key/value head stays while any query head of its
group does; GPT-2's fused q|k|v is sliced in each of its sections.

Each round, a selected client (Algorithm 1 of the paper, with the importance computed *before*
local training, since it decides what the client trains):

1. loads the global LoRA state into the full model and scores every head on its local data
   (Eq. 6: mean max attention probability, :func:`fedslice.slicing.heads.head_importance`);
2. keeps its top ``1 - sparsity`` heads (Eq. 7; or random ones, or all) and trains
   - ``prune='parameters'`` (default, the paper's §3.1): the full model, in which the pruned
     heads' trainable tensors are frozen (:func:`fedslice.slicing.partial.partial_model`): they
     still run forward; their weight gradients and optimizer state are saved;
   - ``prune='forward'``: a really smaller model: q/k/v rows and o columns of the pruned heads
     are sliced away (:func:`fedslice.slicing.surgery.extract_model`), so forward and backward
     FLOPs fall; a layer left without heads outputs o's bias only. At 90% sparsity every
     client trains a different network whose updates FedAvg cannot reconcile (README, "Head
     pruning": 0.64 vs 0.82 test accuracy on a 4-class topic task);
3. uploads the LoRA tensors of its sub-model only (q/k/v ``lora_B`` rows and o ``lora_A``
   columns of the kept heads, the head-free LoRA tensors of layers that kept a head, the
   classifier), its keep-mask and its importance vector α_c (counted in the upload bytes).

The server (:class:`HeadsStrategy`, pure functions over state dicts) applies Eq. 8 per head and
Eq. 5 to the rest (:func:`fedslice.slicing.head_aggregate.aggregate_heads`). Client selection is the
engine's ``federation.selection`` ('loss_gap' = Eq. 9). Baselines of the paper's Table 1:
B1 = ``pruning='none', aggregation='fedavg'`` (FedPETuning), B2 = ``pruning='random',
aggregation='fedavg'``.
"""

from fedslice.methods.heads.options import HeadsMethod
from fedslice.methods.heads.strategy import ALPHA, KEPT, HeadsStrategy
from fedslice.methods.heads.report import paper_ops, plot_head_importance, table6_rows
from fedslice.methods.heads.method import Heads, HeadStage
from fedslice.registry import register_method

register_method(name="heads", options_cls=HeadsMethod, method_cls=Heads, stage="heads",
                stage_cls=HeadStage)

__all__ = ["ALPHA", "Heads", "HeadStage", "HeadsMethod", "HeadsStrategy", "KEPT", "paper_ops",
           "plot_head_importance", "table6_rows"]
