"""``classification`` with a sequence-classification head (encoders, or decoders' ``score`` head)."""

from __future__ import annotations

import math

import torch
import torch.nn as nn

from fedslice import progress
from fedslice.compute import model_device, to_device
from fedslice.data import TokenCache, iter_batches, num_batches, num_labels, tokenize_split
from fedslice.data.labels import RawSplit
from fedslice.data.packing import first_token_states, is_packed, model_inputs
from fedslice.data.sources import load_raw_splits
from fedslice.paths import cache_root
from fedslice.models.arch import unwrap_model
from fedslice.tasks.base import Task, length_order

_TOKENS = TokenCache(disk=None if (root := cache_root()) is None else root / "tokens")


class Classification(Task):
    kind = "classification"
    primary_metric = "accuracy"

    def load_raw(self, carve_missing: bool = True):
        return load_raw_splits(self.cfg.data, self.cfg.seed, carve_missing)

    def num_labels(self, raw) -> int:
        return num_labels(raw)

    def encode(self, raw, loaded):
        self.label_names = raw["train"].label_names
        self.text_columns = raw["train"].text_columns
        return {name: _TOKENS.get(split, name, loaded.tokenizer, self.cfg.data.max_length)
                for name, split in raw.items()}

    def loss(self, model: nn.Module, batch):
        if is_packed(batch):
            return packed_classifier_loss(model, batch, self.arch.model_type)
        return super().loss(model, batch)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split, batch_size: int, max_generations=None):
        return evaluate_classifier(model, split, batch_size)

    def input_columns(self) -> list[str]:
        return list(self.text_columns or self.cfg.data.text_columns or [])

    @torch.no_grad()
    def predict(self, model, loaded, rows, batch_size, source):
        texts = [tuple(str(r[c]) for c in self.input_columns()) for r in rows]
        split = tokenize_split(RawSplit(texts, [0] * len(texts), source), loaded.tokenizer,
                               self.cfg.data.max_length)
        order = length_order(split)
        device = model_device(model)
        was = model.training
        model.eval()
        with progress.task("predict", num_batches(len(split), batch_size)) as advance:
            out = {}
            for lo in range(0, len(order), batch_size):
                idx = order[lo:lo + batch_size].tolist()
                batch = split.collate(idx)
                batch.pop("labels")
                p = torch.softmax(model(**to_device(batch, device)).logits.float().cpu(), -1)
                out.update(zip(idx, p))
                advance()
        model.train(was)
        probs = [out[i] for i in range(len(rows))]
        return [{"prediction": int(p.argmax()), "probabilities": p.tolist()} for p in probs]


@torch.no_grad()
def evaluate_classifier(model: nn.Module, data, batch_size: int) -> dict[str, float]:
    """Accuracy, mean cross-entropy and the accuracy on each class's examples (``None`` for a
    class without examples); batches of similar length (sorted) keep padding small."""
    if len(data) == 0:
        return {"accuracy": math.nan, "loss": math.nan}
    was_training = model.training
    model.eval()
    device = model_device(model)
    correct = 0
    loss_sum = 0.0
    hits = totals = None
    with progress.task("evaluation", num_batches(len(data), batch_size)) as advance:
        for batch in iter_batches(data, length_order(data), batch_size, shuffle=False,
                                  generator=None):
            advance()
            out = model(**to_device(batch, device))
            right = out.logits.argmax(-1).cpu() == batch["labels"]
            correct += int(right.sum())
            k = out.logits.shape[-1]
            if hits is None:
                hits, totals = torch.zeros(k, dtype=torch.int64), torch.zeros(k, dtype=torch.int64)
            hits += torch.bincount(batch["labels"][right], minlength=k)[:k]
            totals += torch.bincount(batch["labels"], minlength=k)[:k]
            loss_sum += float(out.loss) * len(batch["labels"])
    model.train(was_training)
    per_class = [h / t if t else None for h, t in zip(hits.tolist(), totals.tolist())]
    return {"accuracy": correct / len(data), "loss": loss_sum / len(data),
            "per_class_accuracy": per_class}


def packed_classifier_loss(model: nn.Module, batch, model_type: str) -> torch.Tensor:
    """The loss of a packed batch (:mod:`fedslice.data.packing`): the encoder runs on the packed
    rows, the head on each example's first-token state; equal to the padded batch's loss."""
    hf = unwrap_model(model)
    batch = to_device(batch, model_device(model))
    with first_token_states(hf, model_type, batch["example_starts"]):
        return model(**model_inputs(batch, hf, causal=False), labels=batch["labels"]).loss
