"""The training batches a client's loader draws, simulated for the planner: the profile's
length, the positions and attention pairs of a step, packed layouts.
"""

from __future__ import annotations

import numpy as np
import torch


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
