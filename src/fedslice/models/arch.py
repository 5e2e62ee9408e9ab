"""The architecture table: where each architecture keeps its layers, attention and FFN.

This is the ONE place that knows module names of a model family. Everything else (LoRA targets,
salience, slicing, cost formulas) asks an :class:`ArchSpec` for logical parts: ``q``, ``k``,
``v``, ``o`` (attention), ``ffn_in``, ``ffn_out`` (feed-forward), the layer list and the classifier.

All entries here store linear weights as ``nn.Linear`` (out_features, in_features), with separate
q/k/v projections. GPT-2 (fused ``c_attn``, Conv1D with transposed weights), T5 and BART
(encoder/decoder/cross families) need the fields ``fused_qkv``/``weight_layout`` and several layer
lists; they are not in the table yet, and loading one fails with the list of supported ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn as nn

from fedslice.errors import ModelError

PART_NAMES = ("q", "k", "v", "o", "ffn_in", "ffn_out")


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    layers: str  # dotted path of the nn.ModuleList of transformer blocks
    parts: dict[str, str]  # logical part -> dotted path inside one block
    classifier: tuple[str, ...]  # top-level modules of the task head (trained by every method)
    embeddings: str  # dotted path of the embeddings module
    num_layers_attr: str
    num_heads_attr: str
    hidden_attr: str
    ffn_attr: str
    # attributes of the attention module (the parent of ``q``) that hold its head count and its
    # width: a sliced sub-model sets them per layer (HF reads the head count off the weights'
    # shapes at forward time; these are kept truthful for code that reads them).
    heads_attr: str = "num_attention_heads"
    heads_width_attr: str | None = "all_head_size"

    # -- dimensions ------------------------------------------------------------------------
    def dims(self, config) -> dict[str, int]:
        """(L, H, d, d_ff, head_dim) of a HF config."""
        d = getattr(config, self.hidden_attr)
        h = getattr(config, self.num_heads_attr)
        return {"num_layers": getattr(config, self.num_layers_attr), "num_heads": h,
                "hidden": d, "ffn": getattr(config, self.ffn_attr), "head_dim": d // h}

    # -- module access ---------------------------------------------------------------------
    def blocks(self, model: nn.Module) -> nn.ModuleList:
        return _get(_unwrap(model), self.layers)

    def part(self, model: nn.Module, layer: int, part: str) -> nn.Linear:
        return _get(self.blocks(model)[layer], self.parts[part])

    def attention(self, model: nn.Module, layer: int) -> nn.Module:
        """The attention module of a block: the parent of its ``q`` projection."""
        parent = self.parts["q"].rpartition(".")[0]
        block = self.blocks(model)[layer]
        return _get(block, parent) if parent else block

    def part_name(self, layer: int, part: str) -> str:
        """Full dotted name of a part in the *unwrapped* HF model, e.g. 'bert.encoder.layer.0...'."""
        return f"{self.layers}.{layer}.{self.parts[part]}"

    def part_regex(self, parts: list[str], layers: list[int] | None = None) -> str:
        """A regex that fully matches the module names of these parts in every layer, or only in
        ``layers`` (for peft)."""
        alts = "|".join(self.parts[p].replace(".", r"\.") for p in parts)
        num = r"\d+" if layers is None else "(?:" + "|".join(str(i) for i in sorted(layers)) + ")"
        return rf"(?:.*\.)?{self.layers.replace('.', chr(92) + '.')}\.{num}\.(?:{alts})"


def _get(root: nn.Module, path: str) -> nn.Module:
    mod = root
    for attr in path.split("."):
        mod = mod[int(attr)] if attr.isdigit() else getattr(mod, attr)
    return mod


def _unwrap(model: nn.Module) -> nn.Module:
    """The HF model under a peft wrapper (PeftModel -> LoraModel -> HF model)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


_BERT_PARTS = {"q": "attention.self.query", "k": "attention.self.key",
               "v": "attention.self.value", "o": "attention.output.dense",
               "ffn_in": "intermediate.dense", "ffn_out": "output.dense"}

ARCHITECTURES: dict[str, ArchSpec] = {
    "bert": ArchSpec("bert", "bert.encoder.layer", _BERT_PARTS, ("classifier",),
                     "bert.embeddings", "num_hidden_layers", "num_attention_heads",
                     "hidden_size", "intermediate_size"),
    "roberta": ArchSpec("roberta", "roberta.encoder.layer", _BERT_PARTS, ("classifier",),
                        "roberta.embeddings", "num_hidden_layers", "num_attention_heads",
                        "hidden_size", "intermediate_size"),
    "distilbert": ArchSpec("distilbert", "distilbert.transformer.layer",
                           {"q": "attention.q_lin", "k": "attention.k_lin", "v": "attention.v_lin",
                            "o": "attention.out_lin", "ffn_in": "ffn.lin1", "ffn_out": "ffn.lin2"},
                           ("pre_classifier", "classifier"), "distilbert.embeddings",
                           "n_layers", "n_heads", "dim", "hidden_dim", "n_heads", None),
    "vit": ArchSpec("vit", "vit.encoder.layer",
                    {**_BERT_PARTS, "q": "attention.attention.query",
                     "k": "attention.attention.key", "v": "attention.attention.value"},
                    ("classifier",), "vit.embeddings", "num_hidden_layers",
                    "num_attention_heads", "hidden_size", "intermediate_size"),
}


def arch_for(model_or_config) -> ArchSpec:
    """The table entry of a HF model or config; unsupported architectures name the supported ones."""
    config = getattr(_unwrap(model_or_config), "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    if model_type not in ARCHITECTURES:
        raise ModelError(f"unsupported architecture {model_type!r}: supported are "
                         f"{', '.join(sorted(ARCHITECTURES))}")
    return ARCHITECTURES[model_type]
