"""The federated data of a run: the encoded splits and each client's share of the train split."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from fedslice.data.batching import TokenizedSplit


@dataclass
class FederatedData:
    train: TokenizedSplit
    dev: TokenizedSplit
    test: TokenizedSplit
    partitions: list[np.ndarray]  # per client, its rows of ``train``
    report: dict[str, Any]
    label_names: list[str] | None = None
    #: each raw split read and its content key (``data.data_sources``): what a checkpoint
    #: records, so a resume can tell changed data
    sources: dict[str, dict[str, str]] | None = None

    def label_map(self) -> dict[str, Any] | None:
        """What ``labels.json`` of a run folder holds: each class name and its id (None when
        the labels are plain ids without names)."""
        if not self.label_names:
            return None
        return {"names": list(self.label_names),
                "ids": {name: i for i, name in enumerate(self.label_names)}}

    def client(self, cid: int) -> TokenizedSplit:
        return self.train.subset(self.partitions[cid])
