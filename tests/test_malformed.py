"""No reply crashes a server: malformed replies (hypothesis) for every method and aggregation rule,
in the simulation's strategy and in the Flower ServerApp's adapter; the round completes with
exactly the valid replies averaged, each malformed one rejected, logged and counted."""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedslice.methods import METHODS

from malformed import (CONTENT_CASES, REPLY_CASES, RULES, FlowerHarness, combinations, fit_round)

# make test (--dist loadgroup): the module's tests on one worker, so that `fitted` (round 1 of
# every method and rule, ~20 s) is computed once, not once on each worker
pytestmark = pytest.mark.xdist_group("malformed")

SETTINGS = settings(max_examples=10, deadline=None, derandomize=True, database=None,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fitted(tiny_model_dir, tiny_data_dir, tmp_path_factory):
    """Round 1 of every accepted (method, rule): each method's clients fitted once."""
    tmp = tmp_path_factory.mktemp("malformed")
    out, replies = {}, {}
    for method, rule in combinations(tiny_data_dir, tiny_model_dir, tmp):
        own = (method, rule) == ("fedpft", "dp")  # kd = "before": no APoZ report asked for
        out[method, rule] = fit_round(method, rule, tiny_data_dir, tiny_model_dir, tmp,
                                      replies=None if own else replies.get(method))
        if not own:
            replies.setdefault(method, out[method, rule].replies)
    return out


def _applicable(f, cases) -> list[str]:
    c = f.clients[0]
    return [n for n, fn in cases.items() if fn(f.replies[c], f.context(c), lambda n: 0) is not None]


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _expect_valid_average(f, result, bad: list[int]) -> None:
    """``result`` rejected exactly ``bad`` and equals the round of the valid replies alone."""
    valid = sorted(set(f.clients) - set(bad))
    assert sorted(result.invalid) == sorted(bad) and result.rejected == len(bad)
    assert result.used == valid
    assert {e["client"] for e in result.excluded} >= set(bad)
    reference = f.aggregate({c: f.replies[c] for c in valid})
    assert result.skipped == reference.skipped
    assert _same(result.state, reference.state)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("method", sorted(METHODS))
def test_malformed_replies_never_crash_a_round(fitted, method, rule, caplog):
    f = fitted.get((method, rule))
    if f is None:
        pytest.skip(f"the config refuses {rule} with {method}")
    names = _applicable(f, REPLY_CASES)

    @SETTINGS
    @given(st.data())
    def round_with(data):
        cases = data.draw(st.lists(st.sampled_from([None, *names]), min_size=len(f.clients),
                                   max_size=len(f.clients)), label="cases")
        pick = lambda n: data.draw(st.integers(0, max(n - 1, 0)))  # noqa: E731
        replies = {c: REPLY_CASES[case](f.replies[c], f.context(c), pick) if case else f.replies[c]
                   for c, case in zip(f.clients, cases)}
        _expect_valid_average(f, f.aggregate(replies), [c for c, k in zip(f.clients, cases) if k])

    with caplog.at_level("WARNING"):
        round_with()
    assert "rejected" in caplog.text


@pytest.mark.parametrize("method", sorted(METHODS))
def test_every_malformed_case_is_rejected_in_the_simulation_and_on_flower(fitted, method, caplog):
    """The matrix: each case once (one client broken), simulation and ServerApp."""
    f = fitted[method, "mean"]
    bad = f.clients[-1]
    flower = FlowerHarness(f)
    for name in _applicable(f, REPLY_CASES):
        broken = REPLY_CASES[name](f.replies[bad], f.context(bad), lambda n: 0)
        result = f.aggregate({**f.replies, bad: broken})
        _expect_valid_average(f, result, [bad])
        try:
            content = _encode(broken)
        except Exception:  # noqa: BLE001 - not a message anyone can send (not a Reply, a list)
            continue
        _flower_round(f, flower, {bad: content}, name)
    for name, fn in CONTENT_CASES.items():
        _flower_round(f, flower, {bad: fn(flower.content(bad), f.context(bad), lambda n: 0)}, name)


def _encode(reply):
    """``reply`` as a message content, as sent by a client that does not use our encoder (its
    values are not coerced: a float or text num_examples stays so)."""
    import json

    from flwr.app import ConfigRecord, RecordDict

    from fedslice.flower.codec import ARRAYS, META, state_to_record
    meta = ConfigRecord({"metrics": json.dumps(reply.metrics), "num_examples": reply.num_examples})
    return RecordDict({ARRAYS: state_to_record(reply.arrays), META: meta})


def _flower_round(f, flower, broken: dict, name: str) -> None:
    contents = {c: flower.content(c) for c in f.clients}
    contents.update(broken)
    state, record = flower.round(contents)
    valid = sorted(set(f.clients) - set(broken))
    reference = f.aggregate({c: f.replies[c] for c in valid})
    assert record["rejected"] == len(broken), (name, record["excluded"])
    assert [m["client"] for m in record["client_metrics"] if m["used"]] == valid, name
    assert _same(state, reference.state), name


@pytest.mark.parametrize("method", sorted(METHODS))
def test_malformed_messages_never_crash_the_serverapp(fitted, method):
    f = fitted[method, "mean"]
    flower = FlowerHarness(f)
    names = _applicable(f, REPLY_CASES)

    @SETTINGS
    @given(st.data())
    def round_with(data):
        pick = lambda n: data.draw(st.integers(0, max(n - 1, 0)))  # noqa: E731
        broken = {}
        for c in f.clients:
            kind = data.draw(st.sampled_from(["valid", "reply", "content"]))
            if kind == "reply":
                reply = REPLY_CASES[data.draw(st.sampled_from(names))](f.replies[c], f.context(c), pick)
                try:
                    broken[c] = _encode(reply)
                except Exception:  # noqa: BLE001 - not encodable: a ClientApp cannot send it
                    continue
            elif kind == "content":
                broken[c] = CONTENT_CASES[data.draw(st.sampled_from(sorted(CONTENT_CASES)))](
                    flower.content(c), f.context(c), pick)
        _flower_round(f, flower, broken, str(sorted(broken)))

    round_with()


@pytest.mark.parametrize("method", ["fedavg", "fedpetuning", "fedpft", "fedot"])
def test_malformed_messages_never_crash_the_serverapps_dp(fitted, method):
    """Under Flower's DP wrapper (CentralDP): each malformed reply rejected and counted, the
    others used (the state is noised by Flower, so the used set is what is compared)."""
    f = fitted[method, "dp"]
    flower = FlowerHarness(f, dp=True)
    names = _applicable(f, REPLY_CASES)

    @SETTINGS
    @given(st.data())
    def round_with(data):
        pick = lambda n: data.draw(st.integers(0, max(n - 1, 0)))  # noqa: E731
        broken = {}
        for c in f.clients:
            kind = data.draw(st.sampled_from(["valid", "reply", "content"]))
            if kind == "reply":
                reply = REPLY_CASES[data.draw(st.sampled_from(names))](f.replies[c], f.context(c), pick)
                try:
                    broken[c] = _encode(reply)
                except Exception:  # noqa: BLE001
                    continue
            elif kind == "content":
                broken[c] = CONTENT_CASES[data.draw(st.sampled_from(sorted(CONTENT_CASES)))](
                    flower.content(c), f.context(c), pick)
        contents = {c: flower.content(c) for c in f.clients}
        contents.update(broken)
        state, record = flower.round(contents)
        valid = sorted(set(f.clients) - set(broken))
        assert record["rejected"] == len(broken), record["excluded"]
        assert [m["client"] for m in record["client_metrics"] if m["used"]] == valid
        assert record["skipped"] == (len(valid) < f.method.strategy.min_valid())
        assert all(bool(torch.isfinite(t).all()) for t in state.values())

    round_with()
