"""Attention-head importance (confidence) and head keep-masks, on every architecture of the table.

Importance follows Voita et al. (2019), as used by Eq. 6 of the heads paper: for each attention
family (encoder self, decoder self, decoder cross: :attr:`ArchSpec.attention_outputs`), layer
and head, the max attention probability over the allowed keys for each query token, averaged
over the counted query tokens of an example, then over the examples. Allowed keys are real
(non-padding) tokens that are not special (the tokenizer's [CLS]/[SEP], BOS/EOS, padding and
the decoder start token): attention parked on them is a "no-op" and would make every head look
confident. An image backbone has no token ids: its prefix tokens (the class token, DeiT's
distillation token: ``ImageInput.prefix_tokens``) are left out of the keys, as [CLS] is in text
(attention parked on the class token, which carries no patch content until the classifier reads
it, would make a head look confident without localising anything), and every token, the class
token included, counts as a query (the class token's query is the one the classifier reads).
Causal self-attention: a query sees only itself and earlier keys, so its max runs over
the allowed keys among those; a query that sees one real token only (the first one: its softmax
has one entry, probability 1 whatever the head) or no allowed key is not counted. Decoder heads
also park attention on the first real token when the prompt has no BOS (an "attention sink":
on SmolLM2 + E2E the confidence has a Spearman correlation of 0.90 with the share of attention
on the first token); ``sink_keys`` = n also removes the first n real tokens of causal
self-attention from the allowed keys (0, the paper's rule, by default). Grouped-query
attention returns one weight map per *query* head: query heads are scored one by one.
transformers 5 has no ``head_mask``; attention weights need eager attention.

A keep-mask is one boolean (R, H) tensor whose rows are every (attention family, layer) pair,
stack by stack, family by family (:func:`mask_rows`): R = L for an encoder or a decoder-only
model, L_enc + 2 L_dec for an encoder-decoder. Every stack has the same head count H.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.nn as nn

from fedslice.compute import model_device, to_device
from fedslice.data.batching import TokenizedSplit, iter_batches
from fedslice.data.packing import segment_ids
from fedslice.errors import ConfigError, ModelError
from fedslice.models.arch import arch_for
from fedslice.slicing.aggregate import aggregate_deltas
from fedslice.slicing.keys import HeadPositions, KeyInfo, key_info
from fedslice.slicing.spec import ModelSlice, SliceSpec, Spec, kv_groups, stack_list
from fedslice.slicing.state import extract_state, scatter

Dims = Mapping[str, int] | Sequence[Mapping[str, int]]


def confidence(attentions: Iterable[torch.Tensor], query_mask: torch.Tensor,
               key_mask: torch.Tensor, causal: bool = False,
               segments: torch.Tensor | None = None) -> torch.Tensor:
    """Per-example head confidence.

    attentions: one (B, H, Tq, Tk) tensor of probabilities per layer.
    query_mask: (B, Tq), 1 on real query tokens.
    key_mask:   (B, Tk), 1 on keys that may be attended (not padding, not special).
    causal:     self-attention where query i sees keys <= i (then Tq = Tk and the real keys are
                the real queries).
    segments:   (B, T) of packed self-attention rows (``fedslice.data.packing.segment_ids``:
                the example of each token, 0 on padding): a query's keys are its own example's.
    Returns (B, L, H): mean over counted queries of the max over allowed keys; a query is counted
    if it is real, has an allowed key and (causal) sees 2+ real tokens. Packed: (B * S, L, H),
    one entry per (row, example slot), zero where a row holds fewer examples.
    """
    q, k = query_mask.bool(), key_mask.bool()
    allowed = k[:, None, :].expand(-1, q.shape[1], -1)                   # (B, Tq, Tk)
    same = None if segments is None else segments[:, :, None] == segments[:, None, :]  # (B, T, T)
    if same is not None:
        allowed = allowed & same
    counted = q & allowed.any(-1)                                        # (B, Tq)
    if causal:
        seen = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool, device=q.device).tril()  # (Tq, Tk)
        allowed = allowed & seen
        own = seen if same is None else seen & same                     # (B?, Tq, Tk)
        counted = q & allowed.any(-1) & ((q[:, None, :] & own).sum(-1) >= 2)
    w = counted.float()
    # packed: each counted query's weight in its example's mean, (B, Tq, S)
    slots = None if segments is None else \
        torch.nn.functional.one_hot(segments, int(segments.max()) + 1)[..., 1:].float() * w[:, :, None]
    out = []
    for att in attentions:
        peak = (att * allowed[:, None].to(att.dtype)).amax(dim=-1)         # (B, H, Tq)
        if slots is None:
            out.append((peak * w[:, None, :]).sum(-1) / w.sum(-1).clamp_min(1)[:, None])  # (B, H)
        else:
            sums = torch.einsum("bhq,bqs->bsh", peak, slots)              # (B, S, H)
            out.append((sums / slots.sum(1).clamp_min(1)[:, :, None]).flatten(0, 1))  # (B * S, H)
    return torch.stack(out, dim=1)                                       # (B, L, H) or (B * S, L, H)


def ensure_eager_attention(model: nn.Module) -> str:
    """Switch a HF model to eager attention (SDPA returns no weights); return the previous one."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    previous = getattr(base.config, "_attn_implementation", None) or "eager"
    if previous != "eager":
        try:
            base.set_attn_implementation("eager")
        except (ValueError, AttributeError, NotImplementedError) as e:
            raise ModelError(f"head importance needs eager attention weights, which "
                             f"{type(base).__name__} cannot provide: {e}") from None
    return previous


