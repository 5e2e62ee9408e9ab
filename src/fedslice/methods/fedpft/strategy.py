"""The server side of ``fedpft``: its strategy (payloads, weighting, server state). See
:mod:`fedslice.methods.fedpft`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import torch

from fedslice.distill.apoz import split_report
from fedslice.fl.orders import order_fields
from fedslice.fl.strategy import Payload, Reply, State, Strategy
from fedslice.methods.fedpft.orders import ProxyOrders
from fedslice.methods.fedpft.options import FedPFTMethod, KD_DURING, UPDATE_PREFIX
from fedslice.methods.fedpft.proxy import global_layer
from fedslice.models.arch import ArchSpec
from fedslice.slicing.keys import key_info


class FedPFTStrategy(Strategy):
    """FedAvg of LoRA + classifier; keeps each client's proxy copy current and asks for APoZ
    reports in alignment rounds.

    A client's first payload carries the compressed FFN tensors whole; after re-alignments, a
    client that already holds a proxy receives only the re-distilled neurons since its copy
    (``proxy_update.<key>`` slices along the neuron axis plus ``proxy_update.<layer>.index``),
    as the paper's communication analysis assumes."""

    def __init__(self, fed, method: FedPFTMethod, arch: ArchSpec, proxy: Mapping[str, torch.Tensor],
                 widths: dict[int, int], offsets: tuple[int, ...] = (0,),
                 base: State | None = None, client_sizes: Mapping[int, int] | None = None,
                 max_tokens: int = 512):
        super().__init__(fed, client_sizes)
        self.max_tokens = max_tokens  # tokens of one example at most (data.max_length [+ target])
        self.method, self.arch, self.widths = method, arch, widths
        #: the proxy's compressed FFN tensors after layer KD (their values read once: :meth:`initial`)
        self.proxy = proxy
        self.offsets = offsets  # global index of each stack's first layer (widths' keys)
        self.base = dict(base or {})  # the proxy's other frozen tensors (Payload.model), constant
        self.updates: list[dict[int, torch.Tensor]] = []  # neuron masks of each re-alignment
        self.client_version: dict[int, int] = {}  # re-alignments included in the client's copy

    def initial(self, state: State) -> State:
        """The trainable state and the proxy's compressed FFN tensors (the server keeps them
        current: neuron-level KD re-distils them)."""
        return {**state, **{k: t.detach().cpu().clone() for k, t in self.proxy.items()}}

    @property
    def proxy_keys(self):
        """The names of the proxy's compressed FFN tensors, in the model's order."""
        return self.proxy.keys()

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
            cfg.update(ProxyOrders.entries(report_apoz=True, apoz_tau=self.method.apoz_tau))
        return cfg

    def payload_for(self, server_round: int, state: State, client: int, config: dict) -> Payload:
        """Whole proxy at first participation (compressed FFNs, and the rest as ``model``: the
        client has no other copy of the model), else the neurons re-distilled since its copy.
        ``proxy_version``/``proxy_base`` let the client check its copy (see ``_check_copy``)."""
        arrays = {k: v for k, v in state.items() if k not in self.proxy_keys}
        held = self.client_version.get(client)
        config = {**config, **order_fields(client=client), **ProxyOrders.entries(version=self.version)}
        if held is None:
            arrays.update({k: v for k, v in state.items() if k in self.proxy_keys})
        else:
            config.update(ProxyOrders.entries(base=held))
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
        asked = ProxyOrders.of(payload.config).report_apoz
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
        size = self.client_sizes.get(payload.orders.client)
        examples = min(n for n in (size, self.method.apoz_max_examples, reply.num_examples)
                       if n is not None)
        bound = examples * self.max_tokens
        if tokens > bound:
            return (f"apoz_tokens={tokens:g} is more than the {examples} examples it counted x "
                    f"{self.max_tokens} tokens (data.max_length [+ task.max_target_length]) = {bound}")
        return None

    def client_updates(self, server_round: int, state: State, payloads: dict[int, Payload],
                       replies: dict[int, Reply]) -> tuple[list[State], list]:
        """FedAvg of LoRA + classifier: the APoZ reports are not model tensors."""
        stripped = {c: Reply(split_report(r.arrays)[0], r.num_examples, r.metrics)
                    for c, r in replies.items()}
        return super().client_updates(server_round, state, payloads, stripped)
