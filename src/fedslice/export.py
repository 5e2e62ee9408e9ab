"""The trained model of a run folder, rebuilt for inference and exported (``fedslice export``).

A run folder holds the trained tensors (``final_trainable.safetensors``, fedslice's names), the
resolved config and ``inference.json``: the model's head and labels, the text columns, the saved
tensors the evaluated model does not hold. :func:`trained_model` rebuilds the model fedslice
evaluated from these, over the base model named in the config, without the training data:
the adapter (if any) is rebuilt from its own tensors (:meth:`fedslice.peft.Adapter.export_config`).

Formats:

* ``peft``: ``adapter_config.json`` + ``adapter_model.safetensors`` in peft's names (and the task
  head as ``modules_to_save``): ``PeftModel.from_pretrained(base, DIR)``. Only for a run whose
  result is an adapter over the unchanged base model.
* ``merged``: a standard transformers folder (config with the label names, safetensors, tokenizer,
  generation config): ``AutoModelFor...from_pretrained(DIR)``, no fedslice needed.
* ``merged`` with ``size``: the elastic sub-model at that FLOPs fraction of a method that has
  them (its export hook, :class:`fedslice.registry.ElasticExport`: RaFFM's), smaller in its config
  (fewer heads, FFN neurons, layers). Where the architecture's config derives the head size from
  the hidden size (BERT, RoBERTa, DistilBERT, GPT-2, BART), fewer heads cannot be said in the
  stock config: the folder then carries a 60-line modeling file (``fedslice_elastic.py``, plain
  transformers and torch) that narrows the attention projections, loaded with
  ``trust_remote_code=True``.
"""

from __future__ import annotations

import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from fedslice.run.checkpoint import CHECKPOINT, read_checkpoint
from fedslice.run.session import INFERENCE, inference_info
from fedslice.config import ExperimentConfig
from fedslice.experiment import validate_config
from fedslice.errors import ConfigError, FedsliceError
from fedslice.models.arch import CLASSIFIER_HEADS, ArchSpec, arch_for
from fedslice.models.loading import LoadedModel, load_model
from fedslice.models.quantize import dequantize_base, quantize_base, quantized_weights, quiet
from fedslice.output import (CONFIG_JSON, LATEST_WEIGHTS, SUMMARY, WEIGHTS, is_staging,
                             write_json_atomic)
from fedslice.methods import method_class
from fedslice.peft.base import base_name, make_adapter
from fedslice.registry import METHODS, ElasticExport

log = logging.getLogger(__name__)

FORMATS = ("peft", "merged")


# --------------------------------------------------------------------------------------------
# Reading a run
# --------------------------------------------------------------------------------------------

@dataclass
class TrainedRun:
    path: Path
    cfg: ExperimentConfig
    info: dict[str, Any]
    state: dict[str, torch.Tensor]
    #: None for a finished run; else what was exported instead ("checkpoint after round N of M")
    partial: str | None = None

    @property
    def arch(self) -> ArchSpec:
        return arch_for(self._model_config())

    def _model_config(self):
        from fedslice.models.loading import load_config
        return load_config(self.cfg.model)[0]


def read_run(run_dir: str | Path, allow_partial: bool = False) -> TrainedRun:
    """The config, inference info and trained state of a run folder. A run that did not finish
    (a staging folder, or files missing) is refused naming what is missing, unless
    ``allow_partial``: then its latest checkpoint is read, or the latest weights a failed run kept
    (``LATEST_WEIGHTS``) when they are newer, when there is no checkpoint or when it is damaged.
    A damaged file is a :class:`FedsliceError` naming it."""
    path = Path(run_dir)
    if not path.is_dir():
        raise FedsliceError(f"{path} is not a run folder (no such folder)")
    _check_run_files(path)
    cfg = validate_config(_read_json(path / CONFIG_JSON), str(path / CONFIG_JSON))
    info = _read_json(path / INFERENCE)
    if not isinstance(info, dict) or "head" not in info:
        raise FedsliceError(f"{path / INFERENCE} is damaged: it does not say the model's head")
    missing = [n for n in (SUMMARY, WEIGHTS) if not (path / n).is_file()]
    staging = is_staging(path)
    if not missing and not staging:
        return TrainedRun(path, cfg, info, load_tensors(path / WEIGHTS))
    what = f"{', '.join(missing) or 'nothing'} missing" + (", a staging folder" if staging else "")
    if not allow_partial:
        raise FedsliceError(f"{path} is not a finished run ({what}); with --allow-partial its "
                            f"latest checkpoint ({CHECKPOINT}) or the latest weights a failed "
                            f"run kept ({LATEST_WEIGHTS}) are exported instead")
    return _read_partial(path, cfg, info, what)


