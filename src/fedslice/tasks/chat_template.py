"""Conversations rendered with the model's own chat template, and where the assistant speaks.

The template is the tokenizer's (``tokenizer.chat_template``), or the Jinja file of
``task.chat_template_file`` (which replaces it, also in the exported model). A conversation is
rendered once, whole, and tokenized as ``apply_chat_template(tokenize=True)`` does (no special
tokens added: the template writes its own). The assistant's spans are found by rendering
prefixes: for the assistant turn ``i``, the conversation before it with the generation prompt
(``turns[:i]``, ``add_generation_prompt=True``) and the conversation up to it (``turns[:i+1]``);
what the second adds to the first is the turn as the model must write it: its content and the
template's end-of-turn token (``<|im_end|>``, ``<|eot_id|>``), without the whitespace a
template puts after that token before the next turn (ChatML's newline). A token is trained when
its characters overlap such a span (tokenizer offsets; a tokenizer without offsets tokenizes
the pieces one by one). Most templates have no ``{% generation %}`` markers, so HF's
``return_assistant_tokens_mask`` cannot be relied on; where a template has them, the two agree
(``tests/test_chat.py``).

A template that renders a turn differently once later turns follow (one that drops earlier
turns' reasoning, or adds a default system prompt only before a first assistant turn) has no
such prefixes: :class:`TemplateMismatch`, named per row.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from fedslice.data.conversations import BadConversation, Turn
from fedslice.data.packing import IGNORE
from fedslice.errors import ConfigError


class TemplateMismatch(BadConversation):
    """The template does not render this conversation as a sequence of growing prefixes."""


def install_template(tokenizer: Any, template_file: str | None, model_name: str) -> None:
    """The tokenizer's chat template, or the one of ``task.chat_template_file`` (set on the
    tokenizer, so an export keeps it); a tokenizer with none is a ConfigError naming the field."""
    if template_file is not None:
        path = Path(template_file).expanduser()
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as e:
            raise ConfigError(f"task.chat_template_file = {template_file!r}: cannot read it "
                              f"({e.strerror or e})") from None
        if not text.strip():
            raise ConfigError(f"task.chat_template_file = {template_file!r} is empty")
        tokenizer.chat_template = text
        return
    if not getattr(tokenizer, "chat_template", None):
        raise ConfigError(f"task.kind = 'chat': the tokenizer of {model_name!r} has no chat "
                          "template: give one as a Jinja file in task.chat_template_file (e.g. "
                          "the template of the instruct model this one was trained like)")


def render(tokenizer: Any, turns: list[Turn], generation_prompt: bool = False) -> str:
    """The template's text of ``turns`` (a template error is a :class:`BadConversation`)."""
    try:
        return tokenizer.apply_chat_template(turns, tokenize=False,
                                             add_generation_prompt=generation_prompt)
    except Exception as e:  # jinja2's TemplateError, or the template's raise_exception
        if type(e).__module__.startswith("jinja2") or "Template" in type(e).__name__:
            raise BadConversation(f"the chat template refuses this conversation: {e}") from None
        raise


def assistant_spans(tokenizer: Any, turns: list[Turn]) -> tuple[str, list[tuple[int, int]]]:
    """``(text, spans)``: the rendered conversation and the character span ``[start, end)`` of
    each assistant turn in it (content + end-of-turn token, trailing whitespace excluded)."""
    text = render(tokenizer, turns)
    spans = []
    for i, turn in enumerate(turns):
        if turn["role"] != "assistant":
            continue
        before = render(tokenizer, turns[:i], generation_prompt=True)
        upto = render(tokenizer, turns[:i + 1])
        if not upto.startswith(before) or not text.startswith(upto):
            raise TemplateMismatch(
                f"the chat template renders turn {i + 1} (assistant) differently once other "
                "turns follow, so its tokens cannot be told apart (a template that rewrites "
                "earlier turns, or a conversation that starts with the assistant)")
        end = len(upto.rstrip())
        if end <= len(before):
            raise TemplateMismatch(f"the chat template renders turn {i + 1} (assistant) as nothing")
        spans.append((len(before), end))
    return text, spans


def tokenize_conversation(tokenizer: Any, turns: list[Turn]
                          ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(ids (T,), trained (T,) bool, prompt (P,))``: the conversation's token ids, which of
    them the assistant says, and the tokens of the conversation before its last assistant turn
    with the generation prompt (tokenized alone, as an answer is asked for: at a boundary
    without a special token, BPE may merge it otherwise within the whole)."""
    text, spans = assistant_spans(tokenizer, turns)
    if getattr(tokenizer, "is_fast", False):
        enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = torch.tensor(enc["input_ids"], dtype=torch.int64)
        offsets = torch.tensor(enc["offset_mapping"], dtype=torch.int64).reshape(-1, 2)  # (T, 2)
        trained = torch.zeros(len(ids), dtype=torch.bool)
        for a, b in spans:
            trained |= (offsets[:, 0] < b) & (offsets[:, 1] > a)
    else:
        ids, trained = _piecewise(tokenizer, text, spans)
    prompt = tokenizer(text[:spans[-1][0]], add_special_tokens=False)["input_ids"]
    return ids, trained, torch.tensor(prompt, dtype=torch.int64)


def _piecewise(tokenizer: Any, text: str, spans: list[tuple[int, int]]):
    """Token ids of ``text`` tokenized piece by piece (outside and inside ``spans``)."""
    cuts = sorted({0, len(text), *(x for s in spans for x in s)})
    ids, trained = [], []
    for a, b in zip(cuts, cuts[1:]):
        piece = tokenizer(text[a:b], add_special_tokens=False)["input_ids"]
        inside = any(s <= a and b <= e for s, e in spans)
        ids += piece
        trained += [inside] * len(piece)
    return torch.tensor(ids, dtype=torch.int64), torch.tensor(trained, dtype=torch.bool)


def labels_of(ids: torch.Tensor, trained: torch.Tensor) -> torch.Tensor:
    """The token ids where trained, :data:`IGNORE` elsewhere."""
    return torch.where(trained, ids, torch.full_like(ids, IGNORE))
