"""``fedpft``: Federated Proxy Fine-Tuning (Peng et al. 2024).

1. **Sub-FM construction** (Sec. 3.4). Each FFN neuron's saliency is the L2 norm of its ``W1`` row
   and ``W2`` column (Eq. 8: :func:`fedslice.slicing.salience.salience` with ``norm='l2'``), or
   with ``method.salience = "activation"`` (not in the paper) its mean |input to ``W2``| over
   ``calibration_examples`` passages of the distillation corpus times its ``W2`` column's L1 norm
   (the server's data only; on SmolLM2 the weight norms rank the units the model needs last). In the
   compressed layers (all but ``method.whole_layers``, default the first and the last, counted
   in each stack: an encoder-decoder keeps the first/last encoder and decoder layers whole) the top
   ``keep_ratio`` of the neurons are kept, in their original order; attention is untouched. The
   proxy is :func:`~fedslice.slicing.surgery.extract_model` of the full model for that
   :class:`~fedslice.slicing.spec.SliceSpec`: it shares the embeddings, attention (and its LoRA),
   LayerNorms, whole layers and classifier with the full model, and owns copies of the compressed
   FFN tensors (``W1``, ``b1``, ``W2`` and, unshared so it can be distilled, ``b2``).
2. **Layer-level KD before FL** (Eq. 13): on the server's unlabeled corpus, the compressed FFNs are
   trained so that every layer's output matches the full model's, plus ``mu * ||W1W2 - W1'W2'||^2``
   with a real gradient (:mod:`fedslice.distill.losses`). Every layer = every block of every stack
   (:func:`~fedslice.distill.loop.block_units`): an encoder-decoder's decoder reads the corpus
   teacher-forced, each stack's padding masked. Cached on disk; the loss curve goes to
   ``fedpft_distill.json``/``.png`` in the run folder.
3. **FL**: clients receive only the proxy's tensors (LoRA + classifier every round; the compressed
   FFN tensors at first participation, and the re-distilled neurons when a re-alignment happened
   since their last participation), train LoRA on attention + the classifier, FedAvg.
4. **Neuron-level KD during FL** (Sec. 3.5): in every ``align_every``-th round, clients also report
   each compressed neuron's APoZ on their local data before training (GELU-aware, see
   :mod:`fedslice.distill.apoz`); after aggregation the server pools them and re-distils only the
   ``align_proportion`` of each layer's neurons with the highest APoZ, the others fixed (gradient
   masks), teacher = the full model with the current LoRA. Not after the last round (the proxy
   would not be used again).
5. **Plug-in**: LoRA + classifier are the very tensors of the full model (shared modules), so
   evaluation runs the full model: ``test_accuracy`` is the full FM's; ``proxy_*_accuracy`` the
   proxy's.
6. **Head re-fit** (``method.head_refit_steps`` > 0; off by default, not in the paper): after the
   last round the server distils the proxy's predictions (soft labels, KL) on the distillation
   corpus into the plugged-in full model's classifier, everything else frozen
   (:mod:`~fedslice.methods.fedpft.refit`): no labels and no client data are read. The global
   state (what is evaluated and saved) holds the re-fitted head; ``proxy_*_accuracy`` is the
   proxy's with the head FL trained. Its cost is ``head_refit_flops`` / ``_time_s`` in the
   summary (the proxy's pass over the corpus for the soft labels included).

A client never reads the full model (FedPFT's premise): the first payload of a client carries the
whole proxy: its compressed FFNs in ``arrays`` and its other frozen tensors (embeddings,
attention, LayerNorms, whole layers, buffers) in ``Payload.model``
(:class:`~fedslice.methods.submodel.ClientBase`), all counted in ``bytes_down``. In the client
role (a Flower ClientApp) the model is built from the HF config on the meta device
(:func:`~fedslice.models.loading.build_from_config`); the proxy gets the compressed layers' kept
width from ``keep_ratio`` (which neurons were kept matters to the server only), real storage only
for the proxy's own tensors, and its values from that payload.

Ablations (``method.kd``): ``none`` (FedPFT_N), ``before`` (FedPFT_B), ``during`` (FedPFT_D).

Any architecture of the table: the proxy is a :class:`~fedslice.slicing.spec.ModelSlice` (one
spec per stack); a gated FFN's neuron (SwiGLU, gated-GELU) is one gate·up unit (gate row, up
row, down column; saliency sums the three, the gate is sliced, distilled and re-aligned with
``ffn_in``). Compressed layers are numbered globally over the stacks (encoder layers first), the
numbering of APoZ reports, neuron updates and ``compressed_layers``.

The global state holds LoRA + classifier (full-model names, also the proxy's) and the proxy's
compressed FFN tensors (proxy names; same keys as the full model's FFN but of the kept width).
"""

from fedslice.methods.fedpft.options import FedPFTMethod
from fedslice.methods.fedpft.proxy import (build_proxy, compressed_layers, ffn_weights, proxy_spec,
                                           top_neurons)
from fedslice.methods.fedpft.strategy import FedPFTStrategy
from fedslice.methods.fedpft.method import FedPFT
from fedslice.registry import register_method

register_method(name="fedpft", options_cls=FedPFTMethod, method_cls=FedPFT)

__all__ = ["build_proxy", "compressed_layers", "FedPFT", "FedPFTMethod", "FedPFTStrategy",
           "ffn_weights", "proxy_spec", "top_neurons"]
