"""Secure aggregation (privacy.secure_aggregation): the protocol on Flower's primitives, the
quantized encoding's stated error, the in-process rule (the server's aggregation sees only
sums) and the config's refusals."""

import copy

import numpy as np
import pytest
import torch

from fedslice.api import setup
from fedslice.config import PrivacyConfig
from fedslice.experiment import validate_config
from fedslice.fl import secagg as sp
from fedslice.fl.rules import SecureAggregation, find_rule
from fedslice.fl.rules.secagg import MAX_CLIENTS
from fedslice.run.engine import Simulation
from tests.conftest import assert_refused_naming, method_options


def _keys(clients, t):
    secrets = {c: sp.setup(c) for c in clients}
    peers = {c: (s.pk1, s.pk2) for c, s in secrets.items()}
    boxes = {c: sp.share_keys(secrets[c], peers, t) for c in clients}
    for c in clients:
        sp.receive_shares(secrets[c], {s: boxes[s][c] for s in clients if s != c})
    return secrets, peers


def _vectors(clients, params, seed=0):
    rng = np.random.default_rng(seed)
    return {c: [rng.integers(0, params.target_range + 1, (3, 4)), rng.integers(0, 9, (5,))]
            for c in clients}


@pytest.mark.parametrize("dead,gone", [((), ()), ((2,), ()), ((0, 4), (1,)), ((), (3, 5))])
def test_masks_cancel_and_dropouts_are_recovered(dead, gone):
    """The unmasked sum is exactly the integer sum of the clients whose vectors arrived: the
    dead clients' pairwise masks are rebuilt from the survivors' shares of their sk1, while at
    least t survivors answer the unmasking."""
    clients, params = list(range(6)), sp.Params(threshold=3, clip_range=1.0)
    secrets, peers = _keys(clients, params.threshold)
    vecs = _vectors(clients, params)
    active = [c for c in clients if c not in dead]
    masked = {c: sp.mask(secrets[c], vecs[c], params) for c in active}
    for c in active:  # a masked vector alone says nothing of its vector
        assert not np.array_equal(masked[c][0], vecs[c][0])
    total = sp.add_masked([masked[c] for c in active], params)
    shares = {}
    for s in active:
        if s in gone:
            continue
        for owner, share in sp.unmask_shares(secrets[s], active, list(dead), 3).items():
            shares.setdefault(owner, []).append(share)
    out = sp.unmask(total, shares, active, list(dead), peers, params)
    for i in range(2):
        assert np.array_equal(out[i], sum(vecs[c][i] for c in active) % params.mod_range)


def test_too_few_shares_is_refused_naming_the_client():
    clients, params = [0, 1, 2, 3], sp.Params(threshold=3, clip_range=1.0)
    secrets, peers = _keys(clients, 3)
    vecs = _vectors(clients, params)
    masked = [sp.mask(secrets[c], vecs[c], params) for c in clients]
    shares = {}
    for s in (0, 1):  # only two of four answer
        for owner, share in sp.unmask_shares(secrets[s], clients, [], 3).items():
            shares.setdefault(owner, []).append(share)
    with pytest.raises(sp.ProtocolError, match="client 0: 2 shares"):
        sp.unmask(sp.add_masked(masked, params), shares, clients, [], peers, params)
    with pytest.raises(sp.ProtocolError, match="both active and dead"):
        sp.unmask_shares(secrets[0], [0, 1, 2], [2], 3)


