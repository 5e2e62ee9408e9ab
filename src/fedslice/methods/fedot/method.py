"""The ``fedot`` method: model preparation, a client's local training and the server's round
end. See :mod:`fedslice.methods.fedot`.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fedslice.config import ExperimentConfig
from fedslice.distill import cache
from fedslice.distill.loop import DistillLog, distill, stack_mask
from fedslice.distill.losses import hidden_loss
from fedslice.distill.report import write_curves
from fedslice.errors import ConfigError
from fedslice.fl.strategy import Payload, State, Strategy
from fedslice.methods.plan_records import PlannedModel
from fedslice.methods.base import Method, Role, Side
from fedslice.methods.fedot.layout import fedot_layout, FROZEN_PREFIX
from fedslice.methods.fedot.options import FedOTMethod
from fedslice.methods.fedot.strategy import SubModelStrategy
from fedslice.methods.submodel import (ClientBase, cached_distill, make_corpus,
                                       named_params, sub_accuracy, transformer_params)
from fedslice.models.loading import LoadedModel, materialize
from fedslice.peft import LoraAdapter
from fedslice.slicing.spec import ModelSlice, SliceSpec
from fedslice.slicing.surgery import extract_model
from fedslice.tasks import Task

log = logging.getLogger(__name__)


class FedOT(Method):
    name = "fedot"
    batched_clients = True  # every client trains the same adapter + emulator sub-model
    client_model_from_server = True
    quantized_base = ("its clients train a model the server builds and sends (a proxy or "
                      "emulator); quantizing that client model is not wired yet")
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
                 role: Role = "both", client_sizes: Mapping[int, int] | None = None, **kw):
        self.loaded = loaded  # the preprocessor and config the distillation corpus is encoded with
        self.opts: FedOTMethod = cfg.method
        super().__init__(cfg, loaded, task, role, client_sizes, **kw)

    def prepare_model(self, model: nn.Module) -> nn.Module:
        o = self.opts
        all_dims = self.arch.all_dims(model.config)
        #: (bottom adapter, emulator, top adapter) layers of every stack
        self.layouts = [fedot_layout(d["num_layers"], o.bottom_layers, o.top_layers, o.emulator_layers)
                        for d in all_dims]
        self.bottom_layers, self.emulator, self.top_layers = self.layouts[0]  # the first (an encoder's or decoder's only) stack
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
        if self.arch.head_bias and not self.bottom_layers:
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
    @contextmanager
    def planned_model(self, knobs) -> Iterator[PlannedModel]:
        """What every client trains and sends: the adapter layers at both ends around the emulator, at the method's
        own settings (it plans no budgets)."""
        yield PlannedModel(self.sub, self.trainable(self.sub))

    def client_model(self, payload: Payload) -> tuple[nn.Module, dict[str, nn.Parameter]]:
        """The adapter + emulator model, with the payload (sub-model names) loaded."""
        arrays = dict(payload.arrays)
        frozen = {k: arrays.pop(k) for k in list(arrays) if k.startswith(FROZEN_PREFIX)}
        if frozen:
            self._load_emulator(frozen)
        elif self.emulator_params and not self.emulator_held:
            raise RuntimeError(f"client {payload.orders.client}: no distilled emulator on this "
                               "worker and none in the payload (its copy was lost)")
        self.client_base.receive(payload.model, f"client {payload.orders.client}")
        params = self.trainable(self.sub)
        self.load_state(params, arrays)
        return self.sub, params

    def kept_state(self, side: Side) -> State:
        """A client's: the sub-model it received (kept between its participations): the
        distilled emulator and the other frozen tensors."""
        if side != "client" or self.role != "client":
            return {}
        out = self.client_base.state()
        if self.emulator_held:
            out.update({FROZEN_PREFIX + k: p.detach().clone() for k, p in self.emulator_params.items()})
        return out

    def restore_state(self, side: Side, state: State) -> None:
        if side != "client":
            return
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
               "adapter_layers": self.bottom_layers + self.top_layers, "emulator_layers": self.emulator,
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


