"""FLOPs of a client's local training: counted on one real step
(:class:`torch.utils.flop_counter.FlopCounterMode`, :func:`measure_step_flops`) and the analytic
estimate it is checked against (6·N·tokens plus the attention term, :func:`analytic_train_flops`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from fedslice.measure.sizes import model_device
from fedslice.models.arch import is_linear


# Head modules of sequence-classification models run once per example (on the pooled / first
# token), not once per token. Matched against the module's qualified name.
_HEAD_NAME_PARTS = ("pooler", "classifier", "score")


def _output_embeddings(model: nn.Module) -> nn.Module | None:
    """The LM head of ``model`` (HF or peft-wrapped), or None."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    get_out = getattr(base, "get_output_embeddings", None)
    return get_out() if callable(get_out) else None


def linear_param_counts(model: nn.Module) -> dict[str, int]:
    """Weight counts of the model's ``nn.Linear`` layers, for :func:`analytic_train_flops`.

    Returns ``{"total", "trainable", "head_total", "head_trainable"}``: ``total``/``trainable``
    are the per-token linear layers (the transformer body, including LoRA ``lora_A``/``lora_B``
    linears of a peft model); ``head_*`` are the linears of the classification head (module
    names containing ``pooler``, ``classifier`` or ``score``), which run once per example, and
    the LM head (the output embedding), which runs at the positions where a loss is taken.
    GPT-2's ``Conv1D`` counts as a linear layer.
    Biases are not counted (they cost no multiply-adds). The unused ``original_module`` copy that
    peft keeps for ``modules_to_save`` is skipped, and so is a prompt-learning ``prompt_encoder``
    (it runs on the virtual tokens once per step or per sequence: ``Adapter.cost`` counts it).
    """
    counts = {"total": 0, "trainable": 0, "head_total": 0, "head_trainable": 0}
    lm_head = _output_embeddings(model)
    for name, module in model.named_modules():
        if not is_linear(module):
            continue
        w = module._parameters.get("weight")  # a partly trained weight: its kept slice
        w = module.weight if w is None else w
        segments = name.split(".")
        if "original_module" in segments:
            continue  # peft modules_to_save keeps an unused copy of the original head
        if "prompt_encoder" in segments:
            continue  # P-tuning's MLP, prefix tuning's projection: not per token (the adapter's cost)
        is_head = module is lm_head or any(part in seg for seg in segments for part in _HEAD_NAME_PARTS)
        prefix = "head_" if is_head else ""
        frozen = getattr(module, "frozen", None)  # PartialLinear: the frozen slice runs forward too
        frozen = getattr(module, "_partial", {}).get("weight", (frozen,))[0]  # partial_parameters
        counts[prefix + "total"] += w.numel() + (frozen.numel() if isinstance(frozen, torch.Tensor) else 0)
        if w.requires_grad:
            counts[prefix + "trainable"] += w.numel()
    return counts


def _kv_heads_as_query(query_shape, key_shape, value_shape) -> tuple:
    """Grouped-query attention's key/value shapes ``(B, H_kv, S, D)`` with the query's ``H`` heads:
    the kernel broadcasts each key/value head over its group, so it runs the products of ``H``
    heads (how torch 2.13 counts them; earlier versions refuse H != H_kv)."""
    h = query_shape[1]
    return query_shape, (*key_shape[:1], h, *key_shape[2:]), (*value_shape[:1], h, *value_shape[2:])


