"""What secure aggregation costs in upload (issue 60, part 3): bytes a client sends per round
with and without ``privacy.secure_aggregation``, on MiniLM-L6 (fedpetuning; raffm+heads with its
FLOPs tiers), one round of one local step (the bytes do not depend on training). Bytes only: the
machine is shared, no wall times.

    python bench/secagg_bytes.py            (prints a markdown table)
"""

from __future__ import annotations

import sys

from fedslice.api import setup
from fedslice.experiment import load_config
from fedslice.run.engine import Simulation

RUNS = [("fedpetuning (LoRA r16 q,v)", "configs/fedpetuning_sst2.toml", []),
        ("raffm+heads (tiers 0.5/1.0 FLOPs)", "configs/raffm_heads_sst2.toml",
         ["budgets.width_steps=4"]),
        ("raffm+heads (tiers 0.5/0.75 FLOPs)", "configs/raffm_heads_sst2.toml",
         ["budgets.width_steps=4", "budgets.tiers=[{share=0.5,flops_share=0.5},{share=0.5,flops_share=0.75}]"]),
        ("fedpetuning, lora.ranks [4, 8, 16] (tiers 0.987/0.995 FLOPs)", "configs/fedpetuning_sst2.toml",
         ["lora.ranks=[4,8,16]", "method.tiers=[{share=0.5,flops=0.987},{share=0.5,flops=0.995}]"])]
SHRINK = ["federation.rounds=1", "federation.local_steps=1", "federation.clients_per_round=5",
          "data.max_dev_examples=32", "evaluation.every=1", "output.plots=false",
          "output.progress=false", "output.save_weights=false"]


def key_bytes(n: int) -> int:
    """Key material one client sends in a round of ``n``: two public keys (stage 0), one Fernet
    ciphertext of its two shares per other client (stage 1), its shares for the unmasking
    (stage 3, at most one per client), measured from Flower's functions."""
    from fedslice.fl import secagg as sp

    peers = {c: sp.setup(c) for c in range(n)}
    pub = {c: (s.pk1, s.pk2) for c, s in peers.items()}
    out = sp.share_keys(peers[0], pub, max(2, n // 2 + 1))
    shares = sp.unmask_shares(peers[0], [0], list(range(1, n)), 1) if n > 1 else {}
    return len(peers[0].pk1) + len(peers[0].pk2) + sum(map(len, out.values())) + \
        sum(map(len, shares.values()))


def main() -> int:
    rows = []
    for label, path, extra in RUNS:
        cfg = load_config(path, [*SHRINK, *extra, "privacy.secure_aggregation=true"])
        method, data = setup(cfg)
        _, record = Simulation(cfg, method, data).run_round(1, method.initial_state())
        used = [m for m in record["client_metrics"] if m.get("used")]
        plain = [m["bytes_up_plain"] for m in used]  # the reply a plain round would send
        n = len(record["clients"])
        rows.append((label, n, min(plain), max(plain), record["secagg_upload_bytes"],
                     record["secagg_full_upload_bytes"], key_bytes(n), record["secagg_clipped"]))
    print("| method | clients | plain upload min / max (B) | masked vector: union (B) | "
          "masked vector: full shape (B) | keys and shares (B) | secure / plain max | clipped |")
    print("|---|---|---|---|---|---|---|---|")
    for label, n, lo, hi, masked, full, keys, clipped in rows:
        print(f"| {label} | {n} | {lo:,} / {hi:,} | {masked:,} | {full:,} | {keys:,} | "
              f"{(masked + keys) / hi:.2f}x | {clipped} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
