"""Rendering prompts and targets from data columns, and tokenizing them with counted truncation."""

from __future__ import annotations

import logging
import string
from collections.abc import Mapping, Sequence

import torch

from fedslice.config import TaskConfig
from fedslice.errors import ConfigError

log = logging.getLogger(__name__)

ALPACA_PROMPT = ("Below is an instruction that describes a task{ctx}. Write a response that "
                 "appropriately completes the request.\n\n### Instruction:\n{instruction}\n\n"
                 "{input_block}### Response:\n")


def template_fields(template: str) -> list[str]:
    """The column names a ``str.format`` template reads."""
    try:
        return [f for _, f, _, _ in string.Formatter().parse(template) if f]
    except ValueError as e:
        raise ConfigError(f"template {template!r} is not a valid format string: {e}") from None


def check_columns(template: str, columns: Sequence[str], field: str, source: str) -> None:
    """A template field the data lacks is a ConfigError naming it (at load, before training)."""
    missing = [f for f in template_fields(template) if f not in columns]
    if missing:
        raise ConfigError(f"{field}: {template!r} reads column(s) {missing} that {source} lacks "
                          f"(columns: {list(columns)})")


def render(template: str, row: Mapping[str, str]) -> str:
    return template.format_map(row)


def alpaca_prompt(row: Mapping[str, str]) -> str:
    """The Alpaca prompt (with or without its input section)."""
    extra = (row.get("input") or "").strip()
    return ALPACA_PROMPT.format(
        ctx=", paired with an input that provides further context" if extra else "",
        instruction=row["instruction"], input_block=f"### Input:\n{extra}\n\n" if extra else "")


def apply_chat(tokenizer, prompt: str) -> str:
    """The prompt as a user turn of the tokenizer's chat template, ready for the answer."""
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError("task.chat_template: the model's tokenizer has no chat template: give "
                          "one as a Jinja file in task.chat_template_file")
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                         add_generation_prompt=True, tokenize=False)


class Truncation:
    """Counts what tokenization cut, for the run log (never silently)."""

    def __init__(self):
        self.counts: dict[str, list[int]] = {}

    def ids(self, tokenizer, texts: list[str], limit: int, what: str, *, special: bool,
            side: str = "right") -> list[torch.Tensor]:
        enc = tokenizer(texts, add_special_tokens=special, truncation=False)["input_ids"]
        cut = sum(len(e) > limit for e in enc)
        c = self.counts.setdefault(what, [0, 0])
        c[0] += cut
        c[1] += len(enc)
        keep = (lambda e: e[len(e) - limit:]) if side == "left" else (lambda e: e[:limit])
        return [torch.tensor(keep(e) if len(e) > limit else e, dtype=torch.int64) for e in enc]

    def log(self, limits: Mapping[str, str]) -> None:
        for what, (cut, total) in self.counts.items():
            if cut:
                log.warning("truncated %d of %d %s to %s tokens", cut, total, what, limits[what])
            else:
                log.info("no %s truncated (%d, limit %s tokens)", what, total, limits[what])


def task_prompts(cfg: TaskConfig, rows: list[Mapping[str, str]], columns: Sequence[str],
                 default_columns: Sequence[str], source: str) -> list[str]:
    """The rendered prompt of every row (preset, template, or the default columns)."""
    if cfg.preset == "alpaca":
        for c in ("instruction", "output"):
            if c not in columns:
                raise ConfigError(f"task.preset = 'alpaca' needs column {c!r}; {source} has "
                                  f"{list(columns)}")
        return [alpaca_prompt(r) for r in rows]
    template = cfg.prompt or "\n".join("{" + c + "}" for c in default_columns)
    check_columns(template, columns, "task.prompt", source)
    return [render(template, r) for r in rows]