def _attention_flop_mapping() -> dict[Any, Any]:
    """FLOP formulas for the attention kernels, where torch's counter does not know them or
    refuses grouped-query attention (torch before 2.13 on the fused CUDA kernels).

    On CPU, ``scaled_dot_product_attention`` dispatches to
    ``aten._scaled_dot_product_flash_attention_for_cpu``, which :class:`FlopCounterMode` does not
    count (it counts the CUDA kernels). We count it the same way torch counts the CUDA flash
    kernel: 2 matmuls forward, 5 backward (the scores are recomputed). Every fused SDPA kernel is
    counted with the key/value heads broadcast to the query's (:func:`_kv_heads_as_query`).
    """
    from torch.utils import flop_counter as fc

    def _fwd(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_flop_count(*_kv_heads_as_query(query_shape, key_shape, value_shape))

    def _bwd(grad_out_shape, query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        return fc.sdpa_backward_flop_count(grad_out_shape,
                                           *_kv_heads_as_query(query_shape, key_shape, value_shape))

    aten = torch.ops.aten
    mapping: dict[Any, Any] = {}
    for kernel in ("flash_attention_for_cpu", "flash_attention", "efficient_attention", "cudnn_attention"):
        for name, formula in ((f"_scaled_dot_product_{kernel}", _fwd),
                              (f"_scaled_dot_product_{kernel}_backward", _bwd)):
            op = getattr(aten, name, None)
            if op is not None:
                mapping[op] = formula
    return mapping


def _flop_mapping() -> dict[Any, Any]:
    """The formulas the counters add to torch's: the attention kernels'
    (:func:`_attention_flop_mapping`) and oneDNN's linear kernel, which a CPU client's frozen
    linear layers run on (:func:`fedslice.onednn.flop_mapping`)."""
    from fedslice.onednn import flop_mapping

    return {**_attention_flop_mapping(), **flop_mapping()}


def _is_attention_op(op: Any) -> bool:
    """Whether a counted op is attention's (the scores and the weighted sum: batched matmuls and
    the fused attention kernels), whose FLOPs grow with the square of a row's length, where
    the linear layers' grow with its tokens."""
    name = str(op)
    return name in ("aten.bmm", "aten.baddbmm") or "attention" in name


def head_segments(model: nn.Module) -> tuple[str, ...]:
    """Name parts of the modules of ``model`` that run at the head positions, not at every
    token: the classification head (``pooler``, ``classifier``, ``score``) and the LM head (the
    output embedding's attribute name, e.g. ``lm_head``)."""
    parts = list(_HEAD_NAME_PARTS)
    lm_head = _output_embeddings(model)
    if lm_head is not None:
        for name, module in model.named_modules():
            if module is lm_head and name:
                parts.append(name.split(".")[-1])
                break
    return tuple(parts)


class FlopCount:
    """Result holder of :func:`count_flops`: ``total`` FLOPs (0 when counting was disabled), and
    of them ``attention`` (:func:`_is_attention_op`) and ``head`` (the ops counted in the modules
    whose name has one of ``head`` parts, :func:`head_segments`; 0 when none were given)."""

    __slots__ = ("total", "enabled", "attention", "head")

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.total = 0
        self.attention = 0
        self.head = 0

    def __repr__(self) -> str:
        return (f"FlopCount(total={self.total}, attention={self.attention}, head={self.head}, "
                f"enabled={self.enabled})")


def _split_counts(counts: dict[str, dict[Any, int]], head: Sequence[str]) -> tuple[int, int]:
    """``(attention, head)`` FLOPs of a counter's per-module counts (module paths below the
    root's class name; ``"Global"``: every op). A head module's ops (forward and backward, as
    torch's module tracker attributes them) are counted once, at the outermost module whose
    last name part is a head part; attention excludes them."""
    attention = sum(n for op, n in counts.get("Global", {}).items() if _is_attention_op(op))
    head_total = head_attention = 0
    if head:
        def is_head(segment: str) -> bool:
            return any(part in segment for part in head)

        for path, ops in counts.items():
            if path == "Global":
                continue
            segments = path.split(".")[1:]
            if segments and is_head(segments[-1]) and not any(is_head(s) for s in segments[:-1]):
                head_total += sum(ops.values())
                head_attention += sum(n for op, n in ops.items() if _is_attention_op(op))
    return attention - head_attention, head_total


_OP_COUNTER: type | None = None


def _op_counter():
    """A dispatch mode that counts what :class:`FlopCounterMode` counts (its formulas and ours,
    per op; an op it would decompose, decomposed the same way), without its module tracker,
    which hooks every module's forward and backward: its Python work per module and per op cost
    a quarter of a CPU step and about a second per client on a GPU. Used where no count by
    module is asked for; the totals are the same (``tests/test_costs.py``). The class and its
    formulas are made once per process (torch's dispatch-mode module loads on first use)."""
    global _OP_COUNTER
    if _OP_COUNTER is None:
        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils.flop_counter import FlopCounterMode

        registry = dict(FlopCounterMode(display=False, custom_mapping=_flop_mapping()).flop_registry)
        composite = torch._C.DispatchKey.CompositeImplicitAutograd

        class OpCounter(TorchDispatchMode):
            def __init__(self) -> None:
                super().__init__()
                self.by_op: dict[Any, int] = {}

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                packet = func._overloadpacket
                formula = registry.get(packet)
                if formula is None:
                    if torch._C._dispatch_has_kernel_for_dispatch_key(func.name(), composite):
                        with self:  # as FlopCounterMode: count what the op decomposes into
                            out = func.decompose(*args, **kwargs)
                        if out is not NotImplemented:
                            return out
                    return func(*args, **kwargs)
                out = func(*args, **kwargs)
                self.by_op[packet] = self.by_op.get(packet, 0) + int(formula(*args, **kwargs, out_val=out))
                return out

            def total(self) -> int:
                return int(sum(self.by_op.values()))

        _OP_COUNTER = OpCounter
    return _OP_COUNTER()


@contextlib.contextmanager
def count_flops(enabled: bool = True, head: Sequence[str] = ()) -> Iterator[FlopCount]:
    """Count the FLOPs of the code in the block::

        with count_flops(enabled=step == 0) as fc:
            model(**batch).loss.backward()
        fc.total

    Same counter as :func:`measure_step_flops` (including the CPU attention kernels) but around
    the caller's own code, so the real training step is measured without running it twice.
    ``fc.total`` is set when the block ends; with ``enabled=False`` nothing is counted (no
    overhead) and ``fc.total`` stays 0. ``fc.attention`` and ``fc.head`` split the total
    (``head``: the head modules' name parts, :func:`head_segments`), for an extrapolation to
    other batch shapes that scales each part by what it grows with (``fl.client.train_local``).
    """
    result = FlopCount(enabled)
    if not enabled:
        yield result
        return
    if not head:  # no count by module: the lean counter
        ops = _op_counter()
        try:
            with ops:
                yield result
        finally:
            result.total = ops.total()
            result.attention = int(sum(n for op, n in ops.by_op.items() if _is_attention_op(op)))
        return
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False, custom_mapping=_flop_mapping())
    try:
        with counter:
            yield result
    finally:
        result.total = int(counter.get_total_flops())
        result.attention, result.head = _split_counts(counter.get_flop_counts(), head)


def measure_step_flops(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> int:
    """FLOPs of one training step (forward, loss, backward) of ``model`` on ``batch``.

    ``model(**batch)`` must return an object with ``.loss`` (HF models do when ``labels`` is in the
    batch; a peft model works too). Counted with :class:`torch.utils.flop_counter.FlopCounterMode`:
    matrix multiplications, convolutions and attention kernels (a multiply-add is 2 FLOPs);
    element-wise ops, softmax, layer norms and the optimizer step are not counted. Only the
    gradients autograd actually computes are counted, so frozen weights cost no weight-gradient.

    The measurement does not alter training: existing ``.grad`` values are restored (parameters
    without a gradient before have ``grad is None`` after), the CPU/CUDA random state is restored
    (dropout draws), and the train/eval mode is left as it was. Tensors in ``batch`` are moved to
    the model's device.
    """
    device = model_device(model)
    inputs = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in batch.items()}
    params = list(model.parameters())
    saved_grads = [p.grad for p in params]
    for p in params:
        p.grad = None
    cuda_devices = [device] if device.type == "cuda" else []
    try:
        with torch.random.fork_rng(devices=cuda_devices), torch.enable_grad():
            with count_flops() as fc:
                out = model(**inputs)
                loss = out.loss if hasattr(out, "loss") else out["loss"]
                if loss is None:
                    raise ValueError("measure_step_flops: model(**batch) returned no loss; put 'labels' in the batch")
                loss.backward()
            flops = fc.total
    finally:
        model.zero_grad(set_to_none=True)
        for p, g in zip(params, saved_grads):
            p.grad = g
    return flops


def embeddings_train(model: nn.Module) -> bool:
    """Whether ``model``'s input embeddings train (full fine-tuning): autograd then computes the
    gradient of the first layer's input (``analytic_train_flops(embedding_backward=...)``)."""
    try:
        return any(p.requires_grad for p in model.get_input_embeddings().parameters())
    except (AttributeError, NotImplementedError):
        return False


def frozen_bottom(model: nn.Module, blocks: Sequence[nn.Module]) -> tuple[int, int]:
    """``(L_f, N_f)``: the number of lowest ``blocks`` (one stack, bottom first) that hold no
    trainable tensor, and their linear weights (:func:`linear_param_counts`), when nothing below
    or beside them trains either (frozen embeddings; outside the blocks only the output head:
    the LM head or a ``pooler``/``classifier``/``score`` module). Autograd's backward then stops
    above them (:func:`analytic_train_flops` ``frozen_layers``); otherwise ``(0, 0)``."""
    if embeddings_train(model):
        return 0, 0
    inside = {id(p) for b in blocks for p in b.parameters()}
    lm_head = _output_embeddings(model)
    head = {id(p) for p in lm_head.parameters()} if lm_head is not None else set()
    for name, p in model.named_parameters():
        if not p.requires_grad or not p.numel() or id(p) in inside or id(p) in head:
            continue
        if not any(part in seg for seg in name.split(".") for part in _HEAD_NAME_PARTS):
            return 0, 0  # a prompt, a prefix, a trained norm below the head: no early stop
    frozen = 0
    for block in blocks:
        if any(p.requires_grad and p.numel() for p in block.parameters()):
            break
        frozen += 1
    return frozen, sum(linear_param_counts(b)["total"] for b in blocks[:frozen])


def _decomposed_attention(model: nn.Module) -> bool:
    """Whether ``model``'s attention trains as separate matmuls, whose gradients autograd takes
    one by one (eager attention; torch's CPU sdpa under attention dropout, its math path): a
    fused kernel (CPU sdpa without dropout, CUDA) computes every input-gradient anyway."""
    from fedslice.data.packing import attention_dropout

    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    config = getattr(base, "config", None)
    if config is None:
        return False
    if getattr(config, "_attn_implementation", None) == "eager":
        return True
    return bool(attention_dropout(config)) and all(p.device.type == "cpu" for p in base.parameters())


def _trains(module: nn.Module) -> bool:
    return any(p.requires_grad and p.numel() for p in module.parameters())


def bottom_skips(model: nn.Module, arch, frozen_layers: int = 0) -> dict[str, float]:
    """What autograd leaves out in the lowest trained block of a one-stack ``model`` (block
    ``frozen_layers``) when no gradient is needed at its input (frozen embeddings), beyond the
    q/k/v input-gradients :func:`analytic_train_flops` already subtracts, as its keyword
    arguments:

    * ``bottom_attention_skipped``: the attention width of the attention-gradient matmuls it
      does not run (each ``2·s·width·T`` FLOPs): the keys' gradient when k trains nothing (LoRA
      on q and v), the queries' when q trains nothing, the probabilities' when neither does,
      the values' when v trains nothing. Only where attention runs as separate matmuls
      (:func:`_decomposed_attention`); not for a fused q/k/v projection.
    * ``bottom_adapter_input_params``: the weights of the LoRA A matrices of the block's q/k/v,
      whose input is the block's input too (their input-gradient is not computed either).

    Empty for an encoder-decoder, a model whose embeddings train, or no trained block."""
    if len(arch.stacks) != 1 or embeddings_train(model):
        return {}
    from fedslice.models.arch import module_at

    blocks = arch.blocks(model)
    if frozen_layers >= len(blocks):
        return {}
    att = arch.stacks[0].attention[0]
    block = blocks[frozen_layers]
    mods = {part: module_at(block, getattr(att, part)) for part in ("q", "k", "v")}
    adapter = 0
    for m in {id(m): m for m in mods.values()}.values():
        for name, sub in m.named_modules():
            if name.split(".")[0] == "lora_A" and is_linear(sub):
                adapter += sub.weight.numel()
    out: dict[str, float] = {"bottom_adapter_input_params": adapter}
    if att.fused_qkv or not _decomposed_attention(model):
        return out
    q = mods["q"]
    q = getattr(q, "base_layer", q)
    width = getattr(q, "out_features", None) or q.weight.shape[0]
    tq, tk, tv = (_trains(mods[p]) for p in ("q", "k", "v"))
    out["bottom_attention_skipped"] = float(width) * ((not tq) + (not tk) + (not tq and not tk) + (not tv))
    return out


def analytic_train_flops(
    *,
    num_layers: int,
    hidden: int,
    ffn: int,
    num_heads: int,
    tokens: int,
    seq_len: float,
    trainable_linear_params: int,
    total_linear_params: int,
    embedding_backward: bool = False,
    examples: int = 0,
    head_positions: int | None = None,
    head_linear_params: int = 0,
    head_trainable_linear_params: int = 0,
    virtual_tokens: int = 0,
    prefix_keys: int = 0,
    adapter_flops: float = 0.0,
    frozen_layers: int = 0,
    frozen_linear_params: int = 0,
    bottom_attention_skipped: float = 0.0,
    bottom_adapter_input_params: int = 0,
) -> dict[str, float]:
    """Analytic FLOPs of training on ``tokens`` tokens (forward + backward; optimizer excluded).

    A multiply-add is 2 FLOPs. With ``N`` = ``total_linear_params`` (weights of the per-token
    linear layers), ``N_t`` = ``trainable_linear_params``, ``L`` = ``num_layers``,
    ``d`` = ``hidden``, ``s`` = ``seq_len`` (mean sequence length) and ``T`` = ``tokens``:

    * forward  = 2·N·T  +  4·L·s·d·T  — the matmuls, plus the attention scores QKᵀ and the
      weighted sum AV (2·s·d multiply-adds per token and layer; PaLM, Chowdhery et al. 2022,
      appendix B: 6·N + 12·L·d·s FLOPs per token for training, of which 4·L·d·s forward);
    * backward = input-gradients + weight-gradients, where input-gradients ≈ forward
      (2·N·T for the linears, and 8·L·s·d·T for attention, since both operands of QKᵀ and AV are
      activations) and weight-gradients = 2·N_t·T (frozen weights need none).

    Full fine-tuning (``N_t = N``) gives the familiar ≈ 6·N·tokens (Kaplan et al. 2020) plus
    12·L·s·d·T; LoRA with a frozen backbone (``N_t`` ≈ 0) gives ≈ 4·N·tokens plus the attention
    term. If ``embedding_backward`` is false (the embeddings are frozen), autograd does not
    compute the gradient w.r.t. the embedding output, so the input-gradients of the first
    layer's Q/K/V projections (3·d² weights) are subtracted.

    ``ffn`` and ``num_heads`` describe the model but do not change the count (``N`` already
    includes the FFN, and attention FLOPs do not depend on the number of heads). The
    output head (``head_linear_params``, ``head_trainable_linear_params``) runs at
    ``head_positions`` positions: once per example for a classifier (the default,
    ``examples``), at every target token for a language-model head (generation computes the
    logits only there).

    An adapter adds (:class:`fedslice.peft.AdapterCost`): ``virtual_tokens`` positions per
    example that the whole model runs on (prompt tuning, P-tuning: ``T + P·examples`` tokens of
    length ``s + P``; the gradient reaches the input, so the first layer's input-gradients are
    computed), ``prefix_keys`` keys every self-attention reads at each query (prefix tuning:
    the attention term at ``s + P`` keys), and ``adapter_flops`` of its own operations (IA3's
    scaling, P-tuning's encoder, DoRA's norms), counted in the backward half as a whole.

    ``frozen_layers`` lowest blocks with nothing trainable in or below them (their
    ``frozen_linear_params`` linear weights, part of ``N``): autograd's backward stops above
    them, so their input-gradients (linears and attention) are not computed, and the skipped
    q/k/v input-gradient is the lowest trained block's. Only with frozen embeddings and no
    virtual tokens or prefix keys (those need the gradient at the bottom).

    With frozen embeddings and no virtual tokens or prefix keys, autograd also skips in the
    lowest trained block the attention-gradient matmuls of ``bottom_attention_skipped`` width
    (``2·s·width·T`` FLOPs each: the keys' gradient under LoRA on q and v) and the
    input-gradients of ``bottom_adapter_input_params`` adapter weights that read the block's
    input (its LoRA A matrices): :func:`bottom_skips`.

    Returns ``{"forward", "backward", "total"}`` in FLOPs (floats).
    """
    del ffn, num_heads  # documented: they do not enter the count
    T = float(tokens) + float(virtual_tokens) * examples
    seq_len = float(seq_len) + virtual_tokens + prefix_keys
    embedding_backward = embedding_backward or virtual_tokens > 0
    if frozen_layers and (embedding_backward or prefix_keys or not 0 < frozen_layers <= num_layers):
        raise ValueError(f"frozen_layers={frozen_layers} of {num_layers}: the backward reaches the "
                         "bottom (trained embeddings, virtual tokens or prefix keys), or out of range")
    heads = float(examples if head_positions is None else head_positions)
    attn_fwd = 4.0 * num_layers * float(seq_len) * hidden * T
    forward = 2.0 * total_linear_params * T + attn_fwd + 2.0 * head_linear_params * heads
    input_grads = 2.0 * total_linear_params * T + 2.0 * attn_fwd + 2.0 * head_linear_params * heads
    if frozen_layers:  # (L_f of L blocks, their weights): no backward below the lowest trained block
        input_grads -= 2.0 * frozen_linear_params * T + 2.0 * attn_fwd * frozen_layers / num_layers
    if not embedding_backward and frozen_layers < num_layers:
        input_grads -= 2.0 * (3 * hidden * hidden) * T
        if not prefix_keys:
            input_grads -= 2.0 * seq_len * T * bottom_attention_skipped \
                + 2.0 * bottom_adapter_input_params * T
    weight_grads = 2.0 * trainable_linear_params * T + 2.0 * head_trainable_linear_params * heads
    backward = input_grads + weight_grads + adapter_flops
    return {"forward": forward, "backward": backward, "total": forward + backward}
