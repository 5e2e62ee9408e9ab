"""Filling a pruned head's output on the server: each client's kept heads' output means and
moments, and the ridge fit that predicts a pruned head from the kept ones (``method.fill``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn

from fedslice.errors import ModelError
from fedslice.models.arch import arch_for
from fedslice.slicing.heads import Dims, dims_stacks, mask_rows


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
        att, d = arch.stacks[k].attention[f], dims_stacks(dims)[k]
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
