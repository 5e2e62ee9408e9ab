"""FedPFT's proxy: which FFN neurons it keeps (salience), its slice spec, and building it. See
:mod:`fedslice.methods.fedpft`.
"""

from __future__ import annotations
import torch
import torch.nn as nn
from fedslice.errors import ConfigError
from fedslice.models.arch import ArchSpec
from fedslice.slicing.spec import ModelSlice, SliceSpec
from fedslice.slicing.surgery import extract_model


def compressed_layers(whole_layers: list[int], num_layers: int) -> list[int]:
    """The layers to compress: every layer not in ``whole_layers`` (negative = from the end)."""
    whole = set()
    for i in whole_layers:
        j = i + num_layers if i < 0 else i
        if not 0 <= j < num_layers:
            raise ConfigError(f"method.whole_layers: layer {i} is out of range for a "
                              f"{num_layers}-layer model (use 0..{num_layers - 1} or "
                              f"-{num_layers}..-1)")
        whole.add(j)
    return [l for l in range(num_layers) if l not in whole]


def kept_count(keep_ratio: float, ffn: int) -> int:
    """Neurons kept per compressed layer: round(keep_ratio * F), at least 1."""
    if not 0 < keep_ratio <= 1:
        raise ConfigError(f"method.keep_ratio must be in (0, 1], got {keep_ratio}")
    return min(ffn, max(1, round(keep_ratio * ffn)))


def top_neurons(saliency: torch.Tensor, k: int) -> tuple[int, ...]:
    """Indices of the ``k`` most salient neurons (stable on ties), in their original order."""
    order = torch.argsort(saliency, descending=True, stable=True)[:k]
    return tuple(sorted(order.tolist()))


def proxy_spec(neuron_saliency: list[torch.Tensor] | None, dims: dict[str, int], keep_ratio: float,
               layers: list[int]) -> SliceSpec:
    """All layers and heads; in ``layers`` the top ``keep_ratio`` neurons by saliency (without
    saliencies, the leading ones: the proxy's shape, as a client builds it)."""
    F, L = dims["ffn"], dims["num_layers"]
    k = kept_count(keep_ratio, F)

    def kept(l: int) -> tuple[int, ...]:
        if l not in layers:
            return tuple(range(F))
        return tuple(range(k)) if neuron_saliency is None else top_neurons(neuron_saliency[l], k)
    neurons = tuple(kept(l) for l in range(L))
    heads = tuple(tuple(range(dims["num_heads"])) for _ in range(L))
    return SliceSpec(tuple(range(L)), heads, neurons, L, dims["num_heads"], dims["head_dim"], F)


def proxy_slice(saliency: list[list[torch.Tensor] | None], all_dims: list[dict[str, int]], keep_ratio: float,
                whole_layers: list[int]) -> ModelSlice:
    """One :func:`proxy_spec` per stack: every stack keeps ``whole_layers`` (its own layer
    numbers: by default its first and last layer) whole and compresses the others.
    ``saliency[k][l]``: (F,) neuron saliency of layer l of stack k."""
    return ModelSlice(tuple(proxy_spec(sal, d, keep_ratio, compressed_layers(whole_layers, d["num_layers"]))
                            for sal, d in zip(saliency, all_dims)))


def global_layer(offsets: tuple[int, ...], stack: int, layer: int) -> int:
    """The global index of a block (stacks in table order: see ``block_units``)."""
    return offsets[stack] + layer


def stack_offsets(spec: ModelSlice) -> tuple[int, ...]:
    """Global index of each stack's first block."""
    sizes = [s.num_layers for s in spec.stacks]
    return tuple(sum(sizes[:k]) for k in range(len(sizes)))


def compressed_units(spec: ModelSlice) -> dict[int, tuple[int, int]]:
    """Global layer -> (stack, layer) of every layer whose FFN the proxy compresses."""
    offsets = stack_offsets(spec)
    return {global_layer(offsets, k, l): (k, l) for k, s in enumerate(spec.stacks)
            for j, l in enumerate(s.layers) if not s.is_identity(j, "ffn")}


def build_proxy(model: nn.Module, spec: ModelSlice, arch: ArchSpec) -> nn.Module:
    """The proxy of ``model``: shares everything but the sliced FFNs, whose ``b2`` is unshared
    too (so distilling the proxy never changes the full model)."""
    proxy = extract_model(model, spec, arch)
    for k, l in compressed_units(spec).values():
        out = arch.ffn_part(proxy, k, l, "ffn_out")
        if out.bias is not None:
            out.bias = nn.Parameter(out.bias.detach().clone(), requires_grad=False)
    return proxy


def ffn_modules(model: nn.Module, arch: ArchSpec, stack: int, layer: int) -> list[nn.Module]:
    """The gate (if any), ``ffn_in`` and ``ffn_out`` modules of one block."""
    parts = [arch.ffn_part(model, stack, layer, p) for p in ("gate", "ffn_in", "ffn_out")]
    return [m for m in parts if m is not None]


def ffn_weights(model: nn.Module, arch: ArchSpec, units: dict[int, tuple[int, int]]) -> dict[int, list[tuple[torch.Tensor, torch.Tensor]]]:
    """global layer -> [(W_in (F, d), W_out (d, F))] per input matrix (gate first, then ffn_in),
    the live parameters (views keep their gradient)."""
    out, linear = {}, arch.layout.as_linear
    for g, (k, l) in units.items():
        w_out = linear(arch.ffn_part(model, k, l, "ffn_out").weight)  # (d, F)
        ins = [arch.ffn_part(model, k, l, p) for p in ("gate", "ffn_in")]
        out[g] = [(linear(m.weight), w_out) for m in ins if m is not None]  # (F, d), (d, F)
    return out
