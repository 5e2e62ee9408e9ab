"""The ``[task]`` section and distillation settings (``distill`` of fedpft/fedot).
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from fedslice.config.base import Section


class DistillConfig(Section):
    """Server-side distillation on an unlabeled corpus that is never a client's data."""

    corpus: str = Field("../shared/data/wikitext2", description="A text file, a folder of text "
                        "files (.txt: one passage per line; .jsonl/.tsv/.csv: `text_column`), "
                        "resolved like data.path; or a hub dataset 'name[:subset]' "
                        "('wikitext:wikitext-2-raw-v1'). Image tasks: 'server_holdout' (the "
                        "training images the server keeps apart, data.server_holdout) or a folder "
                        "of images.")
    text_column: str = Field("text", description="Column of .jsonl/.tsv/.csv corpus files.")
    hub_split: str = Field("train", description="Split of a hub corpus.")
    steps: int = Field(200, ge=0, description="Optimizer steps of layer-level (FedPFT) or "
                       "emulator (FedOT) distillation before FL.")
    lr: float = Field(6e-4, gt=0)
    warmup: float = Field(0.048, ge=0, lt=1, description="Linear warm-up fraction, then linear decay.")
    mu: float = Field(1.0, ge=0, description="Weight of the FFN weight-alignment term "
                      "||W1W2 - W1'W2'||^2 of Eq. 13 (FedPFT; ignored by FedOT).")
    batch_size: int = Field(16, gt=0)
    max_length: int = Field(128, ge=8, description="Tokens per corpus chunk (lines are packed).")
    cache_dir: str | None = Field(None, description="Where distilled proxies are cached (default "
                                  "$FEDSLICE_CACHE_DIR or ~/.cache/fedslice); '' disables the cache.")
    seed: int | None = Field(None, description="Seed of the distillation before FL (corpus "
                             "order); default: the experiment's seed. Fix it to share one distilled "
                             "proxy (and its cache entry) across runs that differ in seed.")

    def seed_or(self, run_seed: int) -> int:
        return run_seed if self.seed is None else self.seed


