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

The client model is :func:`~fedslice.slicing.spec.extract_model` of the full model for the depth
:class:`~fedslice.slicing.spec.SliceSpec` of adapter + emulator layers: it shares the adapter
(and its LoRA), embeddings and classifier with the full model. With ``distill_emulator`` the
emulator layers are copies, distilled before FL so that their output matches the middle layers'
(hidden-state MSE normalised by the teacher's mean square; both fed the same adapter output).
Clients train the adapter (LoRA on it, or fully) and the classifier with the emulator frozen;
the adapter plugs into the full model, which is what ``test_accuracy`` evaluates.

The global state uses the full model's names; each client receives and returns its sub-model's
names (:func:`~fedslice.slicing.spec.extract_state` / :func:`~fedslice.slicing.spec.scatter`).

A client never reads the full model (Offsite-Tuning's premise): its first payload carries the
sub-model's frozen tensors (embeddings, the adapter's base weights, the emulator, buffers) in
``Payload.model`` (:class:`~fedslice.methods.submodel.ClientBase`; a distilled emulator as
``emulator.<name>`` in ``arrays``), counted in ``bytes_down``. In the client role (a Flower ClientApp) the model
is built from the HF config on the meta device (:func:`~fedslice.models.loading.build_from_config`),
the layout comes from the config, and only the sub-model's tensors get storage.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn as nn
from pydantic import Field

from fedslice.config import DistillConfig, ExperimentConfig, MethodOptions
from fedslice.distill import cache
from fedslice.distill.loop import DistillLog, distill, stack_mask
from fedslice.distill.losses import hidden_loss
from fedslice.distill.report import write_curves
from fedslice.errors import ConfigError
from fedslice.fl.strategy import Payload, Reply, State, Strategy
from fedslice.tasks import Task
from fedslice.methods.base import Method, Role
from fedslice.methods.submodel import (ClientBase, cached_distill, make_corpus,
                                       named_params, sub_accuracy, transformer_params)
from fedslice.models.arch import ArchSpec
from fedslice.models.loading import LoadedModel, materialize
from fedslice.peft import LoraAdapter
from fedslice.registry import register_method
from fedslice.slicing.aggregate import client_delta
from fedslice.slicing.spec import ModelSlice, SliceSpec, extract_model, extract_state, scatter

log = logging.getLogger(__name__)

FROZEN_PREFIX = "emulator."


# --------------------------------------------------------------------------------------------
# Options ([method] with name = "fedot")
# --------------------------------------------------------------------------------------------

class FedOTMethod(MethodOptions):
    """FedOT: Offsite-Tuning (Xiao et al. 2023) with FedAvg. Bottom/top layers are the trainable
    adapter; the middle layers are replaced by a uniform layer-drop emulator (frozen)."""

    name: Literal["fedot"] = "fedot"
    bottom_layers: int | None = Field(None, ge=0, description="Adapter layers at the bottom "
                                      "(default max(1, round(L/6)): 2 of 12, as in the paper).")
    top_layers: int | None = Field(None, ge=0, description="Adapter layers at the top (same default).")
    emulator_layers: int | None = Field(None, gt=0, description="Middle layers kept by uniform "
                                        "layer drop (default max(1, round(3/8 * middle)): 8 -> 3).")
    adapter_tuning: Literal["lora", "full"] = Field("lora", description="LoRA ([lora], on the "
                                                    "adapter layers only) or full fine-tuning.")
    lora_r: int | None = Field(None, gt=0, description="LoRA rank on the adapter (default "
                               "lora.r; lora.alpha is scaled with it, so alpha/r is unchanged); "
                               "raise it to match the trainable parameters of LoRA on every layer.")
    distill_emulator: bool = Field(False, description="Distil the emulator to the middle layers "
                                   "before FL (settings in `distill`; mu is not used).")
    distill: DistillConfig = Field(default_factory=DistillConfig)


# --------------------------------------------------------------------------------------------
# Layout (pure)
# --------------------------------------------------------------------------------------------

def default_adapter_layers(num_layers: int) -> int:
    """Adapter layers at each end: the paper's 2 of 12, scaled to the depth (at least 1)."""
    return max(1, round(num_layers / 6))


def default_emulator_layers(middle: int) -> int:
    """Emulator layers: the paper's 3 of 8 middle layers, scaled (at least 1)."""
    return max(1, round(3 * middle / 8))


def emulator_indices(middle: list[int], k: int) -> list[int]:
    """Uniform layer drop: ``k`` of the ``middle`` layers at ``round(i * (m-1) / (k-1))``."""
    m = len(middle)
    if not 1 <= k <= m:
        raise ValueError(f"cannot keep {k} of {m} middle layers")
    if k == 1:
        return [middle[round((m - 1) / 2)]]
    stride = (m - 1) / (k - 1)
    return [middle[round(i * stride)] for i in range(k)]


def fedot_layout(num_layers: int, bottom: int | None, top: int | None,
                 emulator: int | None) -> tuple[list[int], list[int], list[int]]:
    """(bottom adapter layers, emulator layers, top adapter layers) of a ``num_layers`` model."""
    b = default_adapter_layers(num_layers) if bottom is None else bottom
    t = default_adapter_layers(num_layers) if top is None else top
    if b + t >= num_layers:
        raise ConfigError(f"method.bottom_layers={b} + method.top_layers={t} adapter layers leave "
                          f"no emulator in a {num_layers}-layer model (need at most "
                          f"{num_layers - 1} together)")
    if b + t == 0:
        raise ConfigError("method.bottom_layers and method.top_layers are both 0: no adapter to train")
    middle = list(range(b, num_layers - t))
    k = default_emulator_layers(len(middle)) if emulator is None else emulator
    if k > len(middle):
        raise ConfigError(f"method.emulator_layers={k} is more than the {len(middle)} middle layers")
    return list(range(b)), emulator_indices(middle, k), list(range(num_layers - t, num_layers))


# --------------------------------------------------------------------------------------------
# Server
# --------------------------------------------------------------------------------------------

class SubModelStrategy(Strategy):
    """Each client gets its sub-model's slice of the global state; slices are scattered back to
    full-model names and averaged where held (a depth spec holds whole tensors).

    ``frozen`` (sub-model names) are tensors the server made that a client cannot rebuild from the
    checkpoint (the distilled emulator), ``base`` the sub-model's other frozen tensors: a client
    holds no copy of the model, so both go to a client at its first participation (``frozen`` as
    ``emulator.<name>``, ``base`` as the payload's ``model``), and again after a round it did not
    reply to (it may have lost them)."""

    def __init__(self, fed, spec: SliceSpec | ModelSlice, arch: ArchSpec, shapes: dict[str, torch.Size],
                 frozen: State | None = None, base: State | None = None,
                 client_sizes: Mapping[int, int] | None = None):
        super().__init__(fed, client_sizes)
        self.spec, self.arch, self.shapes = spec, arch, shapes
        self.frozen, self.base = dict(frozen or {}), dict(base or {})
        self.holders: set[int] = set()  # clients that were sent ``frozen`` and ``base``

    def payload_for(self, server_round: int, state: State, client: int, config: dict) -> Payload:
        arrays, model = extract_state(state, self.spec, self.arch), {}
        if (self.frozen or self.base) and client not in self.holders:
            arrays.update({FROZEN_PREFIX + k: t for k, t in self.frozen.items()})
            model = self.base
            self.holders.add(client)
        return Payload(arrays=arrays, config={**config, "client": client}, model=model)

    def forget(self, client: int) -> None:
        self.holders.discard(client)

    def expected_update(self, state: State, payload: Payload, reply: Reply) -> State:
        return {k: t for k, t in payload.arrays.items() if not k.startswith(FROZEN_PREFIX)}

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "holders": sorted(self.holders)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.holders = {int(c) for c in state["holders"]}

    def client_updates(self, server_round: int, state: State, payloads: dict[int, Payload],
                       replies: dict[int, Reply]) -> tuple[list[State], list]:
        deltas, weights = [], []
        for c in sorted(replies):
            full, masks = scatter(replies[c].arrays, self.spec, self.arch, self.shapes)
            deltas.append(client_delta(state, full))
            weights.append({k: replies[c].num_examples * m for k, m in masks.items()})
        return deltas, weights


# --------------------------------------------------------------------------------------------
# The method
# --------------------------------------------------------------------------------------------

class FedOT(Method):
    name = "fedot"
    batched_clients = True  # every client trains the same adapter + emulator sub-model
    client_model_from_server = True
    adapters = None  # an adapter that can be applied to some layers only (check_config)
    legacy_adapter_option = "adapter_tuning"

    @classmethod
    def check_config(cls, cfg: ExperimentConfig) -> None:
        super().check_config(cfg)
        adapter = cls.adapter_class(cfg)
        if not adapter.in_modules:
            raise ValueError(f"peft.method={adapter.name!r}: method fedot trains its adapter "
                             "layers (the bottom and top blocks) on an emulator of the middle "
                             f"ones; the {adapter.name} adapter adds virtual tokens or keys to "
                             "the model as a whole, not to some layers: use lora, dora, ia3 or "
                             "none")

    def __init__(self, cfg: ExperimentConfig, loaded: LoadedModel, task: Task,
                 role: Role = "both", client_sizes: Mapping[int, int] | None = None):
        self.loaded = loaded  # the preprocessor and config the distillation corpus is encoded with
        self.opts: FedOTMethod = cfg.method
        super().__init__(cfg, loaded, task, role, client_sizes)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        o = self.opts
        all_dims = self.arch.all_dims(model.config)
        #: (bottom adapter, emulator, top adapter) layers of every stack
        self.layouts = [fedot_layout(d["num_layers"], o.bottom_layers, o.top_layers, o.emulator_layers)
                        for d in all_dims]
        self.bottom, self.emulator, self.top = self.layouts[0]  # the first (an encoder's or decoder's only) stack
        self._check_layout()
        full = self._adapter(model, [b + t for b, _, t in self.layouts])
        self.spec = ModelSlice(tuple(SliceSpec.leading(d, d["num_heads"], d["ffn"], layers=b + e + t)
                                     for d, (b, e, t) in zip(all_dims, self.layouts)))
        self.sub = extract_model(full, self.spec, self.arch)
        self.kd_log, self.kd_cached = None, False
        self.emulator_params: dict[str, nn.Parameter] = {}  # the distilled copies (sub-model names)
        self.emulator_held = self.role != "client"  # a client receives it in its first payload
        own = o.distill_emulator and o.distill.steps > 0
        if own:
            self._own_emulator()
        if self.role == "client":  # shapes only so far (meta device): storage for the sub-model
            materialize(self.sub)
        if own:
            self.emulator_params = self._emulator_params()
            if self.role != "client":
                self.kd_log, self.kd_cached = self._distill_emulator(full)
        self.client_base = ClientBase(self.sub, self.emulator_params, from_server=self.role == "client")
        return full

    def _check_layout(self) -> None:
        """A stack whose first block holds a table every layer reads (T5's relative-position
        bias) needs its first layer in the sub-model."""
        if self.arch.head_bias and not self.bottom:
            raise ConfigError(f"method.bottom_layers: a {self.arch.model_type} model keeps its "
                              "relative-position bias in the first layer of each stack, which the "
                              "client model needs: use at least 1")

    def _adapter(self, model: nn.Module, layers: list[list[int]]) -> nn.Module:
        """The adapter on the adapter layers only (``layers[k]``: of stack k): LoRA on them, or
        all their parameters (``none``); the classifier trains, everything else is frozen."""
        r = self.opts.lora_r
        if r is not None and isinstance(self.adapter, LoraAdapter):
            lora = self.adapter.options  # another rank, the same scaling alpha / r
            self.adapter = self.adapter.replace(r=r, alpha=lora.alpha * r / lora.r)
        return self.adapter.apply(model, layers=layers)

    def make_strategy(self) -> Strategy:
        shapes = {n: p.shape for n, p in self.trainable().items()}
        frozen = {k: p.detach() for k, p in self.emulator_params.items()}  # (a client's: unused)
        return SubModelStrategy(self.cfg.federation, self.spec, self.arch, shapes, frozen,
                                self.client_base.payload(), self.client_sizes)

    def _own_emulator(self) -> None:
        """Give the sub-model its own copies of the emulator layers of every stack (the full
        model's middle layers stay untouched)."""
        for k, (b, e, _) in enumerate(self.layouts):
            blocks = self.arch.blocks(self.sub, k)  # the sub-model's own list
            for j in range(len(b), len(b) + len(e)):
                blocks[j] = copy.deepcopy(blocks[j])

    def _emulator_params(self) -> dict[str, nn.Parameter]:
        """The emulator layers' parameters (every stack) by sub-model name."""
        layers = [self.arch.blocks(self.sub, k)[j] for k, (b, e, _) in enumerate(self.layouts)
                  for j in range(len(b), len(b) + len(e))]
        return named_params(self.sub, layers)

    def _emulator_pairs(self) -> list[tuple[int, int, int]]:
        """(stack, global index of its last emulator layer in the sub-model, global index of its
        last middle layer in the full model): the outputs the emulator distillation matches."""
        sub_at = full_at = 0
        out = []
        for k, (b, e, t) in enumerate(self.layouts):
            L = self.spec.stacks[k].num_layers
            out.append((k, sub_at + len(b) + len(e) - 1, full_at + L - len(t) - 1))
            sub_at, full_at = sub_at + len(b) + len(e) + len(t), full_at + L
        return out

    def _distill_emulator(self, full: nn.Module) -> tuple[DistillLog, bool]:
        """The emulator copies, trained so that their output matches the middle layers' (per
        stack; an encoder-decoder's decoder reads the corpus teacher-forced, the mean over stacks)."""
        d = self.opts.distill
        params, pairs = self.emulator_params, self._emulator_pairs()
        corpus = make_corpus(self.cfg, d, self.task, self.loaded, d.steps, "method.distill.corpus")

        def loss(s_layers, t_layers, batch):  # emulator output vs the middle layers' output
            value = sum(hidden_loss(s_layers[s], t_layers[t], stack_mask(self.arch, k, batch))
                        for k, s, t in pairs) / len(pairs)
            return value, {"loss": float(value.detach())}

        def run() -> DistillLog:
            log.info("fedot: emulator distillation, %d steps", d.steps)
            return distill(self.sub, full, self.arch, params, corpus.split, loss, steps=d.steps, lr=d.lr,
                           warmup=d.warmup, batch_size=d.batch_size, seed=d.seed_or(self.cfg.seed))
        layers = [list(x) for x in self.layouts[0]] if len(self.layouts) == 1 else \
            [[list(x) for x in lay] for lay in self.layouts]
        skip = tuple(p for p in (self.adapter.prefix, "classifier") if p)
        inputs = {"kind": "fedot-emulator-kd", "model": cache.weights_fingerprint(full, skip),
                  "layers": layers, "steps": d.steps,
                  "seed": d.seed_or(self.cfg.seed), **corpus.cache_inputs()}
        return cached_distill(cache.cache_root(d.cache_dir), inputs, params, run)

    # -- client ------------------------------------------------------------------------------
    def client_model(self, payload: Payload) -> tuple[nn.Module, dict[str, nn.Parameter]]:
        """The adapter + emulator model, with the payload (sub-model names) loaded."""
        arrays = dict(payload.arrays)
        frozen = {k: arrays.pop(k) for k in list(arrays) if k.startswith(FROZEN_PREFIX)}
        if frozen:
            self._load_emulator(frozen)
        elif self.emulator_params and not self.emulator_held:
            raise RuntimeError(f"client {payload.config.get('client')}: no distilled emulator on this "
                               "worker and none in the payload (its copy was lost)")
        self.client_base.receive(payload.model, f"client {payload.config.get('client')}")
        params = self.trainable(self.sub)
        self.load_state(params, arrays)
        return self.sub, params

    def client_state(self) -> State:
        """The sub-model this client received (kept between its participations): the distilled
        emulator and the other frozen tensors."""
        if self.role != "client":
            return {}
        out = self.client_base.state()
        if self.emulator_held:
            out.update({FROZEN_PREFIX + k: p.detach().clone() for k, p in self.emulator_params.items()})
        return out

    def load_client_state(self, state: State) -> None:
        self._load_emulator(state)
        self.client_base.load_state(state)

    @torch.no_grad()
    def _load_emulator(self, state: State) -> None:
        if self.role != "client":
            return
        kept = {k[len(FROZEN_PREFIX):]: t for k, t in state.items() if k.startswith(FROZEN_PREFIX)}
        if kept and set(kept) != set(self.emulator_params):
            raise RuntimeError(f"emulator tensors {sorted(kept)} do not match this sub-model's "
                               f"{sorted(self.emulator_params)}")
        for k, t in kept.items():
            self.emulator_params[k].copy_(t)
        self.emulator_held = bool(kept)

    # -- reporting ---------------------------------------------------------------------------
    def final_metrics(self, state: State, data: Any, records: list[dict[str, Any]],
                      batch_size: int) -> dict[str, Any]:
        self.eval_model(state)  # the adapter is shared: the sub-model holds it too
        full_p, sub_p = transformer_params(self.model, self.arch), transformer_params(self.sub, self.arch)
        out = {**sub_accuracy(self.task, self.sub, data, batch_size), "full_transformer_params": full_p,
               "proxy_transformer_params": sub_p, "proxy_param_fraction": sub_p / full_p,
               "adapter_layers": self.bottom + self.top, "emulator_layers": self.emulator,
               "emulator_distilled": self.kd_log is not None, "kd_before_cached": self.kd_cached}
        if self.kd_log is not None:
            out.update(self.kd_log.summary("kd_before"))
        return out

    @classmethod
    def report_views(cls, folder, config, metrics, summary) -> list:
        from fedslice.distill.report import distill_view
        view = distill_view(folder, "fedot_distill", "Emulator distillation (fedot)")
        return [view] if view else []

    def write_artifacts(self, folder: Path) -> None:
        write_curves(folder, "fedot_distill", {"emulator KD before FL": self.kd_log},
                     plot=self.cfg.output.plots,
                     extra={"cached": self.kd_cached, "emulator_layers": self.emulator})


register_method(name="fedot", options_cls=FedOTMethod, method_cls=FedOT)
