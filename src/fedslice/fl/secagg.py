"""Secure aggregation (SecAgg, Bell et al. 2020) as pure functions over Flower's own primitives.

Every cryptographic step is Flower's (``flwr.common.secure_aggregation``, the functions its
``secaggplus_mod`` and ``SecAggPlusWorkflow`` call): ECDH key pairs and HKDF shared keys, Fernet
encryption of the key shares, Shamir secret sharing, the seeded mask generator, stochastic
quantization. Nothing here is cryptography of our own; this module only arranges those calls so
that the in-process engine (:class:`fedslice.fl.rules.secagg.SecureAggregation`) and the Flower
ServerApp/ClientApp drive the same protocol, stage by stage:

0. ``setup``: each client draws two key pairs (pk1 for masks, pk2 for encrypting shares);
1. ``share_keys``: given every client's public keys, a client draws its private-mask seed ``b``
   and sends each other client, encrypted under their pk2 shared key, a Shamir share of ``b``
   and of its sk1 (threshold ``t``);
2. ``mask``: a client quantizes its vector and adds its private mask (from ``b``) and, for
   every other client of the round, the pairwise mask from their sk1/pk1 shared key, with the
   sign of the id order: the pairwise masks cancel in the sum;
3. ``unmask_shares`` / ``unmask``: the clients whose masked vectors arrived are *active*, the
   others *dead*; each surviving client reveals its shares of the active clients' ``b`` and of
   the dead clients' sk1 (never both of one client); with ``t`` shares of each the server removes
   the active clients' private masks and the dead clients' pairwise masks, and holds the sum of
   the active clients' quantized vectors and nothing else.

Here every client is every other's neighbour (SecAgg; SecAgg+ would share with a random
subset). What a client's vector holds (its weighted update and weights in full shape) is
:func:`encode`'s; the server reads the sums with :func:`decode`.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from flwr.common.secure_aggregation.crypto.shamir import combine_shares, create_shares
from flwr.common.secure_aggregation.crypto.symmetric_encryption import (decrypt, encrypt,
                                                                         generate_shared_key)
from flwr.common.secure_aggregation.ndarrays_arithmetic import (parameters_addition,
                                                                parameters_mod,
                                                                parameters_subtraction)
from flwr.common.secure_aggregation.quantization import dequantize, quantize
from flwr.common.secure_aggregation.secaggplus_utils import (pseudo_rand_gen,
                                                             share_keys_plaintext_concat,
                                                             share_keys_plaintext_separate)
from flwr.supercore.primitives.asymmetric import (bytes_to_private_key, bytes_to_public_key,
                                                  generate_key_pairs, private_key_to_bytes,
                                                  public_key_to_bytes)

if TYPE_CHECKING:  # torch is imported by the functions on tensors only: a node answering the
    import torch   # key stages (a fresh ClientApp process per message on Flower) never loads it

Vector = list[np.ndarray]

#: Flower's SecAggPlusWorkflow defaults: values quantized to [0, 2^22], sums taken mod 2^32, so
#: up to 2^32 / 2^22 = 1024 clients' vectors add without wrapping
TARGET_RANGE = 2**22
MOD_RANGE = 2**32
MAX_CLIENTS = MOD_RANGE // TARGET_RANGE
#: the most levels a round uses (Flower's quantizer rounds to int32)
MAX_TARGET_RANGE = 2**30


def target_range(n: int, mod_range: int = MOD_RANGE) -> int:
    """The quantization levels of a round of ``n`` clients: the largest power of two ``L`` (at
    most 2^30) whose sum over ``n`` vectors cannot wrap, ``n L < mod_range``. A power of two
    (even) so that 0 lands exactly on a level (``c`` times ``L / 2c``): an element nobody of
    the round weighs decodes to exactly 0, never to one step of noise that the division by the
    summed weight would blow up. A fixed 2^22 (Flower's default, made for 1024 clients) would
    waste the field on small rounds: a weight far below its bound W (heads' importance of an
    unimportant head, 1e-4 W) then keeps only a few significant levels, and the mean
    ``sum w delta / sum w`` there carries a relative error of n 2^-21 W / sum w (issue 60,
    bench/secagg_divergence.py). 4 clients: 2^29 levels; 1024: 2^21."""
    if n < 1:
        raise ValueError(f"a round of {n} clients")
    levels = MAX_TARGET_RANGE
    while levels > 1 and n * levels >= mod_range:
        levels >>= 1
    return levels


class ProtocolError(ValueError):
    """A client's message fails the protocol's checks (the message names the client)."""


@dataclass(frozen=True)
class Params:
    """The round's public protocol parameters."""

    threshold: int
    clip_range: float
    target_range: int = TARGET_RANGE
    mod_range: int = MOD_RANGE

    def step(self, clip_range: float | None = None) -> float:
        """The quantization step: a client's value is off by less than this after rounding."""
        return 2 * (self.clip_range if clip_range is None else clip_range) / self.target_range


@dataclass
class ClientSecrets:
    """What one client keeps between the stages (never sent as is)."""

    nid: int
    sk1: bytes
    pk1: bytes
    sk2: bytes
    pk2: bytes
    seed: bytes = b""  # b: the private mask's seed
    seed_shares: dict[int, bytes] = field(default_factory=dict)  # shares of others' b it holds
    sk1_shares: dict[int, bytes] = field(default_factory=dict)  # shares of others' sk1
    peers: dict[int, tuple[bytes, bytes]] = field(default_factory=dict)  # nid -> (pk1, pk2)


# -- stage 0 -------------------------------------------------------------------------------------
def setup(nid: int) -> ClientSecrets:
    """A client's two fresh key pairs; it publishes ``(pk1, pk2)``."""
    sk1, pk1 = generate_key_pairs()
    sk2, pk2 = generate_key_pairs()
    return ClientSecrets(nid, private_key_to_bytes(sk1), public_key_to_bytes(pk1),
                         private_key_to_bytes(sk2), public_key_to_bytes(pk2))


# -- stage 1 -------------------------------------------------------------------------------------
def share_keys(me: ClientSecrets, peers: Mapping[int, tuple[bytes, bytes]],
               threshold: int) -> dict[int, bytes]:
    """Stage 1 for client ``me``: checks the public keys the server relays (``peers``: every
    client of the round, ``me`` included), draws ``b`` and returns, per other client, its
    encrypted shares of ``b`` and sk1."""
    if len(peers) < threshold:
        raise ProtocolError(f"client {me.nid}: {len(peers)} clients share keys, fewer than the "
                            f"threshold {threshold}")
    keys = [k for pair in peers.values() for k in pair]
    if len(set(keys)) != len(keys):
        raise ProtocolError(f"client {me.nid}: two public keys of the round are identical")
    if tuple(peers.get(me.nid, ())) != (me.pk1, me.pk2):
        raise ProtocolError(f"client {me.nid}: the server relayed other public keys for it")
    me.peers = {nid: tuple(p) for nid, p in peers.items()}
    me.seed = os.urandom(32)
    order = sorted(me.peers)
    b_shares = create_shares(me.seed, threshold, len(order))
    sk_shares = create_shares(me.sk1, threshold, len(order))
    out = {}
    for i, nid in enumerate(order):
        if nid == me.nid:
            me.seed_shares[nid], me.sk1_shares[nid] = b_shares[i], sk_shares[i]
            continue
        key = generate_shared_key(bytes_to_private_key(me.sk2), bytes_to_public_key(me.peers[nid][1]))
        out[nid] = encrypt(key, share_keys_plaintext_concat(me.nid, nid, b_shares[i], sk_shares[i]))
    return out


def receive_shares(me: ClientSecrets, ciphertexts: Mapping[int, bytes]) -> None:
    """Stage 2's first half for ``me``: decrypt and keep the shares the other clients sent it."""
    for src, ct in ciphertexts.items():
        if src not in me.peers:
            raise ProtocolError(f"client {me.nid}: shares from client {src}, not of the round")
        key = generate_shared_key(bytes_to_private_key(me.sk2), bytes_to_public_key(me.peers[src][1]))
        actual, dst, b_share, sk_share = share_keys_plaintext_separate(decrypt(key, ct))
        if actual != src or dst != me.nid:
            raise ProtocolError(f"client {me.nid}: a share from client {actual} to client {dst} "
                                f"arrived as from {src}")
        me.seed_shares[src], me.sk1_shares[src] = b_share, sk_share


# -- stage 2 -------------------------------------------------------------------------------------
def _pairwise(sk1: bytes, pk1: bytes, mod_range: int, shapes: list[tuple[int, ...]]) -> Vector:
    key = generate_shared_key(bytes_to_private_key(sk1), bytes_to_public_key(pk1))
    return pseudo_rand_gen(key, mod_range, shapes)


def mask(me: ClientSecrets, vector: Vector, params: Params) -> Vector:
    """``vector`` (non-negative integers) plus ``me``'s private mask and its pairwise masks with
    every client whose shares it holds, mod the modulus."""
    shapes = [a.shape for a in vector]
    out = parameters_addition([a.astype(np.int64) for a in vector],
                              pseudo_rand_gen(me.seed, params.mod_range, shapes))
    for nid in sorted(me.sk1_shares):
        if nid == me.nid:
            continue
        pm = _pairwise(me.sk1, me.peers[nid][0], params.mod_range, shapes)
        out = parameters_addition(out, pm) if me.nid > nid else parameters_subtraction(out, pm)
    return _arrays(parameters_mod(out, params.mod_range))


def _arrays(vector) -> Vector:
    """Numpy arrays (Flower's mod of a 0-d array gives a numpy scalar)."""
    return [np.asarray(a, dtype=np.int64) for a in vector]


def flat(vector: Vector) -> np.ndarray:
    """A masked vector as it travels: its arrays raveled into one, in order (one array on the
    wire instead of one per tensor: Flower moves each array as its own objects, one request
    each, and a round's replies then cost thousands of requests; :func:`check_masked` splits it
    back by the round's public layout)."""
    return np.concatenate([np.asarray(a).reshape(-1) for a in vector]) if vector else \
        np.zeros(0, dtype=np.int64)


def _split(nid: int, a: np.ndarray, shapes: Sequence[tuple[int, ...]]) -> Vector:
    """A flat masked vector (:func:`flat`) as the layout's arrays, or a ProtocolError."""
    n = sum(int(np.prod(s)) for s in shapes)
    if a.ndim != 1 or a.size != n:
        raise ProtocolError(f"client {nid}: its masked vector holds {a.size} numbers in "
                            f"{a.ndim} dimensions, the round's layout {n} in one")
    ends = np.cumsum([int(np.prod(s)) for s in shapes])
    return [part.reshape(s) for part, s in zip(np.split(a, ends[:-1]), shapes)]


def check_masked(nid: int, vector: object, shapes: Sequence[tuple[int, ...]],
                 params: Params) -> Vector:
    """A client's masked vector as the server receives it (its arrays, or all of them in one
    flat array: :func:`flat`), or a :class:`ProtocolError` naming the client: as many arrays as
    announced, of the announced shapes, integers in [0, modulus)."""
    if isinstance(vector, np.ndarray):
        vector = _split(nid, vector, shapes)
    if not isinstance(vector, (list, tuple)) or len(vector) != len(shapes):
        raise ProtocolError(f"client {nid}: its masked vector is not {len(shapes)} arrays")
    for i, (a, shape) in enumerate(zip(vector, shapes)):
        if not isinstance(a, np.ndarray) or a.shape != tuple(shape) or a.dtype.kind not in "iu":
            raise ProtocolError(f"client {nid}: masked array {i} is not an integer array of "
                                f"shape {tuple(shape)}")
        if a.size and (int(a.min()) < 0 or int(a.max()) >= params.mod_range):
            raise ProtocolError(f"client {nid}: masked array {i} leaves [0, {params.mod_range})")
    return [np.asarray(a, dtype=np.int64) for a in vector]


def add_masked(vectors: Sequence[Vector], params: Params) -> Vector:
    """The sum of masked vectors, mod the modulus (the server's only arithmetic on them)."""
    total = vectors[0]
    for v in vectors[1:]:
        total = parameters_mod(parameters_addition(total, v), params.mod_range)
    return _arrays(total)


# -- stage 3 -------------------------------------------------------------------------------------
def unmask_shares(me: ClientSecrets, active: Sequence[int], dead: Sequence[int],
                  threshold: int) -> dict[int, bytes]:
    """``me``'s shares for the server: of ``b`` for each active client, of sk1 for each dead one
    (a client in both lists is refused: both shares would unmask its vector)."""
    if set(active) & set(dead):
        raise ProtocolError(f"client {me.nid}: clients {sorted(set(active) & set(dead))} are "
                            "listed as both active and dead")
    if len(active) < threshold:
        raise ProtocolError(f"client {me.nid}: {len(active)} active clients, fewer than the "
                            f"threshold {threshold}")
    out = {nid: me.seed_shares[nid] for nid in active if nid in me.seed_shares}
    out.update({nid: me.sk1_shares[nid] for nid in dead if nid in me.sk1_shares})
    return out


def unmask(masked_sum: Vector, shares: Mapping[int, Sequence[bytes]], active: Sequence[int],
           dead: Sequence[int], peers: Mapping[int, tuple[bytes, bytes]],
           params: Params) -> Vector:
    """The sum of the active clients' vectors: their private masks and the dead clients' pairwise
    masks removed, each secret rebuilt from ``threshold`` shares (``shares``: client -> the
    shares of its secret the survivors revealed). A ProtocolError when a secret has too few."""
    shapes = [a.shape for a in masked_sum]
    out = masked_sum
    for nid in sorted(set(active) | set(dead)):
        got = list(shares.get(nid, ()))
        if len(got) < params.threshold:
            raise ProtocolError(f"client {nid}: {len(got)} shares of its secret, the threshold "
                                f"is {params.threshold}")
        secret = combine_shares(got[:params.threshold])
        if nid in active:
            out = parameters_subtraction(out, pseudo_rand_gen(secret, params.mod_range, shapes))
            continue
        for other in sorted(active):  # the pairwise masks the active clients added for nid
            pm = _pairwise(secret, peers[other][0], params.mod_range, shapes)
            # client `other` added +pm if other > nid, else -pm: undo it
            out = parameters_subtraction(out, pm) if other > nid else parameters_addition(out, pm)
    return _arrays(parameters_mod(out, params.mod_range))


# -- what a vector holds -------------------------------------------------------------------------
@contextmanager
def _seeded(seed: int | None):
    """Flower's quantizer draws its stochastic rounding from numpy's global generator: seed it
    for the call (reproducible runs) and give the caller's state back."""
    if seed is None:
        yield
        return
    saved = np.random.get_state()
    np.random.seed(seed % 2**32)
    try:
        yield
    finally:
        np.random.set_state(saved)


@dataclass(frozen=True)
class Layout:
    """What each client's vector holds, in order: per key, its weighted update ``w/W * delta``,
    then per key its weight ``w/W`` (in ``weight_shapes``: the update's shape, or ``()`` where
    every client's weight is one number for the whole tensor, as FedAvg's), then one count of
    clipped coordinates. ``bounds``: W per key, the largest weight any client of the round may
    give an element of it (public: from the partition sizes the server knows).

    ``union``: per key, the elements any client of the round may update (the union of the
    slices the server sent, flat, bool), or absent where that is the whole tensor: a key's
    update (and per-element weight) then travels as those elements only, in flat order, and
    the server scatters their sum back. The server announces it before the masking (it chose
    the slices); a client's weight outside it is refused (:func:`encode`)."""

    shapes: dict[str, tuple[int, ...]]
    bounds: dict[str, float]
    weight_shapes: dict[str, tuple[int, ...]] | None = None  # None: the full shapes
    union: dict[str, np.ndarray] = field(default_factory=dict)

    def update_shape(self, key: str) -> tuple[int, ...]:
        """The shape a key's update travels in: its union's size, or its full shape."""
        u = self.union.get(key)
        return self.shapes[key] if u is None else (int(u.sum()),)

    def weight_shape(self, key: str) -> tuple[int, ...]:
        if self.weight_shapes is not None and tuple(self.weight_shapes[key]) == ():
            return ()
        return self.update_shape(key)

    def array_shapes(self) -> list[tuple[int, ...]]:
        return [*(self.update_shape(k) for k in self.shapes),
                *(self.weight_shape(k) for k in self.shapes), (1,)]

    def coordinates(self) -> int:
        return sum(int(np.prod(s)) for s in self.array_shapes())

    def full_coordinates(self) -> int:
        """What the vector would hold without the union (every key in its full shape)."""
        return Layout(self.shapes, self.bounds, self.weight_shapes).coordinates()

    def _flat(self, key: str, a: np.ndarray) -> np.ndarray:
        u = self.union.get(key)
        return a if u is None else a.reshape(-1)[u]

    def _full(self, key: str, a: np.ndarray) -> np.ndarray:
        u = self.union.get(key)
        if u is None:
            return a
        out = np.zeros(int(np.prod(self.shapes[key])), dtype=a.dtype)
        out[u] = a
        return out.reshape(self.shapes[key])


def union_of(shapes: Mapping[str, tuple[int, ...]],
             held: Sequence[Mapping[str, torch.Tensor]]) -> dict[str, np.ndarray]:
    """The union of the clients' held elements per key (``held``: per client, per key a mask
    broadcasting to the key's shape; a key absent: not held), flat bool, for the keys where it
    is not the whole tensor (an empty union included)."""
    import torch

    out = {}
    for k, shape in shapes.items():
        u = torch.zeros(shape, dtype=torch.bool)
        for h in held:
            if k in h:
                u |= torch.as_tensor(h[k]).expand(shape) != 0
        if not bool(u.all()):
            out[k] = u.reshape(-1).numpy()
    return out


def pack_union(u: np.ndarray) -> bytes:
    """A key's union as it is announced: one bit per element."""
    return np.packbits(u.astype(np.uint8)).tobytes()


def unpack_union(data: bytes, shape: Sequence[int]) -> np.ndarray:
    n = int(np.prod(shape))
    return np.unpackbits(np.frombuffer(data, dtype=np.uint8), count=n).astype(bool)


def encode(delta: Mapping[str, torch.Tensor], weight: Mapping[str, torch.Tensor | float] | float,
           layout: Layout, params: Params, seed: int | None = None) -> Vector:
    """One client's vector: per key ``w/W * delta`` clipped to [-c, c] and ``w/W`` clipped to
    [0, 1] (a key it did not train: zeros), on the round's union of slices, quantized by
    Flower's stochastic quantizer, and the number of coordinates that were clipped. A
    ProtocolError when a weight the layout holds as one number varies over its tensor, or a
    weight is not 0 outside the union."""
    import torch

    ups, ws, clipped = [], [], 0
    for k, shape in layout.shapes.items():
        w = weight.get(k, 0.0) if isinstance(weight, Mapping) else weight
        if k not in delta:
            w = 0.0
        w = torch.as_tensor(w, dtype=torch.float64).expand(shape) / layout.bounds[k]
        d = delta[k].double() if k in delta else torch.zeros(shape, dtype=torch.float64)
        u = layout._flat(k, (w * d).numpy())
        if k in layout.union and bool((w.reshape(-1).numpy()[~layout.union[k]] != 0).any()):
            raise ProtocolError(f"the update of {k} reaches outside the round's union of slices")
        wn = layout._flat(k, w.numpy()) if layout.weight_shape(k) else _one(w, k)
        clipped += int((np.abs(u) > params.clip_range).sum()) + int((wn > 1).sum() + (wn < 0).sum())
        ups.append(u)
        ws.append(np.clip(wn, 0.0, 1.0))
    with _seeded(seed):
        q = quantize(ups, params.clip_range, params.target_range) + \
            quantize(ws, 1.0, params.target_range)
    return [np.asarray(a, dtype=np.int64) for a in q] + [np.array([clipped], dtype=np.int64)]


def _one(w: torch.Tensor, key: str) -> np.ndarray:
    """The one weight of a tensor the layout weighs by one number (0-d)."""
    import torch

    first = w.reshape(-1)[0] if w.numel() else torch.zeros((), dtype=w.dtype)
    if w.numel() and not bool((w == first).all()):
        raise ProtocolError(f"the weight of {key} varies over its elements, the round's layout "
                            "holds one number for it")
    return np.asarray(float(first))


def decode(total: Vector, n: int, layout: Layout, params: Params
           ) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], int]:
    """From the unmasked sum of ``n`` clients' vectors: per key ``sum_c w_c delta_c`` and
    ``sum_c w_c`` (W multiplied back) in float32 and full shape (0 outside the union), and the
    round's count of clipped coordinates."""
    import torch

    k = len(layout.shapes)
    ups = dequantize(total[:k], params.clip_range, params.target_range)
    ws = dequantize(total[k:2 * k], 1.0, params.target_range)
    num, den = {}, {}
    for i, key in enumerate(layout.shapes):
        w, shape = layout.bounds[key], layout.shapes[key]
        # dequantize subtracts c once; the sum of n vectors carries n shifts
        up = (np.asarray(ups[i]) - (n - 1) * params.clip_range) * w
        num[key] = torch.from_numpy(layout._full(key, up)).float()
        wt = (np.asarray(ws[i], dtype=np.float64) - (n - 1) * 1.0) * w
        if layout.weight_shape(key):
            den[key] = torch.from_numpy(layout._full(key, wt)).float()
        else:
            d = torch.as_tensor(wt, dtype=torch.float32).expand(shape).clone()
            if key in layout.union:
                d = d * torch.from_numpy(layout.union[key].reshape(shape))
            den[key] = d
    return num, den, int(total[2 * k][0])


def error_bound(n: int, layout: Layout, params: Params) -> dict[str, tuple[float, float]]:
    """Per key, the largest error of the decoded (``sum w delta``, ``sum w``) against the exact
    sums of ``n`` clients' unclipped contributions: each client's value is off by less than one
    quantization step, scaled back by W."""
    return {k: (n * params.step() * w, n * params.step(1.0) * w) for k, w in layout.bounds.items()}
