"""LoRA's own aggregation math, as pure functions over state dicts (the rules of
:mod:`fedslice.fl.rules.lora` call them; the simulation and Flower run the same code).

A LoRA layer wraps a linear map ``W`` (out, in) with ``A`` (r, in) and ``B`` (out, r); its
effective weight is ``W + s B A`` with ``s = alpha / r_global`` (every client, whatever its rank,
uses the global adapter's scale: a client at rank r_c holds the leading r_c components of the
global adapter, zero-padded above, so its update adds into the global one unchanged).

Averaging ``A`` and ``B`` apart (FedIT) is not averaging the updates ``B A``. The functions here
compute, per wrapped layer, the **target** update: the weighted mean of the clients' products

    M[i, j] = sum_c p_c[i, j] (s B_c A_c)[i, j] / sum_c p_c[i, j]

(where some client holds (i, j); elsewhere the previous global ``s B_g A_g`` stays), with a
client's weight of the product element (i, j) taken from the method's weights of its factors:
``p_c[i, j] = min(b_c[i], a_c[j])``, ``b_c[i]`` the client's weight of ``B``'s row i and
``a_c[j]`` of ``A``'s column j (each the largest over the rank axis). For FedAvg's scalar weights
that is |D_c|; for RaFFM's held-masks |D_c| where the client's slice holds both the row and the
column; for the heads paper's Eq. 8 the head's α_hc on the rows of a q/k/v head (B rows are
head-tied, A is held whole with |D_c| >= 1 > α) and on the columns of an o head. A client's
factors are taken where it holds them (weight > 0) and zero elsewhere: a component above its
rank does not enter its product.

What the rules do with the target:

* FedEx-LoRA: keep the averaged factors and fold the residual ``target - s B_new A_new`` into the
  frozen base weight (:func:`fold`);
* FLoRA: fold the whole target into the base and restart from a fresh adapter;
* FlexLoRA (``svd``): re-factorise the target by truncated SVD (:func:`svd_factors`), and report
  the energy the truncation discards.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedslice.peft.tuners.lora.layer import LORA_TENSORS

State = dict[str, torch.Tensor]

#: attribute of a LoRA layer -> the axis of its weight that runs over the rank
RANK_AXIS: dict[str, int] = {attr: 0 if side == "in" else 1 for attr, side in LORA_TENSORS.items()}
_A, _B = (next(a for a, s in LORA_TENSORS.items() if s == side) for side in ("in", "out"))


@dataclass(frozen=True)
class LoraPair:
    """The LoRA tensors of one wrapped layer, by their names in a state dict, and the name of
    the frozen base weight they adapt (peft: ``<module>.base_layer.weight``)."""

    module: str
    a: str
    b: str

    @property
    def base(self) -> str:
        return f"{self.module}.base_layer.weight"


def lora_pairs(names: Iterable[str]) -> list[LoraPair]:
    """Every (A, B) pair among ``names`` (``<module>.lora_A.<adapter>.weight`` and its B)."""
    names = set(names)
    out = []
    for n in sorted(names):
        module, sep, rest = n.partition(f".{_A}.")
        if not sep or not rest.endswith("weight"):
            continue
        b = f"{module}.{_B}.{rest}"
        if b in names:
            out.append(LoraPair(module, n, b))
    return out


def rank_axis(name: str) -> int | None:
    """The rank axis of a LoRA tensor named ``name`` (0 for A, 1 for B), None for any other."""
    for seg in name.split("."):
        if seg in RANK_AXIS:
            return RANK_AXIS[seg]
    return None


def truncate_rank(t: torch.Tensor, axis: int, r: int) -> torch.Tensor:
    """The leading ``r`` components of a LoRA factor (a view)."""
    return t.narrow(axis, 0, r)


def at_rank(state: Mapping[str, torch.Tensor], rank: int | None) -> dict[str, torch.Tensor]:
    """``state`` with its LoRA factors truncated to ``rank`` (None: as it is)."""
    if rank is None:
        return dict(state)
    return {k: truncate_rank(t, rank_axis(k), rank) if rank_axis(k) is not None and t.dim() == 2
            else t for k, t in state.items()}


def pad_rank(t: torch.Tensor, axis: int, r: int) -> torch.Tensor:
    """A factor of rank < r zero-padded to rank ``r`` (HetLoRA's padding)."""
    extra = r - t.shape[axis]
    if extra <= 0:
        return t
    shape = list(t.shape)
    shape[axis] = extra
    return torch.cat([t, t.new_zeros(shape)], dim=axis)


def rank_mask(shape: Sequence[int], axis: int, r: int) -> torch.Tensor:
    """1.0 on the leading ``r`` components along ``axis``, 0 above, broadcastable to ``shape``."""
    m = (torch.arange(shape[axis]) < r).float()
    view = [1] * len(shape)
    view[axis] = shape[axis]
    return m.view(view)


def _weight(w, key: str, shape) -> torch.Tensor:
    wk = w[key] if isinstance(w, Mapping) else w
    return torch.as_tensor(wk, dtype=torch.float32).expand(shape)


def client_factors(state: Mapping[str, torch.Tensor], delta: Mapping[str, torch.Tensor], w,
                   pair: LoraPair) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(B_c, A_c, p_c) of one client: its factors where it holds them (zero elsewhere) and its
    weight of each element of the product (module doc); None when it sent neither factor."""
    if pair.a not in delta and pair.b not in delta:
        return None
    a, b = state[pair.a].float(), state[pair.b].float()
    wa = _weight(w, pair.a, a.shape) if pair.a in delta else torch.zeros(a.shape)
    wb = _weight(w, pair.b, b.shape) if pair.b in delta else torch.zeros(b.shape)
    A = torch.where(wa > 0, a + delta.get(pair.a, 0.0), 0.0)                 # (r, in)
    B = torch.where(wb > 0, b + delta.get(pair.b, 0.0), 0.0)                 # (out, r)
    p = torch.minimum(wb.amax(dim=1)[:, None], wa.amax(dim=0)[None, :])      # (out, in)
    return B, A, p


def target_update(state: Mapping[str, torch.Tensor], deltas: Sequence[Mapping[str, torch.Tensor]],
                  weights: Sequence, pair: LoraPair, scale: float, eta: float = 1.0
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The layer's target effective update ``T`` (out, in) and where some client held it:
    ``s B_g A_g + eta (M - s B_g A_g)``, M the weighted mean of the clients' ``s B_c A_c`` (module
    doc); ``s B_g A_g`` where nobody held the element (``eta = 1``: exactly M where held)."""
    old = scale * (state[pair.b].float() @ state[pair.a].float())            # (out, in)
    num, den = torch.zeros_like(old), torch.zeros_like(old)
    for delta, w in zip(deltas, weights):
        f = client_factors(state, delta, w, pair)
        if f is None:
            continue
        B, A, p = f
        num += p * (scale * (B @ A))
        den += p
    held = den > 0
    mean = torch.where(held, num / torch.where(held, den, 1.0), old)
    return old + eta * (mean - old), held


def product(state: Mapping[str, torch.Tensor], pair: LoraPair, scale: float) -> torch.Tensor:
    """``s B A`` (out, in) of a state."""
    return scale * (state[pair.b].float() @ state[pair.a].float())


def svd_factors(target: torch.Tensor, rank: int, scale: float
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlexLoRA: ``B`` (out, rank) and ``A`` (rank, in) with ``s B A`` the best rank-``rank``
    approximation of ``target`` (truncated SVD, the singular values split evenly between the
    factors, components ordered by singular value so that the leading r of them are the best
    rank-r approximation), and the singular values (for the discarded energy)."""
    U, S, Vh = torch.linalg.svd(target.double() / scale, full_matrices=False)
    k = min(rank, S.numel())
    root = S[:k].sqrt()
    B = torch.zeros(target.shape[0], rank, dtype=torch.float64)
    A = torch.zeros(rank, target.shape[1], dtype=torch.float64)
    B[:, :k] = U[:, :k] * root
    A[:k] = root[:, None] * Vh[:k]
    return B.float(), A.float(), S.float()


def discarded_energy(singular: torch.Tensor, rank: int) -> float:
    """Fraction of the squared Frobenius norm a rank-``rank`` truncation drops."""
    e = singular.double() ** 2
    total = float(e.sum())
    return float(e[rank:].sum()) / total if total > 0 else 0.0


def svd_flops(out: int, inp: int) -> float:
    """Analytic FLOPs of a thin SVD of an (out, in) matrix with both factor sets (Golub-Van
    Loan's R-SVD count: 4 m^2 n + 8 m n^2 + 9 n^3, m >= n); torch's FLOP counter does not count
    ``linalg.svd``."""
    m, n = max(out, inp), min(out, inp)
    return 4.0 * m * m * n + 8.0 * m * n * n + 9.0 * n ** 3


def fresh_a(shape: Sequence[int], seed: int, name: str) -> torch.Tensor:
    """A LoRA ``A`` as peft initialises it (Kaiming-uniform with a = sqrt(5): U(-1/sqrt(in),
    1/sqrt(in))), drawn from a generator seeded by ``seed`` and the tensor's name, so every
    process draws the same one without it being sent."""
    ss = np.random.SeedSequence([int(seed) & 0xFFFFFFFF, zlib.crc32(name.encode())])
    g = torch.Generator().manual_seed(int(ss.generate_state(1, dtype=np.uint64)[0] >> 1))
    bound = 1.0 / math.sqrt(shape[1])
    return (torch.rand(tuple(shape), generator=g) * 2 - 1) * bound
