"""The server side of ``raffm``: its strategy (payloads, weighting, server state). See
:mod:`fedslice.methods.raffm`.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from fedslice.config import FederationConfig
from fedslice.fl.orders import Orders, order_fields
from fedslice.fl.strategy import Payload, Reply, State, Strategy
from fedslice.methods.plan_strategy import plan_config
from fedslice.methods.plan_records import ClientPlan
from fedslice.methods.raffm.options import RaFFMMethod
from fedslice.models.arch import ArchSpec
from fedslice.slicing.keys import sliceable_keys
from fedslice.slicing.permute import Permutation, permute_state
from fedslice.slicing.salience import model_salience, salience_order
from fedslice.slicing.spec import spec_from_dict
from fedslice.slicing.state import extract_state, scatter


class RaFFMStrategy(Strategy):
    """Per-client leading-slice payloads and slice aggregation over state dicts; owns the
    permutation of the global state (relative to the checkpoint's order)."""

    def __init__(self, fed: FederationConfig, opts: RaFFMMethod, arch: ArchSpec,
                 dims: list[Mapping[str, int]], plans: dict[int, ClientPlan],
                 adapter_scale: float | None, trainable: set[str] | None = None,
                 client_sizes: Mapping[int, int] | None = None, scales: State | None = None,
                 knob_defaults: Mapping[str, Any] | None = None,
                 activations: Callable[[State], dict] | None = None):
        super().__init__(fed, client_sizes)
        self.opts, self.arch, self.dims, self.plans = opts, arch, dims, plans
        #: frozen layer scales salience reads (DINOv2); the state's own values win
        self.scales = dict(scales or {})
        #: trainable tensor names with the layer index replaced by '#' (None: every tensor)
        self.trainable = None if trainable is None else {_generic(k) for k in trainable}
        self.adapter_scale = adapter_scale  # the adapter's scale in salience (LoRA: alpha / r)
        self.perm = Permutation.identity(dims)
        #: the method's knobs where a plan sets none (:meth:`fedslice.methods.base.Method.orders`)
        self.knob_defaults = dict(knob_defaults or {})
        #: salience = 'activation': state -> the output projections' mean |input| of the model
        #: holding that state over the calibration batch (the method's calibration forward)
        self.activations = activations

    # -- ordering ----------------------------------------------------------------------------
    def reorder(self, state: State) -> State:
        """Salience-order heads and neurons of ``state``; tracks the cumulative permutation."""
        acts = None
        if self.opts.salience == "activation":
            if self.activations is None:
                raise RuntimeError("salience = 'activation': the strategy was given no "
                                   "calibration forward (RaFFMStrategy(activations=...))")
            acts = self.activations(state)
        sal = model_salience({**self.scales, **state}, self.arch, self.dims, self.opts.salience,
                             self.adapter_scale, acts)
        rel = salience_order(sal, self.dims, self.arch)
        self.perm = self.perm.then(rel)
        return permute_state(state, rel, self.arch)

    def initial(self, state: State) -> State:
        """The checkpoint's tensors salience-ordered (``method.reorder``; false: the
        checkpoint's order, an ablation); the permutation starts from the checkpoint's."""
        self.perm = Permutation.identity(self.dims)
        return self.reorder(state) if self.opts.reorder else state

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "perm": self.perm.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.perm = Permutation.from_dict(state["perm"])

    # -- configure ---------------------------------------------------------------------------
    def payload_for(self, server_round: int, state: State, client: int, config: dict) -> Payload:
        cp = self.plans[client]
        cfg = {**config, **order_fields(client=client), **plan_config(cp)}
        if cp.sits_out is not None:
            return Payload(arrays={}, config={**cfg, **order_fields(sit_out=cp.sits_out)})
        if self.orders(cfg).base_precision not in (None, "none"):
            # a client over a quantized copy of its slice quantizes once per order of the base
            cfg.update(order_fields(base_order=self.perm.digest))
        if self.opts.size_weight:
            cfg.update(order_fields(weight_factor=self.size_factor(client)))
        return Payload(arrays=extract_state(state, cp.knobs.spec, self.arch),
                       config={**cfg, **order_fields(spec=cp.knobs.spec.to_dict())})

    def orders(self, config) -> Orders:
        """A payload's orders, the method's knobs where its plan sets none."""
        return Orders.of(config).resolved(self.knob_defaults)

    def client_rank(self, client: int) -> int | None:
        return self.plans[client].knobs.rank

    def client_slice(self, payload: Payload):
        """The client's sub-model (its payload's spec; None for a client that sat out)."""
        spec = payload.orders.spec
        return None if spec is None else spec_from_dict(spec)

    def frozen_state_keys(self, trainable, frozen) -> list[str]:
        """The frozen q/k/v/o/FFN tensors: the global state holds them (permuted and sliced on
        the server, sent as frozen slices)."""
        return sliceable_keys(self.arch, list(frozen))

    def expected_update(self, state: State, payload: Payload, reply: Reply) -> State:
        """The trainable tensors of the client's slice (the frozen slices are sent, not returned)."""
        if self.trainable is None:
            return payload.arrays
        return {k: t for k, t in payload.arrays.items() if _generic(k) in self.trainable}

    # -- aggregate ---------------------------------------------------------------------------
    def size_factor(self, client: int) -> float:
        """f^p: the client's planned share of a dense client's FLOPs to the power
        ``size_weight`` (1 when p = 0)."""
        p = self.opts.size_weight
        return 1.0 if p == 0 else self.plans[client].flops_share ** p

    def client_factor(self, payload: Payload) -> float:
        """f^p, as the payload carries it (:meth:`size_factor` when it was made)."""
        return payload.orders.weight_factor

    def client_view(self, payload: Payload, shapes) -> tuple[State, dict]:
        """The trainable tensors of the client's slice scattered to full shape, held where its
        slice is (nothing for a client that sat out)."""
        if self.absent(payload) is not None:
            return {}, {}
        arrays = self.expected_update({}, payload, Reply({}, 0))
        return scatter({k: t for k, t in arrays.items()}, spec_from_dict(payload.orders.spec),
                       self.arch, shapes)

    def client_updates(self, server_round: int, state: State, payloads: dict[int, Payload],
                       replies: dict[int, Reply]) -> tuple[list[State], list]:
        """Slice aggregation: each client's delta scattered into full shape, weighted by its
        examples (x f^p) times its held-mask."""
        shapes = {k: t.shape for k, t in state.items()}
        deltas, weights = [], []
        for c in sorted(replies):
            sent, reply = payloads[c], replies[c]
            spec = spec_from_dict(sent.orders.spec)
            delta = {k: t.float() - sent.arrays[k].float() for k, t in reply.arrays.items()}
            full, masks = scatter(delta, spec, self.arch, shapes)
            deltas.append(full)
            w = float(reply.num_examples) * self.client_factor(sent)
            weights.append({k: w * m for k, m in masks.items()})
        return deltas, weights

    def after_aggregate(self, server_round: int, state: State) -> State:
        """Re-order every ``reorder_every`` rounds (after whatever rule combined the updates)."""
        every = self.opts.reorder_every
        if self.opts.reorder and every and server_round % every == 0:
            return self.reorder(state)
        return state


def _generic(name: str) -> str:
    """A tensor name without its layer index (a sub-model with fewer layers renumbers them)."""
    return re.sub(r"\.\d+\.", ".#.", name)