def test_a_malformed_masked_vector_is_refused_naming_the_node():
    params = sp.Params(threshold=2, clip_range=1.0)
    shapes = [(3,), (1,)]
    with pytest.raises(sp.ProtocolError, match="client 7: masked array 0 is not an integer"):
        sp.check_masked(7, [np.zeros(3, dtype=np.float32), np.zeros(1, dtype=np.int64)], shapes, params)
    with pytest.raises(sp.ProtocolError, match="client 7: masked array 1 leaves"):
        sp.check_masked(7, [np.zeros(3, dtype=np.int64), np.array([2**32])], shapes, params)
    with pytest.raises(sp.ProtocolError, match="client 7: its masked vector is not 2 arrays"):
        sp.check_masked(7, [np.zeros(3, dtype=np.int64)], shapes, params)
    # the wire form, one flat array: split by the layout, or refused naming the client
    with pytest.raises(sp.ProtocolError, match="client 7: its masked vector holds 3 numbers in 1 "
                                               "dimensions, the round's layout 4 in one"):
        sp.check_masked(7, np.zeros(3, dtype=np.uint32), shapes, params)
    with pytest.raises(sp.ProtocolError, match="client 7: its masked vector holds 4 numbers in 2"):
        sp.check_masked(7, np.zeros((2, 2), dtype=np.uint32), shapes, params)
    with pytest.raises(sp.ProtocolError, match="client 7: masked array 1 leaves"):
        sp.check_masked(7, np.array([0, 1, 2, 2**32], dtype=np.int64), shapes, params)
    assert MAX_CLIENTS == sp.MAX_CLIENTS


def test_a_flat_masked_vector_is_the_same_vector():
    """The wire form (:func:`flat`, one array for the whole vector) splits back into exactly the
    arrays that were masked, 0-d arrays (one weight per tensor) included."""
    clients, params = [0, 1, 2], sp.Params(threshold=2, clip_range=1.0)
    secrets, peers = _keys(clients, 2)
    vecs = _vectors(clients, params)
    masked = [sp.mask(secrets[c], vecs[c], params) for c in clients]
    shapes = [a.shape for a in masked[0]]
    for m in masked:
        wire = sp.flat(m).astype(np.uint32)
        assert wire.ndim == 1 and wire.size == sum(a.size for a in m)
        back = sp.check_masked(0, wire, shapes, params)
        assert [a.shape for a in back] == shapes
        assert all(np.array_equal(a, b) for a, b in zip(back, m))
    shapes0d = [(2, 3), (), (1,)]
    v = [np.arange(6).reshape(2, 3), np.array(7), np.array([9])]
    back = sp.check_masked(0, sp.flat(v), shapes0d, params)
    assert [a.shape for a in back] == shapes0d and int(back[1]) == 7 and back[0][1, 2] == 5


@pytest.mark.parametrize("seed", range(3))
def test_decoded_sums_within_the_stated_quantization_error(seed):
    """Random updates and weights (scalar, per-element masks, zeros where a client holds
    nothing): the decoded sum w delta and sum w are within n quantization steps (times W) of the
    exact sums, and the clipped coordinates are counted."""
    g = torch.Generator().manual_seed(seed)
    shapes = {"a": (4, 6), "b": (6,)}
    layout = sp.Layout(shapes, {"a": 50.0, "b": 50.0})
    params = sp.Params(threshold=2, clip_range=0.05)
    n, num, den, total, outside = 5, {}, {}, None, 0
    for c in range(n):
        delta = {k: 0.02 * torch.randn(s, generator=g) for k, s in shapes.items()}
        if c == 0:
            delta["a"][0, 0] = 10.0  # outside the clipping range: clipped and counted
            outside += 1
        mask = (torch.rand(shapes["a"], generator=g) > 0.4).float()
        w = {"a": (10 + c) * mask, "b": float(20 + c)}
        if c == 3:
            del delta["b"]  # trained nothing of b
        for k in shapes:
            wk = torch.as_tensor(w[k]).expand(shapes[k]) * (k in delta)
            contrib = (wk * delta[k]).clamp(-0.05 * 50, 0.05 * 50) if k in delta else 0.0 * wk
            num[k] = num.get(k, 0) + contrib
            den[k] = den.get(k, 0) + wk
        v = sp.encode(delta, w, layout, params, seed=c)
        total = v if total is None else [a + b for a, b in zip(total, v)]
    total = [a % params.mod_range for a in total]
    got_num, got_den, clipped = sp.decode(total, n, layout, params)
    bound = sp.error_bound(n, layout, params)
    assert clipped == outside
    for k in shapes:
        assert (got_num[k].double() - num[k].double()).abs().max() <= bound[k][0] + 1e-6
        assert (got_den[k].double() - den[k].double()).abs().max() <= bound[k][1] + 1e-6
        # where nobody trained: exactly zero
        assert torch.equal(got_den[k][den[k] == 0], torch.zeros_like(got_den[k][den[k] == 0]))