class TaskConfig(Section):
    """What the model learns from the data (like a task in HF's pipelines).

    ``classification`` with an encoder: a sequence-classification head on ``data.text_columns``.
    ``classification`` with ``label_words`` on a generative model (decoder or encoder-decoder):
    text-to-text, the prompt's label word is predicted by likelihood (summed log-probabilities
    of its tokens, no free generation). ``generation``: prompt -> target, scored with BLEU and
    ROUGE on greedy generations and loss/perplexity on the targets; decoders train on
    prompt + target (loss on target tokens only), encoder-decoders map prompt -> target.
    ``preference``: DPO on rows of a prompt and a chosen and a rejected answer, against the
    frozen base (the adapter switched off) as reference (docs/preference.md).
    """

    kind: Literal["classification", "generation", "chat", "image_classification", "preference"] = Field(
        "classification", description="'chat': conversations rendered with the model's chat "
        "template, loss on every assistant turn (docs/instruction_tuning.md); 'preference': DPO "
        "on prompt / chosen / rejected rows (docs/preference.md).")
    prompt: str | None = Field(None, description="Template over data columns, e.g. 'Describe the "
                               "restaurant: {mr}\n' (generation and text-to-text classification; "
                               "default: the text columns joined by a newline).")
    target: str | None = Field(None, description="Template of the target (generation), e.g. '{ref}'.")
    preset: Literal["none", "alpaca"] = Field("none", description="'alpaca': instruction data in "
                                              "the Alpaca layout (columns instruction, input, "
                                              "output): with kind = 'generation' the Alpaca "
                                              "prompt (sets prompt/target); with kind = 'chat' a "
                                              "user turn and the answer, in the chat template.")
    label_words: dict[str, str] | None = Field(None, description="Text-to-text classification: "
                                               "label (as in the data) -> its word, e.g. "
                                               "{0 = ' negative', 1 = ' positive'}.")
    chat_template: bool | None = Field(None, description="Wrap the prompt as a user turn of the "
                                       "tokenizer's chat template (instruct models). Unset: "
                                       "kind = 'preference' wraps it when the tokenizer has a "
                                       "template; the other kinds do not.")
    chat_template_file: str | None = Field(None, description="A Jinja chat template file used "
                                           "instead of the tokenizer's (kind = 'chat', or "
                                           "chat_template = true; needed when the model has "
                                           "none); the exported model keeps it.")
    messages_column: str | None = Field(None, description="kind = 'chat': the column of "
                                        "conversations (a list of {role, content} turns, or "
                                        "ShareGPT's {from, value}; a JSON string in CSV). Unset: "
                                        "'messages', else 'conversations'. kind = 'preference': "
                                        "the column of each pair's prompt as a conversation "
                                        "(ending with a user turn; unset: a list-valued 'prompt' "
                                        "column, else 'messages' or 'conversations' when there "
                                        "is no 'prompt' column).")
    max_target_length: int = Field(64, ge=1, description="Target tokens kept (longer targets are "
                                   "truncated and counted); prompts are limited by data.max_length.")
    max_new_tokens: int = Field(64, ge=1, description="Greedy generation length at evaluation.")
    dpo_beta: float = Field(0.1, gt=0, description="preference: DPO's beta, the strength of the "
                            "KL tie to the reference (the frozen base with the adapter off); "
                            "rewards are beta x (log p_policy - log p_base) of a response.")
    chosen_column: str = Field("chosen", description="preference: the column of the preferred "
                               "response (the prompt is task.prompt, default '{prompt}').")
    rejected_column: str = Field("rejected", description="preference: the column of the "
                                 "dispreferred response.")
    image_size: int | None = Field(None, ge=8, description="image_classification: the side in px "
                                   "the images are resized to (shorter side, then a centre crop); "
                                   "default: the backbone's image processor's size. The tokens per "
                                   "image, and so the cost, grow with its square: (S/patch)^2 + 1.")

    @field_validator("label_words")
    @classmethod
    def _distinct_words(cls, v):
        if v is not None:
            if len(v) < 2:
                raise ValueError("give at least two label words")
            if len(set(v.values())) != len(v):
                raise ValueError(f"label words must differ: {v}")
        return v

    @model_validator(mode="after")
    def _kind_fields(self) -> "TaskConfig":
        if self.kind == "image_classification":
            text = [f for f in ("prompt", "target", "label_words") if getattr(self, f) is not None]
            if text or self.preset != "none" or self.chat_template:
                raise ValueError(f"{text or ['preset/chat_template']} are for text tasks, not "
                                 "kind = 'image_classification'")
            return self
        if self.image_size is not None:
            raise ValueError("image_size is for kind = 'image_classification'")
        if self.kind == "preference" and (self.label_words is not None or self.target is not None
                                          or self.preset != "none"):
            raise ValueError("label_words/target/preset are not for kind = 'preference' (its rows "
                             "are task.prompt, task.chosen_column and task.rejected_column)")
        if self.kind == "preference" and self.messages_column is not None and self.prompt is not None:
            raise ValueError("kind = 'preference': give task.prompt (a template over columns) or "
                             "task.messages_column (a conversation column), not both")
        if self.kind == "generation" and self.label_words is not None:
            raise ValueError("label_words are for kind = 'classification'")
        if self.kind == "chat":
            given = [f for f in ("prompt", "target", "label_words") if getattr(self, f) is not None]
            if given:
                raise ValueError(f"{given} are not for kind = 'chat': a conversation is rendered "
                                 "by the model's chat template (messages_column, or preset = "
                                 "'alpaca', picks the data)")
            return self
        if self.messages_column is not None and self.kind != "preference":
            raise ValueError("messages_column is for kind = 'chat' or 'preference'")
        if self.kind == "classification" and (self.target is not None or self.preset != "none"):
            raise ValueError("target/preset are for kind = 'generation' (classification predicts "
                             "label_words)")
        if self.kind == "generation" and self.preset == "none" and self.target is None:
            raise ValueError("generation needs a target template, e.g. target = '{ref}' (or "
                             "preset = 'alpaca')")
        return self