def _check_run_files(path: Path) -> None:
    """Both files every run folder has from its start; which one is missing, if one is."""
    absent = [n for n in (CONFIG_JSON, INFERENCE) if not (path / n).is_file()]
    if len(absent) == 2:
        raise FedsliceError(f"{path} is not a run folder: it has neither {CONFIG_JSON} nor "
                            f"{INFERENCE} (give the folder `fedslice run` printed as results)")
    if absent:
        there = CONFIG_JSON if absent[0] == INFERENCE else INFERENCE
        raise FedsliceError(f"{path} is a run folder with {absent[0]} missing ({there} is there): "
                            f"it was deleted or moved; restore it (fedslice needs both)")


def _read_json(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise FedsliceError(f"{file} is damaged (not JSON: {e}); restore it from a copy") from None


def load_tensors(file: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file; a damaged one (truncated, not safetensors) is a
    :class:`FedsliceError` naming it (an unreadable one an OSError: the environment)."""
    from safetensors.torch import load_file
    try:
        return load_file(str(file))
    except OSError:
        raise
    except Exception as e:  # noqa: BLE001 - SafetensorError, and whatever a torn file raises
        why = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise FedsliceError(f"{file} is damaged ({why}): it is truncated or not a safetensors "
                            "file; restore it from a copy, or run the experiment again") from None


def _read_partial(path: Path, cfg: ExperimentConfig, info: dict[str, Any], what: str) -> TrainedRun:
    """An unfinished run's latest weights or checkpoint, whichever is newer and intact."""
    latest, latest_error = _attempt(lambda: _latest_weights(path))
    has_ckpt = (path / CHECKPOINT).is_file()
    ckpt, ckpt_error = _attempt(lambda: read_checkpoint(path)) if has_ckpt else (None, None)
    if latest is None and ckpt is None:
        if latest_error or ckpt_error:
            errors = "; ".join(str(e) for e in (ckpt_error, latest_error) if e)
            raise FedsliceError(f"{path} is not a finished run ({what}) and nothing in it can be "
                                f"exported: {errors}")
        raise FedsliceError(f"{path} is not a finished run ({what}) and has neither a checkpoint "
                            f"({CHECKPOINT}) nor the latest weights ({LATEST_WEIGHTS}) to export: "
                            "it stopped before either was written")
    for error in (ckpt_error, latest_error):
        if error is not None:
            log.warning("%s; exporting what else the run kept", error)
    if latest is not None and (ckpt is None or latest[0] > ckpt.round):
        # a failed run's weights after its last finished round (newer than any checkpoint)
        return TrainedRun(path, cfg, info, latest[1], f"latest weights after round {latest[0]} "
                          f"of {cfg.federation.rounds} ({what})")
    run = TrainedRun(path, cfg, info, {}, f"checkpoint after round {ckpt.round} of "
                     f"{cfg.federation.rounds} ({what})")
    run.state = method_class(cfg.method.name).export_state(ckpt.state, ckpt.server, run.arch)
    return run


def _attempt(read):
    """``(read(), None)``, or ``(None, the FedsliceError)`` of a damaged file."""
    try:
        return read(), None
    except FedsliceError as e:
        return None, e


def _latest_weights(path: Path) -> tuple[int, dict[str, torch.Tensor]] | None:
    """The round and tensors of ``LATEST_WEIGHTS`` (written by a run that failed after a round,
    in the exported form), or None when there is none."""
    file = path / LATEST_WEIGHTS
    if not file.is_file():
        return None
    tensors = load_tensors(file)
    from safetensors import safe_open
    with safe_open(str(file), "pt") as f:
        meta = f.metadata() or {}
    try:
        rnd = int(meta.get("round", ""))
    except ValueError as e:
        raise FedsliceError(f"{file} does not say after which round it was written") from e
    return rnd, tensors


# --------------------------------------------------------------------------------------------
# Rebuilding the trained model
# --------------------------------------------------------------------------------------------

@dataclass
class Rebuilt:
    loaded: LoadedModel  # the base model (its tensors updated in place) and tokenizer
    model: nn.Module  # what fedslice evaluates: the base model, or it wrapped with the adapter
    adapter: Any  # the run's adapter (fedslice.peft.Adapter), or None: no adapter tensors
    changed_base: list[str]  # base-model tensors the run changed (beyond the task head)
    head_modules: list[str]  # task-head modules the run trained


def _head_modules(arch: ArchSpec, keys) -> list[str]:
    names = [base_name(k) for k in keys]
    return [m for m in arch.classifier if any(n.startswith(m + ".") for n in names)]


@torch.no_grad()
def trained_model(run: TrainedRun, *, head_as_modules_to_save: bool = False,
                  dequantized: bool = False) -> Rebuilt:
    """The model fedslice evaluated at the end of ``run``: the base model named in the config
    (quantized as the run's ``model.quantize`` says) with the trained tensors loaded and the
    adapter (if any) rebuilt from its tensors. ``dequantized``: a quantized base is turned back
    into plain fp32 weights of the values it held (what the adapter trained over) before the
    adapter is applied, so peft merges into it and plain transformers saves it."""
    cfg, info = run.cfg, run.info
    loaded = load_model(cfg.model, info.get("num_labels"), cfg.seed, head=info["head"])
    arch = loaded.arch
    quantized: set[str] = set()
    if cfg.model.quantize != "none":
        quantize_base(loaded.model, cfg.model.quantize, arch)  # the same, deterministic values
        quantized = set(quantized_weights(loaded.model))
        if dequantized:
            dequantize_base(loaded.model)
    # a frozen base tensor the method carried in its state (raffm: the checkpoint's fp32 value)
    # stays as the quantized model holds it: what the run evaluated
    state = {k: t for k, t in run.state.items()
             if k not in set(info.get("exclude", [])) and base_name(k) not in quantized}
    adapter = make_adapter(cfg, method_class(cfg.method.name).adapter_name(cfg), arch)
    own = {k: t for k, t in state.items() if adapter.owns(k)}
    adapter = adapter if own else None  # full fine-tuning, or nothing of the adapter trained
    plain = {base_name(k): t for k, t in state.items() if k not in own}
    params = loaded.model.state_dict()
    unknown = [k for k in plain if k not in params]
    wrong = [f"{k}: {tuple(t.shape)} saved, {tuple(params[k].shape)} in the model"
             for k, t in plain.items() if k in params and params[k].shape != t.shape]
    if unknown or wrong:
        raise FedsliceError(f"{run.path}: the trained tensors do not fit {cfg.model.name!r}: "
                            f"{(unknown + wrong)[:5]}")
    heads = _head_modules(arch, plain)
    changed = [k for k, t in plain.items()
               if not any(k.startswith(m + ".") for m in heads) and not torch.equal(params[k], t)]
    loaded.model.load_state_dict(plain, strict=False)
    model = loaded.model
    if adapter is not None:
        from peft import get_peft_model
        pc = adapter.export_config(own, heads if head_as_modules_to_save else None)
        with quiet():
            model = get_peft_model(loaded.model, pc)
        names = dict(model.named_parameters())
        missing = [k for k in own if k not in names]
        if missing:
            raise FedsliceError(f"{run.path}: adapter tensors without a module: {missing[:3]}")
        for k, t in own.items():
            names[k].copy_(t)
    model.eval()
    return Rebuilt(loaded, model, adapter, changed, heads)


# --------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------

def default_out(run: TrainedRun, fmt: str, size: float | None) -> Path:
    tag = fmt if size is None else f"{fmt}-size{size:g}"
    return run.path / "export" / tag


def export_run(run_dir: str | Path, fmt: str, out: str | Path | None = None, *,
               size: float | None = None, allow_partial: bool = False) -> Path:
    """Export the trained model of a run folder; return the folder written."""
    if fmt not in FORMATS:
        raise ConfigError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    run = read_run(run_dir, allow_partial)
    if size is not None and fmt != "merged":
        raise ConfigError("--size exports a smaller standalone model: use --format merged")
    dest = Path(out) if out else default_out(run, fmt, size)
    if dest.exists() and any(dest.iterdir()):
        raise FedsliceError(f"{dest} exists and is not empty: choose another --out")
    elastic = elastic_export(run) if size is not None else None
    spec = elastic.spec(run.path, size, finished=run.partial is None) if elastic else None
    # a quantized base is exported de-quantized: ``merged`` holds the values the adapter trained
    # over plus its update; ``peft`` holds the adapter only (it loads on the quantized base)
    rebuilt = trained_model(run, head_as_modules_to_save=fmt == "peft", dequantized=True)
    tmp = dest.with_name(f".{dest.name}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        if fmt == "peft":
            _save_peft(run, rebuilt, tmp)
        else:
            _save_merged(run, rebuilt, tmp, spec, elastic)
        write_json_atomic(tmp / "fedslice_export.json", {
            "run": str(run.path.resolve()), "format": fmt, "size": size,
            "base_model": run.cfg.model.name, "method": run.cfg.method.name,
            "base_quantize": run.cfg.model.quantize,
            "partial": run.partial, "head": run.info["head"],
            "label_names": run.info.get("label_names")})
        if dest.exists():
            dest.rmdir()
        tmp.rename(dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if run.partial:
        log.warning("exported %s from the %s", run.path, run.partial)
    return dest


def _not_adapter(run: TrainedRun, why: str) -> FedsliceError:
    return FedsliceError(f"{run.path}: method {run.cfg.method.name!r} did not train an adapter over "
                         f"the unchanged base model ({why}): export it with --format merged")


def _save_peft(run: TrainedRun, rebuilt: Rebuilt, dest: Path) -> None:
    if rebuilt.adapter is None:
        raise _not_adapter(run, "no adapter tensors: every trained tensor is a base-model one")
    if rebuilt.changed_base:
        raise _not_adapter(run, f"{len(rebuilt.changed_base)} base-model tensors changed, e.g. "
                                f"{rebuilt.changed_base[0]}")
    rebuilt.model.save_pretrained(str(dest))
    cfg = json.loads((dest / "adapter_config.json").read_text())
    cfg["base_model_name_or_path"] = _base_path(run)
    (dest / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    rebuilt.loaded.tokenizer.save_pretrained(str(dest))


def _base_path(run: TrainedRun) -> str:
    from fedslice.models.loading import resolve_model_path
    return resolve_model_path(run.cfg.model.name)


def _merged_model(rebuilt: Rebuilt) -> nn.Module:
    model = rebuilt.model
    if rebuilt.adapter is not None:
        model = model.merge_and_unload()
    return model


def _label_config(run: TrainedRun, config) -> None:
    names = run.info.get("label_names")
    if run.info["head"] in CLASSIFIER_HEADS and names:
        config.id2label = dict(enumerate(names))
        config.label2id = {n: i for i, n in enumerate(names)}


def _save_merged(run: TrainedRun, rebuilt: Rebuilt, dest: Path, spec,
                 elastic: ElasticExport | None) -> None:
    model = _merged_model(rebuilt)
    _label_config(run, model.config)
    if elastic is not None:
        elastic.save(model, rebuilt.loaded.arch, spec, dest, run.info["head"])
    else:
        model.save_pretrained(str(dest))
    rebuilt.loaded.tokenizer.save_pretrained(str(dest))


# --------------------------------------------------------------------------------------------
# Elastic sizes: the method's export hook
# --------------------------------------------------------------------------------------------

def elastic_export(run: TrainedRun) -> ElasticExport:
    """How the run's method exports one of its sizes (its registry entry's hook); a ConfigError
    naming the methods that have sizes when it has none."""
    hook = METHODS.get(run.cfg.method.name).elastic_export
    if hook is None:
        sized = [n for n in METHODS.names() if METHODS.get(n).elastic_export is not None]
        raise ConfigError(f"--size: method {run.cfg.method.name!r} has no elastic sizes (those of "
                          f"{', '.join(sized) or 'no registered method'}: sub-models of several "
                          "sizes); export the whole model without --size")
    return hook


__all__ = ["FORMATS", "INFERENCE", "Rebuilt", "TrainedRun", "export_run", "inference_info",
           "read_run", "trained_model"]