def test_quantization_uses_the_field_a_round_allows():
    """The levels grow as the round shrinks, never so far that n clients' values wrap mod 2^32
    or leave int32 (Flower's quantizer); a weight far below its bound (an unimportant head's
    importance, 1e-4 W) then keeps its mean exact to well below the 2^22 levels' error."""
    assert sp.target_range(1024) == 2**21 and sp.target_range(4) == 2**29
    assert sp.target_range(1) == sp.target_range(3) == 2**30
    for n in (1, 2, 3, 4, 10, 1000, 1024, 5000):
        levels = sp.target_range(n)
        assert n * levels < sp.MOD_RANGE and levels <= 2**31 - 1 and levels & (levels - 1) == 0
    with pytest.raises(ValueError, match="0 clients"):
        sp.target_range(0)
    g = torch.Generator().manual_seed(0)
    n, shapes = 4, {"a": (8, 16)}
    layout = sp.Layout(shapes, {"a": 1000.0})
    deltas = [1e-3 * torch.randn(shapes["a"], generator=g) for _ in range(n)]
    weights = [{"a": torch.full(shapes["a"], 0.1 * (c + 1))} for c in range(n)]  # 1e-4 W .. 4e-4 W
    for c in range(n):  # rows 4.. are nobody's
        weights[c]["a"][4:], deltas[c][4:] = 0.0, 0.0
    exact = sum(w["a"] * d for w, d in zip(weights, deltas)) / sum(w["a"] for w in weights).clamp_min(1e-30)
    errors = {}
    for levels in (sp.TARGET_RANGE, sp.target_range(n)):
        params = sp.Params(threshold=2, clip_range=1.0, target_range=levels)
        total = None
        for c in range(n):
            v = sp.encode({"a": deltas[c]}, weights[c], layout, params, seed=c)
            total = v if total is None else [x + y for x, y in zip(total, v)]
        num, den, _ = sp.decode([x % params.mod_range for x in total], n, layout, params)
        errors[levels] = float(((num["a"][:4] / den["a"][:4]) - exact[:4]).abs().max())
        # the rows no client weighs (and trained nothing): exactly 0, not one step of noise
        assert torch.equal(den["a"][4:], torch.zeros(4, 16)) and torch.equal(num["a"][4:], torch.zeros(4, 16))
    fine = errors[sp.target_range(n)]
    assert fine < 2e-5 and fine * 50 < errors[sp.TARGET_RANGE]  # 2^29 vs 2^22 levels: ~128x


def test_a_round_announces_its_levels(tiny_cfg_dict, tmp_path):
    """The rule's parameters for a round of n clients carry target_range(n): the server
    decodes with the levels every client encoded with."""
    cfg = validate_config(_cfg(tiny_cfg_dict, tmp_path, "fedpetuning"))
    method, _ = setup(cfg)
    rule = find_rule(method.strategy, SecureAggregation)
    assert rule.params(4).target_range == sp.target_range(4) == 2**29
    assert rule.params(4).step() == pytest.approx(2 * 0.5 / 2**29)


