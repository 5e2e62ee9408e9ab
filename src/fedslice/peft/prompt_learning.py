"""The prompt-learning adapters (HF peft's ``PromptLearningConfig`` family): prompt tuning,
P-tuning and prefix tuning. They add no layer to the model: peft wraps it in the
``PeftModelFor<task>`` that prepends learned virtual tokens to the input (prompt tuning,
P-tuning) or learned keys/values to every self-attention (prefix tuning, through the model's
key/value cache). Their tensors live in ``prompt_encoder.<adapter>`` (peft's own names, shared by
the three: the ``prefix`` asks "is it an adapter tensor", not "which one").

What follows from that, for the library:

* they are not inside the modules they affect (``in_modules = False``): a sliced sub-model
  (RaFFM, FedPFT's proxy, forward head pruning) does not slice them;
* the wrapper is chosen from the model's head (sequence classification, causal LM, seq2seq LM);
  peft wraps the classifier in a ``modules_to_save`` copy, which is undone here so that the
  classifier keeps its HF names and trains in place (as with LoRA);
* an encoder-decoder gets its virtual tokens on the encoder side only
  (``num_transformer_submodules = 1``: peft's default of 2 allocates a second block of virtual
  tokens that the forward pass never reads);
* the layer count, width and heads peft needs come from the architecture table (peft cannot
  read DistilBERT's config).
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch.nn as nn

from fedslice.errors import ConfigError
from fedslice.models.arch import ArchSpec
from fedslice.peft.base import Adapter, AdapterCost, Layers, freeze, train_classifier


def task_type(model: nn.Module) -> TaskType:
    """peft's task type of a HF model, from its head: a LM head (output embeddings) on an
    encoder-decoder is seq2seq, on a decoder causal; anything else a sequence classifier."""
    from peft import TaskType  # peft loads transformers' auto classes: only when used

    lm = model.get_output_embeddings() is not None
    if getattr(model.config, "is_encoder_decoder", False):
        return TaskType.SEQ_2_SEQ_LM if lm else TaskType.SEQ_CLS
    return TaskType.CAUSAL_LM if lm else TaskType.SEQ_CLS


def unwrap_saved_modules(model: nn.Module, arch: ArchSpec) -> None:
    """Put the classifier modules peft wrapped for ``modules_to_save`` back in place (the
    original module, its HF parameter names), in place."""
    base = model.get_base_model()
    for name in arch.classifier:
        wrapper = getattr(base, name, None)
        original = getattr(wrapper, "original_module", None)
        if original is not None:
            setattr(base, name, original)


class PromptLearningAdapter(Adapter):
    """Base of prompt tuning, P-tuning and prefix tuning (module doc). Subclasses set ``name``
    and build peft's config in :meth:`peft_config`."""

    prefix = "prompt_encoder"
    module_tensors: ClassVar[dict[str, str | None]] = {}
    in_modules = False
    head_tied = False
    table6 = "prompt_tuning"
    #: virtual tokens prepended to the input embeddings (prompt, P-tuning; not prefix tuning)
    input_prompts: ClassVar[bool] = False

    @property
    def virtual_tokens(self) -> int:
        return self.options.num_virtual_tokens if self.input_prompts else 0

    @classmethod
    def check_supported(cls, arch: ArchSpec, task: Any, options) -> None:
        if cls.input_prompts:
            check_input_prompts(cls.name, arch, task)
        else:
            super().check_supported(arch, task, options)

    def peft_config(self, common: dict[str, Any], model: nn.Module):
        """peft's config for ``model``; ``common``: task type, virtual tokens, layers, width and
        heads."""
        raise NotImplementedError

    @classmethod
    def owns_module(cls, module: nn.Module) -> bool:
        return False

    def apply(self, model: nn.Module, layers: Layers = None) -> nn.Module:
        if layers is not None:
            raise ConfigError(f"peft.method={self.name!r} cannot be limited to some layers")
        freeze(model)
        d = self.arch.dims(model.config)
        kind = task_type(model)
        common = {"task_type": kind, "num_virtual_tokens": self.options.num_virtual_tokens,
                  "num_layers": d["num_layers"], "token_dim": d["hidden"],
                  "num_attention_heads": d["num_heads"],
                  "num_transformer_submodules": 1}
        from peft import get_peft_model

        model = get_peft_model(model, self.peft_config(common, model))
        unwrap_saved_modules(model, self.arch)
        if self.options.train_classifier:
            train_classifier(model, self.arch)
        return model

    def encoder_params(self, model: nn.Module) -> int:
        """Weights of the prompt encoder beyond its virtual-token table (P-tuning's MLP,
        prefix tuning's projection): they run on every virtual token of every sequence."""
        return sum(p.numel() for n, p in self.tensors(model).items()
                   if not n.endswith("embedding.weight") and n.endswith("weight"))

    def cost(self, model: nn.Module) -> AdapterCost:
        """Its parameters; the model runs on ``P`` more positions per sequence (prompt
        tuning, P-tuning); P-tuning's encoder costs 6 FLOPs per weight per virtual token once per
        step (peft's ``get_prompt`` encodes one row of prompt tokens and repeats the output over
        the batch)."""
        ts = self.tensors(model)
        n = sum(p.numel() for p in ts.values())
        b = sum(p.numel() * p.element_size() for p in ts.values())
        P = self.options.num_virtual_tokens
        enc = 6.0 * self.encoder_params(model) * P
        return AdapterCost(n, b, 0.0, flops_per_step=enc, virtual_tokens=self.virtual_tokens)

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "virtual_tokens": self.options.num_virtual_tokens}


def check_input_prompts(name: str, arch: ArchSpec, task: Any) -> None:
    """Virtual tokens at the input need a model that takes input embeddings and does not
    look for its last token in ``input_ids``: a ConfigError naming both otherwise."""
    if getattr(task, "head", None) != "sequence_classification" or arch.kind == "encoder":
        return
    why = ("pools the hidden state of the last non-padding token, which it finds in input_ids; "
           "peft replaces input_ids by input embeddings (with the virtual tokens), so it would "
           "pool padding" if arch.kind == "decoder" else
           "does not accept input embeddings (transformers raises NotImplementedError), and "
           "peft passes the virtual tokens as input embeddings")
    raise ConfigError(f"peft.method={name!r} cannot train a {arch.model_type} sequence "
                      f"classifier: {arch.model_type}'s classification head {why}. Use "
                      f"text-to-text classification (task.label_words) or another adapter")
