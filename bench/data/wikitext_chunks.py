"""Build a long-text classification set from WikiText-2: 50-word chunks with random 4-way labels,
the long-text profile of issue 61 (every text past ``data.max_length = 64`` MiniLM tokens).

Input: ../shared/data/wikitext2 (Merity et al. 2016, "Pointer Sentinel Mixture Models"; licence
CC BY-SA 3.0), its raw ``valid.txt`` (sha256 f0737ed3...) and ``test.txt`` (sha256 d790b833...),
checked. The words of every non-empty, non-heading line (headings are `` = Title = `` lines), valid
then test, are cut into consecutive chunks of 50 words (the last, shorter one dropped): 8,903
chunks. Labels are drawn uniformly from 0..3 with ``random.Random(0)`` (they carry no meaning:
this set measures memory and FLOPs on long texts, not accuracy). The chunks are shuffled with the
same generator and cut into test 200, dev 200 and train 8,503.

Deterministic: the same inputs give the same files; ``SOURCE.json`` beside them records the
inputs' sha256, licence, seed, row counts and the files' sha256. The data stays out of git
(bench/data/out/ is ignored).

    python bench/data/wikitext_chunks.py [--src ../shared/data/wikitext2] [--out bench/data/out/wikitext_chunks]
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FILES = {"valid.txt": "f0737ed31fc1329026e95cb8b98e19c2a182c39c240ab909dc31abf2f8af58e8",
         "test.txt": "d790b833ef8cf03a90db7bf1271b7520b83c45ce07ba3c1a9699df81e239eca0"}
LICENSE = "CC BY-SA 3.0 (WikiText-2, Merity et al. 2016)"
WORDS, LABELS, SEED = 50, 4, 0
SIZES = {"test": 200, "dev": 200}  # the rest is train


def words_of(path: Path) -> list[str]:
    raw = path.read_bytes()
    digest = hashlib.sha256(raw).hexdigest()
    if digest != FILES[path.name]:
        raise SystemExit(f"{path}: sha256 {digest}, expected {FILES[path.name]}")
    words = []
    for line in raw.decode("utf-8").splitlines():
        s = line.strip()
        if s and not (s.startswith("=") and s.endswith("=")):
            words.extend(s.split())
    return words


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--src", type=Path, default=ROOT.parent / "shared/data/wikitext2")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/data/out/wikitext_chunks")
    args = ap.parse_args(argv)
    words = [w for name in FILES for w in words_of(args.src / name)]
    chunks = [" ".join(words[i:i + WORDS]) for i in range(0, len(words) - WORDS + 1, WORDS)]
    rng = random.Random(SEED)
    rows = [(c, rng.randrange(LABELS)) for c in chunks]
    rng.shuffle(rows)
    splits, at = {}, 0
    for name, n in SIZES.items():
        splits[name] = rows[at:at + n]
        at += n
    splits["train"] = rows[at:]
    args.out.mkdir(parents=True, exist_ok=True)
    files = {}
    for name, part in splits.items():
        path = args.out / f"{name}.csv"
        with path.open("w", encoding="utf-8", newline="") as f:
            w = csv.writer(f)
            w.writerow(["text", "label"])
            w.writerows(part)
        files[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    record = {"dataset": "WikiText-2 raw valid+test, 50-word chunks, random labels",
              "source": str(args.src), "inputs_sha256": FILES, "license": LICENSE,
              "words_per_chunk": WORDS, "labels": LABELS, "seed": SEED, "chunks": len(chunks),
              "rows": {k: len(v) for k, v in splits.items()}, "columns": ["text", "label"],
              "files_sha256": files, "builder": "bench/data/wikitext_chunks.py"}
    (args.out / "SOURCE.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