def test_one_weight_per_tensor_where_the_layout_says_so():
    """A layout that holds one weight for a tensor (FedAvg's examples) sends one number for it,
    decodes to the same sums, and refuses a weight that varies over the tensor."""
    shapes = {"a": (3, 4)}
    params = sp.Params(threshold=2, clip_range=0.5)
    one = sp.Layout(shapes, {"a": 10.0}, {"a": ()})
    full = sp.Layout(shapes, {"a": 10.0})
    assert one.coordinates() == 12 + 1 + 1 and full.coordinates() == 12 + 12 + 1
    g = torch.Generator().manual_seed(0)
    deltas = [{"a": 0.01 * torch.randn(3, 4, generator=g)} for _ in range(3)]
    sums = {}
    for name, layout in (("one", one), ("full", full)):
        total = None
        for c, d in enumerate(deltas):
            v = sp.encode(d, {"a": float(4 + c)}, layout, params, seed=c)
            total = v if total is None else [x + y for x, y in zip(total, v)]
        sums[name] = sp.decode([x % params.mod_range for x in total], 3, layout, params)
    bound = sp.error_bound(3, one, params)["a"]
    exact_num = sum((4 + c) * d["a"] for c, d in enumerate(deltas))
    for num, den, _ in sums.values():
        assert (num["a"] - exact_num).abs().max() <= bound[0] + 1e-6
        assert (den["a"] - 15.0).abs().max() <= bound[1] + 1e-6 and den["a"].shape == (3, 4)
    with pytest.raises(sp.ProtocolError, match="the weight of a varies"):
        sp.encode(deltas[0], {"a": torch.arange(12.0).reshape(3, 4)}, one, params)


# -- the rule in process -------------------------------------------------------------------------

CASES = {
    "fedpetuning": ({"name": "fedpetuning"}, {}),
    "fedpetuning+fedadam": ({"name": "fedpetuning"}, {"server_opt": {"name": "fedadam"}}),
    "raffm+ranks": ({"name": "raffm", "width_steps": 4, "tiers": [
        {"share": 0.5, "flops": 0.6}, {"share": 0.5, "flops": 1.0}]}, {"lora": {"ranks": [2, 4]}}),
    "fedsa": ({"name": "fedpetuning"}, {"lora": {"aggregation": "fedsa"}}),
    "ffa": ({"name": "fedpetuning"}, {"lora": {"aggregation": "ffa"}}),
    "raffm": ("raffm", {}),
    "fedot": ("fedot", {}),
    "heads": ("heads", {}),
    "heads-fedavg": ({"name": "heads", "sparsity": 0.5, "aggregation": "fedavg"}, {}),
    "raffm+heads": ({"name": "raffm+heads", "sparsity": 0.5,
                     "tiers": [{"share": 0.5, "flops": 0.5}, {"share": 0.5, "flops": 1.0}],
                     "width_steps": 4}, {}),
    # no client trains the whole model: the round's union of slices is smaller than it
    "raffm-narrow": ({"name": "raffm", "width_steps": 4, "reorder_every": 1, "tiers": [
        {"share": 0.5, "flops": 0.4}, {"share": 0.5, "flops": 0.7}]}, {}),
    "raffm+heads-narrow": ({"name": "raffm+heads", "sparsity": 0.5, "width_steps": 4, "tiers": [
        {"share": 0.5, "flops": 0.4}, {"share": 0.5, "flops": 0.7}]}, {}),
    "fedpetuning+ranks": ({"name": "fedpetuning", "tiers": [
        {"share": 0.5, "flops": 0.95}, {"share": 0.5, "flops": 0.92}]},
        {"lora": {"r": 8, "ranks": [2, 4, 8]}}),
    # one client of the round has the widest sub-model: its elements outside the narrower
    # slice are summed over it alone (counted in secagg_single_holder)
    "raffm-one-wide": ({"name": "raffm", "width_steps": 4, "tiers": [
        {"share": 0.75, "flops": 0.4}, {"share": 0.25, "flops": 0.7}]}, {}),
}
#: cases whose union is exactly what the clients' weights hold (heads: the kept heads of each
#: client's slice are a subset of the announced slice)
EXACT_UNION = ("raffm", "raffm+ranks", "fedot", "raffm-narrow", "fedpetuning+ranks", "fedpetuning",
               "raffm-one-wide")
NARROW = ("raffm-narrow", "raffm+heads-narrow", "fedpetuning+ranks")


