"""The ``fedpft`` method: model preparation, a client's local training and the server's round
end. See :mod:`fedslice.methods.fedpft`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fedslice import measure
from fedslice.config import ExperimentConfig
from fedslice.data.batching import TokenizedSplit, iter_batches
from fedslice.distill import cache
from fedslice.distill.apoz import (aggregate_apoz, apoz_report, count_near_zero, select_neurons,
                                   split_report)
from fedslice.distill.loop import DistillLog, block_masks, decoder_start, distill, teacher_forced
from fedslice.distill.losses import layer_kd_loss
from fedslice.distill.report import write_curves
from fedslice.fl.strategy import Payload, Reply, State, Strategy, find_inner
from fedslice.methods.facts import Facts
from fedslice.methods.plan_records import PlannedModel
from fedslice.methods.base import Method, Role, Side
from fedslice.methods.fedpft.options import FedPFTMethod, KD_BEFORE, KD_DURING, UPDATE_PREFIX
from fedslice.methods.fedpft.orders import ProxyOrders
from fedslice.methods.fedpft.proxy import (build_proxy, compressed_layers, compressed_units, ffn_modules,
                                           ffn_weights, global_layer, proxy_slice, stack_offsets)
from fedslice.methods.fedpft.refit import head_params, refit_head, soft_targets
from fedslice.methods.fedpft.strategy import FedPFTStrategy
from fedslice.methods.submodel import (ClientBase, Corpus, cached_distill, make_corpus,
                                       concat_logs, named_params, sub_accuracy, sub_seed,
                                       transformer_params)
from fedslice.models.loading import LoadedModel, materialize
from fedslice.slicing.keys import key_info
from fedslice.slicing.salience import model_salience, output_activations
from fedslice.slicing.spec import ModelSlice
from fedslice.tasks import Task

log = logging.getLogger(__name__)


class FedPFT(Method):
    name = "fedpft"
    #: each client's fit loads the proxy's re-distilled neurons into the proxy this process
    #: holds (and checks its version): that copy must persist, so clients train in this process
    parallel_clients = False
    client_model_from_server = True
    quantized_base = ("its clients train a model the server builds and sends (a proxy or "
                      "emulator); quantizing that client model is not wired yet")
    adapters = None  # an adapter inside the attention modules (check_config)

    @classmethod
    def facts(cls, cfg: ExperimentConfig) -> Facts:
        """Clients report APoZ statistics when neuron-level KD runs during FL."""
        if cfg.method.kd in KD_DURING:
            return super().facts(cfg).but(client_statistics=(
                f"method.kd={cfg.method.kd!r} (neuron-level KD during FL re-distils the "
                "neurons chosen by the clients' APoZ statistics of their data; set "
                "method.kd = 'before', layer-level KD on the server's corpus only, or 'none')"))
        return super().facts(cfg)

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
        steps = cfg.method.head_refit_steps
        if steps and (cfg.task.kind == "generation" or cfg.task.label_words):
            what = "generation" if cfg.task.kind == "generation" else "classification with label_words"
            raise ValueError(f"method.head_refit_steps = {steps}: the head re-fit distils the proxy's "
                             f"class probabilities into the full model's classifier; task {what} has "
                             "no classifier head (the LM head is tied to the embeddings): set "
                             "method.head_refit_steps = 0")

    def __init__(self, cfg: ExperimentConfig, loaded: LoadedModel, task: Task,
                 role: Role = "both", client_sizes: Mapping[int, int] | None = None, **kw):
        self.loaded = loaded  # the preprocessor and config the distillation corpus is encoded with
        self.opts: FedPFTMethod = cfg.method
        self.align_logs: list[DistillLog] = []
        self.align_records: list[dict[str, Any]] = []
        self.refit_log: DistillLog | None = None  # the head re-fit after the last round
        self.proxy_head: State = {}  # the classifier as FL trained it (the proxy's), once re-fit
        self.held_version: int | None = None  # proxy version of this worker's copy (client side)
        super().__init__(cfg, loaded, task, role, client_sizes, **kw)

    # -- construction ----------------------------------------------------------------------
    def prepare_model(self, model: nn.Module) -> nn.Module:
        """LoRA on attention of the full model, then the proxy and its layer-level KD. A client
        (role "client") has the model's shape only (meta device): its proxy keeps the leading
        neurons, gets zeros now and the server's values in its first payload."""
        o = self.opts
        # a client gets the distilled proxy in its payload: no corpus, no distillation there
        self.corpus = self._corpus(model) if self.role != "client" else None
        self.spec = self._proxy_slice(model)
        full = self.teacher = self.adapter.apply(model)
        self.units = compressed_units(self.spec)  # global layer -> (stack, layer)
        self.compressed = list(self.units)
        self.proxy = build_proxy(full, self.spec, self.arch)
        if self.role == "client":
            materialize(self.proxy)  # the proxy's tensors only: the full model stays shapes
        ffns = [m for k, l in self.units.values() for m in ffn_modules(self.proxy, self.arch, k, l)]
        self.proxy_params = named_params(self.proxy, ffns)
        self.deploy_exclude = tuple(sorted(self.proxy_params))  # the deployed model is the full one
        self.client_base = ClientBase(self.proxy, self.proxy_params, from_server=self.role == "client")
        self.kd_before, self.kd_cached = None, False
        if o.kd in KD_BEFORE and self.compressed and o.distill.steps > 0 and self.role != "client":
            self.kd_before, self.kd_cached = self._layer_kd(full)
        return full

    def _proxy_slice(self, model: nn.Module) -> ModelSlice:
        """Every stack's neurons' saliency (``method.salience``; a gated neuron: gate row + up row
        + down column, or its gated activation) and the proxy's slice: ``whole_layers`` of each
        stack whole."""
        all_dims = self.arch.all_dims(model.config)
        rule = self.opts.salience
        if self.role == "client" or (rule == "activation" and self.corpus is None):
            # a client: shapes only (meta device), the leading neurons, values follow; no corpus
            # for "activation": no layer is compressed, no neuron needs ranking
            neurons = [None] * len(all_dims)
        else:
            acts = self._calibration_activations(model) if rule == "activation" else None
            sal = model_salience(model.state_dict(), self.arch, all_dims, rule, activations=acts)
            neurons = [[s.neurons for s in stack] for stack in sal]
        return proxy_slice(neurons, all_dims, self.opts.keep_ratio, self.opts.whole_layers)

    def _calibration_activations(self, model: nn.Module) -> dict:
        """The output projections' mean |input| (:func:`output_activations`) of the full
        ``model`` over the first ``calibration_examples`` passages of the corpus."""
        split, bs = self.corpus.split, self.opts.distill.batch_size
        rows = range(min(self.opts.calibration_examples, len(split)))
        start = decoder_start(model)
        batches = (teacher_forced(b, self.arch, start)
                   for b in iter_batches(split, rows, bs, shuffle=False, generator=None))
        return output_activations(model, self.arch, batches)

    def _corpus(self, model: nn.Module) -> Corpus | None:
        """The distillation corpus (checked now; an empty one fails before FL starts)."""
        o = self.opts
        compresses = any(compressed_layers(o.whole_layers, d["num_layers"])
                         for d in self.arch.all_dims(model.config))
        calibrates = o.salience == "activation"
        if (o.kd == "none" and not o.head_refit_steps and not calibrates) or not compresses:
            return None
        steps = max(o.distill.steps if o.kd in KD_BEFORE else 0, o.align_steps if o.kd in KD_DURING else 0,
                    o.head_refit_steps, -(-o.calibration_examples // o.distill.batch_size) if calibrates else 0)
        corpus = make_corpus(self.cfg, o.distill, self.task, self.loaded, steps, "method.distill.corpus")
        if o.kd in KD_DURING and o.align_steps > 0:
            _ = corpus.split  # packed now, not at the first alignment
        return corpus

    def make_strategy(self) -> Strategy:
        widths = self._widths()
        return FedPFTStrategy(self.cfg.federation, self.opts, self.arch, self.proxy_params, widths,
                              offsets=stack_offsets(self.spec), base=self.client_base.payload(),
                              client_sizes=self.client_sizes, max_tokens=self._max_example_tokens())

    def _max_example_tokens(self) -> int:
        """Real tokens one client example can hold, the bound of an APoZ report's count: the
        prompt (``data.max_length``), plus a decoder's target (``task.max_target_length``), which
        the causal layout feeds through the same stack (an encoder-decoder's encoder reads the
        prompt only)."""
        causal = getattr(self.task, "layout", None) == "causal"
        return self.cfg.data.max_length + (self.cfg.task.max_target_length if causal else 0)

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
    @contextmanager
    def planned_model(self, knobs) -> Iterator[PlannedModel]:
        """What every client trains and sends: the proxy (a client never sees the full model), at the method's
        own settings (it plans no budgets)."""
        yield PlannedModel(self.proxy, self.trainable(self.proxy))

    def client_model(self, payload: Payload) -> tuple[nn.Module, dict[str, nn.Parameter]]:
        return self.proxy, self._load(payload.arrays)

    def kept_state(self, side: Side) -> dict[str, Any]:
        """A client's: its proxy copy (compressed FFN tensors, and in the client role the rest
        of the proxy, ``base.*``) and its version. The server's: the distillation logs and the
        proxy version the clients hold."""
        if side == "server":
            return self._server_state()
        if self.held_version is None:
            return {}
        kept = {k: p.detach().clone() for k, p in self.proxy_params.items()}
        return {**kept, **self.client_base.state(), "proxy_version": torch.tensor(self.held_version)}

    def restore_state(self, side: Side, state: dict[str, Any]) -> None:
        if side == "server":
            self._load_server_state(state)
        else:
            self._load_client_state(state)

    @torch.no_grad()
    def _load_client_state(self, state: State) -> None:
        self.held_version = int(state["proxy_version"]) if "proxy_version" in state else None
        for k, t in state.items():
            if k in self.proxy_params:
                self.proxy_params[k].copy_(t)
        self.client_base.load_state(state)

    def _check_copy(self, payload: Payload) -> None:
        """Refuse an incremental proxy update that does not start from this process's copy (a
        client id served by another worker before): the client fails this round, and the server
        sends it the whole proxy next time (``FedPFTStrategy.aggregate_train``)."""
        proxy = ProxyOrders.of(payload.config)
        if proxy.version is None:
            return
        if proxy.base is not None and (self.held_version is None or self.held_version < proxy.base):
            raise RuntimeError(f"client {payload.orders.client}: the proxy update starts from "
                               f"version {proxy.base}, this worker holds version {self.held_version}")
        self.held_version = proxy.version

    def fit(self, payload: Payload, data: TokenizedSplit, seed: int) -> Reply:
        """Local training of the proxy; in alignment rounds, APoZ on the local data first."""
        self._check_copy(payload)
        self.client_base.receive(payload.model, f"client {payload.orders.client}")
        count, proxy = None, ProxyOrders.of(payload.config)
        if proxy.report_apoz:
            self._load(payload.arrays)
            count = count_near_zero(self.proxy, self.arch, self.compressed, data,
                                    payload.orders.batch_size, proxy.apoz_tau,
                                    self.opts.apoz_max_examples, seed)
        reply = super().fit(payload, data, seed)
        if count is not None:
            report = apoz_report(count.counts, count.layer_tokens)
            reply.arrays.update(report)
            measure.ClientCost.add(reply.metrics, bytes_up=measure.tensor_bytes(report),
                                   params_up=measure.num_params(report), flops_measured=count.flops)
            reply.metrics.update(flops_apoz=count.flops, apoz_tokens=count.tokens)
        return reply

    # -- server ------------------------------------------------------------------------------
    def on_round_end(self, server_round: int, state: State,
                     replies: dict[int, Reply]) -> tuple[State, dict[str, Any]]:
        """Neuron-level KD after every ``align_every``-th round (Sec. 3.5); after the last round
        the head re-fit (``method.head_refit_steps``)."""
        state, metrics = self._align(server_round, state, replies)
        last = server_round == self.cfg.federation.rounds
        if last and self.opts.head_refit_steps and self.corpus is not None:
            state, refit = self._refit_head(server_round, state)
            metrics = {**metrics, **refit}
        return state, metrics

    def _align(self, server_round: int, state: State,
               replies: dict[int, Reply]) -> tuple[State, dict[str, Any]]:
        """Neuron-level KD, in an alignment round."""
        if not find_inner(self.strategy, FedPFTStrategy).align_round(server_round):
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
        find_inner(self.strategy, FedPFTStrategy).proxy_changed(update)
        n = int(sum(int(m.sum()) for m in update.values()))
        self.align_logs.append(lg)
        rec = {"round": server_round, "neurons": n, **lg.summary("align"),
               "apoz_mean": {str(l): float(a.mean()) for l, a in apoz.items()}}
        self.align_records.append(rec)
        return new_state, {"align_neurons": n, **lg.summary("align")}

    def _refit_head(self, server_round: int, state: State) -> tuple[State, dict[str, Any]]:
        """Distil the proxy's predictions on the corpus into the full model's classifier (the
        plugged-in model's head); the proxy keeps the head FL trained (``proxy_head``)."""
        o, split = self.opts, self.corpus.split
        self._load(state)
        head = head_params(self.trainable(self.model), self.adapter.owns)
        self.proxy_head = {k: state[k].detach().clone() for k in head}
        t0 = time.perf_counter()
        targets, flops, tokens = soft_targets(self.proxy, split, o.distill.batch_size)  # (N, C)
        lg = refit_head(self.model, head, split, targets, steps=o.head_refit_steps, lr=o.head_refit_lr,
                        batch_size=o.distill.batch_size, temperature=o.head_refit_temperature,
                        seed=sub_seed(self.cfg.seed, server_round, 3))
        lg.flops, lg.tokens = lg.flops + flops, lg.tokens + tokens  # the targets' proxy pass too
        lg.time_s = time.perf_counter() - t0
        self.refit_log = lg
        new_state = {**state, **{k: p.detach().clone() for k, p in head.items()}}
        return new_state, {**lg.summary("head_refit"), "head_refit_examples": len(split)}

    def _server_state(self) -> dict[str, Any]:
        return {"align_logs": [lg.to_dict() for lg in self.align_logs],
                "align_records": self.align_records, "held_version": self.held_version,
                "refit_log": None if self.refit_log is None else self.refit_log.to_dict(),
                "proxy_head": self.proxy_head}

    def _load_server_state(self, state: dict[str, Any]) -> None:
        self.align_logs = [DistillLog.from_dict(d) for d in state["align_logs"]]
        self.align_records = list(state["align_records"])
        self.held_version = state["held_version"]
        refit = state.get("refit_log")  # absent in a checkpoint of an older version
        self.refit_log = None if refit is None else DistillLog.from_dict(refit)
        self.proxy_head = dict(state.get("proxy_head") or {})

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

    def proxy_model(self, state: State) -> nn.Module:
        """The proxy with ``state`` loaded; after a head re-fit, with the head FL trained."""
        self._load({**state, **self.proxy_head})
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
        if self.refit_log is not None:
            out.update(self.refit_log.summary("head_refit"))
        return out

    @classmethod
    def report_views(cls, folder, config, metrics, summary) -> list:
        from fedslice.distill.report import distill_view
        view = distill_view(folder, "fedpft_distill", "Distillation (fedpft)")
        return [view] if view else []

    def write_artifacts(self, folder: Path) -> None:
        phases = {"layer-level KD before FL": self.kd_before,
                  "neuron-level KD during FL": concat_logs(self.align_logs),
                  "head re-fit after FL": self.refit_log}
        write_curves(folder, "fedpft_distill", phases, plot=self.cfg.output.plots,
                     extra={"cached": self.kd_cached, "compressed_layers": self.compressed,
                            "kept_neurons": self._widths()[self.compressed[0]] if self.compressed else None,
                            "alignments": self.align_records})


