"""Client-reported values are bounded: one lying client cannot take every head (Eq. 8 importance)
or every FedPFT neuron choice (APoZ token counts)."""

from __future__ import annotations

import pytest
import torch

from fedslice.fl.strategy import Reply

from malformed import fit_round

KEPT, ALPHA = "heads.kept", "heads.alpha"


@pytest.fixture(scope="module")
def heads(tiny_model_dir, tiny_data_dir, tmp_path_factory):
    return fit_round("heads", "mean", tiny_data_dir, tiny_model_dir, tmp_path_factory.mktemp("heads"))


def _liar_share(f, replies: dict, liar: int) -> tuple[float, list[float]]:
    """The liar's mean share of the Eq. 8 weight over the rows (heads) of the head-tied LoRA
    tensors it holds, and each client's total weight over one such tensor's head rows."""
    _, weights = f.method.strategy.client_updates(1, f.state, f.payloads, replies)
    order = sorted(replies)
    shares, totals = [], [0.0] * len(order)
    for k in weights[0]:
        if "lora_B" not in k or not any(p in k for p in ("query", "value")):
            continue
        w = torch.stack([weights[i][k][:, 0] for i in range(len(order))])  # (clients, rows)
        held = w[order.index(liar)] > 0
        shares.append((w[order.index(liar), held] / w[:, held].sum(0)).mean())
        totals = [t + float(w[i].sum()) for i, t in enumerate(totals)]
    return float(torch.stack(shares).mean()), totals


def test_a_client_claiming_full_confidence_does_not_take_every_head(heads):
    """A client reporting α = 1 on every head it kept (the largest value validation accepts)
    weighs on a head as much as when it reports its true α; unbounded Eq. 8 would give it 2.5x
    the share here (0.73 instead of 0.29, measured)."""
    f, liar = heads, heads.clients[0]
    honest, _ = _liar_share(f, f.replies, liar)
    r = f.replies[liar]
    lying = Reply({**r.arrays, ALPHA: r.arrays[KEPT].float()}, r.num_examples, r.metrics)
    assert f.method.strategy.check_reply(f.state, f.payloads[liar], lying) is None  # a valid reply
    replies = {**f.replies, liar: lying}
    share, totals = _liar_share(f, replies, liar)
    assert share <= 1.05 * honest, (share, honest)
    # every client's weights average 1 over its kept heads: the same total for all (a head-tied
    # tensor holds head_dim rows per head; every client keeps the same number of heads)
    assert totals == pytest.approx([totals[0]] * len(totals), rel=1e-5)
    # and what validation refuses outright
    for alpha, reason in [(r.arrays[KEPT].float() * 3, "outside (0, 1]"),
                          (r.arrays[ALPHA] * 0, "outside (0, 1]"),
                          (r.arrays[ALPHA] + ~r.arrays[KEPT], "not 0 on a pruned head")]:
        bad = Reply({**r.arrays, ALPHA: alpha}, r.num_examples, r.metrics)
        assert reason in f.method.strategy.check_reply(f.state, f.payloads[liar], bad)


def test_fedpft_apoz_token_counts_are_bounded(tiny_model_dir, tiny_data_dir, tmp_path):
    """APoZ reports are averaged weighted by each client's token count: a count above what its
    examples can hold (examples x data.max_length) is rejected, so one report cannot outweigh
    the others more than its data allows."""
    f = fit_round("fedpft", "mean", tiny_data_dir, tiny_model_dir, tmp_path)
    s, c = f.method.strategy, f.clients[0]
    r = f.replies[c]
    assert f.payloads[c].config.get("report_apoz") and r.metrics["apoz_tokens"] > 0
    bound = len(f.data.partitions[c]) * 16  # the client's examples x data.max_length
    for tokens, ok in [(bound, True), (bound + 1, False), (10**12, False), (0, False),
                       (-5, False), (2.5, False), ("12", False), (None, False)]:
        metrics = {**r.metrics, "apoz_tokens": tokens}
        if tokens is None:
            del metrics["apoz_tokens"]
        reason = s.validate(f.state, f.payloads[c], Reply(r.arrays, r.num_examples, metrics))
        assert (reason is None) == ok, (tokens, reason)
        if not ok:
            assert "apoz_tokens" in reason
