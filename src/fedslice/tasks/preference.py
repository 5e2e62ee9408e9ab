"""``preference``: direct preference optimisation (DPO, Rafailov et al. 2023) on rows of a prompt,
a chosen and a rejected response.

Each row renders its prompt from ``task.prompt`` (default ``'{prompt}'``: the ``prompt``
column), wrapped as a user turn of the tokenizer's chat template when it has one (unless
``task.chat_template = false``); or, a conversation (TRL's conversational layout, OpenAI's
``{role, content}`` turns or ShareGPT's ``{from, value}``: a list-valued ``prompt`` column, or
``task.messages_column``, or a ``messages``/``conversations`` column where there is no
``prompt``), rendered whole by the chat template with the assistant's cue, system turns kept;
its last turn is the user's. The responses are the columns ``task.chosen_column`` and
``task.rejected_column`` (text, or the assistant's turn: ``{role, content}``, ``{from, value}``
or a list of one), each ending with the end-of-sequence token. A decoder reads
``prompt + response``; log-probabilities are summed over the response tokens only.

The loss is DPO's (Eq. 7), per pair::

    -log sigmoid(beta * [(log pi(y_w|x) - log ref(y_w|x)) - (log pi(y_l|x) - log ref(y_l|x))])

with ``beta = task.dpo_beta`` and the reference the frozen base: the same model with its adapter
switched off (:func:`fedslice.peft.adapters_off`), run per batch without gradients; no second
model is held, and full fine-tuning (no frozen base left) is refused. The implicit rewards are
``beta * (log pi - log ref)`` of each response.

Evaluation reports the reward accuracy (chosen reward > rejected reward, strictly; all rewards
are 0 before training), the mean reward margin and chosen/rejected rewards, the DPO loss, the
model's own preference accuracy (``log pi(y_w|x) > log pi(y_l|x)``), and the base's
(``base_accuracy``, summed log-probabilities; ``base_accuracy_per_token``, each response's mean
per token): what the untrained model already prefers.

A batch holds one row per pair: the chosen response's ``input_ids``/``attention_mask``/
``labels`` and the rejected one's under ``rejected_*``, so whatever splits or slices a batch's
rows (micro-batches, the planner's measured rows, the batched multi-client pass) keeps pairs
whole. Batches are not packed (``federation.pack`` is ignored: a pair's two sequences would need
their log-probabilities gathered per packed example), and only decoders are supported.

"""

from __future__ import annotations

import dataclasses
import logging
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from fedslice.data.batching import Indices, as_index_list, iter_batches
from fedslice.data.conversations import (CONVERSATION_COLUMNS, BadConversation, Turn, parse_turns)
from fedslice.data.locate import load_tables
from fedslice.data.pairs import PairSplit
from fedslice.data.tables import RawTable, drop_incomplete
from fedslice.errors import ConfigError, DataError
import fedslice.tasks.lm as lm
from fedslice.tasks.base import length_order
from fedslice.tasks.chat_template import install_template, render as render_chat
from fedslice.tasks.text import Truncation, apply_chat, render, template_fields
from fedslice.tasks.text2text import TextToText, eval_mode

log = logging.getLogger(__name__)

METRICS = ("reward_accuracy", "reward_margin", "chosen_reward", "rejected_reward", "loss",
           "accuracy", "base_accuracy", "base_accuracy_per_token")
REJECTED = "rejected_"  # the prefix of the rejected response's batch keys


def dpo_loss(policy_chosen: torch.Tensor, policy_rejected: torch.Tensor, ref_chosen: torch.Tensor,
             ref_rejected: torch.Tensor, beta: float):
    """DPO's per-pair loss (Rafailov et al. 2023, Eq. 7) and the implicit rewards, from summed
    response log-probabilities ``(B,)`` under the policy and the reference:
    ``(losses, chosen rewards, rejected rewards)``, each ``(B,)``."""
    chosen = beta * (policy_chosen - ref_chosen)
    rejected = beta * (policy_rejected - ref_rejected)
    return -F.logsigmoid(chosen - rejected), chosen, rejected