def _tokens(batch: dict[str, torch.Tensor], side: str, config) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids, mask) of one side of a batch. A decoder given no ``decoder_input_ids`` (BART's
    sequence classifier) reads the input shifted right after the decoder start token."""
    if side == "input":
        return batch["input_ids"], batch["attention_mask"]
    if "decoder_input_ids" in batch:
        ids = batch["decoder_input_ids"]
        return ids, batch.get("decoder_attention_mask", torch.ones_like(ids))
    ids, mask = batch["input_ids"], batch["attention_mask"]
    start = getattr(config, "decoder_start_token_id", None)
    start = ids.new_full((ids.shape[0], 1), -1 if start is None else int(start))
    return torch.cat([start, ids[:, :-1]], 1), torch.cat([torch.ones_like(mask[:, :1]), mask[:, :-1]], 1)


def drop_sinks(key_mask: torch.Tensor, n: int) -> torch.Tensor:
    """``key_mask`` (B, Tk) without the first ``n`` allowed keys of each row (any padding side)."""
    k = key_mask.bool()
    return k & (k.long().cumsum(-1) > n)


def first_keys(key_mask: torch.Tensor, segments: torch.Tensor, n: int) -> torch.Tensor:
    """(B, T): the first ``n`` allowed keys of each example of packed rows (``drop_sinks`` per
    example)."""
    k = key_mask.bool()
    seg = torch.nn.functional.one_hot(segments, int(segments.max()) + 1)[..., 1:] & k[:, :, None]  # (B, T, S)
    rank = seg.long().cumsum(1)                                          # (B, T, S)
    return ((rank <= n) & seg).any(-1)


def real_positions(att: torch.Tensor, tq: int, tk: int) -> torch.Tensor:
    """The weights (B, H, Tq, Tk) of the real queries and keys of a (B, H, P+Tq, P'+Tk) map:
    an adapter may prepend virtual tokens (prompt tuning: queries and keys) or keys (prefix
    tuning); like special tokens, they are not keys a head is confident about."""
    return att[..., att.shape[-2] - tq:, att.shape[-1] - tk:]


def batch_confidence_sums(out, batch: dict[str, torch.Tensor], model: nn.Module,
                          special: torch.Tensor, sink_keys: int = 0, arch=None
                          ) -> dict[str, torch.Tensor]:
    """{family name: (L, H)} sum over the examples of ``batch`` of the head confidence, from the
    attention weights of ``out`` (a model output run with ``output_attentions=True`` on
    ``batch``); ``special``: the token ids that are no keys, on the batch's device. The scoring
    of one batch of :func:`head_importance`, also used on a training batch's forward
    (``method.importance_source = "first_step"``)."""
    arch = arch_for(model) if arch is None else arch
    sums: dict[str, torch.Tensor] = {}
    for fam in arch.attention_outputs:
        atts = getattr(out, fam.output, None)
        if not atts:
            continue
        if arch.image is not None:  # (B, T): patches count, prefix tokens are no keys
            q_mask = batch["attention_mask"]
            keys = q_mask.bool().clone()
            keys[:, :arch.image.prefix_tokens] = False
        else:
            q_ids, q_mask = _tokens(batch, fam.queries, model.config)
            k_ids, k_mask = _tokens(batch, fam.keys, model.config)
            keys = k_mask.bool() & ~torch.isin(k_ids, special)   # (B, Tk)
        segments = None
        if "example_starts" in batch:  # packed rows (self-attention of one stack)
            segments = segment_ids(batch["attention_mask"], batch["position_ids"])
        if fam.causal and sink_keys:
            keys = drop_sinks(keys, sink_keys) if segments is None else \
                keys & ~first_keys(keys, segments, sink_keys)
        atts = [real_positions(a.detach(), q_mask.shape[1], keys.shape[1]) for a in atts]
        sums[fam.name] = confidence(atts, q_mask, keys, fam.causal, segments).sum(0)  # (L, H)
    return sums


@torch.no_grad()
def head_importance(model: nn.Module, data: TokenizedSplit, special_token_ids: Iterable[int],
                    batch_size: int = 64, sink_keys: int = 0) -> dict[str, torch.Tensor]:
    """Mean head confidence over ``data``: {family name: (L, H)} for each attention family of
    the model (``'encoder.self'``, ``'decoder.self'``, ``'decoder.cross'``); ``sink_keys``: the
    first allowed keys of causal self-attention that do not count (module docstring).

    Runs in inference mode with eager attention (restored afterwards).
    """
    if len(data) == 0:
        raise ValueError("head importance of an empty dataset")
    special = torch.tensor(sorted(set(special_token_ids)), dtype=torch.int64)
    arch = arch_for(model)
    previous = ensure_eager_attention(model)
    was_training = model.training
    model.eval()
    sums: dict[str, torch.Tensor] = {}
    try:
        order = torch.argsort(data.lengths, stable=True)
        device = model_device(model)
        special = special.to(device)
        for batch in iter_batches(data, order, batch_size, shuffle=False, generator=None):
            batch.pop("labels", None)
            batch = to_device(batch, device)
            out = model(**batch, output_attentions=True)
            for name, conf in batch_confidence_sums(out, batch, model, special, sink_keys,
                                                    arch).items():
                sums[name] = sums.get(name, 0) + conf
    finally:
        model.train(was_training)
        if previous != "eager":
            base = model.get_base_model() if hasattr(model, "get_base_model") else model
            base.set_attn_implementation(previous)
    if not sums:
        raise ModelError("the model returned no attention weights (output_attentions=True)")
    return {f: s / len(data) for f, s in sums.items()}


def keep_mask(importance: torch.Tensor, sparsity: float, *,
              mode: Literal["importance", "random", "none"] = "importance",
              scope: Literal["global", "per_layer"] = "global",
              generator: torch.Generator | None = None, min_keep: int = 0) -> torch.Tensor:
    """Boolean (L, H) mask of the heads a client keeps (Eq. 7 as a top-k rule).

    ``global`` keeps the round((1-s) * L * H) most important heads over all layers; ``per_layer``
    keeps round((1-s) * H) in every layer; at least ``min_keep`` (a small sub-model's client
    keeps one head where the rounding would keep none). ``random`` draws the kept heads from
    ``generator`` instead; ``none`` keeps every head. Ties in importance are broken by the
    head's index.
    """
    if not 0.0 <= sparsity < 1.0:
        raise ConfigError(f"sparsity must be in [0, 1), got {sparsity}")
    n_layers, n_heads = importance.shape
    if mode == "none" or sparsity == 0.0:
        return torch.ones(n_layers, n_heads, dtype=torch.bool)
    scores = importance.float() if mode == "importance" else \
        torch.rand(n_layers, n_heads, generator=generator)
    if scope == "global":
        k = max(min_keep, int(np.round((1 - sparsity) * n_layers * n_heads)))
        rows = [scores.flatten()]
    else:
        k = max(min_keep, int(np.round((1 - sparsity) * n_heads)))
        rows = list(scores)
    if k < 1:
        pool = f"of {n_layers * n_heads}" if scope == "global" else f"per layer of {n_heads}"
        raise ConfigError(f"sparsity {sparsity} keeps no head ({pool}): lower it")
    masks = []
    for row in rows:
        order = torch.argsort(row, descending=True, stable=True)
        m = torch.zeros_like(row, dtype=torch.bool)
        m[order[:k]] = True
        masks.append(m)
    return torch.cat(masks).view(n_layers, n_heads)


def _stacks(dims: Dims) -> list[Mapping[str, int]]:
    """Per-stack dims (a single Mapping is a one-stack model)."""
    return [dims] if isinstance(dims, Mapping) else list(dims)


def mask_rows(dims: Dims) -> dict[tuple[int, int], int]:
    """(stack, attention family) -> first row of its block of ``num_layers`` rows in a keep-mask."""
    out, r = {}, 0
    for k, d in enumerate(_stacks(dims)):
        for f in range(d.get("families", 1)):
            out[(k, f)] = r
            r += d["num_layers"]
    return out


def num_rows(dims: Dims) -> int:
    """Rows R of a keep-mask: one per (attention family, layer)."""
    return sum(d["num_layers"] * d.get("families", 1) for d in _stacks(dims))


def head_axes(names: Iterable[str], arch) -> dict[str, KeyInfo]:
    """Which adapter tensors in the blocks are split by attention head: name -> its
    :class:`KeyInfo` (stack, layer, family, part, axis).

    An adapter's tensor (:attr:`KeyInfo.adapter`) of an attention projection is head-tied when it
    has an axis along the projection's heads (:meth:`fedslice.peft.Adapter.tensor_axes`). For
    LoRA: on q/k/v (and a fused q|k|v), ``lora_B`` (out, r) has one block of head_dim rows per
    query (or key/value) head, per section of a fused one (axis 0); for the attention output
    projection the heads index its input, the columns of ``lora_A`` (r, in) (axis 1). ``lora_A``
    of q/k/v and ``lora_B`` of o mix all heads: not head-tied. DoRA's magnitudes of q/k/v follow
    ``lora_B``'s rows; IA3's vectors of q/k/v (out, 1) and o (1, in) are split the same way.
    """
    out = {}
    for n in names:
        info = key_info(arch, n)
        if info is not None and info.part in ("q", "k", "v", "qkv", "o") and info.axis is not None \
                and info.adapter is not None:
            out[n] = info
    return out


def head_weight(per_head: torch.Tensor, info: KeyInfo, dims: Mapping[str, int],
                kv_reduce: Literal["sum", "max"] = "sum") -> torch.Tensor:
    """A per-query-head weight vector (H,) laid out along the head axis of the tensor ``info``
    describes, broadcastable against it: (rows, 1) or (1, cols).

    A key/value head of grouped-query attention gets the ``kv_reduce`` of its query heads' weights;
    a fused q|k|v repeats the vector in each of its three sections.
    """
    w = per_head.float()                                                 # (H,)
    kv = kv_groups(dims)
    if info.kind == "kv" and kv and info.family == 0:
        groups = w.view(kv, -1)                                          # (KV, H / KV)
        w = groups.sum(1) if kv_reduce == "sum" else groups.amax(1)      # (KV,)
    elif info.kind == "qkv":
        w = torch.cat([w, w, w])                                         # (3 H,)
    w = w.repeat_interleave(dims["head_dim"])                            # (rows,)
    return w[:, None] if info.axis == 0 else w[None, :]


# --------------------------------------------------------------------------------------------
# Masks as slice specs, and head-weighted aggregation (Eq. 8)
# --------------------------------------------------------------------------------------------

def mask_spec(mask: torch.Tensor, dims: Dims) -> ModelSlice:
    """The slice of a (R, H) keep-mask (:func:`mask_rows`): every layer of every stack, its kept
    heads per attention family (key/value heads follow their query heads), every FFN neuron."""
    stacks, rows = _stacks(dims), mask_rows(dims)
    if tuple(mask.shape) != (num_rows(dims), stacks[0]["num_heads"]):
        raise ValueError(f"keep-mask of shape {tuple(mask.shape)}, expected "
                         f"{(num_rows(dims), stacks[0]['num_heads'])}")
    out = []
    for k, d in enumerate(stacks):
        L = d["num_layers"]

        def heads(f: int) -> tuple[tuple[int, ...], ...]:
            block = mask[rows[(k, f)]:rows[(k, f)] + L].bool()          # (L, H)
            return tuple(tuple(int(h) for h in torch.nonzero(row).flatten()) for row in block)

        full = tuple(range(d["ffn"]))
        out.append(SliceSpec(tuple(range(L)), heads(0), (full,) * L, L, d["num_heads"],
                             d["head_dim"], d["ffn"], kv_groups(d),
                             heads(1) if d.get("families", 1) > 1 else None))
    return ModelSlice(tuple(out))


def _stack_slices(spec: Spec, dims: Dims) -> list[SliceSpec]:
    """One SliceSpec per stack of ``spec`` (a stack kept whole: its full spec)."""
    stacks = _stacks(dims)
    given = list(stack_list(spec)) + [None] * (len(stacks) - len(stack_list(spec)))
    return [SliceSpec.full(d) if s is None else s for s, d in zip(given, stacks)]


def sub_dims(dims: Dims, spec: Spec) -> list[dict[str, int]]:
    """The per-stack dims of the sub-model of ``spec`` as a keep-mask sees them: its kept layers
    and its heads per layer (which must be as many in every kept layer and family: RaFFM's
    width slices are; a ModelError otherwise), key/value heads likewise."""
    out = []
    for k, (d, s) in enumerate(zip(_stacks(dims), _stack_slices(spec, dims))):
        fams = range(d.get("families", 1))
        counts = {len(s.heads_of(j, f)) for j in range(len(s.layers)) for f in fams}
        kv = {len(s.kv_heads(j, 0)) for j in range(len(s.layers))}
        if len(counts) != 1 or len(kv) != 1 or 0 in counts:
            raise ModelError(f"stack {k}: a head stage over a sub-model needs the same number of "
                             f"heads in every kept layer, got {sorted(counts)} (key/value: {sorted(kv)})")
        h, m = counts.pop(), kv.pop()
        if h % m:
            raise ModelError(f"stack {k}: the sub-model keeps {h} query heads over {m} key/value "
                             "heads (a partial group): heads cannot be pruned inside it")
        out.append({**d, "num_layers": len(s.layers), "num_heads": h, "num_kv_heads": m,
                    "ffn": len(s.neurons[0])})
    return out


def to_full(sub: torch.Tensor, spec: Spec, dims: Dims) -> torch.Tensor:
    """A (R', H') per-head tensor of the sub-model of ``spec`` (keep-mask, importance) placed at
    its heads in the full model's (R, H) layout; zero (False) on every head outside the slice."""
    rows, sub_rows = mask_rows(dims), mask_rows(sub_dims(dims, spec))
    out = torch.zeros((num_rows(dims), _stacks(dims)[0]["num_heads"]), dtype=sub.dtype)
    for k, s in enumerate(_stack_slices(spec, dims)):
        for f in range(_stacks(dims)[k].get("families", 1)):
            for j, layer in enumerate(s.layers):
                heads = torch.tensor(s.heads_of(j, f), dtype=torch.long)
                out[rows[(k, f)] + layer, heads] = sub[sub_rows[(k, f)] + j, :len(heads)]
    return out


def restrict(spec: Spec, kept: torch.Tensor, dims: Dims) -> ModelSlice:
    """``spec`` keeping, in each of its layers, only the heads that the full-layout keep-mask
    ``kept`` (R, H) keeps: the slice a client of a sub-model trains after pruning heads in it
    (in the sub-model's order of heads)."""
    rows, out = mask_rows(dims), []
    for k, s in enumerate(_stack_slices(spec, dims)):
        def heads(f: int) -> tuple[tuple[int, ...], ...]:
            r = rows[(k, f)]
            return tuple(tuple(h for h in s.heads_of(j, f) if bool(kept[r + layer, h]))
                         for j, layer in enumerate(s.layers))

        cross = heads(1) if _stacks(dims)[k].get("families", 1) > 1 else None
        out.append(SliceSpec(s.layers, heads(0), s.neurons, s.num_layers, s.num_heads,
                             s.head_dim, s.ffn, s.num_kv_heads, cross))
    return ModelSlice(tuple(out))


@dataclass
class HeadUpdate:
    """One client's upload: its sub-state (full-model names, kept heads only), its (R, H) keep
    mask, its importance α_c (Eq. 7: 0 on pruned heads; None under FedAvg) and |D_c|."""

    arrays: Mapping[str, torch.Tensor]
    kept: torch.Tensor
    alpha: torch.Tensor | None
    num_examples: int
    #: the slice the client trained, in full-model indices (None: :func:`mask_spec` of ``kept``,
    #: the full model's kept heads); a sub-model's, restricted to its kept heads (:func:`restrict`)
    spec: Spec | None = None
    #: a factor on every weight of the client (RaFFM's f^p)
    factor: float = 1.0


def head_client_weights(update: HeadUpdate, keys: Iterable[str], masks: Mapping[str, torch.Tensor],
                        axes: Mapping[str, KeyInfo], dims: Dims,
                        mode: Literal["head_weighted", "fedavg"]) -> dict[str, torch.Tensor | float]:
    """Per-key weights of one client: α_hc on the rows/columns of head h of a head-tied tensor
    (``head_weighted``, Eq. 8; a key/value head: the sum of α over its kept query heads) or |D_c|
    on the kept heads (``fedavg``; a key/value head: while any query head of its group is kept);
    |D_c| times the held-mask on every other tensor (Eq. 5)."""
    n = float(update.num_examples)
    kept, stacks, rows = update.kept.bool(), _stacks(dims), mask_rows(dims)
    out: dict[str, torch.Tensor | float] = {}
    for k in keys:
        info = axes.get(k)
        if info is None:
            out[k] = n * masks[k]
            continue
        r = rows[(info.stack, info.family)] + info.layer
        if mode == "head_weighted":
            per_head, reduce = update.alpha[r].float() * kept[r], "sum"     # (H,)
        else:
            per_head, reduce = n * kept[r].float(), "max"
        w = head_weight(per_head, info, stacks[info.stack], reduce)
        if isinstance(keys, Mapping) and keys[k].dim() == 1:
            w = w.flatten()  # a vector along the head axis (DoRA's magnitudes): (rows,)
        out[k] = w * masks[k]
    return out


def aggregate_heads(global_state: Mapping[str, torch.Tensor], updates: Sequence[HeadUpdate],
                    arch, dims: Dims, *,
                    mode: Literal["head_weighted", "fedavg"] = "head_weighted",
                    eta: float = 1.0, eps: float = 1e-8,
                    positions: Positions | None = None) -> dict[str, torch.Tensor]:
    """Server update of the global trainable state from head-pruned clients (pure function).

    Head-tied LoRA tensors (q/k/v ``lora_B`` rows, o ``lora_A`` columns; :func:`head_axes`):
    ``p_h += eta * sum_c α_hc Δp_hc / (sum_c α_hc + eps)`` (Eq. 8), or the example-weighted mean
    over the clients that kept head h (``fedavg``). A head that no client kept is unchanged.
    A tensor outside the blocks that maps to heads (``positions``: a prefix's key/value columns)
    is weighted per key/value head the same way. Every other tensor: Eq. 5 over the clients that
    sent it (eps = 0).
    """
    deltas, weights = head_deltas(global_state, updates, arch, dims, mode, positions)
    return combine_heads(global_state, deltas, weights, arch, dims, eta=eta, eps=eps,
                         positions=positions)


Positions = Mapping[str, HeadPositions]


def kept_positions(pos: HeadPositions, kept: torch.Tensor, dims: Dims) -> torch.Tensor:
    """The entries along ``pos.axis`` that a client with the (R, H) keep-mask ``kept`` holds:
    those of a key/value head with a kept query head in its row (all of them under plain
    multi-head attention, where a key/value head is its query head)."""
    return torch.nonzero(_kv_kept(kept, dims)[pos.row, pos.kv]).flatten()


def _kv_kept(kept: torch.Tensor, dims: Dims) -> torch.Tensor:
    """(R, KV): a key/value head is kept while any query head of its group is."""
    kv = _stacks(dims)[0].get("num_kv_heads", kept.shape[1])
    return kept.bool().view(kept.shape[0], kv, -1).any(-1)


def position_cuts(positions: Positions, kept: torch.Tensor, dims: Dims
                  ) -> dict[str, tuple[torch.Tensor, int]]:
    """name -> (kept entries, axis) of each tensor outside the blocks that maps to heads (for
    :func:`fedslice.slicing.partial.partial_model`'s ``extra``)."""
    return {n: (kept_positions(p, kept, dims), p.axis) for n, p in positions.items()}


def heads_state(state: Mapping[str, torch.Tensor], kept: torch.Tensor, arch, dims: Dims,
                positions: Positions | None = None) -> dict[str, torch.Tensor]:
    """What a client with keep-mask ``kept`` holds of ``state``: the block tensors of its kept
    heads (:func:`extract_state` of :func:`mask_spec`), and of a tensor outside the blocks that
    maps to heads (a prefix: ``positions``) the entries of its kept key/value heads."""
    out = extract_state(state, mask_spec(kept, dims), arch)
    for name, pos in (positions or {}).items():
        if name in out:
            out[name] = out[name].index_select(pos.axis, kept_positions(pos, kept, dims))
    return out


def _position_weight(per_head: torch.Tensor, pos: HeadPositions, dims: Dims, shape,
                     reduce: Literal["sum", "max"]) -> torch.Tensor:
    """A per-(row, query head) weight (R, H) summed (or maxed) over each key/value head's group
    and laid out along ``pos.axis`` of a tensor of ``shape``, broadcastable against it."""
    kv = _stacks(dims)[0].get("num_kv_heads", per_head.shape[1])
    groups = per_head.float().view(per_head.shape[0], kv, -1)           # (R, KV, H / KV)
    w = (groups.sum(-1) if reduce == "sum" else groups.amax(-1))[pos.row, pos.kv]  # (N,)
    view = [1] * len(shape)
    view[pos.axis] = shape[pos.axis]
    return w.view(view)


def head_deltas(global_state: Mapping[str, torch.Tensor], updates: Sequence[HeadUpdate], arch,
                dims: Dims, mode: Literal["head_weighted", "fedavg"],
                positions: Positions | None = None
                ) -> tuple[list[dict[str, torch.Tensor]], list[dict[str, torch.Tensor | float]]]:
    """Each client's update scattered to full shape (zeros where not held) and its per-element
    weights (α on head-tied rows/columns, or |D_c| x held-mask). ``positions``: tensors outside
    the blocks that map to heads (a prefix), weighted per key/value head alike."""
    if mode == "head_weighted" and any(u.alpha is None for u in updates):
        raise ValueError("head_weighted aggregation needs every client's importance alpha")
    positions = positions or {}
    shapes = {k: t.shape for k, t in global_state.items()}
    axes = head_axes(global_state, arch)
    deltas, weights = [], []
    for u in updates:
        spec = mask_spec(u.kept, dims) if u.spec is None else u.spec
        if u.spec is None:
            g_sub = heads_state(global_state, u.kept, arch, dims, positions)
        else:  # a sub-model's slice: no prefix positions (RaFFM refuses such adapters)
            g_sub = extract_state(global_state, spec, arch)
        delta = {k: u.arrays[k].float() - g_sub[k].float() for k in u.arrays}  # sliced shapes
        outside = {k: delta.pop(k) for k in list(delta) if k in positions}
        full, masks = scatter(delta, spec, arch, shapes)
        w = head_client_weights(u, full, masks, axes, dims, mode)
        n, kept = float(u.num_examples), u.kept.bool()
        for k, d in outside.items():
            pos = positions[k]
            idx = kept_positions(pos, kept, dims)
            full[k] = torch.zeros(shapes[k]).index_copy_(pos.axis, idx, d)
            per_head = (u.alpha.float() * kept) if mode == "head_weighted" else n * kept.float()
            held = torch.zeros(shapes[k][pos.axis])
            held[idx] = 1.0
            view = [1] * len(shapes[k])
            view[pos.axis] = shapes[k][pos.axis]
            w[k] = _position_weight(per_head, pos, dims, shapes[k],
                                    "sum" if mode == "head_weighted" else "max") * held.view(view)
        if u.factor != 1.0:
            w = {k: u.factor * x for k, x in w.items()}
        deltas.append(full)
        weights.append(w)
    return deltas, weights


def combine_heads(global_state: Mapping[str, torch.Tensor], deltas, weights, arch,
                  dims: Dims, *, eta: float = 1.0, eps: float = 1e-8,
                  positions: Positions | None = None) -> dict[str, torch.Tensor]:
    """Eq. 8 (eps) on the head-tied tensors (``positions`` too), Eq. 5 (no eps) on the others."""
    axes = {**head_axes(global_state, arch), **(positions or {})}
    tied = {k: t for k, t in global_state.items() if k in axes}
    rest = {k: t for k, t in global_state.items() if k not in axes}
    new = aggregate_deltas(tied, deltas, weights, eta=eta, eps=eps)
    new.update(aggregate_deltas(rest, deltas, weights, eta=eta, eps=0.0))
    return {k: new[k] for k in global_state}


# --------------------------------------------------------------------------- pruned heads' means
class OutputMeans(dict):
    """(stack, family, layer) -> the mean input of that attention's output projection ``o`` (the
    heads' concatenated outputs, one block of ``head_dim`` columns per head) over the real tokens
    of the forwards run inside :func:`output_means`; filled when its ``with`` block ends. With
    ``regression``: also, per key, the moments a linear fill is fitted from
    (:class:`FillMoments`)."""

    def __init__(self) -> None:
        super().__init__()
        self.moments: dict[tuple[int, int, int], FillMoments] = {}


@dataclass
class FillMoments:
    """Sums over real tokens of one attention layer, ``h`` its input (what ``q`` reads) with a
    constant 1 appended, ``x`` its output projection's input: ``gram`` = sum h h^T (D+1, D+1),
    ``cross`` = sum h x^T (D+1, W), in float64; ``half_gram`` / ``half_cross`` the same sums
    over every other row of the forwards' batches (the 1st, 3rd, ... in order: an example, or
    a packed row of several), ``examples`` the rows seen: the two halves a ridge is
    cross-validated on (:func:`fill_ridge`)."""

    gram: torch.Tensor
    cross: torch.Tensor
    half_gram: torch.Tensor
    half_cross: torch.Tensor
    examples: int = 0


def _token_weights(x: torch.Tensor, masks: list[torch.Tensor]) -> torch.Tensor:
    """(B, T) weights of ``x`` (B, T, width): the 2-D attention mask of the forward call with
    x's shape (padding weighs 0), or ones where none has it."""
    m = next((m for m in masks if tuple(m.shape) == tuple(x.shape[:2])), None)
    return torch.ones(x.shape[:2], dtype=x.dtype, device=x.device) if m is None else m.to(x.dtype)


class output_means:  # noqa: N801 (a context manager, used like a function)
    """Context manager: hooks every attention output projection of ``model`` and, over the
    forwards run inside it, averages its input over the real tokens (``attention_mask`` /
    ``decoder_attention_mask`` of the call; every position where a call passes none of the
    right shape). Yields an :class:`OutputMeans`, filled on exit::

        with output_means(model) as means:
            head_importance(model, data, ...)
    """

    def __init__(self, model: nn.Module, arch=None, regression: bool = False):
        self.model, self.arch, self.regression = model, arch or arch_for(model), regression
        self.means = OutputMeans()

    def __enter__(self) -> OutputMeans:
        sums: dict[tuple[int, int, int], torch.Tensor] = {}
        counts: dict[tuple[int, int, int], torch.Tensor] = {}  # on x's device: no host sync
        inputs: dict[tuple[int, int, int], torch.Tensor] = {}  # each layer's q input, this call
        masks: list[torch.Tensor] = []

        def on_call(_module, _args, kwargs):
            masks[:] = [v for k, v in kwargs.items() if k.endswith("attention_mask")
                        and torch.is_tensor(v) and v.dim() == 2]

        def on_q(key):
            def hook(_module, args):
                inputs[key] = args[0].detach()
            return hook

        def on_o(key):
            def hook(_module, args):
                x = args[0].detach()
                w = _token_weights(x, masks)
                sums[key] = sums.get(key, 0) + (x.float() * w.float()[..., None]).sum((0, 1))
                counts[key] = counts.get(key, 0) + w.float().sum()
                h = inputs.pop(key, None)
                if self.regression and h is not None and h.shape[:2] == x.shape[:2]:
                    self._add_moments(key, h, x, w)
            return hook

        self.hooks = [self.model.register_forward_pre_hook(on_call, with_kwargs=True)]
        for k, stack in enumerate(self.arch.stacks):
            for j, block in enumerate(self.arch.blocks(self.model, k)):
                for f, att in enumerate(stack.attention):
                    o = block.get_submodule(att.o)
                    self.hooks.append(o.register_forward_pre_hook(on_o((k, f, j))))
                    if self.regression:
                        q = block.get_submodule(att.q)
                        self.hooks.append(q.register_forward_pre_hook(on_q((k, f, j))))
        self._sums, self._counts = sums, counts
        return self.means

    def _add_moments(self, key, h: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> None:
        """Add one call's real tokens (weights ``w``, (B, T): padding 0) to ``key``'s moments."""
        m = self.means.moments.get(key)
        seen = 0 if m is None else m.examples
        half = (torch.arange(len(w), device=w.device) + seen) % 2 == 0               # (B,): its rows
        half = half[:, None].expand(w.shape).reshape(-1)                          # (N,): its tokens
        hb = h.reshape(-1, h.shape[-1]).double()                                  # (N, D)
        hb = torch.cat([hb, hb.new_ones(len(hb), 1)], 1)                          # (N, D + 1)
        hw = hb * w.reshape(-1, 1).double()
        xb = x.reshape(-1, x.shape[-1]).double()                                  # (N, W)
        # each half's sums over its own tokens: as many multiply-adds as the whole's
        gh, ch = hw[half].T @ hb[half], hw[half].T @ xb[half]
        gram, cross = gh + hw[~half].T @ hb[~half], ch + hw[~half].T @ xb[~half]
        if m is None:
            self.means.moments[key] = FillMoments(gram, cross, gh, ch, len(w))
        else:
            m.gram += gram
            m.cross += cross
            m.half_gram += gh
            m.half_cross += ch
            m.examples += len(w)

    def __exit__(self, *exc) -> None:
        for h in self.hooks:
            h.remove()
        self.means.update({key: s / self._counts[key].clamp_min(1.0) for key, s in self._sums.items()})


#: ridge of the linear fill, relative to the mean diagonal of the inputs' second moments, where
#: the moments' two halves cannot choose one (fewer than two examples)
FILL_RIDGE = 1e-3
#: the ridges :func:`fill_ridge` chooses from
FILL_RIDGES = (1e-4, 1e-3, 1e-2, 1e-1)


def _ridge_solve(gram: torch.Tensor, target: torch.Tensor, ridge: float) -> torch.Tensor:
    """(gram + ridge x mean diag(gram) x I)^-1 target."""
    scale = ridge * float(torch.diagonal(gram).mean())
    return torch.linalg.solve(gram + scale * torch.eye(len(gram), dtype=gram.dtype, device=gram.device),
                              target)


def fill_ridge(m: FillMoments, pruned_map: torch.Tensor, ridges=FILL_RIDGES) -> float:
    """The ridge of ``ridges`` whose full-rank fill, fitted on one half of ``m``'s examples,
    predicts the other half's pruned-head output best (squared error summed over both ways
    round: two-fold cross-validation over examples, from the moments alone); :data:`FILL_RIDGE`
    where a half holds no token."""
    pm = pruned_map.double()
    halves = [(m.half_gram, m.half_cross @ pm), (m.gram - m.half_gram, (m.cross - m.half_cross) @ pm)]
    if m.examples < 2 or any(float(g[-1, -1]) <= 0 for g, _ in halves):  # g[-1, -1]: the half's tokens
        return FILL_RIDGE

    def held_out_error(ridge: float) -> float:
        err = 0.0
        for (g_fit, c_fit), (g_held, c_held) in (halves, halves[::-1]):
            a = _ridge_solve(g_fit, c_fit, ridge)                                 # (D+1, D_out)
            err += float((a * (g_held @ a)).sum() - 2 * (a * c_held).sum())       # + a constant
        return err
    return min(ridges, key=held_out_error)


def linear_fill(m: FillMoments, pruned_map: torch.Tensor, rank: int,
                ridge: float | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rank-``rank`` linear map of a layer's attention input that best predicts what its
    pruned heads add to the output (ridge least squares over the tokens of ``m``, then reduced-rank
    regression): ``(P, Q)``, P (D+1, r) and Q (r, D_out), the fill being ``[h, 1] @ P @ Q``
    (a rank of D_out or more: Q is None, the fill ``[h, 1] @ P``).
    ``pruned_map`` (W, D_out): the output projection's map of its input columns, zero on the
    kept heads' columns, so ``x @ pruned_map`` is what the pruned heads add. ``ridge``
    (relative to the mean diagonal of the inputs' second moments): default, the one
    :func:`fill_ridge` chooses on ``m``'s two halves."""
    ridge = fill_ridge(m, pruned_map) if ridge is None else ridge
    gram, target = m.gram, m.cross @ pruned_map.double()                          # (D+1, D+1), (D+1, D_out)
    a = _ridge_solve(gram, target, ridge)                                         # (D+1, D_out)
    if rank >= a.shape[1]:
        return a.float(), None
    _, vecs = torch.linalg.eigh(a.T @ gram @ a)                                   # fitted outputs' moments
    v = vecs[:, -rank:]                                                           # (D_out, r): the top r
    return (a @ v).float(), v.T.float()


def _add_linear_fill(q_sub: nn.Module, o_sub: nn.Module, p: torch.Tensor,
                     q: torch.Tensor | None) -> None:
    """Hooks: ``q_sub`` keeps its input h; ``o_sub``'s output gets ``[h, 1] @ p (@ q)``."""
    seen: dict[str, torch.Tensor] = {}
    q_sub.register_forward_pre_hook(lambda _m, args: seen.__setitem__("h", args[0]))

    def add(_m, _a, out):
        fill = seen.pop("h").to(p.dtype) @ p[:-1] + p[-1]                     # (B, T, r)
        return out + (fill if q is None else fill @ q).to(out.dtype)           # (B, T, D_out)
    o_sub.register_forward_hook(add)


@torch.no_grad()
def fill_pruned_heads(sub: nn.Module, model: nn.Module, kept: torch.Tensor, dims: Dims,
                      means: Mapping[tuple[int, int, int], torch.Tensor], arch=None,
                      rank: int | None = None, ridge: float | None = None) -> int:
    """Mean-fill the heads ``sub`` lacks: on each (family, layer) of the sub-model that keeps
    some but not all of its heads (``kept``, over ``dims``: ``model``'s heads), a forward hook
    adds to its output projection's output the constant ``o(m_pruned) - o(0)`` of ``model``'s
    projection, ``m_pruned`` being ``means`` (:func:`output_means`, measured on ``model``) with
    the kept heads' columns zeroed: what the pruned heads add on average in ``model``.
    ``sub`` then matches ``model`` to first order where ``prune = "forward"`` cut heads away
    (mean ablation instead of zero ablation). A layer that keeps no head gets it too where its
    projection still runs (its sliced ``o``, zero input columns); a transposed (``Conv1D``)
    projection of a headless layer does not run, and gets nothing. With ``rank`` (``method.fill
    = "linear"``; ``means`` from ``output_means(..., regression=True)``) a layer that keeps some
    heads gets instead the rank-``rank`` linear map of its attention input that best predicts
    what the pruned heads add (:func:`linear_fill`, at ``ridge``, default each layer's
    cross-validated one; its intercept holds the mean). Returns the layers filled."""
    arch = arch or arch_for(model)
    rows, added = mask_rows(dims), 0
    for (k, f), r0 in rows.items():
        att, d = arch.stacks[k].attention[f], _stacks(dims)[k]
        full_blocks, sub_blocks = arch.blocks(model, k), arch.blocks(sub, k)
        for j in range(d["num_layers"]):
            row, m = kept[r0 + j], means.get((k, f, j))
            if bool(row.all()) or m is None:
                continue
            o, o_sub = full_blocks[j].get_submodule(att.o), sub_blocks[j].get_submodule(att.o)
            if o_sub is o:
                raise ModelError(f"layer {j}: the sub-model shares its output projection with the "
                                 "model (no heads were cut there)")
            cols = row.repeat_interleave(d["head_dim"]).to(m.device)
            if cols.numel() != m.numel():
                raise ModelError(f"layer {j}: {m.numel()} input columns of the output projection, "
                                 f"{row.numel()} heads of {d['head_dim']}")
            was = o.training
            o.eval()  # an adapter's dropout off
            moments = getattr(means, "moments", {}).get((k, f, j))
            if rank is not None and moments is not None and bool(row.any()):
                basis = torch.diag((~cols).to(o_dtype(o)))                    # (W, W): pruned columns
                pruned_map = o(basis) - o(torch.zeros_like(basis[:1]))        # (W, D_out)
                p, q = linear_fill(moments, pruned_map, rank, ridge)
                _add_linear_fill(sub_blocks[j].get_submodule(att.q), o_sub, p, q)
            else:
                x = torch.where(cols, torch.zeros_like(m), m)[None].to(o_dtype(o))
                shift = (o(x) - o(torch.zeros_like(x)))[0]
                o_sub.register_forward_hook(lambda _m, _a, out, s=shift: out + s.to(out.dtype))
            o.train(was)
            added += 1
    return added


def o_dtype(o: nn.Module) -> torch.dtype:
    return next((p.dtype for p in o.parameters() if p.is_floating_point()), torch.float32)
