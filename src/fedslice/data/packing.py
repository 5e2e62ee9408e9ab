"""Packed batches: a step's examples laid end to end in a few rows, so it costs its real tokens.

A padded batch of B examples is ``(B, longest)``; short examples beside a long one make the rest
padding (1.24 padded tokens per real token on SST-2 with 673 sentences per client, 2.04 with 67,
where length grouping has little to sort). A packed batch holds the *same* examples (the same
step, the same loss) in ``R`` rows of ``C`` tokens (about :data:`ROW_TOKENS`, never shorter than
the longest example), filled first-fit by decreasing length: little padding is left.

Each example keeps its own positions (they restart at 0 in every example) and attends only to
itself: the model gets a block-diagonal ``(R, 1, C, C)`` mask (causal within each block for a
decoder; :func:`model_inputs`), which HF's attention takes as it is (sdpa and eager). Packed
batches carry ``example_starts`` ``(N,)``: the flat index ``r * C + t`` of each example's first
token; a classifier reads its first-token (CLS) state there (:func:`first_token_states`). A
causal language-model batch masks the label of each example's first token (never a target
unpacked either: the shift drops it), so no example predicts the next one's first token.

Which architectures and tasks pack is :func:`packs` (the rest keep padded batches).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn
import torch.nn.functional as F

#: encoders whose classification head reads the first token's state (bert, roberta: pooler or
#: head on ``[:, 0]``; distilbert: ``pre_classifier`` on ``[:, 0]``) and the module that returns
#: the per-token states that head reads
_FIRST_TOKEN_HEADS = {"bert": "bert.encoder", "roberta": "roberta.encoder",
                      "distilbert": "distilbert.transformer"}
#: decoders whose causal-LM forward takes a 4D mask and explicit position ids
_CAUSAL_LM = ("llama", "gpt2")
#: about how long a packed row is (:func:`row_capacity`; the longest example when longer): long
#: enough that short examples fill rows well; attention runs over whole rows, masked-out pairs
#: included, so its cost grows with it (rows of 32 and 128 were no faster than 64 on SST-2 with
#: MiniLM on the CPU: BENCHMARKS.md)
ROW_TOKENS = 64
#: families whose learned positions start past the pad id (``padding_idx + 1``)
_POSITIONS_PAST_PAD = ("roberta",)
IGNORE = -100  # fedslice.data.pairs.IGNORE (pairs imports this module)


def packs(model_type: str, head: str, adapter_in_modules: bool = True) -> bool:
    """Whether training batches of this architecture and head can be packed.

    Packed: encoder sequence classification (bert, roberta, distilbert: the head reads the first
    token, gathered per example) and causal-LM tasks on decoders (llama, gpt2). Not packed:
    decoder sequence classification (the ``score`` head pools the last non-pad token of each
    row, found from the row's pad ids), encoder-decoders (t5, bart: the decoder's cross-attention
    would need a block mask over the encoder's packed rows too), image models (every image has
    the same number of patches: nothing to pad), and adapters outside the model's modules
    (``adapter_in_modules`` False: prompt, prefix and P-tuning prepend virtual tokens or keys to
    every row, where packing needs them once per example)."""
    if not adapter_in_modules:
        return False
    if head == "sequence_classification":
        return model_type in _FIRST_TOKEN_HEADS
    return head == "causal_lm" and model_type in _CAUSAL_LM


def first_fit(lengths: list[int], capacity: int) -> list[tuple[int, int]]:
    """``(row, offset)`` of each example: first-fit by decreasing length into rows of
    ``capacity`` tokens (every length must be ≤ ``capacity``)."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    free: list[int] = []  # tokens left in each row
    place = [(0, 0)] * len(lengths)
    for i in order:
        n = lengths[i]
        row = next((r for r, left in enumerate(free) if left >= n), len(free))
        if row == len(free):
            free.append(capacity)
        place[i] = (row, capacity - free[row])
        free[row] -= n
    return place


