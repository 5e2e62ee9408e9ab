"""``federation.upload_dtype``: the precision a client's trained tensors travel to the server in.

A client trains in fp32 and, with ``"fp16"``, sends its reply's floating tensors as IEEE half
floats: half the upload bytes, each value rounded to 11 significant bits (a relative error of at
most 2^-11 = 4.9e-4 of the value). The server turns them back into fp32 before it checks or
aggregates anything, so validation, aggregation rules, server optimizers and checkpoints see
fp32 state as always; the global state and what the server sends down stay fp32.

The rounding is of the values the client sends, not of its change this round: the state the
server keeps is fp32, so rounding errors do not compound over rounds (each round's values are
rounded once). A value beyond fp16's range (65,504) becomes infinite and the reply is rejected
as non-finite. Non-floating tensors (masks, counts) travel as they are.

A planned client may be given its own (``budgets.upload_dtypes``: the planner sends a reply in
half precision where the fp32 one does not fit the client's upload or round time): its payload's
orders say so (``Orders.upload_dtype``), and both ends read the dtype through
:func:`upload_dtype_of`.

The simulation and Flower go through the same two functions: :func:`to_wire` where a reply
leaves its client (the Flower ClientApp; the simulation's round driver), :func:`from_wire` where
it reaches the server (the ServerApp's decoding; the round driver, before faults and
validation). Bytes sent up (``bytes_up``) count what travels; the planner predicts with
:func:`wire_bytes`.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedslice.fl.orders import Orders, OrdersLike
from fedslice.fl.strategy import Reply, State
from fedslice.measure.sizes import tensor_bytes

#: ``federation.upload_dtype`` -> the dtype floating tensors travel in
WIRE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "fp16": torch.float16}


def wire_dtype(name: str) -> torch.dtype:
    """The torch dtype of ``federation.upload_dtype = name`` (ValueError naming the choices)."""
    if name not in WIRE_DTYPES:
        raise ValueError(f"upload dtype {name!r}: choose one of {sorted(WIRE_DTYPES)}")
    return WIRE_DTYPES[name]


def upload_dtype_of(orders: OrdersLike, run: str) -> str:
    """The upload dtype of a reply to a payload with ``orders`` (a payload's config, or its
    record): its plan's, else the run's (``federation.upload_dtype``)."""
    return Orders.of(orders).upload_dtype or run


def _on_wire(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t


def wire_bytes(tensors: Mapping[str, torch.Tensor], name: str) -> int:
    """Bytes ``tensors`` take on the wire at ``upload_dtype = name`` (floating ones in its dtype)."""
    dtype = wire_dtype(name)
    size = torch.tensor([], dtype=dtype).element_size()
    return int(sum(t.numel() * (size if t.is_floating_point() else t.element_size())
                   for t in tensors.values()))


def to_wire(reply: Reply, name: str) -> Reply:
    """``reply`` as its client sends it: floating tensors cast to the upload dtype, and its
    ``bytes_up`` metric lowered by the bytes the cast saves. fp32: the reply itself."""
    dtype = wire_dtype(name)
    if dtype == torch.float32 or not isinstance(reply, Reply):
        return reply
    arrays = {k: _on_wire(t, dtype) for k, t in reply.arrays.items()}
    metrics = dict(reply.metrics)
    if isinstance(metrics.get("bytes_up"), (int, float)):  # less what the cast saves
        metrics["bytes_up"] -= tensor_bytes(reply.arrays) - wire_bytes(reply.arrays, name)
    return Reply(arrays=arrays, num_examples=reply.num_examples, metrics=metrics)


def from_wire(arrays: State, name: str) -> State:
    """A reply's tensors as the server uses them: those in the upload dtype back in fp32.
    Tensors of any other dtype are left as they are (the strategy's checks judge them: an fp32
    tensor is accepted, a float64 one rejected)."""
    dtype = wire_dtype(name)
    if dtype == torch.float32:
        return arrays
    return {k: t.float() if t.dtype == dtype else t for k, t in arrays.items()}


def received(reply: Reply, name: str) -> Reply:
    """:func:`from_wire` of a whole reply (its metrics and example count unchanged)."""
    arrays = from_wire(reply.arrays, name)
    if arrays is reply.arrays:
        return reply
    return Reply(arrays=arrays, num_examples=reply.num_examples, metrics=reply.metrics)
