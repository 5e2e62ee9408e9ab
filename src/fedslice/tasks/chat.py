"""``chat``: instruction tuning on conversations (multi-turn, system turns kept), rendered with the
model's own chat template.

Data: one conversation per row, as a ``messages`` column of ``{role, content}`` turns, ShareGPT's
``conversations`` of ``{from, value}``, or Alpaca columns (``task.preset = 'alpaca'``)
(:mod:`fedslice.data.conversations`). Training: cross-entropy on the assistant's tokens only,
every assistant turn (:mod:`fedslice.tasks.chat_template`), over the conversation cut to
``data.max_length`` tokens; a conversation cut before its first assistant token is dropped
(counted, said once). Evaluation: loss and perplexity per assistant token of the held-out
conversations, and BLEU/ROUGE of greedy answers to the last user turn of a sample of them
(``evaluation.dev_generations``) against the assistant's own last answer; the first answers are
kept as samples for the report. ``predict`` answers each conversation's last user turn.
"""

from __future__ import annotations

import logging

import torch
import torch.nn as nn

from fedslice.data.chat import ChatSplit
from fedslice.data.conversations import (BadConversation, Turn, conversation_column,
                                         read_conversations, row_turns)
from fedslice.data.locate import load_tables
from fedslice.data.tables import RawTable
from fedslice.errors import DataError
from fedslice.tasks.base import seeded_choice
from fedslice.tasks.chat_template import (install_template, labels_of, render,
                                          tokenize_conversation)
from fedslice.tasks.generation import METRICS, Generation
from fedslice.tasks.metrics import generation_scores
from fedslice.tasks.text2text import eval_mode, perplexity

log = logging.getLogger(__name__)


