"""The training batches a client's loader draws, simulated for the planner: the profile's
length, the positions and attention pairs of a step, packed layouts.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from fedslice.fl.orders import Orders
from fedslice.tasks.base import batch_tokens


def planning_lengths(cfg, lengths: torch.Tensor | None, packed: bool = False,
                     batch_size: int | None = None, client_examples: int | None = None
                     ) -> tuple[int, float]:
    """(the profile batch's sequence length, the tokens a training example costs on average).

    The length is the longest training example's as encoded (a generation task's prompt and
    target together; data.max_length without the data): peak memory is the longest batch's.
    Per example: :func:`step_units`' positions over the batch's examples."""
    if lengths is None or len(lengths) == 0:
        return cfg.data.max_length, float(cfg.data.max_length)
    b = batch_size or cfg.federation.batch_size
    return int(torch.as_tensor(lengths).max()), step_units(cfg, lengths, packed, b, client_examples)[0] / b


def step_units(cfg, lengths: torch.Tensor | None, packed: bool, batch_size: int,
               client_examples: int | None = None) -> tuple[float, float]:
    """``(positions, attention pairs)`` a training step of ``batch_size`` examples of the
    training ``lengths`` holds in the mean: rows x row length and rows x row length², what its
    FLOPs grow with (fl.client's extrapolation). Packed batches: their rows, simulated as
    :func:`packed_layouts` lays them out; length-grouped padded batches: each as long as its
    longest, simulated as ``iter_batches`` groups (windows of 16 random batches sorted by
    length, or a client's whole data where it holds fewer: ``client_examples``); random padded
    batches: the expected longest of the batch (order statistics, drawn with replacement). No
    lengths: every example at ``data.max_length``."""
    b = batch_size
    if lengths is None or len(lengths) == 0:
        t = cfg.data.max_length
        return float(b * t), float(b * t * t)
    lens = torch.as_tensor(lengths).flatten().double()
    if packed:
        layouts = packed_layouts(cfg, lens, b, client_examples).astype(np.float64)  # (rows, length)
        return float((layouts[:, 0] * layouts[:, 1]).mean()), float((layouts[:, 0] * layouts[:, 1] ** 2).mean())
    if cfg.federation.group_by_length:
        as_float = lens.numpy()
        batches = [as_float[idx] for idx in drawn_batches(cfg, lens, b, client_examples)]
        rows = np.asarray([len(x) for x in batches])
        t = np.asarray([x.max() for x in batches])
        return float((rows * t).mean()), float((rows * t ** 2).mean())
    ordered, _ = torch.sort(lens)
    n = len(ordered)
    cdf = (torch.arange(1, n + 1, dtype=torch.float64) / n) ** b  # P(max <= i-th smallest)
    pmf = cdf - torch.cat([cdf.new_zeros(1), cdf[:-1]])
    return float(b * (ordered * pmf).sum()), float(b * (ordered ** 2 * pmf).sum())


def drawn_batches(cfg, lengths, batch_size: int, client_examples: int | None = None,
                  draws: int = 48) -> list[np.ndarray]:
    """The examples (indices into the training ``lengths``) of simulated training batches of
    ``batch_size`` examples, drawn as a client's data loader draws them
    (``federation.group_by_length``: a pass over a client's ``client_examples`` examples in
    windows of 16 batches, each sorted by length and cut, the last window and the last batch of
    a window short; else random examples). Seeded: the same lengths give the same batches."""
    lens = torch.as_tensor(lengths).flatten().long().numpy()
    rng = np.random.default_rng(0)
    if not cfg.federation.group_by_length:
        return [rng.integers(0, len(lens), size=batch_size) for _ in range(draws * 4)]
    window = 16 * batch_size
    epoch = window if client_examples is None else max(1, client_examples)  # a client's pass
    out: list[np.ndarray] = []
    while len(out) < draws * 16:
        drawn = rng.integers(0, len(lens), size=epoch)
        for lo in range(0, epoch, window):  # iter_batches: each window of the pass sorted, cut
            idx = drawn[lo:lo + window]
            idx = idx[np.argsort(-lens[idx], kind="stable")]
            out += [idx[i:i + batch_size] for i in range(0, len(idx), batch_size)]
    return out


def packed_layouts(cfg, lengths, batch_size: int, client_examples: int | None = None,
                   head_lengths=None) -> np.ndarray:
    """``(K, 3)``: the rows, row length and head positions (target tokens; the examples where
    ``head_lengths`` is None) of the simulated packed training batches of
    :func:`drawn_batches`, laid out as :func:`fedslice.data.packing.row_capacity` lays a batch
    out."""
    from fedslice.data.packing import ROW_TOKENS, row_capacity

    lens = torch.as_tensor(lengths).flatten().long().numpy()
    heads = None if head_lengths is None else torch.as_tensor(head_lengths).flatten().long().numpy()
    out = []
    for idx in drawn_batches(cfg, lengths, batch_size, client_examples):
        capacity, place = row_capacity(lens[idx].tolist(), ROW_TOKENS)
        out.append((1 + max(r for r, _ in place), capacity, len(idx) if heads is None else heads[idx].sum()))
    return np.asarray(out, dtype=np.int64)


def packed_peak_shape(cfg, lengths, batch_size: int, client_examples: int | None = None,
                      head_lengths=None) -> tuple[int, int, int]:
    """``(rows, row length, head positions)`` that every simulated packed batch of
    ``batch_size`` examples fits in (:func:`packed_layouts`; each at most ``batch_size`` rows of
    the longest example or :data:`fedslice.data.packing.ROW_TOKENS`): the batch a packed plan's
    peak memory is measured on, as activations grow with each (a language model's logits with
    its target tokens)."""
    layouts = packed_layouts(cfg, lengths, batch_size, client_examples, head_lengths)
    return int(layouts[:, 0].max()), int(layouts[:, 1].max()), int(layouts[:, 2].max())


def method_plans(method, batch: dict[str, torch.Tensor] | None = None) -> dict[int, Any]:
    """``method``'s every client's plan under ``[budgets]`` (none in the client role: a client reads its
    plan from its payload), measured on ``batch`` (default: the task's profile batch of
    federation.batch_size rows as long as the longest training example: a step's peak
    memory is its longest batch's), its FLOPs scaled to the
    tokens a batch really holds (:func:`~fedslice.methods.plan_batches.planning_lengths`); kept
    (the method keeps them)."""
    from fedslice.methods.planner import plan_clients

    if method.cfg.budgets is None or method.role == "client":
        return {}
    fed = method.cfg.federation
    # a client's batches are drawn from its own data (grouped by length within it)
    sizes = sorted(method.client_sizes.values()) if method.client_sizes else []
    n = int(sizes[len(sizes) // 2]) if sizes else None
    lengths, heads = method.token_lengths, method.head_lengths
    length, per_example = planning_lengths(method.cfg, lengths, client_examples=n)
    if batch is None:
        known = heads is not None and len(heads) and lengths is not None and len(lengths) == len(heads)
        batch = method.task.planning_batch(
            method.model.config, fed.batch_size, length, method.cfg.seed,
            int(heads.max()) if known else None,
            int((torch.as_tensor(lengths) - heads).max()) if known else None)
    # a padded example's tokens over the profile's (an encoder-decoder's rows are a prompt
    # and a target, each as long as the longest: more than the longest pair)
    unpadded = batch_tokens(batch) / len(batch["input_ids"]) if "input_ids" in batch else length
    packed_of = None
    if method.packs(Orders(pack=fed.pack)):  # what a client of one micro-batch trains on
        def packed_of(rows: int) -> tuple[dict, float, dict]:
            """``rows`` examples packed, the tokens a packed example costs over ``length``,
            and the packed batch every drawn batch of ``rows`` examples fits in (peak memory)."""
            config = method.model.config
            packed = method.task.packed_profile_batch(config, rows, length, method.cfg.seed)
            r, c, h = packed_peak_shape(method.cfg, lengths, rows, n, heads)
            peak = method.task.packed_grid_batch(config, r, c, rows, method.cfg.seed, h / (r * c))
            return packed, planning_lengths(method.cfg, lengths, True, rows, n)[1] / length, peak

    @functools.cache  # the planner asks for every plan it weighs: simulate once per size
    def scale_of(rows: int) -> float:  # a plan's smaller batch holds less padding
        return planning_lengths(method.cfg, lengths, batch_size=rows, client_examples=n)[1] / unpadded

    @functools.cache
    def pairs_of(rows: int, packed: bool) -> float:  # a step's attention pairs, in the mean
        return step_units(method.cfg, lengths, packed, rows, n)[1]

    def heads_of(rows: int) -> float:  # a step's head positions, in the mean
        return float(rows if heads is None or not len(heads) else rows * heads.double().mean())

    return plan_clients(method, method.cfg.budgets, batch, method.client_sizes, fed.num_clients,
                        method.cfg.seed, flops_scale=per_example / unpadded, packed_of=packed_of,
                        scale_of=scale_of, pairs_of=pairs_of, heads_of=heads_of)
