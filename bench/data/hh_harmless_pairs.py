"""Build a small preference set from Anthropic's HH-RLHF (harmless-base, its test file: the one
file of the public GitHub repository anthropics/hh-rlhf stored there, not as a Git LFS pointer).

Keeps the single-turn conversations (one human turn, then the assistant's answer) whose chosen
and rejected transcripts share that human turn and end in different, non-empty answers; writes
``prompt`` (the human turn), ``chosen``, ``rejected`` (the two answers) as JSONL, split by a
seeded permutation into test / dev / train. Deterministic: the same input file gives the same
files (checked by the input's sha256). Licence of the data: MIT (the repository's LICENSE).

    python bench/data/hh_harmless_pairs.py [--mirror GIT_DIR | --file test.jsonl.gz] [--out DIR]

``--mirror``: a clone (bare is fine) of github.com/anthropics/hh-rlhf at commit COMMIT; default
/work/.mirror/anthropics+hh-rlhf/repo. ``--out``: default ~/.cache/fedslice/data/hh-harmless-single
($FEDSLICE_CACHE_DIR/data when set; data.path = "hh-harmless-single" finds it there). The data
stays out of git and out of ../shared.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import json
import os
import random
import subprocess
from pathlib import Path

REPO = "anthropics/hh-rlhf"
COMMIT = "354e5c3cb8960630860dd5774a6ac2a58313bf4d"
PATH = "harmless-base/test.jsonl.gz"
SHA256 = "ebfaaed21162a4de120ae85366075b34425e2a6303fac59b99555002f7016f03"
LICENSE = "MIT (Copyright (c) 2022 Anthropic)"
SEED = 0
SIZES = {"test": 150, "dev": 50}  # the rest is train
HUMAN, ASSISTANT = "\n\nHuman:", "\n\nAssistant:"


def last_answer(text: str) -> tuple[str, str]:
    """(the transcript before the last assistant turn, that turn's answer)."""
    i = text.rfind(ASSISTANT)
    return text[:i], text[i + len(ASSISTANT):].strip()


def single_turn_pairs(records: list[dict]) -> tuple[list[dict], dict[str, int]]:
    pairs, dropped = [], {"multi_turn": 0, "prefix_differs": 0, "empty_or_same": 0}
    for r in records:
        before, chosen = last_answer(r["chosen"])
        before_r, rejected = last_answer(r["rejected"])
        if before != before_r:
            dropped["prefix_differs"] += 1
            continue
        if before.count(HUMAN) != 1 or ASSISTANT in before:
            dropped["multi_turn"] += 1
            continue
        prompt = before.replace(HUMAN, "", 1).strip()
        if not (prompt and chosen and rejected) or chosen == rejected:
            dropped["empty_or_same"] += 1
            continue
        pairs.append({"prompt": prompt, "chosen": chosen, "rejected": rejected})
    return pairs, dropped


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mirror", default="/work/.mirror/anthropics+hh-rlhf/repo")
    ap.add_argument("--file", help="the harmless-base test.jsonl.gz itself (instead of --mirror)")
    cache = Path(os.environ.get("FEDSLICE_CACHE_DIR") or Path.home() / ".cache" / "fedslice").expanduser()
    ap.add_argument("--out", default=str(cache / "data" / "hh-harmless-single"))
    args = ap.parse_args(argv)
    if args.file:
        raw = Path(args.file).read_bytes()
    else:
        raw = subprocess.run(["git", "-C", args.mirror, "show", f"{COMMIT}:{PATH}"],
                             check=True, capture_output=True).stdout
    digest = hashlib.sha256(raw).hexdigest()
    if digest != SHA256:
        raise SystemExit(f"{PATH}: sha256 {digest}, expected {SHA256} (another version of the file)")
    records = [json.loads(line) for line in gzip.decompress(raw).decode("utf-8").splitlines() if line.strip()]
    pairs, dropped = single_turn_pairs(records)
    order = list(range(len(pairs)))
    random.Random(SEED).shuffle(order)
    splits, at = {}, 0
    for name, n in SIZES.items():
        splits[name] = [pairs[i] for i in order[at:at + n]]
        at += n
    splits["train"] = [pairs[i] for i in order[at:]]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in splits.items():
        with (out / f"{name}.jsonl").open("w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    source = {"repository": f"github.com/{REPO}", "commit": COMMIT, "path": PATH, "sha256": digest,
              "license": LICENSE, "records": len(records), "single_turn_pairs": len(pairs),
              "dropped": dropped, "seed": SEED, "rows": {k: len(v) for k, v in splits.items()},
              "columns": ["prompt", "chosen", "rejected"],
              "files_sha256": {f"{k}.jsonl": hashlib.sha256((out / f"{k}.jsonl").read_bytes()).hexdigest()
                               for k in splits}}
    (out / "SOURCE.json").write_text(json.dumps(source, indent=2) + "\n")
    print(json.dumps(source, indent=2))


if __name__ == "__main__":
    main()