def _cfg(tiny_cfg_dict, tmp_path, case, secure=True):
    method, extra = CASES[case]
    d = copy.deepcopy(tiny_cfg_dict)
    if isinstance(method, str):
        method = {"name": method, **method_options(method, tmp_path)}
    d["method"] = method
    d["federation"] = {**d["federation"], "clients_per_round": 4, "rounds": 1}
    for k, v in extra.items():
        d[k] = {**d.get(k, {}), **v}
    d["privacy"] = {"secure_aggregation": secure, "secagg_clip_range": 0.5}
    return d


@pytest.mark.parametrize("case", list(CASES))
def test_secure_round_equals_plain_sums(tiny_cfg_dict, tmp_path, case, monkeypatch):
    """One round of every supported weighting under secure aggregation: what the server's
    combine receives is one pseudo-client (the sums), equal to the exact sums of the clients'
    weighted updates and weights within the stated quantization error; the server's side sees
    only integer masked vectors."""
    cfg = validate_config(_cfg(tiny_cfg_dict, tmp_path, case))
    method, data = setup(cfg)
    rule = find_rule(method.strategy, SecureAggregation)
    assert rule is method.strategy
    seen, server_inputs, sums = {}, [], {}
    client_vector, aggregate_masked = SecureAggregation.client_vector, SecureAggregation.aggregate_masked
    combine_sums = SecureAggregation.combine_sums

    def spy_client(self, rnd, payload, reply, layout, params):
        seen[payload.config["client"]] = (payload, reply)
        return client_vector(self, rnd, payload, reply, layout, params)

    def spy_server(self, rnd, state, masked, *a, **k):
        server_inputs.append(masked)
        sums["state"] = state
        return aggregate_masked(self, rnd, state, masked, *a, **k)

    def spy_sums(self, rnd, state, num, den):
        sums.update(num=num, den=den)
        return combine_sums(self, rnd, state, num, den)

    monkeypatch.setattr(SecureAggregation, "client_vector", spy_client)
    monkeypatch.setattr(SecureAggregation, "aggregate_masked", spy_server)
    monkeypatch.setattr(SecureAggregation, "combine_sums", spy_sums)
    inner_calls = []
    inner_combine = type(rule.inner).combine

    def spy_inner(self, rnd, state, deltas, weights, replies):
        inner_calls.append(len(deltas))
        return inner_combine(self, rnd, state, deltas, weights, replies)

    monkeypatch.setattr(type(rule.inner), "combine", spy_inner)
    state, records, _ = Simulation(cfg, method, data).run()
    rec = records[0]
    assert not rec["skipped"] and rec["secagg_clients"] == len(rec["clients"]) - len(rec["excluded"])
    assert inner_calls == [1]  # one pseudo-client: the sums
    (masked,) = server_inputs
    for v in masked.values():
        assert all(isinstance(a, np.ndarray) and a.dtype.kind in "iu" for a in v)
    # the exact sums from the same replies, through the method's own weighting
    used = sorted(masked)
    state0 = sums["state"]
    deltas, weights = rule.inner.client_updates(1, state0, {c: seen[c][0] for c in used},
                                                {c: seen[c][1] for c in used})
    layout = rule.layout(state0, {c: seen[c][0] for c in used})
    if case in ("fedpetuning", "fedpetuning+fedadam", "ffa", "fedsa"):  # FedAvg: one weight each
        assert all(layout.weight_shape(k) == () for k in layout.shapes)
    if case.startswith("raffm"):  # held-masks: a weight per element
        assert any(layout.weight_shape(k) != () for k in layout.shapes)
    params = rule.params(len(rec["clients"]))
    bound = sp.error_bound(len(used), layout, params)
    assert rec["secagg_clipped"] == 0
    checked = 0
    for k in layout.shapes:
        num = sum((torch.as_tensor((w.get(k, 0.0) if isinstance(w, dict) else w) if k in d else 0.0)
                   * d.get(k, torch.zeros(())).float()).expand(layout.shapes[k])
                  for d, w in zip(deltas, weights))
        den = sum(torch.as_tensor((w.get(k, 0.0) if isinstance(w, dict) else w) if k in d else 0.0,
                                  dtype=torch.float32).expand(layout.shapes[k])
                  for d, w in zip(deltas, weights))
        assert (sums["num"][k].double() - num.double()).abs().max() <= bound[k][0] * 1.0001 + 1e-5, k
        assert (sums["den"][k].double() - den.double()).abs().max() <= bound[k][1] * 1.0001 + 1e-5, k
        nobody = den == 0  # no client weighs it: exactly 0, never a step of rounding noise
        assert not bool(sums["den"][k][nobody].any()) and not bool(sums["num"][k][nobody].any()), k
        checked += bool((den > 0).any())
    assert checked > 0
    # the union of the round's slices: it holds every element a client's weight reaches (exactly
    # those, where no client prunes within its slice); each client uploads exactly its size
    expect = 1
    for k, shape in layout.shapes.items():
        support = torch.zeros(shape, dtype=torch.bool)
        for d, w in zip(deltas, weights):
            if k in d:
                wk = torch.as_tensor(w.get(k, 0.0) if isinstance(w, dict) else w)
                support |= wk.expand(shape) != 0
        union = torch.from_numpy(layout.union[k]).reshape(shape) if k in layout.union else \
            torch.ones(shape, dtype=torch.bool)
        assert not bool((support & ~union).any()), k
        if case in EXACT_UNION:
            assert torch.equal(support, union), k
        size = int(union.sum())
        expect += size + (size if layout.weight_shape(k) else 1)
    assert all(k in layout.shapes for d in deltas for k in d)  # no key a client trains left out
    # the coordinates only one summed client holds: the unmasked sum there is that client's
    # weighted update, and the round counts them (docs/security.md)
    ones = 0
    for k, shape in layout.shapes.items():
        n = sum((torch.as_tensor(w.get(k, 0.0) if isinstance(w, dict) else w).expand(shape) != 0
                 ).int() for d, w in zip(deltas, weights) if k in d)
        ones += int((torch.as_tensor(n) == 1).sum())
    if case in EXACT_UNION:  # (heads: a client's weight is zero on heads pruned in its slice)
        assert rec["secagg_single_holder"] == ones
    if case in ("fedpetuning", "fedpetuning+fedadam", "ffa", "fedsa"):
        assert rec["secagg_single_holder"] == 0
    if case == "raffm-one-wide":
        assert rec["secagg_single_holder"] > 0
    assert rec["secagg_upload_bytes"] == 4 * expect
    assert all(m["bytes_up"] == 4 * expect for m in rec["client_metrics"] if m.get("used"))
    if case in NARROW:
        assert rec["secagg_upload_bytes"] < rec["secagg_full_upload_bytes"]
        assert layout.union
    if case == "fedpetuning+ranks":  # heterogeneous ranks, none the global one
        assert sorted({p.config["lora_rank"] for p, _ in seen.values()}) == [2, 4]


