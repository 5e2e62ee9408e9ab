"""The adapter interface: what the library asks of a PEFT method (LoRA, none = full fine-tuning;
later IA3, prompt, prefix, P-tuning, DoRA), like HF PEFT's tuners.

An adapter is registered by name (``peft.method``) with its options class, the config section
named after it (:func:`fedslice.registry.register_peft_method`); a method builds one with
:func:`make_adapter` and asks it, never matching tensor names itself:

* **apply** it to a model through the architecture table (:meth:`Adapter.apply`, in every layer or
  some), which also sets which parameters train;
* **name** its tensors: the class attribute ``prefix`` (``"lora_"``): a tensor whose dotted name
  has a segment starting with it is the adapter's (:func:`fedslice.registry.adapter_owning`);
* **map** its tensors' rows/columns to heads and FFN neurons: ``module_tensors`` says, per
  attribute of an adapted module (``lora_A``, ``lora_B``), whether its tensors follow the
  module's input or output features; :meth:`tensor_axes` turns that into the axis of a tensor
  (what :mod:`fedslice.slicing.spec`, :mod:`fedslice.slicing.salience` and
  :mod:`fedslice.slicing.heads` slice, permute, score and weigh per head); :meth:`delta_weight`
  is its update of the wrapped weight (salience of the effective weight);
* **count** its parameters, bytes and analytic training FLOPs (:meth:`cost`);
* for a batched multi-client training pass (``batched_clients``): the adapted modules
  (:meth:`adapted_modules`) and, under each, the per-client tensor names
  (:meth:`client_tensor_names`).

Capabilities are class attributes the library asks: ``trains_base`` (the model's own weights
train: full fine-tuning), ``batched_clients``, ``in_modules`` (its tensors live inside the
modules it wraps, so a sliced sub-model slices them with the module: forward head pruning,
RaFFM's sub-models, FedPFT's proxy), ``head_tied`` (some of its tensors map to attention heads:
head pruning trains and sends only the kept heads' slices). Model-dependent limits (an
architecture, a task head) are checked by :meth:`Adapter.check_supported` before weights load.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.nn as nn

from fedslice.config import AdapterOptions, ExperimentConfig
from fedslice.models.arch import ArchSpec
from fedslice.registry import ADAPTERS
from fedslice.slicing.keys import HeadPositions

Layers = Sequence[int] | Sequence[Sequence[int]] | None

#: What peft's wrapper puts before a module's name.
PEFT_PREFIX = "base_model.model."


def base_name(key: str) -> str:
    """A state key as named in the plain HF model: without peft's wrapper prefix, and a wrapped
    layer's own tensors (``<module>.base_layer.weight``) under the module's name."""
    key = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
    return key.replace(".base_layer.", ".")



@dataclass(frozen=True)
class AdapterCost:
    """What an adapter adds to a model: its parameters and their bytes, and the analytic
    training FLOPs (forward + backward) that :func:`fedslice.measure.analytic_train_flops` does
    not already count (it counts every linear map, including LoRA's ``A`` and ``B``):

    * ``flops_per_token``: its own non-linear operations per real token (IA3's scaling: 3 per
      vector element: 1 forward, 2 backward);
    * ``flops_per_sequence``: per training sequence (prefix tuning's projection, run for every
      row of a batch: 6 per weight per virtual token);
    * ``flops_per_step``: per optimizer step (DoRA's weight norm; P-tuning's prompt encoder,
      which peft runs on one row and repeats over the batch);
    * ``virtual_tokens``: positions prepended to every sequence (prompt tuning, P-tuning): the
      whole model runs on them too;
    * ``prefix_keys``: keys/values prepended to every self-attention (prefix tuning): attention
      reads them at every query.

    ``train_flops_per_token`` is the adapter's whole training cost per token at a sequence
    length it is told (for reports: LoRA 6 per parameter, IA3 3 per element, ...)."""

    params: int
    bytes: int
    train_flops_per_token: float
    flops_per_token: float = 0.0
    flops_per_sequence: float = 0.0
    flops_per_step: float = 0.0
    virtual_tokens: int = 0
    prefix_keys: int = 0

    def extra_flops(self, tokens: float, examples: float, steps: float) -> float:
        """The FLOPs of its own operations over a client's local training."""
        return (self.flops_per_token * tokens + self.flops_per_sequence * examples
                + self.flops_per_step * steps)

    def analytic_kwargs(self, tokens: float, examples: float, steps: float) -> dict[str, float]:
        """Keyword arguments of :func:`fedslice.measure.analytic_train_flops` for its share."""
        return {"virtual_tokens": self.virtual_tokens, "prefix_keys": self.prefix_keys,
                "adapter_flops": self.extra_flops(tokens, examples, steps)}


class Adapter:
    """Base class of an adapter (see the module doc). Subclasses set the class attributes and
    implement :meth:`apply`; the rest has defaults for adapters made of ``nn.Linear``
    sub-modules under the wrapped module (peft's tuner layers)."""

    name: ClassVar[str] = ""
    #: the first characters of the adapter's own attribute names (None: it adds no tensors)
    prefix: ClassVar[str | None] = None
    #: attribute of an adapted module -> the side of the module its tensors follow: "in" (they
    #: index the module's input features), "out" (its output features) or None (neither)
    module_tensors: ClassVar[dict[str, str | None]] = {}
    #: the model's own weights train (full fine-tuning)
    trains_base: ClassVar[bool] = False
    #: clients can be trained together over one frozen backbone, each with its own tensors
    batched_clients: ClassVar[bool] = False
    #: its tensors live inside the modules it wraps (a sliced sub-model slices them too)
    in_modules: ClassVar[bool] = True
    #: some of its tensors map to attention heads (head pruning trains/sends kept heads only)
    head_tied: ClassVar[bool] = True

    def __init__(self, options: AdapterOptions | None, arch: ArchSpec, seed: int = 0):
        """``seed``: the experiment's seed, for tensors every process must draw alike without
        receiving them (FFA-LoRA's frozen A)."""
        self.options, self.arch, self.seed = options, arch, seed

    @property
    def virtual_tokens(self) -> int:
        """Positions it prepends to every input sequence (the whole model runs on them)."""
        return 0

    def replace(self, **changes: Any) -> Adapter:
        """The same adapter with some options changed (e.g. another LoRA rank)."""
        return type(self)(self.options.model_copy(update=changes), self.arch, self.seed)

    # -- apply ---------------------------------------------------------------------------------
    def apply(self, model: nn.Module, layers: Layers = None) -> nn.Module:
        """Wrap ``model`` (in every layer, or only in ``layers``: one list, or one per stack) and
        set which parameters train; returns the model to train (possibly a wrapper)."""
        raise NotImplementedError

    @classmethod
    def check_supported(cls, arch: ArchSpec, task: Any, options: AdapterOptions | None) -> None:
        """A ConfigError naming the adapter and the architecture (or task) when it cannot run on
        this pair; called before weights load. Default: it runs everywhere."""

    @property
    def scale(self) -> float | None:
        """The factor of :meth:`delta_weight` in the effective weight (LoRA: alpha / r)."""
        return None

    def resize(self, model: nn.Module, rank: int | None) -> None:
        """Give the adapter's tensors in ``model`` a client's size (LoRA: its rank; None: the
        global adapter's) before a client's tensors are loaded; the effective scale stays the
        global one. Default: adapters without a size refuse a rank."""
        if rank is not None:
            raise ValueError(f"adapter {self.name!r} has no rank to give a client")

    # -- names ---------------------------------------------------------------------------------
    @classmethod
    def owns(cls, tensor_name: str) -> bool:
        """True for a tensor of this adapter (asked by ``prefix``)."""
        return bool(cls.prefix) and any(s.startswith(cls.prefix) for s in tensor_name.split("."))

    @classmethod
    def modules_carrying(cls, keys: Sequence[str]) -> list[str]:
        """Names (in the plain HF model) of the modules that carry this adapter's tensors among
        ``keys``, in order."""
        out: dict[str, None] = {}
        for key in keys:
            if cls.owns(key):
                segments = base_name(key).split(".")
                cut = next(i for i, seg in enumerate(segments) if seg.startswith(cls.prefix))
                out[".".join(segments[:cut])] = None
        return list(out)

    # -- export ----------------------------------------------------------------------------------
    def export_config(self, state: Mapping[str, torch.Tensor],
                      modules_to_save: list[str] | None) -> Any:
        """The HF peft config that rebuilds exactly this adapter's modules from its trained
        tensors ``state`` (peft's names: the modules that carry them, their size), so a method
        that adapted some layers only, or a sub-model, exports what it trained (``fedslice
        export``). ``modules_to_save``: task-head modules peft should save beside it. Default:
        not exportable as a peft adapter."""
        from fedslice.errors import FedsliceError
        raise FedsliceError(f"peft.method = {self.name!r}: fedslice exports LoRA and DoRA adapters "
                            "to peft folders; export this run with --format merged")

    @classmethod
    def owns_module(cls, module: nn.Module) -> bool:
        """True for a module this adapter wraps (it holds every ``module_tensors`` attribute)."""
        return bool(cls.module_tensors) and all(hasattr(module, a) for a in cls.module_tensors)

    @classmethod
    def tensor_axes(cls, leaf: str) -> tuple[int | None, int | None]:
        """(axis indexed by the wrapped module's output features, axis indexed by its input
        features) of the adapter's tensor ``leaf`` (named inside the wrapped module, e.g.
        ``lora_B.default.weight``); None where the tensor has no such axis. Default: the tensors
        are ``nn.Linear`` weights (out, in) of a sub-module that follows one side."""
        follows = cls.module_tensors.get(leaf.split(".", 1)[0])
        if leaf.rsplit(".", 1)[-1] != "weight":
            return (0, None) if follows == "out" else (None, None)  # a bias follows its outputs
        return (0, None) if follows == "out" else (None, 1) if follows == "in" else (None, None)

    @classmethod
    def delta_weight(cls, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor | None:
        """The adapter's update of the wrapped weight, (out, in), from its tensors of one module
        (by leaf name), before :attr:`scale`; None if it has none of that form."""
        return None

    @classmethod
    def effective_weight(cls, weight: torch.Tensor, tensors: Mapping[str, torch.Tensor],
                         scale: float | None) -> torch.Tensor:
        """The weight (out, in) the adapted module applies, from its base ``weight`` and the
        adapter's tensors of that module (by leaf name): what salience scores. Default
        ``W + scale * delta_weight`` (LoRA), or ``W`` without a scale or a delta."""
        delta = cls.delta_weight(tensors) if scale else None
        return weight if delta is None else weight + scale * delta

    def head_positions(self, name: str, shape: torch.Size, dims: Sequence[Mapping[str, int]]
                       ) -> HeadPositions | None:
        """For a tensor of the adapter outside the model's blocks (a prefix), which (keep-mask
        row, key/value head) each position along one axis belongs to; None when it maps to no
        head (and for every tensor inside a block: those are found by :meth:`tensor_axes`)."""
        return None

    # -- per-client tensors (batched training) ----------------------------------------------
    def adapted_modules(self, model: nn.Module) -> dict[str, nn.Module]:
        """Name -> module of every module this adapter wraps in ``model``."""
        return {n: m for n, m in model.named_modules() if self.owns_module(m)}

    def client_tensor_names(self, module: nn.Module) -> list[str]:
        """The names (inside ``module``) of the adapter's tensors of one adapted module: what
        each client of a batched pass holds its own copy of."""
        return [n for n, _ in module.named_parameters() if self.owns(n)]

    def stacked_forward(self, module: nn.Module, names: list[str], stack):
        """For the batched pass (``batched_clients``): a forward of the adapted ``module`` in
        which the rows of client k of ``stack`` (``stack.rows[k]``, set per step) use that
        client's own tensors (``stack.params[k][name]`` for the full ``names`` of this module's
        :meth:`client_tensor_names`), as the adapter computes it for one client alone; the
        frozen base should run once on the whole batch."""
        raise NotImplementedError(f"adapter {self.name!r} has no batched multi-client forward")

    # -- costs ---------------------------------------------------------------------------------
    def tensors(self, model: nn.Module) -> dict[str, nn.Parameter]:
        """The adapter's own parameters in ``model`` by name (for ``none``: none)."""
        return {n: p for n, p in model.named_parameters() if self.owns(n)}

    def cost(self, model: nn.Module) -> AdapterCost:
        """Parameters and bytes of the adapter's tensors; training FLOPs per token: 6 per
        parameter of a per-token linear map (2 forward, 4 backward: input and weight gradient),
        all of it counted by :func:`fedslice.measure.analytic_train_flops` with the linears."""
        ts = self.tensors(model)
        n = sum(p.numel() for p in ts.values())
        return AdapterCost(n, sum(p.numel() * p.element_size() for p in ts.values()), 6.0 * n)

    #: the row of Table 6 of the heads paper that counts its operations ("lora", "ia3",
    #: "prompt_tuning", "p_tuning" = prompts at every layer, "none")
    table6: ClassVar[str] = "none"

    def describe(self) -> dict[str, Any]:
        """What the adapter is, for reports and op counts (``{"adapter": "lora", "rank": 16}``);
        ``table6`` names its row of the heads paper's op count."""
        return {"adapter": self.name, "table6": self.table6}


def make_adapter(cfg: ExperimentConfig, name: str, arch: ArchSpec) -> Adapter:
    """The registered adapter ``name`` with its options from ``cfg`` (the section named after it)."""
    entry = ADAPTERS.get(name)
    return entry.adapter_cls(cfg.adapter_options(name), arch, cfg.seed)


def freeze(model: nn.Module) -> None:
    for p in model.parameters():
        p.requires_grad_(False)


def train_classifier(model: nn.Module, arch: ArchSpec) -> None:
    """Make the sequence-classification head trainable in place (its parameter names stay those
    of the HF checkpoint; absent on a language-model head)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    for name in arch.classifier:
        head = getattr(base, name, None)
        for p in head.parameters() if head is not None else ():
            p.requires_grad_(True)


@contextmanager
def adapters_off(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block ``model`` computes as its frozen base: every adapter bypassed (a
    reference model without a second copy: DPO's). Adapters inside the model's modules (peft's
    tuner layers: LoRA, DoRA, IA3) by the flag their forward reads; prompt learning (prompt,
    P-tuning, prefix) by peft's ``disable_adapter`` (the base model's forward). Unlike peft's
    ``disable_adapter`` for tuner layers, no ``requires_grad`` flag changes: peft's turns every
    adapter tensor trainable again on exit (FFA-LoRA's frozen A, a plan's frozen layers). A model
    without adapters (full fine-tuning trains the base itself) is a ValueError."""
    from peft.tuners.tuners_utils import BaseTunerLayer  # peft only when used (start-up)

    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    config = getattr(model, "active_peft_config", None)
    if getattr(config, "is_prompt_learning", False):
        with model.disable_adapter():
            yield model
        return
    if not layers:
        raise ValueError(f"{type(model).__name__} has no adapter to switch off (full fine-tuning "
                         "trains the base itself: no frozen base is left to compare with)")
    saved = [(m, m._disable_adapters) for m in layers]
    try:
        for m in layers:
            if m.merged:
                raise ValueError("an adapter merged into its base cannot be switched off")
            m._disable_adapters = True
        yield model
    finally:
        for m, flag in saved:
            m._disable_adapters = flag
