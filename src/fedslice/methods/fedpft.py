"""``fedpft``: Federated Proxy Fine-Tuning (Peng et al. 2024).

1. **Sub-FM construction** (Sec. 3.4). Each FFN neuron's saliency is the L2 norm of its ``W1`` row
   and ``W2`` column (Eq. 8: :func:`fedslice.slicing.salience.salience` with ``norm='l2'``). In the
   compressed layers (all but ``method.whole_layers``, default the first and the last, counted
   in each stack: an encoder-decoder keeps the first/last encoder and decoder layers whole) the top
   ``keep_ratio`` of the neurons are kept, in their original order; attention is untouched. The
   proxy is :func:`~fedslice.slicing.spec.extract_model` of the full model for that
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

from __future__ import annotations

import logging
import math
from pathlib import Path
from collections.abc import Mapping
from typing import Any, Literal

import torch
import torch.nn as nn
from pydantic import Field, field_validator

from fedslice.config import DistillConfig, ExperimentConfig, MethodOptions
from fedslice.data.batching import TokenizedSplit
from fedslice.distill import cache
from fedslice.distill.apoz import (aggregate_apoz, apoz_report, count_near_zero, select_neurons,
                                   split_report)
from fedslice.distill.loop import DistillLog, block_masks, distill
from fedslice.distill.losses import layer_kd_loss
from fedslice.distill.report import write_curves
from fedslice.errors import ConfigError
from fedslice import measure
from fedslice.fl.strategy import Payload, Reply, State, Strategy
from fedslice.tasks import Task
from fedslice.methods.base import Method, Role
from fedslice.methods.submodel import (ClientBase, cached_distill, make_corpus,
                                       concat_logs, named_params, sub_accuracy, sub_seed,
                                       transformer_params)
from fedslice.models.arch import ArchSpec
from fedslice.models.loading import LoadedModel, materialize
from fedslice.registry import register_method
from fedslice.slicing.salience import model_salience
from fedslice.slicing.spec import ModelSlice, SliceSpec, extract_model, key_info

log = logging.getLogger(__name__)

KD_BEFORE = ("both", "before")
UPDATE_PREFIX = "proxy_update."
KD_DURING = ("both", "during")


# --------------------------------------------------------------------------------------------
# Options ([method] with name = "fedpft")
# --------------------------------------------------------------------------------------------

class FedPFTMethod(MethodOptions):
    """FedPFT (Peng et al. 2024): FFN-compressed proxy, two-step distillation, LoRA on attention."""

    name: Literal["fedpft"] = "fedpft"
    keep_ratio: float = Field(0.25, description="Fraction of FFN neurons kept (top Eq. 8 saliency) "
                              "in each compressed layer, in (0, 1].")
    whole_layers: list[int] = Field(default_factory=lambda: [0, -1], description="Layers kept "
                                    "whole (negative: from the end); the others are compressed.")
    kd: Literal["both", "before", "during", "none"] = Field(
        "both", description="Ablations: layer-level KD before FL and/or neuron-level KD during FL "
        "(FedPFT, FedPFT_B, FedPFT_D, FedPFT_N).")
    distill: DistillConfig = Field(default_factory=DistillConfig)
    align_every: int = Field(10, gt=0, description="t: neuron-level KD after every t-th round.")
    align_proportion: float = Field(0.5, description="p: fraction of each compressed layer's "
                                    "neurons re-distilled (highest aggregated APoZ), in (0, 1].")
    align_steps: int = Field(50, ge=0, description="Optimizer steps of each neuron-level KD.")
    align_lr: float | None = Field(None, gt=0, description="Default: distill.lr.")
    align_mu: float = Field(0.0, ge=0, description="Weight term during neuron-level KD (the "
                            "public code uses hidden states only).")
    apoz_tau: float = Field(0.05, ge=0, description="An FFN activation (gated: act(gate x) * up x) "
                            "counts as zero when |a| <= tau (Eq. 14 counts exact zeros, which GELU/SiLU "
                            "almost never give; 0: exact zeros, e.g. ReLU).")
    apoz_max_examples: int | None = Field(None, gt=0, description="APoZ on a seeded sample of "
                                          "this many local examples (default: all, as the paper).")

    @field_validator("keep_ratio", "align_proportion")
    @classmethod
    def _fraction(cls, v, info):
        what = {"keep_ratio": "keeps no FFN neuron (any ratio > 0 keeps at least one per layer)",
                "align_proportion": "re-distils no neuron"}
        if not 0 < v <= 1:
            bound = (f"{v:g} {what[info.field_name]}" if v <= 0 else
                     f"{v:g} is more than every neuron; the largest valid value is 1 (all of them)")
            raise ValueError(f"{info.field_name} must be in (0, 1]: {bound}")
        return v


# --------------------------------------------------------------------------------------------
# Sub-FM construction (pure)
# --------------------------------------------------------------------------------------------

def compressed_layers(whole_layers: list[int], num_layers: int) -> list[int]:
    """The layers to compress: every layer not in ``whole_layers`` (negative = from the end)."""
    whole = set()
    for i in whole_layers:
        j = i + num_layers if i < 0 else i
        if not 0 <= j < num_layers:
            raise ConfigError(f"method.whole_layers: layer {i} is out of range for a "
                              f"{num_layers}-layer model (use 0..{num_layers - 1} or "
                              f"-{num_layers}..-1)")
        whole.add(j)
    return [l for l in range(num_layers) if l not in whole]


def kept_count(keep_ratio: float, ffn: int) -> int:
    """Neurons kept per compressed layer: round(keep_ratio * F), at least 1."""
    if not 0 < keep_ratio <= 1:
        raise ConfigError(f"method.keep_ratio must be in (0, 1], got {keep_ratio}")
    return min(ffn, max(1, round(keep_ratio * ffn)))


def top_neurons(saliency: torch.Tensor, k: int) -> tuple[int, ...]:
    """Indices of the ``k`` most salient neurons (stable on ties), in their original order."""
    order = torch.argsort(saliency, descending=True, stable=True)[:k]
    return tuple(sorted(order.tolist()))


def proxy_spec(neuron_saliency: list[torch.Tensor] | None, dims: dict[str, int], keep_ratio: float,
               layers: list[int]) -> SliceSpec:
    """All layers and heads; in ``layers`` the top ``keep_ratio`` neurons by saliency (without
    saliencies, the leading ones: the proxy's shape, as a client builds it)."""
    F, L = dims["ffn"], dims["num_layers"]
    k = kept_count(keep_ratio, F)

    def kept(l: int) -> tuple[int, ...]:
        if l not in layers:
            return tuple(range(F))
        return tuple(range(k)) if neuron_saliency is None else top_neurons(neuron_saliency[l], k)
    neurons = tuple(kept(l) for l in range(L))
    heads = tuple(tuple(range(dims["num_heads"])) for _ in range(L))
    return SliceSpec(tuple(range(L)), heads, neurons, L, dims["num_heads"], dims["head_dim"], F)


def proxy_slice(saliency: list[list[torch.Tensor] | None], all_dims: list[dict[str, int]], keep_ratio: float,
                whole_layers: list[int]) -> ModelSlice:
    """One :func:`proxy_spec` per stack: every stack keeps ``whole_layers`` (its own layer
    numbers: by default its first and last layer) whole and compresses the others.
    ``saliency[k][l]``: (F,) neuron saliency of layer l of stack k."""
    return ModelSlice(tuple(proxy_spec(sal, d, keep_ratio, compressed_layers(whole_layers, d["num_layers"]))
                            for sal, d in zip(saliency, all_dims)))


def global_layer(offsets: tuple[int, ...], stack: int, layer: int) -> int:
    """The global index of a block (stacks in table order: see ``block_units``)."""
    return offsets[stack] + layer


def stack_offsets(spec: ModelSlice) -> tuple[int, ...]:
    """Global index of each stack's first block."""
    sizes = [s.num_layers for s in spec.stacks]
    return tuple(sum(sizes[:k]) for k in range(len(sizes)))


def compressed_units(spec: ModelSlice) -> dict[int, tuple[int, int]]:
    """Global layer -> (stack, layer) of every layer whose FFN the proxy compresses."""
    offsets = stack_offsets(spec)
    return {global_layer(offsets, k, l): (k, l) for k, s in enumerate(spec.stacks)
            for j, l in enumerate(s.layers) if not s.is_identity(j, "ffn")}


def build_proxy(model: nn.Module, spec: ModelSlice, arch: ArchSpec) -> nn.Module:
    """The proxy of ``model``: shares everything but the sliced FFNs, whose ``b2`` is unshared
    too (so distilling the proxy never changes the full model)."""
    proxy = extract_model(model, spec, arch)
    for k, l in compressed_units(spec).values():
        out = arch.ffn_part(proxy, k, l, "ffn_out")
        if out.bias is not None:
            out.bias = nn.Parameter(out.bias.detach().clone(), requires_grad=False)
    return proxy


def ffn_modules(model: nn.Module, arch: ArchSpec, stack: int, layer: int) -> list[nn.Module]:
    """The gate (if any), ``ffn_in`` and ``ffn_out`` modules of one block."""
    parts = [arch.ffn_part(model, stack, layer, p) for p in ("gate", "ffn_in", "ffn_out")]
    return [m for m in parts if m is not None]


def ffn_weights(model: nn.Module, arch: ArchSpec, units: dict[int, tuple[int, int]]) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """global layer -> [(W_in (F, d), W_out (d, F))] per input matrix (gate first, then ffn_in),
    the live parameters (views keep their gradient)."""
    out, linear = {}, arch.layout.as_linear
    for g, (k, l) in units.items():
        w_out = linear(arch.ffn_part(model, k, l, "ffn_out").weight)  # (d, F)
        ins = [arch.ffn_part(model, k, l, p) for p in ("gate", "ffn_in")]
        out[g] = [(linear(m.weight), w_out) for m in ins if m is not None]  # (F, d), (d, F)
    return out


# --------------------------------------------------------------------------------------------
# Server
# --------------------------------------------------------------------------------------------

class FedPFTStrategy(Strategy):
    """FedAvg of LoRA + classifier; keeps each client's proxy copy current and asks for APoZ
    reports in alignment rounds.

    A client's first payload carries the compressed FFN tensors whole; after re-alignments, a
    client that already holds a proxy receives only the re-distilled neurons since its copy
    (``proxy_update.<key>`` slices along the neuron axis plus ``proxy_update.<layer>.index``),
    as the paper's communication analysis assumes."""

    def __init__(self, fed, method: FedPFTMethod, arch: ArchSpec, proxy_keys: list[str],
                 widths: dict[int, int], offsets: tuple[int, ...] = (0,),
                 base: State | None = None, client_sizes: Mapping[int, int] | None = None,
                 max_tokens: int = 512):
        super().__init__(fed, client_sizes)
        self.max_tokens = max_tokens  # tokens of one example at most (data.max_length)
        self.method, self.arch, self.proxy_keys, self.widths = method, arch, set(proxy_keys), widths
        self.offsets = offsets  # global index of each stack's first layer (widths' keys)
        self.base = dict(base or {})  # the proxy's other frozen tensors (Payload.model), constant
        self.updates: list[dict[int, torch.Tensor]] = []  # neuron masks of each re-alignment
        self.client_version: dict[int, int] = {}  # re-alignments included in the client's copy

    @property
    def version(self) -> int:
        return len(self.updates)

    def align_round(self, server_round: int) -> bool:
        """Rounds after which the server re-distils (never after the last round)."""
        return (self.method.kd in KD_DURING and bool(self.widths)
                and server_round % self.method.align_every == 0 and server_round < self.fed.rounds)

    def train_config(self, server_round: int) -> dict[str, Any]:
        cfg = super().train_config(server_round)
        if self.align_round(server_round):
            cfg.update(report_apoz=True, apoz_tau=self.method.apoz_tau)
        return cfg

    def payload_for(self, server_round: int, state: State, client: int, config: dict) -> Payload:
        """Whole proxy at first participation (compressed FFNs, and the rest as ``model``: the
        client has no other copy of the model), else the neurons re-distilled since its copy.
        ``proxy_version``/``proxy_base`` let the client check its copy (see ``_check_copy``)."""
        arrays = {k: v for k, v in state.items() if k not in self.proxy_keys}
        held = self.client_version.get(client)
        config = {**config, "client": client, "proxy_version": self.version}
        if held is None:
            arrays.update({k: v for k, v in state.items() if k in self.proxy_keys})
        else:
            config["proxy_base"] = held
            if held < self.version:
                arrays.update(self.neuron_update(state, self.updates[held:]))
        self.client_version[client] = self.version
        return Payload(arrays=arrays, config=config, model=self.base if held is None else {})

    def forget(self, client: int) -> None:
        """A client that did not reply (failed node, stale copy) gets the whole proxy next time."""
        self.client_version.pop(client, None)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "updates": [{str(l): m for l, m in u.items()} for u in self.updates],
                "client_version": {str(c): v for c, v in self.client_version.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.updates = [{int(l): m.clone() for l, m in u.items()} for u in state["updates"]]
        self.client_version = {int(c): int(v) for c, v in state["client_version"].items()}

    def neuron_update(self, state: State, updates: list[dict[int, torch.Tensor]]) -> State:
        """The re-distilled neurons of ``updates`` (their union), sliced from the proxy tensors."""
        out: State = {}
        for layer in self.widths:
            masks = [u[layer] for u in updates if layer in u]
            if not masks:
                continue
            idx = torch.nonzero(torch.stack(masks).any(0)).flatten()  # (n,) neuron indices
            out[f"{UPDATE_PREFIX}{layer}.index"] = idx
            for key in self.proxy_keys:
                info = key_info(self.arch, key)
                if global_layer(self.offsets, info.stack, info.layer) == layer and info.axis is not None:
                    out[f"{UPDATE_PREFIX}{key}"] = state[key].index_select(info.axis, idx)
        return out

    def proxy_changed(self, update: dict[int, torch.Tensor]) -> None:
        """Record a re-alignment: ``update[layer]`` = bool mask of the re-distilled neurons."""
        self.updates.append({l: m.clone() for l, m in update.items()})

    def expected_update(self, state: State, payload: Payload, reply: Reply) -> State:
        """LoRA + classifier: not the proxy tensors or neuron updates the payload carried."""
        return {k: t for k, t in payload.arrays.items()
                if k not in self.proxy_keys and not k.startswith(UPDATE_PREFIX)}

    def check_reply(self, state: State, payload: Payload, reply: Reply) -> str | None:
        """The generic checks, plus the APoZ report of an alignment round: one fraction in
        [0, 1] per kept neuron of every compressed layer, weighted by ``apoz_tokens``, a count of
        at most the client's examples (or ``apoz_max_examples``) x ``data.max_length`` tokens."""
        model, apoz = split_report(reply.arrays)
        asked = bool(payload.config.get("report_apoz"))
        if apoz and not asked:
            return "APoZ report in a round that did not ask for one"
        if asked and set(apoz) != set(self.widths):
            return f"APoZ report of layers {sorted(apoz)}, expected {sorted(self.widths)}"
        for layer, a in apoz.items():
            if a.shape != (self.widths[layer],) or not a.is_floating_point():
                return f"APoZ of layer {layer} has shape {tuple(a.shape)} and dtype {a.dtype}"
            if not torch.isfinite(a).all() or a.min() < 0 or a.max() > 1:
                return f"APoZ of layer {layer} is not a fraction in [0, 1]"
        if reason := self.check_tokens(payload, reply, asked):
            return reason
        return super().check_reply(state, payload, Reply(model, reply.num_examples, reply.metrics))

    def check_tokens(self, payload: Payload, reply: Reply, asked: bool) -> str | None:
        tokens = reply.metrics.get("apoz_tokens") if isinstance(reply.metrics, dict) else None
        if not asked:
            return None if tokens is None else "apoz_tokens in a round without an APoZ report"
        if isinstance(tokens, bool) or not isinstance(tokens, (int, float)) or \
                not math.isfinite(tokens) or tokens <= 0 or tokens != int(tokens):
            return f"apoz_tokens={tokens!r} is not a positive count (it weighs the APoZ report)"
        size = self.client_sizes.get(payload.config.get("client"))
        examples = min(n for n in (size, self.method.apoz_max_examples, reply.num_examples)
                       if n is not None)
        bound = examples * self.max_tokens
        if tokens > bound:
            return (f"apoz_tokens={tokens:g} is more than the {examples} examples it counted x "
                    f"data.max_length={self.max_tokens} = {bound}")
        return None

    def client_updates(self, server_round: int, state: State, payloads: dict[int, Payload],
                       replies: dict[int, Reply]) -> tuple[list[State], list]:
        """FedAvg of LoRA + classifier: the APoZ reports are not model tensors."""
        stripped = {c: Reply(split_report(r.arrays)[0], r.num_examples, r.metrics)
                    for c, r in replies.items()}
        return super().client_updates(server_round, state, payloads, stripped)


# --------------------------------------------------------------------------------------------
# The method
# --------------------------------------------------------------------------------------------

class FedPFT(Method):
    name = "fedpft"
    #: each client's fit loads the proxy's re-distilled neurons into the proxy this process
    #: holds (and checks its version): that copy must persist, so clients train in this process
    parallel_clients = False
    client_model_from_server = True
    adapters = None  # an adapter inside the attention modules (check_config)

    @classmethod
    def client_statistics(cls, cfg: ExperimentConfig) -> str | None:
        if cfg.method.kd in KD_DURING:
            return (f"method.kd={cfg.method.kd!r} (neuron-level KD during FL re-distils the "
                    "neurons chosen by the clients' APoZ statistics of their data; set "
                    "method.kd = 'before', layer-level KD on the server's corpus only, or 'none')")
        return None

    @classmethod
    def check_config(cls, cfg: ExperimentConfig) -> None:
        super().check_config(cfg)
        adapter = cls.adapter_class(cfg)
        name = adapter.name
        if adapter.trains_base or not adapter.in_modules:
            raise ValueError(f"peft.method={name!r}: method fedpft trains an adapter on the "
                             "attention of its proxy and plugs it into the full model; the "
                             f"{name} adapter " + ("trains the model's own weights" if
                                                   adapter.trains_base else
                                                   "changes the sequence every layer sees (virtual "
                                                   "tokens or keys), which the proxy's layer-by-"
                                                   "layer distillation does not match")
                             + ": use lora, dora or ia3")
        opts = cfg.adapter_options(name)
        targets = getattr(opts, "targets", None)
        raw = getattr(opts, "target_modules", None)
        if raw is not None or (targets is not None and set(targets) - {"q", "k", "v", "o"}):
            raise ValueError(f"{name}.targets: method fedpft trains its adapter on attention only "
                             f"(q, k, v, o): the proxy drops FFN neurons; got {raw or targets}")

    def __init__(self, cfg: ExperimentConfig, loaded: LoadedModel, task: Task,
                 role: Role = "both", client_sizes: Mapping[int, int] | None = None):
        self.loaded = loaded  # the preprocessor and config the distillation corpus is encoded with
        self.opts: FedPFTMethod = cfg.method
        self.align_logs: list[DistillLog] = []
        self.align_records: list[dict[str, Any]] = []
        self.held_version: int | None = None  # proxy version of this worker's copy (client side)
        super().__init__(cfg, loaded, task, role, client_sizes)

    # -- construction ----------------------------------------------------------------------
    def prepare_model(self, model: nn.Module) -> nn.Module:
        """LoRA on attention of the full model, then the proxy and its layer-level KD. A client
        (role "client") has the model's shape only (meta device): its proxy keeps the leading
        neurons, gets zeros now and the server's values in its first payload."""
        o = self.opts
        self.spec = self._proxy_slice(model)
        full = self.teacher = self.adapter.apply(model)
        self.units = compressed_units(self.spec)  # global layer -> (stack, layer)
        self.compressed = list(self.units)
        self.proxy = build_proxy(full, self.spec, self.arch)
        if self.role == "client":
            materialize(self.proxy)  # the proxy's tensors only: the full model stays shapes
        ffns = [m for k, l in self.units.values() for m in ffn_modules(self.proxy, self.arch, k, l)]
        self.proxy_params = named_params(self.proxy, ffns)
        self.client_base = ClientBase(self.proxy, self.proxy_params, from_server=self.role == "client")
        # a client gets the distilled proxy in its payload: no corpus, no distillation there
        self.corpus = self._corpus() if self.role != "client" else None
        self.kd_before, self.kd_cached = None, False
        if o.kd in KD_BEFORE and self.compressed and o.distill.steps > 0 and self.role != "client":
            self.kd_before, self.kd_cached = self._layer_kd(full)
        return full

    def _proxy_slice(self, model: nn.Module) -> ModelSlice:
        """Eq. 8 saliency of every stack's neurons (a gated neuron: gate row + up row + down
        column) and the proxy's slice: ``whole_layers`` of each stack whole."""
        all_dims = self.arch.all_dims(model.config)
        if self.role == "client":  # shapes only (meta device): the leading neurons, values follow
            neurons = [None] * len(all_dims)
        else:
            sal = model_salience(model.state_dict(), self.arch, all_dims, "l2")
            neurons = [[s.neurons for s in stack] for stack in sal]
        return proxy_slice(neurons, all_dims, self.opts.keep_ratio, self.opts.whole_layers)

    def _corpus(self) -> Corpus | None:
        """The distillation corpus (checked now; an empty one fails before FL starts)."""
        o = self.opts
        if o.kd == "none" or not self.compressed:
            return None
        steps = max(o.distill.steps if o.kd in KD_BEFORE else 0, o.align_steps if o.kd in KD_DURING else 0)
        corpus = make_corpus(self.cfg, o.distill, self.task, self.loaded, steps, "method.distill.corpus")
        if o.kd in KD_DURING and o.align_steps > 0:
            _ = corpus.split  # packed now, not at the first alignment
        return corpus

    def make_strategy(self) -> Strategy:
        widths = self._widths()
        return FedPFTStrategy(self.cfg.federation, self.opts, self.arch, list(self.proxy_params), widths,
                              offsets=stack_offsets(self.spec), base=self.client_base.payload(),
                              client_sizes=self.client_sizes, max_tokens=self.cfg.data.max_length)

    def _widths(self) -> dict[int, int]:
        """Global layer -> kept neurons, of every compressed layer."""
        return {g: len(self.spec.stacks[k].neurons[l]) for g, (k, l) in self.units.items()}

    def _kd_loss(self, mu: float):
        s_ffn = ffn_weights(self.proxy, self.arch, self.units)
        t_ffn = ffn_weights(self.teacher, self.arch, self.units)

        def loss(s_layers, t_layers, batch):  # every layer of every stack, its stack's mask
            masks = block_masks(self.proxy, self.arch, batch)
            return layer_kd_loss(s_layers, t_layers, masks, s_ffn, t_ffn, mu)
        return loss

    def _layer_kd(self, full: nn.Module) -> tuple[DistillLog, bool]:
        """Eq. 13 on the corpus, or the cached result of the same settings."""
        d = self.opts.distill
        skip = tuple(p for p in (self.adapter.prefix, "classifier") if p)
        inputs = {"kind": "fedpft-layer-kd", "model": cache.weights_fingerprint(full, skip),
                  "neurons": [list(self.spec.stacks[k].neurons[l]) for k, l in self.units.values()],
                  "layers": self.compressed, "steps": d.steps, "mu": d.mu, "seed": d.seed_or(self.cfg.seed),
                  **self.corpus.cache_inputs()}

        def run() -> DistillLog:
            log.info("fedpft: layer-level distillation, %d steps", d.steps)
            return distill(self.proxy, full, self.arch, self.proxy_params, self.corpus.split, self._kd_loss(d.mu),
                           steps=d.steps, lr=d.lr, warmup=d.warmup, batch_size=d.batch_size,
                           seed=d.seed_or(self.cfg.seed))
        return cached_distill(cache.cache_root(d.cache_dir), inputs, self.proxy_params, run)

    # -- state -------------------------------------------------------------------------------
    def initial_state(self) -> State:
        state = super().initial_state()
        state.update({k: p.detach().clone() for k, p in self.proxy_params.items()})
        return state

    @torch.no_grad()
    def _load(self, arrays: State) -> dict[str, nn.Parameter]:
        """Load LoRA + classifier (shared by proxy and full model), any proxy FFN tensors and
        any re-distilled neurons (``proxy_update.*``)."""
        params = self.trainable(self.proxy)
        for k, t in arrays.items():
            if k in params:
                params[k].copy_(t)
            elif k in self.proxy_params:
                self.proxy_params[k].copy_(t)
            elif k.startswith(UPDATE_PREFIX) and not k.endswith(".index"):
                key = k[len(UPDATE_PREFIX):]
                info = key_info(self.arch, key)
                g = global_layer(stack_offsets(self.spec), info.stack, info.layer)
                idx = arrays[f"{UPDATE_PREFIX}{g}.index"]
                self.proxy_params[key].index_copy_(info.axis, idx, t)
        return params

    # -- client ------------------------------------------------------------------------------
    def client_model(self, payload: Payload) -> tuple[nn.Module, dict[str, nn.Parameter]]:
        return self.proxy, self._load(payload.arrays)

    def client_state(self) -> State:
        """The client's proxy copy (compressed FFN tensors, and in the client role the rest of
        the proxy, ``base.*``) and its version."""
        if self.held_version is None:
            return {}
        kept = {k: p.detach().clone() for k, p in self.proxy_params.items()}
        return {**kept, **self.client_base.state(), "proxy_version": torch.tensor(self.held_version)}

    @torch.no_grad()
    def load_client_state(self, state: State) -> None:
        self.held_version = int(state["proxy_version"]) if "proxy_version" in state else None
        for k, t in state.items():
            if k in self.proxy_params:
                self.proxy_params[k].copy_(t)
        self.client_base.load_state(state)

    def _check_copy(self, payload: Payload) -> None:
        """Refuse an incremental proxy update that does not start from this process's copy (a
        client id served by another worker before): the client fails this round, and the server
        sends it the whole proxy next time (``FedPFTStrategy.aggregate_train``)."""
        base, version = payload.config.get("proxy_base"), payload.config.get("proxy_version")
        if version is None:
            return
        if base is not None and (self.held_version is None or self.held_version < base):
            raise RuntimeError(f"client {payload.config.get('client')}: the proxy update starts from "
                               f"version {base}, this worker holds version {self.held_version}")
        self.held_version = int(version)

    def fit(self, payload: Payload, data: TokenizedSplit, seed: int) -> Reply:
        """Local training of the proxy; in alignment rounds, APoZ on the local data first."""
        self._check_copy(payload)
        self.client_base.receive(payload.model, f"client {payload.config.get('client')}")
        count = None
        if payload.config.get("report_apoz"):
            self._load(payload.arrays)
            count = count_near_zero(self.proxy, self.arch, self.compressed, data,
                                    int(payload.config["batch_size"]), float(payload.config["apoz_tau"]),
                                    self.opts.apoz_max_examples, seed)
        reply = super().fit(payload, data, seed)
        if count is not None:
            report = apoz_report(count.counts, count.layer_tokens)
            reply.arrays.update(report)
            m = reply.metrics
            m["bytes_up"] += measure.tensor_bytes(report)
            m["params_up"] += measure.num_params(report)
            m["flops_measured"] += count.flops
            m.update(flops_apoz=count.flops, apoz_tokens=count.tokens)
        return reply

    # -- server ------------------------------------------------------------------------------
    def on_round_end(self, server_round: int, state: State,
                     replies: dict[int, Reply]) -> tuple[State, dict[str, Any]]:
        """Neuron-level KD after every ``align_every``-th round (Sec. 3.5)."""
        if not self.own_strategy.align_round(server_round):
            return state, {}
        reports = [split_report(r.arrays)[1] for r in replies.values()]
        tokens = [r.metrics.get("apoz_tokens", 0.0) for r in replies.values()]
        apoz = aggregate_apoz([r for r in reports if r], [t for r, t in zip(reports, tokens) if r])
        if set(apoz) != set(self.compressed):
            log.warning("round %d: no APoZ reports, neuron-level distillation skipped", server_round)
            return state, {"align_skipped": True}
        gen = torch.Generator().manual_seed(sub_seed(self.cfg.seed, server_round, 1))
        update = {l: select_neurons(apoz[l], self.opts.align_proportion, gen) for l in self.compressed}
        self._load(state)
        lg = self._neuron_kd(update, sub_seed(self.cfg.seed, server_round, 2))
        new_state = dict(state)
        new_state.update({k: p.detach().clone() for k, p in self.proxy_params.items()})
        self.own_strategy.proxy_changed(update)
        n = int(sum(int(m.sum()) for m in update.values()))
        self.align_logs.append(lg)
        rec = {"round": server_round, "neurons": n, **lg.summary("align"),
               "apoz_mean": {str(l): float(a.mean()) for l, a in apoz.items()}}
        self.align_records.append(rec)
        return new_state, {"align_neurons": n, **lg.summary("align")}

    def server_state(self) -> dict[str, Any]:
        return {"align_logs": [lg.to_dict() for lg in self.align_logs],
                "align_records": self.align_records, "held_version": self.held_version}

    def load_server_state(self, state: dict[str, Any]) -> None:
        self.align_logs = [DistillLog.from_dict(d) for d in state["align_logs"]]
        self.align_records = list(state["align_records"])
        self.held_version = state["held_version"]

    def _neuron_kd(self, update: dict[int, torch.Tensor], seed: int) -> DistillLog:
        """Re-distil the selected neurons (W1 rows, b1, W2 columns); everything else fixed."""
        o, d = self.opts, self.opts.distill
        offsets = stack_offsets(self.spec)
        params, masks = {}, {}
        for name, p in self.proxy_params.items():  # W1 (and gate) rows, b1, W2 columns
            info = key_info(self.arch, name)
            m = update.get(global_layer(offsets, info.stack, info.layer))
            if m is not None and info.axis is not None:
                shape = [1] * p.dim()
                shape[info.axis] = -1
                params[name], masks[name] = p, m.float().reshape(shape)
        return distill(self.proxy, self.teacher, self.arch, params, self.corpus.split, self._kd_loss(o.align_mu),
                       steps=o.align_steps, lr=o.align_lr or d.lr, warmup=d.warmup,
                       batch_size=d.batch_size, seed=seed, grad_masks=masks)

    def eval_model(self, state: State) -> nn.Module:
        """Plug-in: the full model with the trained LoRA + classifier (shared with the proxy)."""
        self._load(state)
        return self.model

    def deploy_exclude(self) -> list[str]:
        """The proxy's compressed FFN tensors: the deployed model is the full one (plug-in)."""
        return sorted(self.proxy_params)

    def proxy_model(self, state: State) -> nn.Module:
        self._load(state)
        return self.proxy

    # -- reporting ---------------------------------------------------------------------------
    def final_metrics(self, state: State, data: Any, records: list[dict[str, Any]],
                      batch_size: int) -> dict[str, Any]:
        full_p, proxy_p = transformer_params(self.model, self.arch), transformer_params(self.proxy, self.arch)
        during = concat_logs(self.align_logs)
        out = {**sub_accuracy(self.task, self.proxy_model(state), data, batch_size),
               "full_transformer_params": full_p, "proxy_transformer_params": proxy_p,
               "proxy_param_fraction": proxy_p / full_p, "compressed_layers": self.compressed,
               "proxy_ffn": [len(n) for st in self.spec.stacks for n in st.neurons], "kd": self.opts.kd,
               "kd_before_cached": self.kd_cached, "kd_during_rounds": len(self.align_logs)}
        if self.kd_before is not None:
            out.update(self.kd_before.summary("kd_before"))
        if during is not None:
            out.update({k: v for k, v in during.summary("kd_during").items()
                        if not k.endswith(("_start", "_end"))})
        return out

    @classmethod
    def report_views(cls, folder, config, metrics, summary) -> list:
        from fedslice.distill.report import distill_view
        view = distill_view(folder, "fedpft_distill", "Distillation (fedpft)")
        return [view] if view else []

    def write_artifacts(self, folder: Path) -> None:
        phases = {"layer-level KD before FL": self.kd_before,
                  "neuron-level KD during FL": concat_logs(self.align_logs)}
        write_curves(folder, "fedpft_distill", phases, plot=self.cfg.output.plots,
                     extra={"cached": self.kd_cached, "compressed_layers": self.compressed,
                            "kept_neurons": self._widths()[self.compressed[0]] if self.compressed else None,
                            "alignments": self.align_records})


register_method(name="fedpft", options_cls=FedPFTMethod, method_cls=FedPFT)
