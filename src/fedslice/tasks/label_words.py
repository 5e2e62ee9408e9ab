"""``classification`` text-to-text on a generative model: the target is the label's word, and a
prediction is the label word with the largest likelihood given the prompt (summed
log-probabilities of its tokens; no free generation), as the heads paper runs MultiNLI on T5."""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from fedslice.data.sources import load_raw_splits
from fedslice.errors import ConfigError, DataError
import fedslice.tasks.lm as lm
from fedslice.tasks.base import length_order
from fedslice.tasks.text import Truncation, task_prompts, template_fields
from fedslice.tasks.text2text import TextToText, eval_mode, groups_of

log = logging.getLogger(__name__)


class LabelWordClassification(TextToText):
    kind = "classification"
    primary_metric = "accuracy"

    def load_raw(self, carve_missing: bool = True):
        return load_raw_splits(self.cfg.data, self.cfg.seed, carve_missing)

    def encode(self, raw, loaded):
        self.bind(loaded)
        words = self.cfg.task.label_words
        trunc = Truncation()
        word_ids = self.target_ids(list(words.values()), trunc, eos=False)
        if len({tuple(w.tolist()) for w in word_ids}) != len(word_ids):
            raise ConfigError(f"task.label_words: two label words have the same tokens "
                              f"({ {k: w.tolist() for k, w in zip(words, word_ids)} })")
        self.classes = list(words)  # label as written in the data -> position = candidate index
        self.label_names = self.classes
        self.text_columns = raw["train"].text_columns
        self.candidates = word_ids
        for k, w in zip(words, word_ids):
            pieces = self.tokenizer.convert_ids_to_tokens(w.tolist())
            log.info("label %s -> %r: %d token(s) %s", k, words[k], len(w), pieces)
        out = {}
        for name, split in raw.items():
            columns = split.text_columns
            rows = [dict(zip(columns, t)) for t in split.texts]
            prompts = task_prompts(self.cfg.task, rows, columns, columns, split.source)
            cls = []
            names = split.label_names
            for i, label in enumerate(split.labels):
                key = names[label] if names else str(label)
                if key not in words:
                    raise DataError(f"{split.source}, row {i + 1}: label {key!r} has no word in "
                                    f"task.label_words ({sorted(words)})")
                cls.append(self.classes.index(key))
            out[name] = self.pair_split(self.prompt_ids(prompts, trunc),
                                        [word_ids[c] for c in cls], cls, groups_of(prompts),
                                        [words[self.classes[c]] for c in cls])
        trunc.log({"prompts": str(self.cfg.data.max_length), "targets": "label word"})
        return out

    def scores(self, model: nn.Module, split, batch_size: int):
        """Per example (in batches of similar length): the summed and the per-token
        log-probabilities of every label word, both (B, K), with the examples' indices."""
        k = len(self.candidates)
        order = length_order(split).tolist()
        per = max(1, batch_size // k)
        with eval_mode(model):
            for lo in range(0, len(order), per):
                idx = order[lo:lo + per]
                rows = [i for i in idx for _ in range(k)]  # each prompt with every candidate
                pairs = split.with_targets(rows, [self.candidates[c] for _ in idx for c in range(k)])
                sums, counts = lm.sequence_logprobs(model, pairs.collate(range(len(rows))),
                                                    self.layout)
                yield idx, sums.view(len(idx), k), (sums / counts).view(len(idx), k)

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split, batch_size: int, max_generations=None):
        """Accuracy of the most likely label word and the mean per-token NLL of the true one."""
        if len(split) == 0:
            return {"accuracy": float("nan"), "loss": float("nan")}
        correct, nll = 0, 0.0
        for idx, scores, per_token in self.scores(model, split, batch_size):
            truth = split.labels[torch.as_tensor(idx)]
            correct += int((scores.argmax(-1) == truth).sum())
            nll -= float(per_token.gather(1, truth[:, None]).sum())
        return {"accuracy": correct / len(split), "loss": nll / len(split)}

    def input_columns(self) -> list[str]:
        t = self.cfg.task
        if t.prompt:
            return template_fields(t.prompt)
        return list(self.text_columns or self.cfg.data.text_columns or [])

    @torch.no_grad()
    def predict(self, model, loaded, rows, batch_size, source):
        """The label word with the largest likelihood; probabilities: softmax of the words'
        summed log-probabilities (over the label words only)."""
        self.bind(loaded)
        words = self.cfg.task.label_words
        trunc = Truncation()
        self.candidates = self.target_ids(list(words.values()), trunc, eos=False)
        prompts = task_prompts(self.cfg.task, rows, list(rows[0]) if rows else [],
                               self.input_columns(), source)
        n = len(prompts)
        split = self.pair_split(self.prompt_ids(prompts, trunc), [self.candidates[0]] * n,
                                [0] * n, list(range(n)), [""] * n)
        out = {}
        for idx, scores, _ in self.scores(model, split, batch_size):
            out.update(zip(idx, torch.softmax(scores.float(), -1)))
        return [{"prediction": int(out[i].argmax()), "probabilities": out[i].tolist()}
                for i in range(n)]
