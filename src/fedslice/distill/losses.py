"""Distillation losses (FedPFT Eq. 13, Offsite-Tuning's emulator loss), all with real gradients.

Both terms are normalised like the public FedPFT code, so that layers of different scale weigh
the same: the squared error of a layer's output is divided by the teacher's mean square
(``rms(T)^2``) over the real (non-padding) tokens, and the weight term by the mean square of the
teacher's product ``W1 W2``.

Unlike the public code, the weight term is built from the student's parameters themselves (not
``.data``), so it has a gradient and actually pulls ``W1'W2'`` towards ``W1W2``. A gated FFN
(SwiGLU, gated-GELU) has two input matrices: the term is the mean of ``||W_gate W2 - ...||`` and
``||W_up W2 - ...||`` (weights in ``nn.Linear`` orientation: the caller converts GPT-2's Conv1D
weights with :meth:`fedslice.models.arch.Layout.as_linear`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def hidden_loss(student: torch.Tensor, teacher: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """||S - T||^2 / ||T||^2 over real tokens: student/teacher (B, T, d), mask (B, T) of 0/1."""
    m = mask.to(student.dtype).unsqueeze(-1)  # (B, T, 1)
    err = ((student - teacher) ** 2 * m).sum()
    scale = (teacher ** 2 * m).sum().clamp_min(1e-12)
    return err / scale


def ffn_product(w_in: torch.Tensor, w_out: torch.Tensor) -> torch.Tensor:
    """(W1 W2)^T of a FFN from ``nn.Linear`` weights: w_in (F, d), w_out (d, F) -> (d, d).

    The paper writes FFN(x) = gelu(x W1) W2 with W1 (d, F) = w_in^T and W2 (F, d) = w_out^T, so
    W1 W2 = (w_out @ w_in)^T; the transpose does not change the Frobenius distance."""
    return w_out @ w_in  # (d, F) @ (F, d) -> (d, d)


def weight_loss(student: tuple[torch.Tensor, torch.Tensor],
                teacher: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """||W1W2 - W1'W2'||^2 / ||W1W2||^2 of one FFN; gradient flows into the student's weights."""
    target = ffn_product(*teacher).detach()
    return ((ffn_product(*student) - target) ** 2).sum() / (target ** 2).sum().clamp_min(1e-12)


Pair = tuple[torch.Tensor, torch.Tensor]


def _pairs(ffn: Pair | Sequence[Pair]) -> list[Pair]:
    """The (w_in, w_out) pairs of one FFN: one for a plain FFN, gate and up for a gated one."""
    return [ffn] if isinstance(ffn[0], torch.Tensor) else list(ffn)  # type: ignore[list-item]


def ffn_weight_loss(student: Pair | Sequence[Pair], teacher: Pair | Sequence[Pair]) -> torch.Tensor:
    """:func:`weight_loss` of one FFN: the mean over its input matrices (a gated FFN's gate and
    up projection, each with the down projection), so gated and plain FFNs weigh the same."""
    s, t = _pairs(student), _pairs(teacher)
    return sum(weight_loss(a, b) for a, b in zip(s, t)) / len(s)


def layer_kd_loss(student_layers: Sequence[torch.Tensor], teacher_layers: Sequence[torch.Tensor],
                  mask: torch.Tensor | Sequence[torch.Tensor],
                  student_ffn: dict[int, Pair | Sequence[Pair]],
                  teacher_ffn: dict[int, Pair | Sequence[Pair]],
                  mu: float) -> tuple[torch.Tensor, dict[str, float]]:
    """Eq. 13: (1/L) sum_i [ ||O_i - O'_i||^2 + mu ||W1W2 - W1'W2'||^2_i ] (normalised terms).

    ``*_layers[i]`` is the output (B, T_i, d) of layer i (all L layers of every stack); ``mask``
    is one (B, T) mask or one per layer (an encoder-decoder's decoder layers read other tokens).
    The weight term runs over the compressed layers (``student_ffn``: layer -> (w_in, w_out),
    or for a gated FFN [(gate, w_out), (w_in, w_out)]); whole layers contribute 0.
    """
    L = len(teacher_layers)
    masks = [mask] * L if isinstance(mask, torch.Tensor) else list(mask)
    hid = sum(hidden_loss(s, t, m) for s, t, m in zip(student_layers, teacher_layers, masks)) / L
    if mu > 0 and student_ffn:
        wt = sum(ffn_weight_loss(student_ffn[i], teacher_ffn[i]) for i in student_ffn) / L
    else:
        wt = torch.zeros((), dtype=hid.dtype)
    total = hid + mu * wt
    return total, {"loss": float(total.detach()), "hidden": float(hid.detach()),
                   "weight": float(wt.detach())}
