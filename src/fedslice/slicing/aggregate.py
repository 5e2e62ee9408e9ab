"""Server aggregation as pure functions over state dicts.

One primitive serves every method: a per-element weighted mean of client updates,

    new = g + eta * sum_c w_c * delta_c / (sum_c w_c + eps)      where sum_c w_c > 0
    new = g                                                      where sum_c w_c = 0

- FedAvg (Eq. 5 of the heads paper): w_c = |D_c|, a scalar per client.
- Slice aggregation (RaFFM, done right): w_c = |D_c| * mask_c; an element held by few clients is
  averaged over those clients only, and an element held by nobody keeps its value.
- Head-weighted aggregation (Eq. 8): w_c = alpha_hc broadcast over the rows of head h.

A client's weight for a key is a float or a tensor broadcastable to the parameter's shape; a key
missing from a client's update counts as weight 0 for that client.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

Weight = float | torch.Tensor
State = dict[str, torch.Tensor]


def client_delta(global_state: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor]) -> State:
    """local - global for every key the client sent (float32 arithmetic)."""
    return {k: local[k].float() - global_state[k].float() for k in local}


def aggregate_deltas(global_state: Mapping[str, torch.Tensor],
                     deltas: Sequence[Mapping[str, torch.Tensor]],
                     weights: Sequence[Weight | Mapping[str, Weight]],
                     *, eta: float = 1.0, eps: float = 0.0) -> State:
    """Per-element weighted mean of ``deltas`` applied to ``global_state`` (see module doc).

    ``weights[c]`` is one weight for every key of client c, or a mapping key -> weight.
    """
    out: State = {}
    for key, g in global_state.items():
        num = torch.zeros_like(g, dtype=torch.float32)
        den = torch.zeros_like(g, dtype=torch.float32)
        for delta, w in zip(deltas, weights):
            if key not in delta:
                continue
            wk = w[key] if isinstance(w, Mapping) else w
            if isinstance(wk, Mapping):
                raise TypeError(f"weight for {key} must be a float or tensor")
            wk = torch.as_tensor(wk, dtype=torch.float32)
            num += wk * delta[key]
            den += wk
        held = den > 0
        step = torch.where(held, num / (den + eps), 0.0)  # 0/0 lands only where not held
        out[key] = (g.float() + eta * step).to(g.dtype)
    return out


def fedavg(global_state: Mapping[str, torch.Tensor], client_states: Sequence[Mapping[str, torch.Tensor]],
           num_examples: Sequence[int], *, eta: float = 1.0) -> State:
    """FedAvg with a server learning rate: Eq. 5 of the heads paper (eta=1 is McMahan's FedAvg)."""
    deltas = [client_delta(global_state, s) for s in client_states]
    return aggregate_deltas(global_state, deltas, [float(n) for n in num_examples], eta=eta)


def finite_update(state: Mapping[str, torch.Tensor]) -> bool:
    """True if every tensor of a client's update is finite (NaN/Inf updates are excluded)."""
    return all(bool(torch.isfinite(t).all()) for t in state.values() if t.is_floating_point())
