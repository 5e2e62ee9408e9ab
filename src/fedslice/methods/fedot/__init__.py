"""``fedot``: Offsite-Tuning (Xiao et al. 2023) run with FedAvg, the FedOT baseline of FedPFT.

The bottom ``bottom_layers`` and top ``top_layers`` transformer layers are the trainable
*adapter*; the ``m`` middle layers are replaced by an *emulator* of ``k`` of them chosen by
uniform layer drop: middle position ``round(i * (m - 1) / (k - 1))`` for ``i = 0..k-1``, so the
first and the last middle layer are always kept. ``round`` is Python's (half to even), as in the
public Offsite-Tuning code (``uniform_choose_layers``): 8 middle layers -> 3 keeps positions
0, 4, 7; 4 -> 3 keeps 0, 2, 3. With ``k = 1`` the middle position ``round((m - 1) / 2)`` is kept.

Defaults scale the paper's 12-layer setting (adapter 2 + 2, middle 8 -> 3) to the model depth:
``max(1, round(L / 6))`` adapter layers at each end and ``max(1, round(3 m / 8))`` emulator layers
(MiniLM, 6 layers: adapter 1 + 1, emulator 2 of the 4 middle layers).

Every stack gets this layout (an encoder-decoder: adapter and emulator in the encoder and in the
decoder, defaults scaled to each stack's depth; ``bottom``/``emulator``/``top`` are the first
stack's, ``layouts`` all of them). Not decoder-only: a client would then hold the whole encoder,
the full-size part Offsite-Tuning keeps from it. The emulator distillation matches each stack's
last emulator output to its last middle layer's (mean over stacks; an encoder-decoder's decoder
reads the corpus teacher-forced).

The client model is :func:`~fedslice.slicing.surgery.extract_model` of the full model for the depth
:class:`~fedslice.slicing.spec.SliceSpec` of adapter + emulator layers: it shares the adapter
(and its LoRA), embeddings and classifier with the full model. With ``distill_emulator`` the
emulator layers are copies, distilled before FL so that their output matches the middle layers'
(hidden-state MSE normalised by the teacher's mean square; both fed the same adapter output).
Clients train the adapter (LoRA on it, or fully) and the classifier with the emulator frozen;
the adapter plugs into the full model, which is what ``test_accuracy`` evaluates.

The global state uses the full model's names; each client receives and returns its sub-model's
names (:func:`~fedslice.slicing.state.extract_state` / :func:`~fedslice.slicing.state.scatter`).

A client never reads the full model (Offsite-Tuning's premise): its first payload carries the
sub-model's frozen tensors (embeddings, the adapter's base weights, the emulator, buffers) in
``Payload.model`` (:class:`~fedslice.methods.submodel.ClientBase`; a distilled emulator as
``emulator.<name>`` in ``arrays``), counted in ``bytes_down``. In the client role (a Flower ClientApp) the model
is built from the HF config on the meta device (:func:`~fedslice.models.loading.build_from_config`),
the layout comes from the config, and only the sub-model's tensors get storage.
"""

from fedslice.methods.fedot.options import FedOTMethod
from fedslice.methods.fedot.layout import emulator_indices, fedot_layout
from fedslice.methods.fedot.strategy import SubModelStrategy
from fedslice.methods.fedot.method import FedOT
from fedslice.registry import register_method

register_method(name="fedot", options_cls=FedOTMethod, method_cls=FedOT)

__all__ = ["emulator_indices", "FedOT", "fedot_layout", "FedOTMethod", "SubModelStrategy"]
