"""``generation``: prompt -> target, rendered from data columns by templates.

Training: cross-entropy on the target tokens (decoders: prompt + target in one sequence, loss on
the target only; encoder-decoders: prompt -> target). Evaluation: loss and perplexity on every
held-out target, and BLEU/ROUGE of batched, deterministic greedy generations, one per distinct
prompt, scored against all the references of that prompt (E2E NLG: every reference of a meaning
representation)."""

from __future__ import annotations

import logging

import numpy as np
import torch
import torch.nn as nn

from fedslice.data.locate import load_tables, resolve_text_columns
from fedslice.data.tables import drop_incomplete
from fedslice.errors import ConfigError
import fedslice.tasks.lm as lm
from fedslice import progress
from fedslice.tasks.base import seeded_choice
from fedslice.tasks.metrics import generation_scores
from fedslice.tasks.text import Truncation, check_columns, render, task_prompts, template_fields
from fedslice.tasks.text2text import TextToText, eval_mode, first_rows, groups_of, perplexity

log = logging.getLogger(__name__)

METRICS = ("bleu", "rouge1", "rouge2", "rougeL", "loss", "perplexity")


class Generation(TextToText):
    kind = "generation"
    primary_metric = "rougeL"

    def load_raw(self, carve_missing: bool = True):
        """Every column of the data (the templates pick theirs); template fields the data lacks
        are errors naming them, before any training."""
        t, d = self.cfg.task, self.cfg.data
        tables = load_tables(d, self.cfg.seed, required=[], carve_missing=carve_missing)
        if t.preset != "alpaca" and t.prompt is None:  # the prompt is the text column(s)
            first = next(iter(tables.values()))  # train (or the first split the data has)
            d = resolve_text_columns(d, list(first.columns), first.source)
        self.text_columns = d.text_columns
        need = [] if t.preset == "alpaca" else [(f, "task.prompt") for f in template_fields(
            t.prompt or "\n".join("{" + c + "}" for c in d.text_columns))]
        need += [(f, "task.target") for f in template_fields(t.target or "{output}")]
        if t.preset == "alpaca":
            need += [("instruction", "task.preset"), ("output", "task.preset")]
        need = list(dict.fromkeys(need))
        for name, table in tables.items():
            missing = [(c, f) for c, f in need if c not in table.columns]
            if missing:  # the config names columns the data lacks: a config error
                raise ConfigError(f"{', '.join(sorted({f for _, f in missing}))}: column(s) "
                                  f"{[c for c, _ in missing]} not in {table.source} (columns: "
                                  f"{list(table.columns)})")
            tables[name], _ = drop_incomplete(table, need, skip=d.bad_rows == "skip")
        return tables

    def encode(self, raw, loaded):
        self.bind(loaded)
        t = self.cfg.task
        target_template = "{output}" if t.preset == "alpaca" else t.target
        trunc = Truncation()
        out = {}
        for name, table in raw.items():
            columns = list(table.columns)
            check_columns(target_template, columns, "task.target", table.source)
            rows = [dict(zip(columns, ("" if c is None else c for c in cells)))
                    for cells in zip(*table.columns.values())]
            prompts = task_prompts(t, rows, columns, self.text_columns or [], table.source)
            targets = [render(target_template, r) for r in rows]
            out[name] = self.pair_split(self.prompt_ids(prompts, trunc),
                                        self.target_ids(targets, trunc, eos=True),
                                        [0] * len(rows), groups_of(prompts), targets)
        trunc.log({"prompts": f"data.max_length={self.cfg.data.max_length}",
                   "targets": f"task.max_target_length={t.max_target_length}"})
        return out

    def limit(self, split, n, seed):
        """``n`` distinct prompts (seeded) with all their references."""
        groups = split.groups.numpy()
        ids = np.unique(groups)
        if n is None or n >= len(ids):
            return split
        keep = set(ids[seeded_choice(len(ids), n, seed)].tolist())
        return split.subset([i for i, g in enumerate(groups) if g in keep])

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split, batch_size: int, max_generations=None):
        if len(split) == 0:
            return dict.fromkeys(METRICS, float("nan"))
        with eval_mode(model):
            loss = self.target_nll(model, split, batch_size)
            firsts = first_rows(split.groups)  # one prompt per group
            firsts = firsts[seeded_choice(len(firsts), max_generations, self.cfg.seed)]
            hyps = self.generate(model, split, firsts.tolist(), batch_size)
        refs_of: dict[int, list[str]] = {}
        for g, ref in zip(split.groups.tolist(), split.references):
            refs_of.setdefault(g, []).append(ref)
        refs = [refs_of[int(split.groups[i])] for i in firsts]
        scores = generation_scores(hyps, refs)
        self.last_samples = [{"prompt": self.tokenizer.decode(split.prompts[i]), "generated": h,
                              "references": r} for i, h, r in zip(firsts[:5], hyps, refs)]
        return {**scores, "loss": loss, "perplexity": perplexity(loss)}

    def input_columns(self) -> list[str]:
        t = self.cfg.task
        if t.preset == "alpaca":
            return ["instruction"]
        if t.prompt:
            return template_fields(t.prompt)
        return list(self.text_columns or self.cfg.data.text_columns or [])

    @torch.no_grad()
    def predict(self, model, loaded, rows, batch_size, source):
        """Greedy generations (``task.max_new_tokens``) from each row's prompt."""
        self.bind(loaded)
        trunc = Truncation()
        prompts = task_prompts(self.cfg.task, rows, list(rows[0]) if rows else [],
                               self.input_columns(), source)
        n = len(prompts)
        empty = torch.zeros(0, dtype=torch.int64)
        split = self.pair_split(self.prompt_ids(prompts, trunc), [empty] * n, [0] * n,
                                list(range(n)), [""] * n)
        with eval_mode(model):
            texts = self.generate(model, split, list(range(n)), batch_size)
        return [{"prediction": t} for t in texts]

    def generate(self, model: nn.Module, split, rows: list[int], batch_size: int) -> list[str]:
        """Greedy generations for ``rows``, batched by prompt length, in the order of ``rows``."""
        lengths = [len(split.prompts[i]) for i in rows]
        order = sorted(range(len(rows)), key=lambda j: lengths[j])
        out: list[str] = [""] * len(rows)
        with progress.task("generation", -(-len(order) // batch_size)) as advance:
            for lo in range(0, len(order), batch_size):
                chunk = order[lo:lo + batch_size]
                texts = lm.generate(model, split, [rows[j] for j in chunk], self.tokenizer,
                                    self.cfg.task.max_new_tokens)
                for j, text in zip(chunk, texts):
                    out[j] = text
                advance()
        return out


def check_partition(cfg) -> None:
    if cfg.data.partition != "iid":
        raise ConfigError(f"data.partition = {cfg.data.partition!r} skews clients by class label; "
                          f"a {cfg.task.kind} task has none: use 'iid'")
