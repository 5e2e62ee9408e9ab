import math

from fedslice.fl.selection import LossGapSelector, UniformSelector, make_selector


def test_uniform_is_seeded_and_without_replacement():
    a, b = UniformSelector(3, seed=1), UniformSelector(3, seed=1)
    picks = [a.select(r, range(10)) for r in range(5)]
    assert picks == [b.select(r, range(10)) for r in range(5)]
    assert all(len(set(p)) == 3 for p in picks)


def test_loss_gap_tries_unseen_clients_first_then_largest_gaps():
    s = LossGapSelector(2, seed=0)
    seen: set[int] = set()
    for r in range(3):  # 6 clients, 2 per round: three rounds cover everyone once
        chosen = s.select(r, range(6))
        assert not seen & set(chosen)
        seen |= set(chosen)
        s.observe(r, {c: float(c) for c in chosen}, None)
    assert seen == set(range(6))
    s.observe(3, {}, global_loss=1.5)
    assert s.select(4, range(6)) == [4, 5]  # gaps 5-1.5 and 4-1.5 are the largest
    s.observe(4, {5: 0.1}, global_loss=1.5)
    assert s.select(5, range(6)) == [3, 4]


def test_loss_gap_ties_broken_by_seed_and_nan_ignored():
    picks = {tuple(LossGapSelector(2, seed=k).select(0, range(8))) for k in range(6)}
    assert len(picks) > 1  # unseen clients tie: the seed decides
    s = LossGapSelector(1, seed=0)
    s.observe(0, {0: math.nan, 1: 2.0}, None)
    assert 0 not in s.last_loss and s.global_loss == 2.0
    assert isinstance(make_selector("random", 2, 0), UniformSelector)