def test_secure_run_matches_plain_run(tiny_cfg_dict, tmp_path):
    """Two rounds of FedAvg with and without secure aggregation, same seed: the same clients,
    losses equal in round 1, the global states within the propagated quantization error."""
    runs = {}
    for secure in (False, True):
        cfg = validate_config(_cfg(tiny_cfg_dict, tmp_path, "fedpetuning", secure))
        method, data = setup(cfg)
        runs[secure] = Simulation(cfg, method, data).run()
    (s0, r0, _), (s1, r1, _) = runs[False], runs[True]
    assert [r["clients"] for r in r0] == [r["clients"] for r in r1]
    assert r0[0]["train_loss"] == pytest.approx(r1[0]["train_loss"], rel=1e-6)
    for k in s0:
        assert torch.allclose(s0[k], s1[k], atol=2e-5), k


def test_dropouts_after_masking(tiny_cfg_dict, tmp_path):
    """Clients whose vectors never arrive (dead) and survivors that vanish before unmasking:
    the round completes while t clients answer; below t it is skipped and the state kept."""
    d = _cfg(tiny_cfg_dict, tmp_path, "fedpetuning")
    d["privacy"]["secagg_threshold"] = 2
    cfg = validate_config(d)
    method, data = setup(cfg)
    rule = method.strategy
    sim = Simulation(cfg, method, data)
    state = method.initial_state()
    clients = [0, 1, 2, 3]
    payloads = rule.configure_train(1, state, clients, 4)
    from fedslice.run.engine import client_seed
    replies = {}
    sim.runner.fit(method, clients, payloads, data.client,
                   {c: client_seed(0, 1, c) for c in clients}, lambda c, r: replies.__setitem__(c, r))
    plain = rule.inner.aggregate_train(1, state, payloads, {c: replies[c] for c in (0, 1, 2)})
    rule.sent = clients
    res = rule.secure_round(1, state, payloads, {c: replies[c] for c in (0, 1, 2)}, {2})
    assert not res.skipped and res.used == [0, 1, 2] and res.metrics["secagg_recovered"] == 1
    for k in plain.state:
        assert torch.allclose(res.state[k], plain.state[k], atol=2e-5), k
    res = rule.secure_round(1, state, payloads, {c: replies[c] for c in (0, 1, 2)}, {1, 2})
    assert res.skipped and "fewer than privacy.secagg_threshold=2" in res.metrics["secagg_skipped"]
    assert all(torch.equal(res.state[k], state[k]) for k in state)


