"""One client's measured costs in one round: the typed cost record (:class:`ClientCost`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, ClassVar


@dataclass
class ClientCost:
    """One client's costs for one round: the typed record behind the cost keys of a round's
    ``client_metrics`` (metrics.jsonl) and of summary.json.

    ``bytes_down``/``params_down``: what the server sent; ``bytes_up``/``params_up``: what the client
    sent back; ``trainable_params``: parameters updated locally; ``flops_measured``: FLOPs of the
    local training (measured on one step and scaled to all steps, or summed); ``flops_analytic``:
    :func:`analytic_train_flops` total for the same tokens; ``examples``/``tokens``: training
    examples and (non-padding or padded, as the caller documents) tokens processed;
    ``peak_rss_mb``: :attr:`PeakMemory.peak_mb`; ``activation_mb``:
    :attr:`PeakMemory.tensor_peak_mb` (or ``saved_activation_mb``); ``train_time_s``: wall time.
    A field is None when it was not measured (a client that sat out).
    """

    bytes_down: int | None = 0
    bytes_up: int | None = 0
    params_down: int | None = 0
    params_up: int | None = 0
    trainable_params: int | None = 0
    flops_measured: float | None = None
    flops_analytic: float | None = None
    examples: int = 0
    tokens: int = 0
    peak_rss_mb: float | None = None
    activation_mb: float | None = None
    train_time_s: float | None = 0.0
    #: what the client's device holds at its peak: the model it trains + ``activation_mb``
    #: (deterministic, unlike RSS deltas); ``gpu_peak_mb``: torch.cuda.max_memory_allocated
    model_mb: float | None = None
    memory_mb: float | None = None
    tokens_real: int | None = None  # non-padding tokens (``tokens`` counts padding too)
    gpu_peak_mb: float | None = None

    #: metrics keys averaged over a round's used replies (``<key>_mean`` in the round record)
    ROUND_MEANS: ClassVar[tuple[str, ...]] = ("bytes_down", "bytes_up", "flops_measured",
                                               "flops_analytic", "trainable_params", "params_up")
    #: ... and over the whole run (``<key>_mean`` in summary.json)
    SUMMARY_MEANS: ClassVar[tuple[str, ...]] = ROUND_MEANS + ("train_time_s",)
    #: metrics keys whose maximum is reported (``<key>_max``)
    PEAKS: ClassVar[tuple[str, ...]] = ("peak_rss_mb", "activation_mb", "memory_mb", "gpu_peak_mb")
    #: every key the server averages or maximises (what a reply's validation bounds at >= 0;
    #: what per-tier reports average)
    AGGREGATED: ClassVar[tuple[str, ...]] = SUMMARY_MEANS + PEAKS
    #: field -> its key in a client's metrics where they differ
    METRIC_KEYS: ClassVar[dict[str, str]] = {"examples": "examples_trained"}

    @classmethod
    def add(cls, metrics: dict[str, Any], **extra: float) -> None:
        """Add ``extra`` costs (fields of this record: more bytes sent up, more FLOPs measured)
        to a client's ``metrics`` in place; a name that is not a field is a TypeError."""
        for name, value in extra.items():
            if name not in cls.__dataclass_fields__:
                raise TypeError(f"{name!r} is not a ClientCost field")
            key = cls.METRIC_KEYS.get(name, name)
            metrics[key] = (metrics.get(key) or 0) + value

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def to_metrics(self) -> dict[str, Any]:
        """The record as a client's metrics (the keys of metrics.jsonl)."""
        return {self.METRIC_KEYS.get(k, k): v for k, v in asdict(self).items()}