@dataclass
class PreferenceSplit:
    """Tokenized pairs: the prompt and both responses of each row, as two
    :class:`~fedslice.data.pairs.PairSplit` s over the same prompts (causal layout)."""

    chosen: PairSplit
    rejected: PairSplit

    def __len__(self) -> int:
        return len(self.chosen)

    @property
    def labels(self) -> torch.Tensor:
        """Zeros (no class): what the partitioners read."""
        return self.chosen.labels

    @property
    def pad_token_id(self) -> int:
        return self.chosen.pad_token_id

    @property
    def lengths(self) -> torch.Tensor:
        """Tokens of the longer of each pair's sequences (prompt + response): a batch's row width."""
        return torch.maximum(self.chosen.lengths, self.rejected.lengths)

    def subset(self, indices: Indices) -> PreferenceSplit:
        return PreferenceSplit(self.chosen.subset(indices), self.rejected.subset(indices))

    def collate(self, indices: Indices) -> dict[str, torch.Tensor]:
        """One row per pair: the chosen sequence's ``input_ids``, ``attention_mask``, ``labels``
        (-100 on prompt and padding), the rejected one's under ``rejected_*``."""
        idx = as_index_list(indices, len(self))
        rejected = self.rejected.collate(idx)
        return {**self.chosen.collate(idx), **{REJECTED + k: v for k, v in rejected.items()}}

    def collate_packed(self, indices: Indices) -> dict[str, torch.Tensor]:
        raise ValueError("preference pairs are not packed")


def prompt_turns(cell, column: str) -> list[Turn]:
    """A conversation prompt's turns (a list, or a JSON string of one), checked: its last turn
    is the user's (the answers follow it)."""
    turns = parse_turns(cell, column)
    if turns[-1]["role"] != "user":
        raise BadConversation(f"the prompt conversation in {column!r} ends with the "
                              f"{turns[-1]['role']}'s turn: its last turn must be the user's (the "
                              "chosen and rejected answers follow it)")
    return turns


def response_text(cell, column: str) -> str:
    """A response cell as text: text, or the assistant's turn (``{role, content}``,
    ``{from, value}``, or a list of one such turn)."""
    if isinstance(cell, str):
        return cell
    if isinstance(cell, dict):
        cell = [cell]
    if isinstance(cell, (list, tuple)) and cell:
        turns = parse_turns(list(cell), column)
        if len(turns) == 1 and turns[0]["role"] == "assistant":
            return turns[0]["content"]
        raise BadConversation(f"{column!r} must be the assistant's answer: text or one assistant "
                              f"turn, got {len(turns)} turn(s) of roles "
                              f"{[t['role'] for t in turns]}")
    raise BadConversation(f"column {column!r} must be text or an assistant turn, got "
                          f"{type(cell).__name__}")


def response(batch: dict[str, torch.Tensor], which: str) -> dict[str, torch.Tensor]:
    """The ``chosen`` or ``rejected`` sequences of a pair batch, as a causal-LM batch."""
    if which == "chosen":
        return {k: v for k, v in batch.items() if not k.startswith(REJECTED)}
    return {k[len(REJECTED):]: v for k, v in batch.items() if k.startswith(REJECTED)}


