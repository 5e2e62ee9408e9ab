"""Central DP-FedAvg (McMahan et al. 2018) with an RDP accountant (Opacus).

Per round: each valid client update is clipped to L2 norm ``C`` (Flower's FlatClip, as its
``DifferentialPrivacyServerSideFixedClipping``), the clipped updates are summed and divided by
the number of clients sampled ``n`` (``clients_per_round``: a fixed denominator, so one client's
influence on the mean is at most C / n), and Gaussian noise of standard deviation ``z * C / n``
(Flower's ``compute_stdv``) is added to every element. The accountant composes one Gaussian
mechanism of noise multiplier ``z`` with sampling rate ``q = n / N`` per aggregated round, where
``N`` is the number of clients the round was sampled from (the clients with data; on Flower, those
connected), ``num_clients`` when unknown (Opacus' ``RDPAccountant``: Poisson subsampling, an
approximation of our fixed-size sampling without replacement, as in the DP-FedAvg paper) and
reports epsilon at ``delta``. It is valid only for uniform sampling and for releases that are the
noised mean alone: the config refuses loss-gap selection and FedPFT's APoZ statistics under DP.

The noise comes from a generator seeded with (seed, round): a run is reproducible and resumes
bit-identically. On Flower the ServerApp wraps its strategy in Flower's own
``DifferentialPrivacyServerSideFixedClipping`` (:class:`fedslice.flower.strategy.CentralDP`):
Flower clips and adds the noise (from numpy's global RNG, seeded once per run), and
``external_noise`` makes :meth:`Privacy.aggregate` take the mean and account only.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import torch

from fedslice.config import DPConfig
from fedslice.slicing.robust import clip_update

log = logging.getLogger(__name__)

State = dict[str, torch.Tensor]
_TAG = 0xD9


def calibrate(target_epsilon: float, delta: float, sample_rate: float, rounds: int) -> float:
    """The noise multiplier z for which epsilon after ``rounds`` rounds is ``target_epsilon``."""
    from opacus.accountants.utils import get_noise_multiplier
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return float(get_noise_multiplier(target_epsilon=target_epsilon, target_delta=delta,
                                          sample_rate=sample_rate, steps=rounds, accountant="rdp"))


class Privacy:
    """Clipping, noise and accounting of DP-FedAvg for one run."""

    def __init__(self, dp: DPConfig, clients_per_round: int, num_clients: int, rounds: int, seed: int,
                 external_noise: bool = False):
        from opacus.accountants import RDPAccountant

        self.clip, self.delta, self.seed, self.target = dp.clip_norm, dp.delta, seed, dp.target_epsilon
        self.n, self.q = clients_per_round, clients_per_round / num_clients
        self.z = dp.noise_multiplier if dp.noise_multiplier is not None else \
            calibrate(dp.target_epsilon, dp.delta, self.q, rounds)
        self.accountant = RDPAccountant()
        self.external_noise = external_noise  # True: a wrapper (Flower's) clips and adds the noise

    @property
    def std(self) -> float:
        from flwr.supercore.differential_privacy import compute_stdv

        return compute_stdv(self.z, self.clip, self.n)

    def epsilon(self) -> float:
        if not self.accountant.history:
            return 0.0
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return float(self.accountant.get_epsilon(self.delta))

    def sample_rate(self, population: int | None) -> float:
        """q of a round: clients_per_round of the ``population`` the selector sampled from (the
        clients with data, on Flower the connected ones), or of num_clients when unknown."""
        return self.q if not population else min(1.0, self.n / population)

    def aggregate(self, server_round: int, global_state: Mapping[str, torch.Tensor],
                  deltas: Sequence[Mapping[str, torch.Tensor]], eta: float,
                  population: int | None = None) -> tuple[State, dict[str, Any]]:
        """g + eta * (sum of clipped deltas / n + N(0, std^2)); one release, accounted at the
        round's sampling rate (:meth:`sample_rate`)."""
        gen = torch.Generator().manual_seed(
            int(np.random.SeedSequence([self.seed, server_round, _TAG]).generate_state(1)[0]))
        clipped, norms = [], []
        for d in deltas:
            c, norm = clip_update(d, self.clip)
            clipped.append(c)
            norms.append(norm)
        out = dict(global_state)
        sent = {k for d in deltas for k in d}  # what clients update (others, e.g. a server-made
        for k, g in global_state.items():       # proxy, are not released and stay unchanged)
            if k not in sent:
                continue
            total = sum((c[k].float() for c in clipped if k in c), torch.zeros(g.shape))
            noise = 0.0 if self.external_noise else torch.randn(g.shape, generator=gen) * self.std
            out[k] = (g.float() + eta * (total / self.n + noise)).to(g.dtype)
        q = self.sample_rate(population)
        self.accountant.step(noise_multiplier=self.z, sample_rate=q)
        epsilon = self.epsilon()
        if self.target is not None and epsilon > self.target * (1 + 1e-6):
            log.warning("round %d: epsilon %.3f is above dp.target_epsilon=%g (calibrated for "
                        "q = %.3g; this run sampled at up to %.3g)", server_round, epsilon,
                        self.target, self.q, q)
        return out, {"dp_epsilon": epsilon, "dp_delta": self.delta, "dp_sample_rate": q,
                     "dp_noise_multiplier": self.z, "dp_noise_std": self.std,
                     "dp_clipped": sum(n > self.clip for n in norms),
                     "update_norm_median": float(np.median(norms)) if norms else None}

    def state_dict(self) -> dict[str, Any]:
        return {"history": [list(h) for h in self.accountant.history]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.accountant.history = [tuple(h) for h in state["history"]]