def row_capacity(lens: list[int], row_tokens: int) -> tuple[int, list[tuple[int, int]]]:
    """``(C, placement)``: rows of about ``row_tokens`` that hold ``lens`` with the fewest
    padded tokens (rows x C), never shorter than the longest example and never longer than
    :func:`row_limit` (the longest example, or ``row_tokens`` when that is longer).

    From the shortest rows that could hold every token in the fewest rows, C grows until first
    fit reaches that many rows or the limit, and the layout of fewest rows x C seen is kept
    (ties: the shorter rows). Without the limit, examples near ``row_tokens`` (which no two
    share) made C grow far past it to save a row: 31 rows of 104 tokens where 32 of 64 hold the
    same batch, 1.6x the tokens and 2.6x attention's pairs (issue 61). So a packed batch of
    ``N`` examples is never more than ``N`` rows of ``row_limit``: what the budget planner
    measures as its worst case."""
    total = sum(lens)
    rows = max(1, -(-total // row_tokens))
    capacity = max(max(lens), -(-total // rows))
    limit = row_limit(lens, row_tokens)
    best: tuple[int, int, list[tuple[int, int]]] | None = None  # (padded tokens, C, placement)
    while True:
        place = first_fit(lens, capacity)
        used = 1 + max(r for r, _ in place)
        if best is None or used * capacity < best[0]:
            best = (used * capacity, capacity, place)
        if used <= rows or capacity >= limit:
            return best[1], best[2]
        capacity = min(limit, capacity + max(1, capacity // 64))


def row_limit(lens: list[int], row_tokens: int) -> int:
    """The longest row :func:`row_capacity` makes for examples of ``lens``."""
    return max(max(lens), row_tokens)


def grid_layout(rows: int, length: int, examples: int) -> tuple[list[int], int, list[tuple[int, int]]]:
    """``(lens, C, placement)`` of ``examples`` examples filling ``rows`` rows of ``length``
    tokens exactly (each row split into near-equal examples; at least one per row): a packed
    batch of a given shape and example count, what the budget planner measures peak memory on."""
    if not 1 <= rows <= examples or length < -(-examples // rows):
        raise ValueError(f"{examples} examples do not fill {rows} rows of {length} tokens")
    lens, place = [], []
    for r in range(rows):
        k = examples // rows + (r < examples % rows)
        cuts = [round(i * length / k) for i in range(k + 1)]
        for lo, hi in zip(cuts, cuts[1:]):
            lens.append(hi - lo)
            place.append((r, lo))
    return lens, length, place


@torch.no_grad()
def pack_layout(lens: torch.Tensor, row_tokens: int | None = None,
                layout: tuple[int, list[tuple[int, int]]] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """``(destination (sum lens,), example_starts (N,), R, C)``: where each token of the
    concatenated examples goes in the flat ``(R * C)`` packed batch (rows of about
    ``row_tokens``, default :data:`ROW_TOKENS`: :func:`row_capacity`; or ``layout``'s
    ``(C, placement)``)."""
    capacity, place = layout if layout is not None else row_capacity(
        lens.tolist(), ROW_TOKENS if row_tokens is None else row_tokens)
    rows = 1 + max(r for r, _ in place)
    starts = torch.tensor([r * capacity + o for r, o in place], dtype=torch.int64)  # (N,)
    offsets = torch.cumsum(lens, 0) - lens  # (N,) where each example begins in the concatenation
    within = torch.arange(int(lens.sum())) - torch.repeat_interleave(offsets, lens)  # (sum,)
    return torch.repeat_interleave(starts, lens) + within, starts, rows, capacity


def scatter_rows(flat: torch.Tensor, dest: torch.Tensor, rows: int, capacity: int,
                 fill: int) -> torch.Tensor:
    """``flat`` tokens (sum lens,) placed at ``dest`` in a ``(rows, capacity)`` tensor of ``fill``."""
    out = torch.full((rows * capacity,), fill, dtype=flat.dtype)
    out[dest] = flat
    return out.view(rows, capacity)  # (R, C)


def pack(seqs: dict[str, tuple[torch.Tensor, int]], lens: torch.Tensor,
         row_tokens: int | None = None, layout=None) -> dict[str, torch.Tensor]:
    """A packed batch of the concatenated examples ``seqs`` (key -> (flat tokens, fill)), with
    ``attention_mask`` (R, C) (1 on real tokens), ``position_ids`` (R, C) restarting at 0 in
    every example (0 on padding), and ``example_starts`` (N,); rows of about ``row_tokens``
    (default :data:`ROW_TOKENS`), or as ``layout`` places them (:func:`pack_layout`)."""
    dest, starts, rows, capacity = pack_layout(lens, row_tokens, layout)
    out = {key: scatter_rows(flat, dest, rows, capacity, fill) for key, (flat, fill) in seqs.items()}
    total = int(lens.sum())
    within = torch.arange(total) - torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    out["position_ids"] = scatter_rows(within, dest, rows, capacity, 0)
    out["attention_mask"] = scatter_rows(torch.ones(total, dtype=torch.int64), dest, rows, capacity, 0)
    out["example_starts"] = starts
    return out


def is_packed(batch: dict[str, torch.Tensor]) -> bool:
    return "example_starts" in batch


def first_rows(batch: dict[str, torch.Tensor], n: int) -> dict[str, torch.Tensor]:
    """The first ``n`` rows of a batch, padded or packed (a packed batch keeps the examples
    that start in those rows: their ``example_starts`` and, per example, labels)."""
    if not is_packed(batch):
        return {k: v[:n] for k, v in batch.items()}
    ids = batch["input_ids"]
    keep = batch["example_starts"] < n * ids.shape[1]  # (N,)
    out = {k: v[:n] for k, v in batch.items() if k not in ("example_starts", "labels")}
    out["example_starts"] = batch["example_starts"][keep]
    labels = batch["labels"]
    out["labels"] = labels[keep] if labels.dim() == 1 else labels[:n]
    return out


def segment_ids(attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """``(R, C)``: the example each token of a packed batch belongs to, 1, 2, ... along each row,
    0 on padding (an example starts where its position is 0)."""
    first = (position_ids == 0) | (  # a Python 0: no tensor made on the device (a host copy and sync)
        torch.arange(position_ids.shape[1], device=position_ids.device) == 0)
    return torch.cumsum((first & attention_mask.bool()).to(torch.int64), 1) * attention_mask


def block_mask(attention_mask: torch.Tensor, position_ids: torch.Tensor, causal: bool,
               additive: torch.dtype | None = None) -> torch.Tensor:
    """The ``(R, 1, C, C)`` mask of a packed batch: each token sees the tokens of its own example
    (and, ``causal``, only those before it); padding sees only padding (no row of the softmax is
    empty). Boolean (True: attend; what sdpa takes), or ``additive`` of that dtype (0 or its
    minimum; what eager attention adds to its scores)."""
    segment = segment_ids(attention_mask, position_ids)  # (R, C)
    allowed = segment[:, :, None] == segment[:, None, :]  # (R, C, C)
    if causal:
        allowed = allowed & torch.ones_like(allowed[0]).tril()
    if additive is None:
        return allowed[:, None]  # (R, 1, C, C)
    mask = torch.zeros(allowed.shape, dtype=additive, device=allowed.device)
    return mask.masked_fill_(~allowed, torch.finfo(additive).min)[:, None]  # (R, 1, C, C)


def model_inputs(batch: dict[str, torch.Tensor], model: nn.Module, causal: bool
                 ) -> dict[str, torch.Tensor]:
    """What a packed batch (on the model's device) gives ``model``: its tensors but labels and
    ``example_starts``, the 2D attention mask made block-diagonal (:func:`block_mask`), the
    positions shifted where the family counts them from past the pad id (roberta)."""
    out = {k: v for k, v in batch.items() if k not in ("labels", "example_starts")}
    config = model.config
    additive = torch.float32 if config._attn_implementation == "eager" else None
    out["attention_mask"] = block_mask(batch["attention_mask"], batch["position_ids"], causal, additive)
    if config.model_type in _POSITIONS_PAST_PAD:
        out["position_ids"] = batch["position_ids"] + (config.pad_token_id + 1)
    return out


@contextmanager
def first_token_states(model: nn.Module, model_type: str, starts: torch.Tensor):
    """Within the block, the per-token states the classification head of ``model`` reads are
    ``(N, 1, d)``: each example's first token (at the flat ``starts`` (N,) of the packed rows),
    so the head (pooler, dropout, classifier) runs once per example, as on padded rows."""
    encoder = model.get_submodule(_FIRST_TOKEN_HEADS[model_type])

    def gather(module, args, output):
        hidden = output[0]  # (R, C, d)
        pooled = hidden.reshape(-1, hidden.shape[-1]).index_select(0, starts)[:, None]  # (N, 1, d)
        output["last_hidden_state"] = pooled
        return output

    handle = encoder.register_forward_hook(gather)
    try:
        yield
    finally:
        handle.remove()


def pack_classification(ids: torch.Tensor, types: torch.Tensor | None, lens: torch.Tensor,
                        labels: torch.Tensor, pad: int, row_tokens: int | None = None, layout=None
                        ) -> dict[str, torch.Tensor]:
    """A packed classification batch of the concatenated token ids ``ids`` (and token types)
    of examples of lengths ``lens`` (N,), with their ``labels`` (N,)."""
    seqs = {"input_ids": (ids, pad)}
    if types is not None:
        seqs["token_type_ids"] = (types, 0)
    out = pack(seqs, lens, row_tokens, layout)
    out["labels"] = labels
    return out


def pack_causal(prompts: list[torch.Tensor], targets: list[torch.Tensor], pad: int,
                row_tokens: int | None = None, layout=None) -> dict[str, torch.Tensor]:
    """A packed causal-LM batch of prompt + target examples: labels (R, C) are the target tokens,
    :data:`IGNORE` on prompts, padding and each example's first token."""
    seqs = [torch.cat([p, t]) for p, t in zip(prompts, targets)]
    labels = [torch.cat([torch.full_like(p, IGNORE), t]) for p, t in zip(prompts, targets)]
    return pack_labeled(seqs, labels, pad, row_tokens, layout)


def pack_labeled(seqs: list[torch.Tensor], labels: list[torch.Tensor], pad: int,
                 row_tokens: int | None = None, layout=None) -> dict[str, torch.Tensor]:
    """A packed causal-LM batch of examples whose per-token ``labels`` (:data:`IGNORE` where no
    loss is taken: a conversation's user turns) are given: labels (R, C), :data:`IGNORE` on
    padding and on each example's first token."""
    labels = [lab.clone() for lab in labels]
    for lab in labels:
        lab[:1] = IGNORE
    lens = torch.tensor([len(s) for s in seqs], dtype=torch.int64)
    return pack({"input_ids": (torch.cat(seqs), pad), "labels": (torch.cat(labels), IGNORE)}, lens,
                row_tokens, layout)


#: the config fields that hold a family's attention-probability dropout
_ATTENTION_DROPOUT = ("attention_probs_dropout_prob", "attention_dropout", "attn_pdrop")


def attention_dropout(config) -> float:
    """The attention-probability dropout of a HF config (0 when it has none)."""
    for name in _ATTENTION_DROPOUT:
        p = getattr(config, name, None)
        if isinstance(p, (int, float)) and p > 0:
            return float(p)
    return 0.0


def uniform_dropout(input: torch.Tensor, p: float = 0.5, training: bool = True,
                    inplace: bool = False) -> torch.Tensor:
    """``F.dropout`` with its keep mask drawn as ``uniform >= p`` (then scaled by 1 / (1 - p)):
    the same distribution as ``bernoulli_``'s mask, other draws, and on the CPU about 1.5x
    faster for the mask and its product (bench/perf/client_ideas.py)."""
    if not training or p == 0.0:
        return input
    if p >= 1.0:
        return input.mul_(0.0) if inplace else input * 0.0
    mask = torch.empty_like(input).uniform_().ge_(p).mul_(1.0 / (1.0 - p))
    return input.mul_(mask) if inplace else input * mask


@contextmanager
def packed_training(model: nn.Module):
    """Within the block, a CPU model with attention dropout trains on eager attention with
    :func:`uniform_dropout` masks (every ``F.dropout`` of the process: the block is one client's
    training). Torch's CPU sdpa takes its unfused math path under dropout anyway, drawing the
    attention-probability mask with ``bernoulli_``; eager attention draws it through
    ``F.dropout``, where the cheaper mask applies: 1.06-1.08x the packed step of MiniLM-L6 (CPU
    seconds at 1 thread, BENCHMARKS.md). Eager and sdpa attention agree to float rounding
    (``tests/test_packing.py``); the dropout masks are other draws of the same distribution, as
    packing's already are. Only for packed batches (``federation.pack``): a padded run keeps
    the draws of the runs made before packing. The attention implementation is restored after."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    previous = getattr(config, "_attn_implementation", None)
    cpu = all(p.device.type == "cpu" for p in base.parameters())
    if config is None or previous not in ("sdpa", "eager") or not cpu or not attention_dropout(config):
        yield
        return
    switched = False
    if previous != "eager":
        try:
            base.set_attn_implementation("eager")
        except (ValueError, AttributeError, NotImplementedError):
            pass
        switched = config._attn_implementation == "eager"
        if not switched:  # the family cannot switch: its sdpa path as it is
            yield
            return
    real = F.dropout
    F.dropout = uniform_dropout
    try:
        yield
    finally:
        F.dropout = real
        if switched:
            base.set_attn_implementation(previous)
