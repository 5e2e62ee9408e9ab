"""Methods as stages that compose: ``method.name = "raffm+heads"``.

A method is one of three kinds of stage (:data:`fedslice.registry.STAGES`), which compose in
this order:

1. the **model** clients start from: the full model (``fedpetuning``; ``fedavg`` trains all of
   it), FedPFT's proxy, FedOT's emulator;
2. a per-client **sub-model** of it: RaFFM's salience-ordered width (and depth) slice, chosen
   by each client's budget;
3. a per-client choice of **heads** inside that: the heads paper's importance, sparsity, prune
   mode, Eq. 8 weighting (and Eq. 9 selection, ``federation.selection``).

The adapter, its rank and the LoRA aggregation rule (``[peft]``, ``[lora]``) and the aggregation
rules (``[aggregation]``, DP) are plug-ins of their own and apply to every composition.

A composition is spelled as one string, its parts joined by ``+`` (``"raffm+heads"``; any order,
``heads+raffm`` means the same): one scalar keeps ``--set method.name=raffm+heads``, run names,
``compare`` labels and the report's title working unchanged, and the order of the stages is not
the user's to get wrong. The six methods are its presets: ``fedpetuning`` is the full model
alone, ``heads`` the head stage over it (``fedpetuning+heads`` is another spelling of it),
``raffm`` the sub-model stage over it, ``fedpft`` and ``fedot`` the other models alone.

A composition is an explicit list of its parts' classes, bottom first
(:class:`~fedslice.methods.stage.Composition`): the bottom part's method class, then the stage
class (``stage_cls``) of each part above it: ``raffm+heads`` is ``[RaFFM, HeadStage]`` (its
options: both parts' options in one table). A stage holds the one below it, asks it through the
hooks (``client_model``, ``client_spec``; the contract: :mod:`fedslice.methods.contract`) and
wraps its strategy (:class:`~fedslice.fl.strategy.Wrapper`), so no stage names another. Pairs that cannot work are
refused here, with the reason, when the config loads (:func:`fedslice.registry.method_name`).
"""

from __future__ import annotations

from typing import Literal

from pydantic import create_model

from fedslice.methods.stage import Composition
from fedslice.registry import ALIASES, METHODS, MethodEntry, STAGES, refuse_composition, register_method


def compose(*names: str) -> MethodEntry:
    """Register the composition of ``names`` (in stage order) and return its entry: its options
    class inherits every part's options (a field two parts both declare must be the same field),
    its method class is the bottom part's class with the parts' stages over it, in order."""
    entries = sorted((METHODS.get(n) for n in names), key=lambda e: STAGES.index(e.stage))
    name = "+".join(e.name for e in entries)
    bottom, above = entries[0], entries[1:]
    for e in above:
        if e.stage_cls is None:
            raise ValueError(f"{name}: {e.name} has no stage class to put over {bottom.name}")
    for i, a in enumerate(entries):
        for b in entries[i + 1:]:
            same = set(a.options_cls.model_fields) & set(b.options_cls.model_fields) - {"name"}
            clash = [k for k in same if a.options_cls.model_fields[k] != b.options_cls.model_fields[k]]
            if clash:
                raise ValueError(f"{name}: {a.name} and {b.name} both have options {clash}")
    title = "".join(e.options_cls.__name__.removesuffix("Method") for e in entries)
    options = create_model(f"{title}Method", __base__=tuple(e.options_cls for e in reversed(entries)),
                           name=(Literal[name], name))  # type: ignore[call-overload]
    options.__doc__ = f"The options of {name}: those of " + ", ".join(e.name for e in entries) + "."
    method = Composition(name, bottom.method_cls, tuple(e.stage_cls for e in above))
    exports = [e.elastic_export for e in entries if e.elastic_export is not None]
    return register_method(name=name, options_cls=options, method_cls=method, stage=entries[-1].stage,
                           parts=tuple(e.name for e in entries),
                           elastic_export=exports[0] if exports else None)


# -- what composes, and what does not (and why) -----------------------------------------------
#: the full model is the bottom every other stage starts from when none is named
ALIASES["fedpetuning+heads"] = "heads"
ALIASES["fedpetuning+raffm"] = "raffm"

_FEDAVG = "fedavg is fedpetuning with peft.method = 'none': name the other method and set peft.method"
for _other in ("raffm", "heads", "fedpft", "fedot", "fedpetuning"):
    refuse_composition("fedavg", _other, _FEDAVG)
for _model in ("fedpft", "fedot"):
    refuse_composition("fedpetuning", _model, "both are the model clients start from (the full "
                       "model, or the server's smaller copy of it): name one")
refuse_composition("fedpft", "fedot", "both are the model clients start from (a proxy with fewer "
                   "FFN neurons, an emulator with fewer layers): name one")
refuse_composition("fedpft", "raffm", "RaFFM slices the salience-ordered full model per client "
                   "and re-orders its neurons; FedPFT's proxy has already dropped FFN neurons by "
                   "saliency and re-aligns the kept ones by neuron KD on the server every round, "
                   "which RaFFM's slices of the proxy would not follow")
refuse_composition("fedot", "raffm", "FedOT's clients train only the adapter layers at both ends "
                   "around a frozen, distilled emulator; a RaFFM width slice would cut the "
                   "emulator the server distilled to stand in for the whole middle")
refuse_composition("fedpft", "heads", "FedPFT's clients report the proxy's APoZ statistics from "
                   "the forward passes of their own training step, which the head stage's "
                   "pruned model replaces (not built: the proxy would need a head-aware APoZ)")
refuse_composition("fedot", "heads", "FedOT's clients train only the adapter layers at both ends "
                   "and the emulator's heads are frozen: heads pruned in the emulator save no "
                   "trained tensor, and those of the adapter layers are the full model's")

compose("raffm", "heads")
