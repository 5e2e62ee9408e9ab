"""HF model loading and the per-architecture table of where attention and FFN weights live."""

from fedslice.models.arch import ARCHITECTURES, ArchSpec, arch_for
from fedslice.models.loading import LoadedModel, load_model, resolve_model_path

__all__ = ["ARCHITECTURES", "ArchSpec", "arch_for", "LoadedModel", "load_model", "resolve_model_path"]
