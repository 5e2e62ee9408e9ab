"""Conversations as people store them, read into one form: a list of ``{"role", "content"}`` turns
with roles ``system``, ``user`` and ``assistant``.

Layouts (one conversation per row):

* ``messages``: a list of ``{"role", "content"}`` turns (the OpenAI / Hugging Face chat layout);
  in JSONL (or Parquet) a list, in CSV/TSV a JSON string of one.
* ShareGPT ``conversations``: a list of ``{"from", "value"}`` turns, ``from`` one of
  ``human`` / ``gpt`` / ``system`` (and FastChat's other names, :data:`ROLES`).
* Alpaca columns ``instruction``, ``input`` (optional) and ``output``: a user turn (the
  instruction, then the input after a blank line when there is one) and the assistant's answer.

A row that is not a conversation (a cell that is not JSON, a turn without a role or content, an
unknown role, an empty turn, no assistant turn) is :class:`BadConversation`, whose message the
caller prefixes with the file and row (:func:`read_conversations`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from typing import Any

from fedslice.data.tables import RawTable
from fedslice.errors import DataError

log = logging.getLogger(__name__)

#: every role name accepted, and the role it is: the chat layout's own, ShareGPT's and
#: FastChat's other names for the assistant
ROLES = {"system": "system", "user": "user", "human": "user", "assistant": "assistant",
         "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant", "bing": "assistant"}
#: the keys of a turn, per layout: (role key, content key)
TURN_KEYS = (("role", "content"), ("from", "value"))
#: the columns that hold a whole conversation, looked for in this order
CONVERSATION_COLUMNS = ("messages", "conversations")
ALPACA = ("instruction", "output")

Turn = dict[str, str]


class BadConversation(ValueError):
    """A row that is not a usable conversation (the message says why, without the row)."""


def conversation_column(columns: Sequence[str], configured: str | None, source: str) -> str | None:
    """The column holding conversations: ``configured`` (``task.messages_column``), else the
    first of :data:`CONVERSATION_COLUMNS` the data has; None when it has none (Alpaca columns)."""
    if configured is not None:
        if configured not in columns:
            raise DataError(f"{source}: no column {configured!r} (set by task.messages_column); "
                            f"columns found: {list(columns)}")
        return configured
    return next((c for c in CONVERSATION_COLUMNS if c in columns), None)


def parse_turns(cell: Any, column: str) -> list[Turn]:
    """The turns of one conversation cell (a list, or a JSON string of one)."""
    if cell is None:
        raise BadConversation(f"row has no field {column!r}")
    if isinstance(cell, str):
        if not cell.strip():
            raise BadConversation(f"row has an empty field {column!r}")
        try:
            cell = json.loads(cell)
        except json.JSONDecodeError as e:
            raise BadConversation(f"{column!r} is not JSON ({e.msg} at character {e.pos})") from None
    if not isinstance(cell, (list, tuple)) or not cell:
        raise BadConversation(f"{column!r} must be a non-empty list of turns, got "
                              f"{_short(cell)}")
    return [_turn(t, i + 1) for i, t in enumerate(cell)]


def _turn(turn: Any, n: int) -> Turn:
    if not isinstance(turn, dict):
        raise BadConversation(f"turn {n} is not an object of role and content: {_short(turn)}")
    keys = next(((r, c) for r, c in TURN_KEYS if r in turn or c in turn), TURN_KEYS[0])
    for key in keys:
        if key not in turn or turn[key] is None:
            raise BadConversation(f"turn {n} has no {key!r} (a turn is {{role, content}} or "
                                  f"ShareGPT's {{from, value}}; keys found: {sorted(turn)})")
    name, content = turn[keys[0]], turn[keys[1]]
    role = ROLES.get(name.strip().lower()) if isinstance(name, str) else None
    if role is None:
        raise BadConversation(f"turn {n} has an unknown role {name!r} (known: "
                              f"{', '.join(ROLES)})")
    if not isinstance(content, str):
        raise BadConversation(f"turn {n} ({role}): content must be text, got {_short(content)}")
    if not content.strip():
        raise BadConversation(f"turn {n} ({role}) is empty")
    return {"role": role, "content": content}


def alpaca_turns(row: dict[str, Any]) -> list[Turn]:
    """An Alpaca row as a user turn and the assistant's answer."""
    for c in ALPACA:
        value = row.get(c)
        if value is None:
            raise BadConversation(f"row has no field {c!r} (task.preset = 'alpaca')")
        if not isinstance(value, str) or not value.strip():
            raise BadConversation(f"row has an empty field {c!r} (task.preset = 'alpaca')")
    extra = row.get("input")
    extra = extra.strip() if isinstance(extra, str) else ""
    user = row["instruction"] + (f"\n\n{extra}" if extra else "")
    return [{"role": "user", "content": user}, {"role": "assistant", "content": row["output"]}]


def check_conversation(turns: list[Turn]) -> list[Turn]:
    """A conversation the model can learn from: at least one assistant turn."""
    if not any(t["role"] == "assistant" for t in turns):
        raise BadConversation("the conversation has no assistant turn (nothing to learn)")
    return turns


def row_turns(table: RawTable, i: int, column: str | None) -> list[Turn]:
    """The turns of row ``i`` of ``table`` (``column``: a conversation column, None: Alpaca)."""
    if column is None:
        return alpaca_turns({c: table.columns[c][i] for c in table.columns})
    return parse_turns(table.columns[column][i], column)


def read_conversations(table: RawTable, column: str | None, *, skip: bool,
                       client_column: str | None = None,
                       need_assistant: bool = True) -> tuple[RawTable, list[list[Turn]]]:
    """The conversations of every row of ``table``, with the table of the rows kept. A bad row
    (:class:`BadConversation`; a missing or empty ``client_column`` value) is a DataError naming
    file and row, or (``skip``) is dropped and counted in one warning."""
    if column is None:
        missing = [c for c in ALPACA if c not in table.columns]
        if missing:
            raise DataError(f"{table.source}: task.preset = 'alpaca' needs column(s) {missing}; "
                            f"columns found: {list(table.columns)}")
    clients = table.column(client_column, "data.client_column") if client_column else None
    kept, out, bad = [], [], []
    for i in range(len(table)):
        try:
            turns = row_turns(table, i, column)
            if need_assistant:
                check_conversation(turns)
            if clients is not None and _blank(clients[i]):
                raise BadConversation(f"the client column {client_column!r} (data.client_column) "
                                      "is empty")
        except BadConversation as e:
            table.refuse_row(i, e, skip, bad)
            continue
        kept.append(i)
        out.append(turns)
    if bad:
        unit = "lines" if table.unit == "line" else "rows"
        shown = ", ".join(str(line) for line, _ in bad[:10]) + (", ..." if len(bad) > 10 else "")
        log.warning("%s: skipped %d conversation(s) that cannot be trained on (%s %s; first: %s)",
                    table.source, len(bad), unit, shown, bad[0][1])
        table = table.select(kept)
    return table, out


def _blank(value: Any) -> bool:
    return value is None or (isinstance(value, str) and not value.strip())


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."