def response_logps(model: nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """``(summed log-probabilities (B,), response tokens (B,))`` of a causal-LM batch's target
    tokens, on the model's device, differentiable (logits only at the target positions)."""
    logits, targets, rows = lm.target_logits(model, batch, "causal")  # (N, V), (N,), (N,)
    token_lp = -F.cross_entropy(logits.float(), targets, reduction="none")  # (N,)
    rows = rows.to(token_lp.device)
    n = batch["labels"].shape[0]
    sums = token_lp.new_zeros(n).index_add(0, rows, token_lp)
    counts = token_lp.new_zeros(n).index_add(0, rows, torch.ones_like(token_lp))
    return sums, counts


def pair_logps(model: nn.Module, batch: dict[str, torch.Tensor], reference: bool = True):
    """``(policy chosen, policy rejected, reference chosen, reference rejected)`` summed
    log-probabilities ``(B,)`` of a pair batch; the reference is ``model`` with its adapter off,
    in eval mode, without gradients (each response its own forward: the rows of a batched
    multi-client pass stay where the per-client adapters expect them). ``reference=False``:
    the policy's only (the reference's are None)."""
    from fedslice.peft import adapters_off

    policy = [response_logps(model, response(batch, w))[0] for w in ("chosen", "rejected")]
    if not reference:
        return policy[0], policy[1], None, None
    with torch.no_grad(), adapters_off(model), eval_mode(model):
        ref = [response_logps(model, response(batch, w))[0] for w in ("chosen", "rejected")]
    return policy[0], policy[1], ref[0], ref[1]


def base_fingerprint(model: nn.Module) -> tuple:
    """What the reference's scores depend on besides the data: the model and the sums of its
    frozen tensors (a method that changes the base, FedEx-LoRA's residual, changes them)."""
    frozen = [p.detach() for p in model.parameters() if not p.requires_grad]
    return id(model), tuple(_tensor_key(p) for p in frozen)


def _tensor_key(t: torch.Tensor):
    """A tensor's sum, or for a quantized one (no sum) its storage and in-place version."""
    try:
        return float(t.sum(dtype=torch.float64))
    except (NotImplementedError, RuntimeError, TypeError):
        return t.data_ptr(), t._version


class Preference(TextToText):
    kind = "preference"
    primary_metric = "reward_accuracy"
    packable = False
    needs_frozen_base = True

    def __init__(self, cfg, arch, head):
        super().__init__(cfg, arch, head)
        if self.layout != "causal":
            raise ConfigError(f"task.kind = 'preference' trains decoders; {cfg.model.name!r} is a "
                              f"{arch.model_type} encoder-decoder")
        self.chat = False
        #: the column of conversation prompts (None: ``task.prompt`` over columns), per the data
        self.conversation: str | None = None
        #: the reference's scores of the splits evaluated (the last few), by what they depend on:
        #: the base is frozen, so an evaluation computes the policy's only (half the forwards)
        self._reference: dict[tuple, dict[str, torch.Tensor]] = {}

    # -- data --------------------------------------------------------------------------------
    @property
    def prompt_template(self) -> str:
        return self.cfg.task.prompt or "{prompt}"

    def conversation_of(self, columns: dict[str, list]) -> str | None:
        """The column of conversation prompts in ``table``: ``task.messages_column``; unset (and
        no ``task.prompt``), a ``prompt`` column holding lists, else ``messages`` or
        ``conversations`` when there is no ``prompt`` column; None: text prompts. ``columns``:
        a split's cells by column."""
        t = self.cfg.task
        if t.messages_column is not None:
            return t.messages_column
        if t.prompt is not None:
            return None
        if "prompt" in columns:
            first = next((c for c in columns["prompt"] if c is not None), None)
            return "prompt" if isinstance(first, (list, tuple)) else None
        return next((c for c in CONVERSATION_COLUMNS if c in columns), None)

    def required(self) -> list[tuple[str, str]]:
        """``(column, config field)`` of every column a row needs, filled."""
        t = self.cfg.task
        need = ([(self.conversation, "task.messages_column")] if self.conversation else
                [(f, "task.prompt") for f in template_fields(self.prompt_template)])
        need += [(t.chosen_column, "task.chosen_column"), (t.rejected_column, "task.rejected_column")]
        return list(dict.fromkeys(need))

    def load_raw(self, carve_missing: bool = True):
        """Every split's rows with a prompt and two different, non-empty responses; a row
        without is an error naming file and line, or (``data.bad_rows = "skip"``) counted and
        skipped."""
        d = self.cfg.data
        tables = load_tables(d, self.cfg.seed, required=[], carve_missing=carve_missing)
        self.conversation = self.conversation_of((tables.get("train") or next(iter(tables.values()))).columns)
        need = self.required()
        for name, table in tables.items():
            missing = [(c, f) for c, f in need if c not in table.columns]
            if missing:
                raise ConfigError(f"{', '.join(sorted({f for _, f in missing}))}: column(s) "
                                  f"{[c for c, _ in missing]} not in {table.source} (columns: "
                                  f"{list(table.columns)})")
            table, _ = drop_incomplete(table, need, skip=d.bad_rows == "skip")
            table = self.read_pairs(table, skip=d.bad_rows == "skip")
            tables[name] = self.drop_ties(table, skip=d.bad_rows == "skip")
            if not len(tables[name]):
                raise DataError(f"{table.source}: no usable preference pair (every row was skipped)")
        self.text_columns = [c for c, f in need if f == "task.prompt"]
        return tables

    def read_pairs(self, table: RawTable, *, skip: bool) -> RawTable:
        """The table with each conversation prompt parsed into turns and each response as text;
        a row that has neither (a malformed turn, a prompt not ending with the user's turn, a
        response that is not the assistant's) is an error naming file and line, or (``skip``)
        is dropped, counted in one warning."""
        t = self.cfg.task
        conv = self.conversation
        columns = {c: list(v) for c, v in table.columns.items()}
        kept, bad = [], []
        for i in range(len(table)):
            try:
                if conv is not None:
                    columns[conv][i] = prompt_turns(columns[conv][i], conv)
                for col in (t.chosen_column, t.rejected_column):
                    columns[col][i] = response_text(columns[col][i], col)
            except BadConversation as e:
                table.refuse_row(i, e, skip, bad)
                continue
            kept.append(i)
        out = dataclasses.replace(table, columns=columns)
        if not bad:
            return out
        shown = ", ".join(str(line) for line, _ in bad[:10]) + (", ..." if len(bad) > 10 else "")
        log.warning("%s: skipped %d pair(s) that cannot be read (%s %s; first: %s)", table.source,
                    len(bad), "lines" if table.unit == "line" else "rows", shown, bad[0][1])
        return out.select(kept)

    def drop_ties(self, table: RawTable, *, skip: bool) -> RawTable:
        """Rows whose responses are text and differ; a row with a non-text response, or the same
        response twice, is an error naming file and line, or is skipped (counted in the log)."""
        t = self.cfg.task
        chosen, rejected = table.columns[t.chosen_column], table.columns[t.rejected_column]
        bad = []
        for i, (c, r) in enumerate(zip(chosen, rejected)):
            if not (isinstance(c, str) and isinstance(r, str)):
                col = t.chosen_column if not isinstance(c, str) else t.rejected_column
                raise DataError(f"{table.where(i)}: column {col!r} must be text, got "
                                f"{type(c if col == t.chosen_column else r).__name__}")
            if c.strip() == r.strip():
                if not skip:
                    raise DataError(f"{table.where(i)}: {t.chosen_column!r} and {t.rejected_column!r} "
                                    "are the same response (set data.bad_rows = \"skip\" to skip "
                                    "such rows)")
                bad.append(i)
        if not bad:
            return table
        shown = ", ".join(str(table.lines[i]) for i in bad[:10]) + (", ..." if len(bad) > 10 else "")
        log.warning("%s: skipped %d pair(s) whose chosen and rejected responses are the same (%s %s)",
                    table.source, len(bad), "lines" if table.unit == "line" else "rows", shown)
        drop = set(bad)
        return table.select([i for i in range(len(table)) if i not in drop])

    def uses_chat(self, tokenizer) -> bool:
        """Whether prompts become a user turn of the chat template: ``task.chat_template`` when
        set, else whenever the tokenizer has a template. Conversation prompts always are (a
        tokenizer without a template is a ConfigError naming ``task.chat_template_file``)."""
        if self.conversation is not None:
            if self.cfg.task.chat_template is False:
                raise ConfigError(f"task.chat_template = false: the prompts of column "
                                  f"{self.conversation!r} are conversations, which only a chat "
                                  "template renders")
            if self.cfg.task.chat_template_file is None:
                install_template(tokenizer, None, self.cfg.model.name)
            return True
        if self.cfg.task.chat_template is not None:
            return self.cfg.task.chat_template
        return bool(getattr(tokenizer, "chat_template", None))

    def bind(self, loaded) -> None:
        super().bind(loaded)
        self.chat = self.uses_chat(loaded.tokenizer)

    def prompt_texts(self, rows: list[dict]) -> list[str]:
        """The prompt text of each row, ready for the answer: a conversation rendered by the
        chat template with the assistant's cue; else ``task.prompt`` rendered over its columns,
        as a user turn of the chat template when :meth:`uses_chat`."""
        if self.conversation is not None:
            return [render_chat(self.tokenizer, self.turns(r), generation_prompt=True) for r in rows]
        prompts = [render(self.prompt_template, r) for r in rows]
        return [apply_chat(self.tokenizer, p) for p in prompts] if self.chat else prompts

    def turns(self, row: dict) -> list[Turn]:
        """A row's conversation prompt (parsed by :meth:`read_pairs`, or raw in ``predict``)."""
        cell = row[self.conversation]
        parsed = isinstance(cell, list) and cell and all(
            isinstance(x, dict) and set(x) == {"role", "content"} for x in cell)
        return cell if parsed else prompt_turns(cell, self.conversation)

    def prompt_ids(self, prompts: list[str], trunc: Truncation) -> list[torch.Tensor]:
        """Prompt ids (the texts of :meth:`prompt_texts`); a long prompt keeps its end
        (``data.max_length``)."""
        return trunc.ids(self.tokenizer, prompts, self.cfg.data.max_length, "prompts",
                         special=not self.chat, side="left")

    def response_ids(self, texts: list[str], trunc: Truncation, what: str) -> list[torch.Tensor]:
        """Response ids (``task.max_target_length``, the end-of-sequence token included)."""
        ids = trunc.ids(self.tokenizer, texts, self.cfg.task.max_target_length - 1, what,
                        special=False)
        end = self.tokenizer.eos_token_id
        if end is None:
            return ids
        return [t if len(t) and t[-1] == end else torch.cat([t, torch.tensor([end])]) for t in ids]

    def encode_rows(self, rows: list[dict], trunc: Truncation, source: str) -> PreferenceSplit:
        t = self.cfg.task
        prompts = self.prompt_ids(self.prompt_texts(rows), trunc)
        chosen = self.response_ids([response_text(r[t.chosen_column], t.chosen_column) for r in rows],
                                   trunc, "chosen responses")
        rejected = self.response_ids([response_text(r[t.rejected_column], t.rejected_column)
                                      for r in rows], trunc, "rejected responses")
        same = sum(torch.equal(c, r) for c, r in zip(chosen, rejected))
        if same:
            log.warning("%s: %d of %d pairs have the same tokens once truncated to "
                        "task.max_target_length = %d (no preference left to learn or score)",
                        source, same, len(rows), t.max_target_length)
        n = len(rows)
        labels, groups = [0] * n, list(range(n))
        return PreferenceSplit(self.pair_split(prompts, chosen, labels, groups, [""] * n),
                               self.pair_split(prompts, rejected, labels, groups, [""] * n))

    def encode(self, raw, loaded):
        self.bind(loaded)
        log.info("preference: prompts %s the chat template", "in" if self.chat else "without")
        trunc = Truncation()
        out = {}
        for name, table in raw.items():
            columns = list(table.columns)
            rows = [dict(zip(columns, cells)) for cells in zip(*table.columns.values())]
            out[name] = self.encode_rows(rows, trunc, table.source)
        limit = f"task.max_target_length={self.cfg.task.max_target_length}"
        trunc.log({"prompts": f"data.max_length={self.cfg.data.max_length}",
                   "chosen responses": limit, "rejected responses": limit})
        return out

    def profile_batch(self, config, batch_size: int, seq_len: int, seed: int):
        """``batch_size`` synthetic pairs of ``seq_len`` tokens per sequence (each response the
        second half): a measured step runs both sequences forward and backward and both again
        forward for the reference."""
        from fedslice.slicing.planner import profile_batch

        chosen = profile_batch(config.vocab_size, batch_size, seq_len, seed, "causal_lm")
        rejected = profile_batch(config.vocab_size, batch_size, seq_len, seed + 1, "causal_lm")
        return {**chosen, **{REJECTED + k: v for k, v in rejected.items()}}

    # -- training ----------------------------------------------------------------------------
    def pair_losses(self, model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """DPO's loss of each pair of the batch ``(B,)``."""
        losses, _, _ = dpo_loss(*pair_logps(model, batch), self.cfg.task.dpo_beta)
        return losses

    def loss(self, model: nn.Module, batch):
        return self.pair_losses(model, batch).mean()

    def client_losses(self, model: nn.Module, batch, rows):
        losses = self.pair_losses(model, batch)
        return [losses[lo:hi].mean() for lo, hi in rows]

    # -- evaluation --------------------------------------------------------------------------
    @torch.no_grad()
    def scores(self, model: nn.Module, split: PreferenceSplit, batch_size: int) -> dict[str, torch.Tensor]:
        """Per pair, in split order: summed log-probabilities of both responses under the model
        and under its base (adapter off), and the responses' token counts."""
        n = len(split)
        key = (id(split), n, int(split.lengths.sum()), base_fingerprint(model))
        cached = self._reference.get(key)
        out = {k: torch.zeros(n, dtype=torch.float64) for k in
               ("chosen", "rejected", "ref_chosen", "ref_rejected", "chosen_tokens", "rejected_tokens")}
        with eval_mode(model):
            for idx, batch in zip(_chunks(length_order(split), batch_size),
                                  iter_batches(split, length_order(split), batch_size, shuffle=False,
                                               generator=None)):
                pc, pr, rc, rr = pair_logps(model, batch, reference=cached is None)
                at = torch.as_tensor(idx)
                for name, value in (("chosen", pc), ("rejected", pr), ("ref_chosen", rc),
                                    ("ref_rejected", rr)):
                    if value is not None:
                        out[name][at] = value.double().cpu()
                out["chosen_tokens"][at] = (batch["labels"][:, 1:] != -100).sum(1).double()
                out["rejected_tokens"][at] = (batch[REJECTED + "labels"][:, 1:] != -100).sum(1).double()
        if cached is None:
            while len(self._reference) >= 4:
                self._reference.pop(next(iter(self._reference)))
            self._reference[key] = {k: out[k] for k in ("ref_chosen", "ref_rejected")}
        else:
            out.update(cached)
        return out

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split, batch_size: int, max_generations=None):
        if len(split) == 0:
            return dict.fromkeys(METRICS, math.nan)
        s = self.scores(model, split, batch_size)
        return preference_metrics(s, self.cfg.task.dpo_beta)

    def input_columns(self) -> list[str]:
        t = self.cfg.task
        prompt = [self.conversation] if self.conversation else template_fields(self.prompt_template)
        return [*prompt, t.chosen_column, t.rejected_column]

    @torch.no_grad()
    def predict(self, model, loaded, rows, batch_size, source):
        """Per row: the response the model's implicit reward prefers (``chosen`` or
        ``rejected`` as the row names them), with both rewards and their margin."""
        if rows:
            self.conversation = self.conversation_of({k: [r.get(k) for r in rows] for k in rows[0]})
        self.bind(loaded)
        try:
            split = self.encode_rows(rows, Truncation(), source)
        except BadConversation as e:
            raise DataError(f"{source}: {e}") from None
        s = self.scores(model, split, batch_size)
        beta = self.cfg.task.dpo_beta
        chosen = beta * (s["chosen"] - s["ref_chosen"])
        rejected = beta * (s["rejected"] - s["ref_rejected"])
        return [{"prediction": "chosen" if c > r else "rejected", "chosen_reward": float(c),
                 "rejected_reward": float(r), "reward_margin": float(c - r)}
                for c, r in zip(chosen.tolist(), rejected.tolist())]


def preference_metrics(s: dict[str, torch.Tensor], beta: float) -> dict[str, float]:
    """The held-out metrics from :meth:`Preference.scores` (see the module doc)."""
    losses, chosen, rejected = dpo_loss(s["chosen"], s["rejected"], s["ref_chosen"],
                                        s["ref_rejected"], beta)
    per_token = (s["ref_chosen"] / s["chosen_tokens"].clamp(min=1)
                 > s["ref_rejected"] / s["rejected_tokens"].clamp(min=1))
    return {"reward_accuracy": float((chosen > rejected).double().mean()),
            "reward_margin": float((chosen - rejected).mean()),
            "chosen_reward": float(chosen.mean()), "rejected_reward": float(rejected.mean()),
            "loss": float(losses.mean()),
            "accuracy": float((s["chosen"] > s["rejected"]).double().mean()),
            "base_accuracy": float((s["ref_chosen"] > s["ref_rejected"]).double().mean()),
            "base_accuracy_per_token": float(per_token.double().mean())}


def _chunks(order: torch.Tensor, size: int) -> list[list[int]]:
    """``order`` cut in batches of ``size``, as ``iter_batches`` cuts it without shuffling."""
    order = order.tolist()
    return [order[lo:lo + size] for lo in range(0, len(order), size)]
