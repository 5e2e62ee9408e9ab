"""Build a 4-topic news classification set (AG News) of about 9,000 training texts, the shape of
issue 61's case (most texts reach ``data.max_length = 64`` MiniLM tokens).

AG's News Topic Classification Dataset (Zhang, Zhao & LeCun, NIPS 2015; built from A. Gulli's AG
corpus), classes World, Sports, Business, Sci/Tech. Its 120,000-row train.csv (29 MiB) is not
held whole by any public snapshot reachable here (files of 4 MiB and more are left out), so the
pool is two verbatim pieces of the original CSVs from public GitHub repositories:

- the whole official test split, 7,600 rows: mhjabreel/CharCnn_Keras at
  555590db4219b1243abb1918effd6a7425a2d75f, ``data/ag_news_csv/test.csv``, sha256
  521465c2428ed7f02f8d6db6ffdd4b5447c1c701962353eb2c40d548c3c85699 (its MD5
  d52ea96a97a2d943681189a97654912d is the one torchtext publishes for the original file);
- the first 2,000 rows of the official train split: amrayach/PML at
  190283295f4bb0b5d9860568b3f02a70ef790e37, ``datasets/ag_news/train.csv``, sha256
  fe1b508b8e4b92d6dedf36c21756e0568a7693a0b7fc244bea416e918308318f (its first row is the
  original's, "Wall St. Bears Claw Back Into the Black").

The 9,600 rows are shuffled with seed 0 and cut into test 300, dev 300 and train 9,000 (so the
benchmark's train split holds texts of the official test split too: this set measures memory and
FLOPs, not a published accuracy). Each row: ``text`` = title + " " + description (as Hugging
Face's ag_news), the CSV's ``\\`` line-break escapes as spaces; ``label`` = class index - 1
(0 World, 1 Sports, 2 Business, 3 Sci/Tech). Rows written by 9,600 -> 9,000 / 300 / 300.

Licence of the data: none stated by either repository (neither has a LICENSE file); the
dataset's own readme says it "is provided by the academic comunity for research purposes in data
mining ... and any other non-commercial activity". Used here for a non-commercial benchmark only.

Deterministic: the same inputs (checked by sha256) give the same files; ``SOURCE.json`` beside
them records the sources, commits, checksums, licence, seed, row counts and the files' sha256.
The data stays out of git (bench/data/out/ is ignored).

    python bench/data/ag_news.py [--out bench/data/out/ag_news]

``--charcnn`` / ``--pml``: git directories of the two repositories (default: the ``fetch``
mirrors under /work/.mirror). Then ``data.path = "<out>"`` in a config reads train/dev/test.csv
(columns ``text,label``).
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import random
import subprocess
from pathlib import Path

SOURCES = [
    {"repository": "github.com/mhjabreel/CharCnn_Keras",
     "commit": "555590db4219b1243abb1918effd6a7425a2d75f", "path": "data/ag_news_csv/test.csv",
     "sha256": "521465c2428ed7f02f8d6db6ffdd4b5447c1c701962353eb2c40d548c3c85699",
     "rows": 7600, "what": "AG News official test split (whole)", "arg": "charcnn",
     "mirror": "/work/.mirror/mhjabreel+CharCnn_Keras/repo"},
    {"repository": "github.com/amrayach/PML",
     "commit": "190283295f4bb0b5d9860568b3f02a70ef790e37", "path": "datasets/ag_news/train.csv",
     "sha256": "fe1b508b8e4b92d6dedf36c21756e0568a7693a0b7fc244bea416e918308318f",
     "rows": 2000, "what": "AG News official train split, its first 2,000 rows", "arg": "pml",
     "mirror": "/work/.mirror/amrayach+PML/repo"},
]
LICENSE = ("none stated by either repository; the dataset's readme: provided by the academic "
           "community for research purposes ... and any other non-commercial activity")
CLASSES = ["World", "Sports", "Business", "Sci/Tech"]
SEED = 0
SIZES = {"test": 300, "dev": 300, "train": 9000}
ROOT = Path(__file__).resolve().parents[2]


def read_source(src: dict, git_dir: str) -> list[tuple[str, int]]:
    """(text, label) rows of one source file, its sha256 checked."""
    raw = subprocess.run(["git", "-C", git_dir, "show", f"{src['commit']}:{src['path']}"],
                         check=True, capture_output=True).stdout
    digest = hashlib.sha256(raw).hexdigest()
    if digest != src["sha256"]:
        raise SystemExit(f"{src['repository']} {src['path']}: sha256 {digest}, expected {src['sha256']}")
    rows = []
    for i, rec in enumerate(csv.reader(io.StringIO(raw.decode("utf-8"))), start=1):
        if len(rec) != 3 or rec[0] not in ("1", "2", "3", "4"):
            raise SystemExit(f"{src['path']} row {i}: expected class index 1-4, title, description; got {rec[:1]}")
        text = " ".join(f"{rec[1]} {rec[2]}".replace("\\n", " ").replace("\\", " ").split())
        rows.append((text, int(rec[0]) - 1))
    if len(rows) != src["rows"]:
        raise SystemExit(f"{src['path']}: {len(rows)} rows, expected {src['rows']}")
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for src in SOURCES:
        ap.add_argument(f"--{src['arg']}", default=src["mirror"], help=f"git directory of {src['repository']}")
    ap.add_argument("--out", type=Path, default=ROOT / "bench/data/out/ag_news")
    args = ap.parse_args(argv)
    pool = [row for src in SOURCES for row in read_source(src, getattr(args, src["arg"]))]
    order = list(range(len(pool)))
    random.Random(SEED).shuffle(order)
    args.out.mkdir(parents=True, exist_ok=True)
    at, files = 0, {}
    for name, n in SIZES.items():
        path = args.out / f"{name}.csv"
        with path.open("w", encoding="utf-8", newline="") as f:
            w = csv.writer(f)
            w.writerow(["text", "label"])
            w.writerows(pool[i] for i in order[at:at + n])
        at += n
        files[path.name] = hashlib.sha256(path.read_bytes()).hexdigest()
    record = {"dataset": "AG News (Zhang, Zhao & LeCun 2015)", "classes": CLASSES,
              "sources": [{k: v for k, v in s.items() if k not in ("arg", "mirror")} for s in SOURCES],
              "license": LICENSE, "pool_rows": len(pool), "seed": SEED, "rows": SIZES,
              "unused_rows": len(pool) - at, "columns": ["text", "label"], "files_sha256": files,
              "builder": "bench/data/ag_news.py"}
    (args.out / "SOURCE.json").write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps(record, indent=2))


if __name__ == "__main__":
    main()
