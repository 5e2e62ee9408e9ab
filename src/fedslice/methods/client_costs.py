"""What a client's local training cost, as its reply's metrics report it: the analytic FLOPs
of its model (:func:`fedslice.measure.analytic_train_flops`, the adapter's share included) and
the typed cost record (:class:`fedslice.measure.ClientCost`). Functions of the method (its
architecture, dims and adapter); :class:`fedslice.methods.base.Method` delegates to them and a
stage adds its own corrections in its ``client_metrics``.
"""

from __future__ import annotations

from typing import Any

import torch.nn as nn

from fedslice import measure
from fedslice.fl.client import LocalResult
from fedslice.fl.strategy import Payload, State
from fedslice.measure import ClientCost


def adapter_flops(method, model: nn.Module, result: LocalResult) -> dict[str, float]:
    """The adapter's share of :func:`fedslice.measure.analytic_train_flops` for one client's
    local training (virtual tokens, prefix keys, its own operations:
    :meth:`fedslice.peft.Adapter.cost`)."""
    return method.adapter.cost(model).analytic_kwargs(result.tokens, result.examples, result.steps)

def analytic_train_flops(method, model: nn.Module, result: LocalResult, *,
                         num_layers: int | None = None,
                         embedding_backward: bool | None = None,
                         frozen: tuple[int, int] | None = None) -> dict[str, float]:
    """:func:`fedslice.measure.analytic_train_flops` of one client's local training on
    ``model``: its linears counted from the model, the output head at ``result``'s head
    positions, the adapter's share. ``num_layers`` defaults to the model's blocks (a sub-model
    may have fewer; an encoder-decoder counts both stacks), ``embedding_backward`` to whether
    the model trains its embeddings; the backward stops above :func:`frozen_bottom`'s blocks
    (``frozen``: its result, when the caller has it). Methods add their own corrections."""
    counts = measure.linear_param_counts(model)
    if num_layers is None:
        num_layers = sum(len(method.arch.blocks(model, k)) for k in range(len(method.arch.stacks)))
    if embedding_backward is None:
        embedding_backward = measure.embeddings_train(model)
    if frozen is None:
        frozen = (0, 0) if embedding_backward else frozen_bottom(method, model)
    return measure.analytic_train_flops(
        num_layers=num_layers, hidden=method.dims["hidden"], ffn=method.dims["ffn"],
        num_heads=method.dims["num_heads"], tokens=result.tokens,
        seq_len=result.attention_length or result.tokens / max(result.rows or result.examples, 1),
        trainable_linear_params=counts["trainable"], total_linear_params=counts["total"],
        embedding_backward=embedding_backward, examples=result.examples,
        head_positions=result.head_positions, head_linear_params=counts["head_total"],
        head_trainable_linear_params=counts["head_trainable"],
        frozen_layers=frozen[0], frozen_linear_params=frozen[1],
        # the lowest trained block's attention- and LoRA-A input-gradients autograd skips
        **({} if embedding_backward else measure.bottom_skips(model, method.arch, frozen[0])),
        **adapter_flops(method, model, result))

def frozen_bottom(method, model: nn.Module) -> tuple[int, int]:
    """:func:`fedslice.measure.frozen_bottom` of a one-stack ``model`` (the lowest blocks
    the backward never reaches, e.g. where head pruning left no trained head); ``(0, 0)``
    for an encoder-decoder (its stacks are not one chain from the bottom)."""
    if len(method.arch.stacks) != 1:
        return 0, 0
    return measure.frozen_bottom(model, list(method.arch.blocks(model)))


def client_cost_metrics(method, model: nn.Module, params: dict[str, nn.Parameter], payload: Payload,
                        arrays: State, result: LocalResult) -> dict[str, float]:
    analytic = analytic_train_flops(method, model, result)
    mb = measure.module_bytes(model) / 2**20
    frozen = {k: t for k, t in payload.arrays.items() if k not in params}
    cost = ClientCost(
        bytes_down=measure.tensor_bytes(payload.arrays) + measure.tensor_bytes(payload.model),
        bytes_up=measure.tensor_bytes(arrays),
        params_down=measure.num_params(payload.arrays) + measure.num_params(payload.model),
        params_up=measure.num_params(arrays),
        trainable_params=sum(p.numel() for p in params.values()),
        flops_measured=result.flops_measured, flops_analytic=analytic["total"],
        examples=result.examples, tokens=result.tokens, peak_rss_mb=result.peak_rss_mb,
        activation_mb=result.activation_mb, train_time_s=result.time_s,
        # what the client's device holds at its peak: the model it trains, saved activations,
        # gradients and AdamW state (deterministic; RSS deltas are not, see measure.py)
        model_mb=mb, memory_mb=mb + result.activation_mb, gpu_peak_mb=result.gpu_peak_mb,
        tokens_real=result.tokens_real)
    # of bytes_down: frozen tensors the server changed (FedEx-LoRA's and FLoRA's base weights)
    return {"loss": result.loss, "steps": result.steps, **cost.to_metrics(),
            "bytes_down_frozen": measure.tensor_bytes(frozen),
            # a plan's FLOPs budget: the local steps it cut (train_local)
            **({"steps_cut": result.steps_cut} if result.steps_cut is not None else {}),
            # a plan's memory budget: the local steps it ran as micro-batches
            **({"plan_downgrades": result.plan_downgrades}
               if result.plan_downgrades is not None else {})}


def sat_out_metrics(payload: Payload) -> dict[str, Any]:
    """The metrics of a client that sat the round out: no loss, no step, no cost."""
    cost = ClientCost(bytes_down=None, bytes_up=None, params_down=None, params_up=None,
                      trainable_params=None, train_time_s=None, peak_rss_mb=0.0, activation_mb=0.0)
    return {"loss": float("nan"), "steps": 0, **cost.to_metrics(), "sat_out": 1,
            "tier": payload.orders.tier}
