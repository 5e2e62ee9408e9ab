"""The heads paper's analytic OPs count (Appendix A, Table 6), implemented as printed.

Table 6 of "Assortment of Attention Heads" gives, per layer, the operations (MACs, "OPs") of one
training step on a sequence of ``T`` tokens with hidden size ``d``; the totals are ``L`` times
the per-layer terms. As printed (forward + backward rows):

=============  ===========================================  ===================================
QKV            fwd ``T d^3``                                bwd ``T d^3 + T d^2``
Attention      fwd ``T^2 d^2 + T^3 d``                      bwd ``T^2 d^2 + 3 T^3 d``
FC             fwd ``T d^3``                                bwd ``T d^3 + T d^2``
LoRA           fwd ``T d^2 r + T r^2 d``                    bwd ``T d^2 r + T r d + T d r + T r^2 d + T d^3``
IA3            fwd ``T d``                                  bwd ``2 T d``
Prompt tuning  fwd ``Tp d^3 + (Tp+T)^2 d^2 + (Tp+T)^3 d``   bwd ``Tp d^3 + (Tp+T)^2 d^2 + 3 (Tp+T)^3 d`` (no ``L``)
P-tuning       the prompt-tuning rows times ``L``
=============  ===========================================  ===================================

The odd terms are kept as printed, on purpose (this function documents the paper, it is not a
cost model): a ``T x d`` by ``d x d`` product costs ``T d^2`` MACs, not ``T d^3``; the scores
``Q K^T`` and ``A V`` cost ``T^2 d`` each, not ``T^2 d^2 + T^3 d``; LoRA's backward through the
frozen weight is ``T d^2``, not ``T d^3``. With T5-small's ``L=18, d=512`` (Table 7) and
``T=512`` every such term is ``512^4 ~ 6.9e10``, so the formulas give ~13.7 T-OPs for LoRA
r=16, not the 33.07 G-OPs of Tables 1-4: the tables were not computed with these formulas as
printed (or with other ``T``/``d``). Use :func:`fedslice.measure.analytic_train_flops` and the
measured FLOPs for real costs; this is reported next to them for comparison with the paper.

Head pruning is not in Table 6. Our reading: the per-head rows (QKV, Attention and the PEFT
rows, which adapt the attention projections) scale with the fraction ``k_l`` of heads a layer
keeps, FC does not: ``total = sum_l k_l (QKV + Attention + PEFT) + FC``. At 90% sparsity this
gives 3.8x fewer OPs for T5-small at T=512 (the paper reports 3.9x).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

Peft = Literal["lora", "ia3", "prompt_tuning", "p_tuning", "none"]


def table6_rows(hidden: int, tokens: float, rank: int = 0, prompt_tokens: int = 0) -> dict[str, float]:
    """Per-layer OPs of each Table 6 row, forward + backward, exactly as printed."""
    d, T, r, Tp = float(hidden), float(tokens), float(rank), float(prompt_tokens)
    S = Tp + T
    return {
        "qkv": T * d**3 + (T * d**3 + T * d**2),
        "attention": (T**2 * d**2 + T**3 * d) + (T**2 * d**2 + T**3 * d + T**3 * d + T**3 * d),
        "fc": T * d**3 + (T * d**3 + T * d**2),
        "lora": (T * d**2 * r + T * r**2 * d)
                + (T * d**2 * r + T * r * d + T * d * r + T * r**2 * d + T * d**3),
        "ia3": T * d + (T * d + T * d),
        "prompt": (Tp * d**3 + S**2 * d**2 + S**3 * d)
                  + (Tp * d**3 + S**2 * d**2 + S**3 * d + S**3 * d + S**3 * d),
    }


def paper_ops(num_layers: int, hidden: int, tokens: float, *, rank: int = 0, peft: Peft = "lora",
              kept: float | Sequence[float] = 1.0, prompt_tokens: int = 0) -> dict[str, float]:
    """OPs (MACs) of one training step on one sequence of ``tokens`` tokens (Table 6).

    ``kept`` is the fraction of heads kept, one number for every layer or one per layer. Returns
    the summed rows ``qkv``, ``attention``, ``fc``, ``peft`` and their ``total``.
    """
    ks = [float(kept)] * num_layers if isinstance(kept, (int, float)) else [float(k) for k in kept]
    if len(ks) != num_layers:
        raise ValueError(f"kept has {len(ks)} entries for {num_layers} layers")
    row = table6_rows(hidden, tokens, rank, prompt_tokens)
    per_layer_peft = {"lora": row["lora"], "ia3": row["ia3"], "p_tuning": row["prompt"],
                      "prompt_tuning": 0.0, "none": 0.0}[peft]
    out = {"qkv": row["qkv"] * sum(ks), "attention": row["attention"] * sum(ks),
           "fc": row["fc"] * num_layers, "peft": per_layer_peft * sum(ks)}
    if peft == "prompt_tuning":  # printed without the factor L: the prompt enters once
        out["peft"] = row["prompt"] * (sum(ks) / num_layers)
    out["total"] = out["qkv"] + out["attention"] + out["fc"] + out["peft"]
    return out