class Chat(Generation):
    kind = "chat"
    primary_metric = "rougeL"

    def load_raw(self, carve_missing: bool = True):
        """Every split's table, its rows checked to be conversations (bad rows: an error naming
        file and row, or skipped under ``data.bad_rows = 'skip'``)."""
        d = self.cfg.data
        tables = load_tables(d, self.cfg.seed, required=[], carve_missing=carve_missing)
        out = {}
        for name, table in tables.items():
            column = self.column_of(table)
            # the client column matters where train is partitioned (not to `fedslice evaluate`)
            client = d.client_column if name == "train" and carve_missing else None
            out[name], _ = read_conversations(table, column, skip=d.bad_rows == "skip",
                                              client_column=client)
        return out  # text_columns stay None: the conversation column is found per table

    def column_of(self, table: RawTable) -> str | None:
        """The table's conversation column (None: Alpaca columns)."""
        if self.cfg.task.preset == "alpaca":
            return None
        column = conversation_column(list(table.columns), self.cfg.task.messages_column,
                                     table.source)
        if column is None:
            raise DataError(f"{table.source}: task.kind = 'chat' reads a 'messages' column "
                            "({role, content} turns) or ShareGPT's 'conversations' ({from, "
                            "value}), or Alpaca columns with task.preset = 'alpaca'; columns "
                            f"found: {list(table.columns)}")
        return column

    def bind(self, loaded) -> None:
        super().bind(loaded)  # installs task.chat_template_file
        if self.cfg.task.chat_template_file is None:  # the tokenizer's own, which it must have
            install_template(loaded.tokenizer, None, self.cfg.model.name)

    def encode(self, raw, loaded):
        self.bind(loaded)
        d = self.cfg.data
        out = {}
        for name, table in raw.items():
            column = self.column_of(table)
            client = d.client_column if name == "train" and d.client_column in table.columns else None
            out[name] = self.encode_table(table, column, client)
        return out

    def encode_table(self, table: RawTable, column: str | None, client: str | None) -> ChatSplit:
        """The conversations of ``table`` tokenized and cut to ``data.max_length``; a row the
        template refuses is an error naming it (or skipped), a row cut before its first
        assistant token is dropped, both counted in one warning each."""
        limit, skip = self.cfg.data.max_length, self.cfg.data.bad_rows == "skip"
        ids, targets, prompts, refs, kept = [], [], [], [], []
        cut = dropped = 0
        refused: list[tuple[int, str]] = []
        for i in range(len(table)):
            turns = row_turns(table, i, column)
            try:
                full, trained, prompt = tokenize_conversation(self.tokenizer, turns)
            except BadConversation as e:
                table.refuse_row(i, e, skip, refused)
                continue
            x = full
            if len(full) > limit:
                cut += 1
                x, trained = full[:limit], trained[:limit]
                if not bool(trained[1:].any()):  # the first token is never a target
                    dropped += 1
                    continue
            ids.append(x)
            targets.append(labels_of(x, trained))
            prompts.append(prompt[max(0, len(prompt) - limit):])  # its end, when cut
            refs.append(last_answer(turns))
            kept.append(i)
        self.log_cuts(table, cut, dropped, refused)
        if not ids:
            raise DataError(f"{table.source}: no conversation left to train or evaluate on "
                            f"(data.max_length = {limit} tokens cuts every one before its first "
                            "assistant token, or every row was skipped)")
        clients = None if client is None else [table.columns[client][i] for i in kept]
        return ChatSplit(ids, targets, prompts, refs, self.pad_id, clients)

    def log_cuts(self, table: RawTable, cut: int, dropped: int,
                 refused: list[tuple[int, str]]) -> None:
        limit = self.cfg.data.max_length
        unit = "lines" if table.unit == "line" else "rows"
        if refused:
            shown = ", ".join(str(n) for n, _ in refused[:10]) + (", ..." if len(refused) > 10 else "")
            log.warning("%s: skipped %d conversation(s) the chat template cannot render as turns "
                        "(%s %s; first: %s)", table.source, len(refused), unit, shown, refused[0][1])
        if dropped:
            log.warning("%s: dropped %d of %d conversation(s): data.max_length = %d tokens cuts "
                        "them before their first assistant token", table.source, dropped,
                        len(table), limit)
        if cut - dropped:
            log.warning("%s: truncated %d of %d conversation(s) to data.max_length = %d tokens",
                        table.source, cut - dropped, len(table), limit)
        elif not cut:
            log.info("%s: no conversation truncated (%d, limit %d tokens)", table.source,
                     len(table), limit)

    def limit(self, split, n, seed):
        return split if n is None or n >= len(split) else \
            split.subset(seeded_choice(len(split), n, seed))

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split, batch_size: int, max_generations=None):
        """Loss and perplexity per assistant token; BLEU/ROUGE of the answers to the last user
        turn of ``max_generations`` conversations (seeded) against the assistant's."""
        if len(split) == 0:
            return dict.fromkeys(METRICS, float("nan"))
        with eval_mode(model):
            loss = self.target_nll(model, split, batch_size)
            rows = seeded_choice(len(split), max_generations, self.cfg.seed)
            hyps = self.generate(model, split, rows.tolist(), batch_size)
        refs = [[split.references[i]] for i in rows]
        scores = generation_scores(hyps, refs)
        self.last_samples = [{"prompt": self.tokenizer.decode(split.prompts[i]), "generated": h,
                              "references": r} for i, h, r in zip(rows[:5], hyps, refs)]
        return {**scores, "loss": loss, "perplexity": perplexity(loss)}

    def input_columns(self) -> list[str]:
        t = self.cfg.task
        if t.preset == "alpaca":
            return ["instruction"]
        return [t.messages_column] if t.messages_column else []

    @torch.no_grad()
    def predict(self, model, loaded, rows, batch_size, source):
        """Greedy answers (``task.max_new_tokens``) to each conversation's last user turn (turns
        after it are left out)."""
        self.bind(loaded)
        table = RawTable({k: [r.get(k) for r in rows] for k in (rows[0] if rows else {})},
                         list(range(1, len(rows) + 1)), source, unit="row")
        column = self.column_of(table) if rows else None
        prompts = []
        for i in range(len(rows)):
            try:
                turns = until_last_user(row_turns(table, i, column))
            except BadConversation as e:
                raise DataError(f"{table.where(i)}: {e}") from None
            text = render(self.tokenizer, turns, generation_prompt=True)
            x = self.tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"][0]
            prompts.append(x[max(0, len(x) - self.cfg.data.max_length):])
        n = len(prompts)
        split = ChatSplit(prompts, prompts, prompts, [""] * n, self.pad_id)
        with eval_mode(model):
            texts = self.generate(model, split, list(range(n)), batch_size)
        return [{"prediction": t} for t in texts]


def last_answer(turns: list[Turn]) -> str:
    return next(t["content"] for t in reversed(turns) if t["role"] == "assistant")


def until_last_user(turns: list[Turn]) -> list[Turn]:
    """The conversation up to its last user turn (what the model answers)."""
    last = max((i for i, t in enumerate(turns) if t["role"] == "user"), default=None)
    if last is None:
        raise BadConversation("the conversation has no user turn to answer")
    return turns[:last + 1]