def test_bad_settings_are_refused_naming_the_fields(tiny_cfg_dict, tmp_path):
    base = {**tiny_cfg_dict, "privacy": {"secure_aggregation": True}}
    assert_refused_naming(base, {"method": {"name": "fedpft", **method_options("fedpft", tmp_path)}},
                          ["privacy.secure_aggregation", "method.name='fedpft'"])
    assert_refused_naming(base, {"aggregation": {"rule": "median"}},
                          ["privacy.secure_aggregation", "aggregation.rule='median'"])
    assert_refused_naming(base, {"aggregation": {"rule": "krum"},
                                 "federation": {"clients_per_round": 5, "num_clients": 6}},
                          ["privacy.secure_aggregation", "aggregation.rule='krum'"])
    assert_refused_naming(base, {"aggregation": {"clip_norm": 1.0}},
                          ["privacy.secure_aggregation", "aggregation.clip_norm"])
    assert_refused_naming(base, {"dp": {"enabled": True, "noise_multiplier": 1.0}},
                          ["privacy.secure_aggregation", "dp.enabled"])
    assert_refused_naming(base, {"lora": {"aggregation": "fedex"}},
                          ["privacy.secure_aggregation", "lora.aggregation='fedex'"])
    assert_refused_naming(base, {"lora": {"aggregation": "svd"}},
                          ["privacy.secure_aggregation", "lora.aggregation='svd'"])
    assert_refused_naming(base, {"method": {"name": "fedpetuning", "tiers": [
        {"share": 0.5, "flops": 0.95}, {"share": 0.5, "flops": 1.0}]},
        "lora": {"r": 8, "ranks": [2, 8], "padding": "zeros"}},
        ["privacy.secure_aggregation", "lora.padding='zeros'"])
    assert_refused_naming(base, {"federation": {"selection": "loss_gap"}},
                          ["privacy.secure_aggregation", "federation.selection"])
    assert_refused_naming(base, {"privacy": {"secure_aggregation": True, "secagg_threshold": 3}},
                          ["privacy.secagg_threshold", "federation.clients_per_round"])
    assert_refused_naming(base, {"privacy": {"secure_aggregation": True, "secagg_clip_range": 0}},
                          ["secagg_clip_range"])
    assert PrivacyConfig().threshold(10) == 6 and PrivacyConfig().threshold(2) == 2
