"""The server side of ``heads``: its strategy (payloads, weighting, server state). See
:mod:`fedslice.methods.heads`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fedslice.fl.strategy import Payload, Reply, State, Strategy, Wrapper
from fedslice.fl.validation import check_num_examples, check_update
from fedslice.methods.heads.options import HeadsMethod
from fedslice.slicing.head_aggregate import HeadUpdate, combine_heads, head_deltas, heads_state
from fedslice.slicing.heads import keep_mask, mask_rows, num_rows, restrict, sub_dims, to_full
from fedslice.slicing.state import extract_state
from fedslice.slicing.keys import HeadPositions, key_info
from fedslice.slicing.spec import HEAD_PARTS


#: Reserved reply keys (not model tensors): the client's keep-mask and importance, both (R, H):
#: one row per (attention family, layer), stack by stack (:func:`mask_rows`).
KEPT = "heads.kept"


ALPHA = "heads.alpha"


def bounded_importance(alpha: torch.Tensor | None, kept: torch.Tensor) -> torch.Tensor | None:
    """α of one client divided by its mean over the client's kept heads: every client's Eq. 8
    weights average 1 on the heads it kept, so its total weight is its number of kept heads
    whatever it reports. Eq. 8 is a ratio per head, so this changes only how clients compare,
    not how one client ranks its heads: a client claiming α = 1 everywhere weighs as much on a
    head as an honest one of average confidence there, instead of taking every head."""
    if alpha is None:
        return None
    mean = alpha[kept].float().mean() if bool(kept.any()) else torch.tensor(1.0)
    return alpha.float() / mean


class HeadsStrategy(Wrapper):
    """The head stage's server side, around the strategy of the stage below it (``inner``:
    FedAvg's over the full model, RaFFM's over per-client sub-models), which keeps choosing the
    payloads, the global state's layout and the work after aggregating. Replies carry only the
    kept heads' tensors of the client's model (the inner strategy's slice,
    :meth:`~fedslice.fl.strategy.Strategy.client_slice`, restricted to the heads the client
    kept); this strategy validates them and aggregates with Eq. 8 (or FedAvg per head), times
    the inner strategy's per-client factor."""

    def __init__(self, inner: Strategy, opts: HeadsMethod, arch, dims: list[dict[str, int]],
                 positions: Mapping[str, HeadPositions] | None = None,
                 knob_defaults: Mapping[str, Any] | None = None):
        super().__init__(inner)
        self.opts, self.arch, self.dims = opts, arch, dims  # dims: one dict per stack
        #: the method's knobs where a plan sets none (:meth:`fedslice.methods.base.Method.orders`)
        self.knob_defaults = dict(opts.knob_defaults() if knob_defaults is None else knob_defaults)
        #: adapter tensors outside the blocks that map to heads (a prefix), by name
        self.positions = dict(positions or {})

    @property
    def mask_shape(self) -> tuple[int, int]:
        return num_rows(self.dims), self.dims[0]["num_heads"]

    def _kept(self, reply: Reply) -> torch.Tensor:
        if KEPT in reply.arrays:
            return reply.arrays[KEPT].bool()
        return torch.ones(self.mask_shape, dtype=torch.bool)

    def expected_update(self, state: State, payload: Payload, reply: Reply) -> State:
        """The adapter slices of the heads the client kept (it reports which, in ``KEPT``), of
        the tensors the inner strategy expects back: every non-empty one, except the attention
        adapter of a (family, layer) that kept no head (it gets no gradient, and is not sent:
        :meth:`HeadStage.local_params`)."""
        kept = self._kept(reply)
        rows = mask_rows(self.dims)
        spec = self.inner.client_slice(payload)
        if spec is None:
            held = heads_state(state, kept, self.arch, self.dims, self.positions)
            layers = None
        else:
            wanted = self.inner.expected_update(state, payload, reply)
            narrowed = restrict(spec, kept, self.dims)
            held = {k: t for k, t in extract_state(state, narrowed, self.arch).items() if k in wanted}
            layers = [s.layers for s in narrowed.stacks]
        out = {}
        for k, t in held.items():
            info = key_info(self.arch, k)
            if t.numel() == 0:
                continue
            if info is not None and info.part in HEAD_PARTS:
                layer = info.layer if layers is None else layers[info.stack][info.layer]
                if not bool(kept[rows[(info.stack, info.family)] + layer].any()):
                    continue
            out[k] = t
        return out

    def check_reply(self, state: State, payload: Payload, reply: Reply) -> str | None:
        """The generic checks, plus the client's head reports: the keep-mask (bool, (R, H), as
        many heads as the sparsity keeps of the client's model, none outside it, and present
        exactly when the method prunes), the importance α of Eq. 8 (in (0, 1] on every kept
        head, 0 on the pruned ones) and the head metrics the run's summary reads (equal to the
        mask)."""
        orders = payload.orders.resolved(self.knob_defaults)
        size = self.client_sizes.get(orders.client)
        if reason := check_num_examples(reply.num_examples, size):
            return reason
        if reason := self.check_heads(reply, orders.sparsity, self.inner.client_slice(payload)):
            return reason
        model = {k: t for k, t in reply.arrays.items() if k not in (KEPT, ALPHA)}
        return check_update(self.expected_update(state, payload, reply), model, reply.num_examples,
                            reply.metrics, size)

    def expected_counts(self, spec, sparsity: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(heads a client keeps per row, or in all under 'global'; the heads it may keep) for a
        client of the full model (``spec`` None) or of a sub-model, at its orders' ``sparsity``."""
        o, s, mode = self.opts, sparsity, self.opts.count_mode
        if spec is None:
            want = keep_mask(torch.zeros(self.mask_shape), s, scope=o.scope, mode=mode)
            allowed = torch.ones(self.mask_shape, dtype=torch.bool)
        else:
            small = sub_dims(self.dims, spec)
            shape = (num_rows(small), small[0]["num_heads"])
            want = to_full(keep_mask(torch.zeros(shape), s, scope=o.scope, mode=mode,
                                     min_keep=1), spec, self.dims)
            allowed = to_full(torch.ones(shape, dtype=torch.bool), spec, self.dims)
        return (want.sum(1) if o.scope == "per_layer" else want.sum()), allowed

    def check_heads(self, reply: Reply, sparsity: float, spec=None) -> str | None:
        shape, o, s = self.mask_shape, self.opts, sparsity
        for key in (KEPT, ALPHA):
            t = reply.arrays.get(key)
            if t is not None and not isinstance(t, torch.Tensor):
                return f"{key} is a {type(t).__name__}, not a tensor"
            if t is not None and tuple(t.shape) != shape:
                return f"{key} has shape {tuple(t.shape)}, expected {shape}"
        if (KEPT in reply.arrays) != (o.pruning != "none"):
            return (f"a keep-mask ({KEPT}) with method.pruning = 'none'" if KEPT in reply.arrays
                    else f"no keep-mask ({KEPT}) with method.pruning = {o.pruning!r}")
        kept = self._kept(reply) if KEPT not in reply.arrays else reply.arrays[KEPT]
        if kept.dtype != torch.bool:
            return f"{KEPT} has dtype {kept.dtype}, expected torch.bool"
        want, allowed = self.expected_counts(spec, s)
        if KEPT not in reply.arrays:  # pruning 'none': every head of the client's model
            kept = allowed
        if bool((kept & ~allowed).any()):
            return f"{KEPT} keeps heads outside the client's sub-model"
        got = kept.sum(1) if o.scope == "per_layer" else kept.sum()
        if not torch.equal(got, want):
            return (f"{KEPT} keeps {got.tolist()} heads, sparsity {s:g} ({o.scope}) "
                    f"keeps {want.tolist()}")
        alpha = reply.arrays.get(ALPHA)
        if o.aggregation == "head_weighted":
            if alpha is None:
                return f"no importance vector ({ALPHA}) for head-weighted aggregation"
            if not alpha.is_floating_point() or not bool(torch.isfinite(alpha).all()):
                return f"importance {ALPHA} is not finite floating point"
            if bool((alpha[~kept] != 0).any()):
                return f"importance {ALPHA} is not 0 on a pruned head"
            if bool(((alpha[kept] <= 0) | (alpha[kept] > 1)).any()):
                return (f"importance {ALPHA} is outside (0, 1] on a kept head (a mean attention "
                        "probability)")
        elif alpha is not None:
            return f"an importance vector ({ALPHA}) with method.aggregation = {o.aggregation!r}"
        if "head_kept" in reply.metrics and reply.metrics["head_kept"] != kept.flatten().int().tolist():
            return "metric head_kept differs from the keep-mask"
        if "head_importance" in reply.metrics and \
                len(reply.metrics["head_importance"] or []) != kept.numel():
            return f"metric head_importance does not hold {kept.numel()} values"
        return None

    def client_updates(self, server_round: int, state: State, payloads: dict[int, Payload],
                       replies: dict[int, Reply]) -> tuple[list[State], list]:
        """Head-pruned updates scattered to full shape; weights α_hc (Eq. 8) or |D_c| on the
        kept heads, |D_c| elsewhere (times the inner strategy's factor of the client)."""
        updates = []
        for c, r in sorted(replies.items()):
            kept = self._kept(r)
            spec = self.inner.client_slice(payloads[c])
            if spec is not None and KEPT not in r.arrays:
                kept = self.expected_counts(spec, payloads[c].orders.resolved(self.knob_defaults).sparsity)[1]
            updates.append(HeadUpdate(
                {k: t for k, t in r.arrays.items() if k not in (KEPT, ALPHA)}, kept,
                bounded_importance(r.arrays.get(ALPHA), kept), r.num_examples,
                spec=None if spec is None else restrict(spec, kept, self.dims),
                factor=self.inner.client_factor(payloads[c])))
        return head_deltas(state, updates, self.arch, self.dims, self.opts.aggregation, self.positions)

    def mean(self, server_round: int, state: State, deltas: list[State], weights: list) -> State:
        return combine_heads(state, deltas, weights, self.arch, self.dims, eta=self.fed.server_lr,
                             eps=self.opts.eps, positions=self.positions)

    def combine(self, server_round: int, state: State, deltas: list[State], weights: list,
                replies: dict[int, Reply]) -> tuple[State, dict]:
        """This stage's :meth:`mean` (not the inner strategy's)."""
        return self.mean(server_round, state, deltas, weights), {}
