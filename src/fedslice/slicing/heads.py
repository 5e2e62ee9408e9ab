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
from typing import Literal

import numpy as np
import torch
import torch.nn as nn

from fedslice.compute import model_device, to_device
from fedslice.data.batching import TokenizedSplit, iter_batches
from fedslice.data.packing import segment_ids
from fedslice.errors import ConfigError, ModelError
from fedslice.models.arch import arch_for
from fedslice.slicing.keys import KeyInfo, key_info
from fedslice.slicing.spec import ModelSlice, SliceSpec, Spec, kv_groups, stack_list


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


def dims_stacks(dims: Dims) -> list[Mapping[str, int]]:
    """Per-stack dims (a single Mapping is a one-stack model)."""
    return [dims] if isinstance(dims, Mapping) else list(dims)


def mask_rows(dims: Dims) -> dict[tuple[int, int], int]:
    """(stack, attention family) -> first row of its block of ``num_layers`` rows in a keep-mask."""
    out, r = {}, 0
    for k, d in enumerate(dims_stacks(dims)):
        for f in range(d.get("families", 1)):
            out[(k, f)] = r
            r += d["num_layers"]
    return out


def num_rows(dims: Dims) -> int:
    """Rows R of a keep-mask: one per (attention family, layer)."""
    return sum(d["num_layers"] * d.get("families", 1) for d in dims_stacks(dims))


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


def mask_spec(mask: torch.Tensor, dims: Dims) -> ModelSlice:
    """The slice of a (R, H) keep-mask (:func:`mask_rows`): every layer of every stack, its kept
    heads per attention family (key/value heads follow their query heads), every FFN neuron."""
    stacks, rows = dims_stacks(dims), mask_rows(dims)
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
    stacks = dims_stacks(dims)
    given = list(stack_list(spec)) + [None] * (len(stacks) - len(stack_list(spec)))
    return [SliceSpec.full(d) if s is None else s for s, d in zip(given, stacks)]


def sub_dims(dims: Dims, spec: Spec) -> list[dict[str, int]]:
    """The per-stack dims of the sub-model of ``spec`` as a keep-mask sees them: its kept layers
    and its heads per layer (which must be as many in every kept layer and family: RaFFM's
    width slices are; a ModelError otherwise), key/value heads likewise. The dims count heads;
    which key/value head a kept query head reads is not theirs to say (a sub-model's groups need
    not be equal blocks of its heads: 3 + 1 of SmolLM2's groups of 3): that is decided in
    full-model indices, :func:`restrict` read inside the sub-model
    (:meth:`~fedslice.slicing.spec.SliceSpec.index_within`)."""
    out = []
    for k, (d, s) in enumerate(zip(dims_stacks(dims), _stack_slices(spec, dims))):
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
    out = torch.zeros((num_rows(dims), dims_stacks(dims)[0]["num_heads"]), dtype=sub.dtype)
    for k, s in enumerate(_stack_slices(spec, dims)):
        for f in range(dims_stacks(dims)[k].get("families", 1)):
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

        cross = heads(1) if dims_stacks(dims)[k].get("families", 1) > 1 else None
        out.append(SliceSpec(s.layers, heads(0), s.neurons, s.num_layers, s.num_heads,
                             s.head_dim, s.ffn, s.num_kv_heads, cross))
    return ModelSlice(tuple(out))
