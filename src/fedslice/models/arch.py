"""The architecture table: where each architecture keeps its layers, attention and FFN.

This is the ONE place that knows module names of a model family. Everything else (LoRA targets,
salience, slicing, cost formulas, tasks) asks an :class:`ArchSpec` for logical parts: ``q``,
``k``, ``v``, ``o`` (attention), ``ffn_in``, ``ffn_out`` (feed-forward; a gated FFN has a
``gate`` beside ``ffn_in``), the layer stacks and the heads a model can carry.

A model has one or two :class:`Stack` s (encoder, decoder) of identical blocks; each block has
one or more attention *families* (``self``; the decoder of an encoder-decoder also ``cross``) and
one FFN. Fused projections (GPT-2's ``c_attn`` giving q|k|v), grouped key/value heads and gated
FFNs are fields of an entry, not branches in the code that uses the table.

The single-stack view (``layers``, ``parts``, ``blocks``, ``part``, ``dims``) is the first stack's
self-attention and FFN: what the encoder-only slicing methods use.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn as nn

from fedslice.errors import ModelError

PART_NAMES = ("q", "k", "v", "o", "ffn_in", "ffn_out")

#: The HF head classes a model can be loaded with (``AutoModelFor...``).
Head = Literal["sequence_classification", "image_classification", "causal_lm", "seq2seq_lm"]
#: Heads that put a classifier on the encoder's output (no language-model head).
CLASSIFIER_HEADS = ("sequence_classification", "image_classification")

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


@dataclass(frozen=True)
class Attention:
    """One attention family of a block: module paths inside the block.

    A fused projection is named for each of q, k and v (the same path): its output rows are
    ``[q | k | v]`` (``fused_qkv``)."""

    family: Literal["self", "cross"]
    q: str
    k: str
    v: str
    o: str

    @property
    def fused_qkv(self) -> bool:
        return self.q == self.k == self.v

    @property
    def module(self) -> str:
        """Path of the attention module (the parent of ``q``)."""
        return self.q.rpartition(".")[0]


@dataclass(frozen=True)
class FFN:
    """The feed-forward network of a block: ``out(act(gate(x)) * in(x))`` when gated
    (SwiGLU, T5's gated-GELU), else ``out(act(in(x)))``."""

    ffn_in: str
    ffn_out: str
    gate: str | None = None
    activation: str = "gelu"  # informational (APoZ thresholds, docs); the model applies it

    @property
    def gated(self) -> bool:
        return self.gate is not None


@dataclass(frozen=True)
class Stack:
    """A list of identical blocks (an encoder or a decoder) and where its sizes live in the config.

    ``layer_scale``: paths (inside a block) of the per-channel scale vectors a block multiplies
    its attention output and its FFN output by before the residual sum (DINOv2's LayerScale,
    ``x + lambda1 * attn(x)``, ``x + lambda2 * ffn(x)``): the effective output projections are
    ``diag(lambda) W_o`` and ``diag(lambda) W_out``, which salience scores. Heads and neurons
    index the projections' *inputs*, so slicing and permuting never touch the scales."""

    name: Literal["encoder", "decoder"]
    layers: str  # dotted path of the nn.ModuleList of blocks, in the unwrapped HF model
    attention: tuple[Attention, ...]
    ffn: FFN
    num_layers_attr: str
    num_heads_attr: str
    ffn_attr: str
    ffn_is_ratio: bool = False  # ffn_attr is a multiple of the hidden size (DINOv2's mlp_ratio)
    layer_scale: tuple[str, str] | None = None  # (attention output, FFN output) scale parameters


@dataclass(frozen=True)
class ImageInput:
    """How an image backbone reads pixels (``pixel_values`` (B, C, H, W)).

    The embeddings cut an image into ``patch_size`` squares (a (H/p)(W/p) grid of patch tokens)
    and put ``prefix_tokens`` learned tokens before them: the class token (``[CLS]``, whose
    final state the classifier reads; DINOv2's classifier reads it beside the mean of the patch
    tokens) and DeiT's distillation token. Tokens per image = patches + prefix tokens: what the
    cost measures count. The position table is learned for ``image_size`` px; DINOv2
    interpolates it to any grid at every forward, ViT/DeiT when their embeddings get
    ``interpolate_kwarg=True`` (set once at load: the table is returned unchanged at the native
    size). ``processor`` is the image processor of the checkpoint's release (class, resize, crop,
    normalisation), used when a model folder has no ``preprocessor_config.json``."""

    processor: str  # JSON: {"class": image processor class, its settings}
    prefix_tokens: int = 1
    pooling: Literal["cls", "cls+mean"] = "cls"  # what the classifier reads (informational)
    patch_size_attr: str = "patch_size"
    image_size_attr: str = "image_size"
    channels_attr: str = "num_channels"
    interpolate_kwarg: str | None = None

    @property
    def processor_settings(self) -> dict:
        return json.loads(self.processor)

    def patch(self, config) -> tuple[int, int]:
        p = getattr(config, self.patch_size_attr)
        return (p, p) if isinstance(p, int) else (int(p[0]), int(p[1]))

    def tokens(self, config, height: int, width: int) -> int:
        """Tokens the model reads for an image of height x width px: patches + prefix tokens."""
        ph, pw = self.patch(config)
        return (height // ph) * (width // pw) + self.prefix_tokens

    def channels(self, config) -> int:
        return int(getattr(config, self.channels_attr, 3))


@dataclass(frozen=True)
class AttentionOutput:
    """Where a HF forward with ``output_attentions=True`` puts the weights of one attention family
    (one tensor (B, H, Tq, Tk) per layer), and which tokens are its queries and keys: ``input``
    (``input_ids``/``attention_mask``) or ``decoder`` (``decoder_input_ids``/...)."""

    stack: int
    family: int  # index into the stack's ``attention``
    name: str  # 'encoder.self', 'decoder.self', 'decoder.cross'
    output: str  # 'attentions', 'encoder_attentions', 'decoder_attentions', 'cross_attentions'
    causal: bool  # a query sees only itself and earlier keys
    queries: Literal["input", "decoder"]
    keys: Literal["input", "decoder"]


@dataclass(frozen=True)
class Layout:
    """How a linear map stores its weight: ``nn.Linear`` as (out, in); HF's ``Conv1D`` (GPT-2)
    as (in, out), with its sizes in ``nf`` (out) and ``nx`` (in). The one place that knows GPT-2's
    transposed layout (like nanoGPT's ``transposed = [...]``): everything else asks
    :meth:`ArchSpec.layout` and works in the linear orientation."""

    name: Literal["linear", "conv1d"]
    out_axis: int  # the weight's axis of output features
    in_axis: int  # the weight's axis of input features
    out_attr: str  # the module attribute that holds the output size
    in_attr: str

    @property
    def transposed(self) -> bool:
        """True when the weight is stored (in, out) (peft's ``fan_in_fan_out``)."""
        return self.out_axis == 1

    def as_linear(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight in ``nn.Linear`` orientation (out, in): a view, gradients flow."""
        return weight.T if self.transposed else weight

    def out_features(self, weight: torch.Tensor) -> int:
        return weight.shape[self.out_axis]


LINEAR = Layout("linear", 0, 1, "out_features", "in_features")
CONV1D = Layout("conv1d", 1, 0, "nf", "nx")
LAYOUTS = {"linear": LINEAR, "conv1d": CONV1D}


def is_linear(module: nn.Module) -> bool:
    """``nn.Linear``, or HF's ``Conv1D`` (GPT-2: a linear map whose weight is stored (in, out))."""
    return isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"


@dataclass(frozen=True)
class ArchSpec:
    model_type: str
    kind: Literal["encoder", "decoder", "encoder-decoder"]
    stacks: tuple[Stack, ...]
    heads: tuple[Head, ...]  # HF heads supported (a T5 classifier head lives under another prefix)
    classifier: tuple[str, ...]  # top-level modules of the sequence-classification head
    embeddings: str  # dotted path of the (input) embeddings module
    hidden_attr: str
    kv_heads_attr: str | None = None  # grouped-query attention: key/value heads (None: = heads)
    head_dim_attr: str | None = None  # None: hidden // heads
    weight_layout: Literal["linear", "conv1d"] = "linear"  # conv1d: weight (in, out), GPT-2
    position: Literal["absolute", "rotary", "relative_bias"] = "absolute"
    # attributes of the attention module that hold its head count and width: a sliced sub-model
    # sets them per layer (HF reads the head count off the weights' shapes at forward time).
    heads_attr: str | None = "num_attention_heads"
    heads_width_attr: str | None = "all_head_size"
    image: ImageInput | None = None  # an image backbone (reads pixel_values), else text
    # the HF class of the classification head where the auto class may pick another one (DeiT:
    # a checkpoint naming ...WithTeacher, two classifiers the table does not describe)
    classifier_class: str | None = None
    # a table with one column per self-attention head, in the first block of each stack and read
    # by every layer of it (T5's relative-position bias): sliced and permuted with the heads
    head_bias: str | None = None
    # its attention takes cached keys/values from outside (HF's ``past_key_values``): what
    # prefix tuning feeds it (DistilBERT's has no cache)
    accepts_past: bool = True

    @property
    def layout(self) -> Layout:
        """How this family stores its linear weights (:data:`LINEAR` or :data:`CONV1D`)."""
        return LAYOUTS[self.weight_layout]

    @property
    def inputs(self) -> Literal["text", "image"]:
        """What the model reads: token ids, or images (``pixel_values``)."""
        return "image" if self.image is not None else "text"

    # -- the single-stack view (first stack, self-attention) ---------------------------------
    @property
    def layers(self) -> str:
        return self.stacks[0].layers

    @property
    def parts(self) -> dict[str, str]:
        """Logical part -> dotted path inside one block of the first stack."""
        att, ffn = self.stacks[0].attention[0], self.stacks[0].ffn
        out = {"q": att.q, "k": att.k, "v": att.v, "o": att.o,
               "ffn_in": ffn.ffn_in, "ffn_out": ffn.ffn_out}
        if ffn.gate:
            out["gate"] = ffn.gate
        return out

    @property
    def is_generative(self) -> bool:
        return "causal_lm" in self.heads or "seq2seq_lm" in self.heads

    @property
    def lm_head(self) -> Head | None:
        """The generative head of this family (causal LM for decoders, seq2seq otherwise)."""
        return next((h for h in self.heads if h not in CLASSIFIER_HEADS), None)

    @property
    def is_simple_encoder(self) -> bool:
        """One stack, one attention family, separate q/k/v, plain FFN, Linear weights, no key/value
        head groups: what the sub-model slicing methods handle today."""
        st = self.stacks
        return (len(st) == 1 and len(st[0].attention) == 1 and not st[0].attention[0].fused_qkv
                and not st[0].ffn.gated and self.weight_layout == "linear"
                and self.kv_heads_attr is None and self.head_dim_attr is None)

    @property
    def attention_outputs(self) -> tuple[AttentionOutput, ...]:
        """Every attention family of the model, stack by stack (the rows of a head keep-mask)."""
        out = []
        for k, st in enumerate(self.stacks):
            for f, att in enumerate(st.attention):
                name = f"{st.name}.{att.family}"
                if len(self.stacks) == 1:
                    out.append(AttentionOutput(k, f, name, "attentions", st.name == "decoder",
                                               "input", "input"))
                    continue
                side = "decoder" if st.name == "decoder" else "input"
                attr = "cross_attentions" if att.family == "cross" else f"{st.name}_attentions"
                out.append(AttentionOutput(k, f, name, attr, side == "decoder" and att.family == "self",
                                           side, "input" if att.family == "cross" else side))
        return tuple(out)

    # -- dimensions ------------------------------------------------------------------------
    def dims(self, config, stack: int = 0) -> dict[str, int]:
        """(L, H, KV heads, d, d_ff, head_dim) of one stack of a HF config."""
        s = self.stacks[stack]
        d = getattr(config, self.hidden_attr)
        h = getattr(config, s.num_heads_attr)
        kv = getattr(config, self.kv_heads_attr, None) if self.kv_heads_attr else None
        head_dim = getattr(config, self.head_dim_attr, None) if self.head_dim_attr else None
        ffn = getattr(config, s.ffn_attr, None) or 4 * d  # GPT-2: n_inner None means 4 d
        if s.ffn_is_ratio:
            ffn = int(d * ffn)
        return {"num_layers": getattr(config, s.num_layers_attr), "num_heads": h,
                "num_kv_heads": kv or h, "hidden": d, "ffn": ffn, "head_dim": head_dim or d // h,
                "families": len(s.attention)}

    def all_dims(self, config) -> list[dict[str, int]]:
        """:meth:`dims` of every stack."""
        return [self.dims(config, k) for k in range(len(self.stacks))]

    def num_layers(self, config) -> int:
        """Blocks over all stacks."""
        return sum(getattr(config, s.num_layers_attr) for s in self.stacks)

    # -- module access ---------------------------------------------------------------------
    def blocks(self, model: nn.Module, stack: int = 0) -> nn.ModuleList:
        return _get(unwrap_model(model), self.stacks[stack].layers)

    def part(self, model: nn.Module, layer: int, part: str) -> nn.Module:
        return _get(self.blocks(model)[layer], self.parts[part])

    def ffn_part(self, model: nn.Module, stack: int, layer: int, part: str) -> nn.Module | None:
        """The ``gate``, ``ffn_in`` or ``ffn_out`` module of a block of any stack (``gate``: None
        for a plain FFN)."""
        path = getattr(self.stacks[stack].ffn, part)
        return _get(self.blocks(model, stack)[layer], path) if path else None

    def attention(self, model: nn.Module, layer: int) -> nn.Module:
        """The self-attention module of a block of the first stack: the parent of its ``q``."""
        parent = self.parts["q"].rpartition(".")[0]
        block = self.blocks(model)[layer]
        return _get(block, parent) if parent else block

    def part_name(self, layer: int, part: str) -> str:
        """Full dotted name of a part in the *unwrapped* HF model, e.g. 'bert.encoder.layer.0...'."""
        return f"{self.layers}.{layer}.{self.parts[part]}"

    def part_paths(self, stack: Stack, part: str) -> list[str]:
        """Paths inside one block of ``stack`` of a logical part, over its attention families
        (``ffn_in`` of a gated FFN includes the gate; a fused q/k/v is named once)."""
        if part in ("q", "k", "v", "o"):
            return list(dict.fromkeys(getattr(a, part) for a in stack.attention))
        if part == "ffn_in":
            return [p for p in (stack.ffn.gate, stack.ffn.ffn_in) if p]
        if part == "ffn_out":
            return [stack.ffn.ffn_out]
        raise ModelError(f"unknown part {part!r}: expected one of {', '.join(PART_NAMES)}")

    def module_names(self, model: nn.Module, parts: list[str],
                     layers: list[int] | list[list[int]] | None = None) -> list[str]:
        """Full names (in the unwrapped HF model) of the modules of ``parts`` in every block of
        every stack of ``model``, or only in blocks numbered ``layers`` (of each stack, or one
        list per stack); no duplicates."""
        names: dict[str, None] = {}
        for k, s in enumerate(self.stacks):
            n = len(self.blocks(model, k))
            mine = layers[k] if layers and isinstance(layers[0], (list, tuple)) else layers
            for i in range(n) if mine is None else sorted(l for l in set(mine) if l < n):
                for part in parts:
                    for path in self.part_paths(s, part):
                        names[f"{s.layers}.{i}.{path}"] = None
        return list(names)


def module_at(root: nn.Module, path: str) -> nn.Module:
    """The submodule of ``root`` at a dotted ``path`` (list items by number)."""
    return _get(root, path)


def _get(root: nn.Module, path: str) -> nn.Module:
    mod = root
    for attr in path.split("."):
        mod = mod[int(attr)] if attr.isdigit() else getattr(mod, attr)
    return mod


def unwrap_model(model: nn.Module) -> nn.Module:
    """The HF model under a peft wrapper (PeftModel -> LoraModel -> HF model)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _encoder(model_type: str, layers: str, parts: dict[str, str], classifier: tuple[str, ...],
             embeddings: str, n_layers: str, n_heads: str, hidden: str, ffn: str,
             stack_kw: dict | None = None, **kw) -> ArchSpec:
    att = Attention("self", parts["q"], parts["k"], parts["v"], parts["o"])
    stack = Stack("encoder", layers, (att,), FFN(parts["ffn_in"], parts["ffn_out"]),
                  n_layers, n_heads, ffn, **(stack_kw or {}))
    head = "image_classification" if kw.get("image") else "sequence_classification"
    return ArchSpec(model_type, "encoder", (stack,), (head,), classifier, embeddings, hidden, **kw)


_BERT_PARTS = {"q": "attention.self.query", "k": "attention.self.key",
               "v": "attention.self.value", "o": "attention.output.dense",
               "ffn_in": "intermediate.dense", "ffn_out": "output.dense"}

_T5_SELF = Attention("self", *(f"layer.0.SelfAttention.{p}" for p in "qkvo"))
_T5_CROSS = Attention("cross", *(f"layer.1.EncDecAttention.{p}" for p in "qkvo"))
# T5 v1.0 (t5-small): ReLU `wi`; flan-t5 / T5 v1.1: gated-GELU `wi_0` (gate) * `wi_1`. The FFN
# entry is picked from the config's `is_gated_act` by `arch_for`.
_T5_FFN = {False: lambda i: FFN(f"layer.{i}.DenseReluDense.wi", f"layer.{i}.DenseReluDense.wo",
                                activation="relu"),
           True: lambda i: FFN(f"layer.{i}.DenseReluDense.wi_1", f"layer.{i}.DenseReluDense.wo",
                               gate=f"layer.{i}.DenseReluDense.wi_0", activation="gelu_new")}


def _t5(gated: bool) -> ArchSpec:
    enc = Stack("encoder", "encoder.block", (_T5_SELF,), _T5_FFN[gated](1), "num_layers",
                "num_heads", "d_ff")
    dec = Stack("decoder", "decoder.block", (_T5_SELF, _T5_CROSS), _T5_FFN[gated](2),
                "num_decoder_layers", "num_heads", "d_ff")
    return ArchSpec("t5", "encoder-decoder", (enc, dec), ("seq2seq_lm",), (), "shared", "d_model",
                    head_dim_attr="d_kv", position="relative_bias", heads_attr="n_heads",
                    heads_width_attr="inner_dim",
                    head_bias="layer.0.SelfAttention.relative_attention_bias")


def _bart_attention(family: Literal["self", "cross"], module: str) -> Attention:
    return Attention(family, f"{module}.q_proj", f"{module}.k_proj", f"{module}.v_proj",
                     f"{module}.out_proj")


# ViT-family backbones (transformers 5 names): attention.{q,k,v,o}_proj, mlp.fc1/fc2.
_VIT_PARTS = {"q": "attention.q_proj", "k": "attention.k_proj", "v": "attention.v_proj",
              "o": "attention.o_proj", "ffn_in": "mlp.fc1", "ffn_out": "mlp.fc2"}


def _processor(cls: str, **settings) -> str:
    return json.dumps({"class": cls, **settings})


def _vision(model_type: str, layers: str, image: ImageInput, **kw) -> ArchSpec:
    """A ViT-family image classifier: one encoder stack, a linear ``classifier`` on the pooled
    tokens; attention modules read the head count off their weights (no width attribute)."""
    return _encoder(model_type, layers, _VIT_PARTS, ("classifier",), f"{model_type}.embeddings",
                    "num_hidden_layers", "num_attention_heads", "hidden_size",
                    kw.pop("ffn", "intermediate_size"), heads_width_attr=None, image=image,
                    accepts_past=kw.pop("accepts_past", False), **kw)


_BART_FFN = FFN("fc1", "fc2")
_LLAMA_ATT = Attention("self", "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj",
                       "self_attn.o_proj")
_GPT2_ATT = Attention("self", "attn.c_attn", "attn.c_attn", "attn.c_attn", "attn.c_proj")

ARCHITECTURES: dict[str, ArchSpec] = {
    "bert": _encoder("bert", "bert.encoder.layer", _BERT_PARTS, ("classifier",),
                     "bert.embeddings", "num_hidden_layers", "num_attention_heads",
                     "hidden_size", "intermediate_size"),
    "roberta": _encoder("roberta", "roberta.encoder.layer", _BERT_PARTS, ("classifier",),
                        "roberta.embeddings", "num_hidden_layers", "num_attention_heads",
                        "hidden_size", "intermediate_size"),
    "distilbert": _encoder("distilbert", "distilbert.transformer.layer",
                           {"q": "attention.q_lin", "k": "attention.k_lin", "v": "attention.v_lin",
                            "o": "attention.out_lin", "ffn_in": "ffn.lin1", "ffn_out": "ffn.lin2"},
                           ("pre_classifier", "classifier"), "distilbert.embeddings",
                           "n_layers", "n_heads", "dim", "hidden_dim", heads_attr="n_heads",
                           heads_width_attr=None, accepts_past=False),
    # ViT (google/vit-*, and DeiT checkpoints without a distillation token): one class token,
    # position table for config.image_size (interpolated at other sizes), mean/std 0.5.
    "vit": _vision("vit", "vit.layers", ImageInput(
        _processor("ViTImageProcessor"), interpolate_kwarg="interpolate_pos_encoding")),
    # DeiT distilled (facebook/deit-*-distilled-*): class + distillation token, ImageNet
    # normalisation, resize 256 -> crop 224; the classifier reads the class token.
    "deit": _vision("deit", "deit.layers", ImageInput(
        _processor("DeiTImageProcessor", image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD),
        prefix_tokens=2, interpolate_kwarg="interpolate_pos_encoding"),
        classifier_class="DeiTForImageClassification"),
    # DINOv2: LayerScale after attention and FFN, FFN width mlp_ratio x hidden, the position table
    # (518 px, patch 14) interpolated at every forward; the classifier reads [CLS] ++ mean(patches).
    "dinov2": _vision("dinov2", "dinov2.encoder.layer", ImageInput(
        _processor("BitImageProcessor", image_mean=IMAGENET_MEAN, image_std=IMAGENET_STD,
                   size={"shortest_edge": 256}, crop_size={"height": 224, "width": 224}),
        pooling="cls+mean"), ffn="mlp_ratio",
        stack_kw={"ffn_is_ratio": True, "layer_scale": ("layer_scale1.lambda1", "layer_scale2.lambda1")}),
    # LLaMA family (SmolLM2, LLaMA 2/3, Qwen2, Mistral shapes): GQA, SwiGLU, RMSNorm, RoPE.
    "llama": ArchSpec(
        "llama", "decoder",
        (Stack("decoder", "model.layers", (_LLAMA_ATT,),
               FFN("mlp.up_proj", "mlp.down_proj", gate="mlp.gate_proj", activation="silu"),
               "num_hidden_layers", "num_attention_heads", "intermediate_size"),),
        ("causal_lm", "sequence_classification"), ("score",), "model.embed_tokens", "hidden_size",
        kv_heads_attr="num_key_value_heads", head_dim_attr="head_dim", position="rotary",
        heads_attr=None, heads_width_attr=None),
    # GPT-2: fused q|k|v in one Conv1D (weight stored (in, out)), learned positions.
    "gpt2": ArchSpec(
        "gpt2", "decoder",
        (Stack("decoder", "transformer.h", (_GPT2_ATT,), FFN("mlp.c_fc", "mlp.c_proj",
                                                             activation="gelu_new"),
               "n_layer", "n_head", "n_inner"),),
        ("causal_lm", "sequence_classification"), ("score",), "transformer.wte", "n_embd",
        weight_layout="conv1d", heads_attr="num_heads", heads_width_attr="split_size"),
    "t5": _t5(gated=False),
    "bart": ArchSpec(
        "bart", "encoder-decoder",
        (Stack("encoder", "model.encoder.layers", (_bart_attention("self", "self_attn"),), _BART_FFN,
               "encoder_layers", "encoder_attention_heads", "encoder_ffn_dim"),
         Stack("decoder", "model.decoder.layers", (_bart_attention("self", "self_attn"),
                                                   _bart_attention("cross", "encoder_attn")),
               _BART_FFN, "decoder_layers", "decoder_attention_heads", "decoder_ffn_dim")),
        ("seq2seq_lm", "sequence_classification"), ("classification_head",), "model.shared",
        "d_model", heads_attr="num_heads", heads_width_attr=None),
}
#: Model types that are the same family as a table entry (same module names).
ALIASES = {"qwen2": "llama", "mistral": "llama"}


def arch_for(model_or_config) -> ArchSpec:
    """The table entry of a HF model or config; unsupported architectures name the supported ones."""
    config = getattr(unwrap_model(model_or_config), "config", model_or_config)
    model_type = getattr(config, "model_type", None)
    model_type = ALIASES.get(model_type, model_type)
    if model_type not in ARCHITECTURES:
        raise ModelError(f"unsupported architecture {model_type!r}: supported are "
                         f"{', '.join(sorted([*ARCHITECTURES, *ALIASES]))}")
    if model_type == "t5" and getattr(config, "is_gated_act", False):
        return _t5(gated=True)
    if model_type == "dinov2" and getattr(config, "use_swiglu_ffn", False):
        raise ModelError("dinov2 with a SwiGLU FFN (use_swiglu_ffn, the giant model) is not in the "
                         "architecture table: supported are the MLP ones (small, base, large)")
    return ARCHITECTURES[model_type]
