"""Tasks: what a model learns from the data, independent of the federated method.

``make_task(cfg, arch)`` picks the task and the model head it needs from ``[task]`` and the
architecture table:

============================  ======================  ==========================================
``task``                      model                   task (head)
============================  ======================  ==========================================
classification                encoder / decoder /     :class:`Classification` (sequence-
                              BART                    classification head)
classification + label_words  decoder / enc-decoder   :class:`LabelWordClassification` (LM head)
generation                    decoder / enc-decoder   :class:`Generation` (LM head)
chat                          decoder                 :class:`Chat` (LM head, chat template)
preference                    decoder                 :class:`Preference` (LM head; DPO against
                                                      the frozen base)
image_classification          image backbone (vit,    :class:`ImageClassification` (image-
                              deit, dinov2)           classification head)
============================  ======================  ==========================================

A text task on an image backbone, or an image task on a text model, is a ConfigError naming both.
"""

from __future__ import annotations

from fedslice.config import ExperimentConfig
from fedslice.errors import ConfigError
from fedslice.models.arch import ArchSpec
from fedslice.tasks.base import Task, batch_examples, batch_tokens
from fedslice.tasks.chat import Chat
from fedslice.tasks.classification import Classification, evaluate_classifier
from fedslice.tasks.generation import Generation, check_partition
from fedslice.tasks.image import ImageClassification
from fedslice.tasks.label_words import LabelWordClassification
from fedslice.tasks.preference import Preference


def make_task(cfg: ExperimentConfig, arch: ArchSpec) -> Task:
    t = cfg.task
    if cfg.data.partition == "natural" and t.kind not in ("chat", "generation"):
        raise ConfigError(f"data.partition = 'natural' is implemented for task.kind = 'chat' and "
                          f"'generation', not {t.kind!r}: use 'iid', 'dirichlet' or 'shards'")
    image_task = t.kind == "image_classification"
    if image_task != (arch.inputs == "image"):
        reads = "images" if arch.inputs == "image" else "text"
        wants = "images" if image_task else "text"
        fix = "task.kind = 'image_classification'" if arch.inputs == "image" else \
            "an image backbone (vit, deit, dinov2)"
        raise ConfigError(f"task.kind = {t.kind!r} reads {wants}, but model.name {cfg.model.name!r} "
                          f"is a {arch.model_type} model that reads {reads}: use {fix}")
    if image_task:
        return ImageClassification(cfg, arch, "image_classification")
    if t.kind == "classification" and t.label_words is None:
        if "sequence_classification" not in arch.heads:
            raise ConfigError(f"task: a {arch.model_type} model classifies text-to-text here: set "
                              "task.label_words (e.g. {0 = 'negative', 1 = 'positive'})")
        return Classification(cfg, arch, "sequence_classification")
    if arch.lm_head is None:
        what = "task.label_words" if t.kind == "classification" else f"task.kind = {t.kind!r}"
        raise ConfigError(f"{what} needs a generative model (decoder or encoder-decoder); "
                          f"{cfg.model.name!r} is a {arch.model_type} encoder")
    if t.kind == "generation":
        check_partition(cfg)
        return Generation(cfg, arch, arch.lm_head)
    if t.kind == "chat":
        if arch.lm_head != "causal_lm":
            raise ConfigError(f"task.kind = 'chat' trains a decoder on rendered conversations; "
                              f"{cfg.model.name!r} is a {arch.model_type} encoder-decoder")
        check_partition(cfg)
        return Chat(cfg, arch, arch.lm_head)
    if t.kind == "preference":
        check_partition(cfg)
        return Preference(cfg, arch, arch.lm_head)
    return LabelWordClassification(cfg, arch, arch.lm_head)


__all__ = ["Chat", "Classification", "Generation", "ImageClassification", "LabelWordClassification",
           "Preference", "Task",
           "batch_examples",
           "batch_tokens", "evaluate_classifier", "make_task"]
