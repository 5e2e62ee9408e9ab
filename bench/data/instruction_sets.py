"""Build the two Alpaca-style instruction sets of ``bench/llm_instruct.py`` (issue 57, part 5).

``alpaca-gpt4-demo``: LLaMA-Factory's ``data/alpaca_en_demo.json`` (999 Alpaca-GPT4 rows:
``instruction``, ``input``, ``output``; the GPT-4 answers of Peng et al. 2023 to Alpaca's
instructions, FlowerTune's general-NLP data), the one public copy of Alpaca(-GPT4) under 4 MiB
that the mirror holds (tatsu-lab/stanford_alpaca's ``alpaca_data.json`` is 22 MB and absent
there). IID clients.

``alpaca-eval-gpt4``: AlpacaEval's 805 instructions with GPT-4's answers
(``results/gpt4/model_outputs.json`` of tatsu-lab/alpaca_eval), whose ``dataset`` column names
where each instruction comes from (selfinstruct, oasst, koala, helpful_base, vicuna): the
category column of the natural client split (``data.client_column = "dataset"``, 5 clients).

Each set is split by a seeded permutation into test / dev / train (JSONL, the source's columns;
empty ``input`` cells dropped from the row, as the Alpaca preset treats them alike) and a
``SOURCE.json`` records the repository, commit, path, sha256, licences and row counts.
Deterministic: the same input bytes (checked against the recorded sha256) give the same files.

    python bench/data/instruction_sets.py [--out DIR] [--mirrors DIR]

``--mirrors``: the folder of bare clones named ``owner+name/repo`` (default /work/.mirror, as
the ``fetch`` tool leaves them); ``--out``: default ~/.cache/fedslice/data (``data.path =
"alpaca-gpt4-demo"`` finds it there). The data stays out of git.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import random
import subprocess
from pathlib import Path

SEED = 0
SETS = {
    "alpaca-gpt4-demo": {
        "repository": "hiyouga/LLaMA-Factory",
        "commit": "ff6d4d12eeb035d6ce06805a5733dd7b29f2ac30",
        "path": "data/alpaca_en_demo.json",
        "sha256": "bcc37c64db1a739a0789a1b81f251146fcf4459f903474bc9e3c21bbb5628318",
        "licence": "CC BY-NC 4.0 (Alpaca-GPT4 data, Peng et al. 2023; GPT-4 outputs under "
                   "OpenAI's terms); the repository is Apache-2.0",
        "columns": ["instruction", "input", "output"],
        "sizes": {"test": 100, "dev": 50},
    },
    "alpaca-eval-gpt4": {
        "repository": "tatsu-lab/alpaca_eval",
        "commit": "cd543a149df89434d8a54582c0151c0b945c3d20",
        "path": "results/gpt4/model_outputs.json",
        "sha256": "9c5149c146fadc99285f23abbaec2a62ba94ffa35c1dddacb70686571d9d780e",
        "licence": "CC BY-NC 4.0 (AlpacaEval data; GPT-4 outputs under OpenAI's terms); the "
                   "repository's code is Apache-2.0",
        "columns": ["dataset", "instruction", "output"],
        "sizes": {"test": 100, "dev": 50},
    },
}


def rows_of(raw: bytes, columns: list[str]) -> list[dict]:
    """The source's rows, its ``columns`` only (an empty ``input`` left out)."""
    out = []
    for r in json.loads(raw.decode("utf-8")):
        row = {c: r[c] for c in columns if c in r and not (c == "input" and not str(r[c]).strip())}
        out.append(row)
    return out


def split(rows: list[dict], sizes: dict[str, int]) -> dict[str, list[dict]]:
    order = list(range(len(rows)))
    random.Random(SEED).shuffle(order)
    out, at = {}, 0
    for name, n in sizes.items():
        out[name] = [rows[i] for i in order[at:at + n]]
        at += n
    out["train"] = [rows[i] for i in order[at:]]
    return out


def build(name: str, raw: bytes, out: Path) -> dict:
    spec = SETS[name]
    digest = hashlib.sha256(raw).hexdigest()
    if spec["sha256"] and digest != spec["sha256"]:
        raise SystemExit(f"{spec['repository']}:{spec['path']}: sha256 {digest}, expected "
                         f"{spec['sha256']} (another version of the file)")
    rows = rows_of(raw, spec["columns"])
    splits = split(rows, spec["sizes"])
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    for part, part_rows in splits.items():
        with (folder / f"{part}.jsonl").open("w", encoding="utf-8") as f:
            for row in part_rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
    source = {"repository": f"github.com/{spec['repository']}", "commit": spec["commit"],
              "path": spec["path"], "sha256": digest, "bytes": len(raw), "licence": spec["licence"],
              "rows": len(rows), "seed": SEED, "splits": {k: len(v) for k, v in splits.items()},
              "columns": spec["columns"],
              "files_sha256": {f"{k}.jsonl": hashlib.sha256((folder / f"{k}.jsonl").read_bytes()).hexdigest()
                               for k in splits}}
    if "dataset" in spec["columns"]:
        counts: dict[str, int] = {}
        for r in splits["train"]:
            counts[r["dataset"]] = counts.get(r["dataset"], 0) + 1
        source["train_rows_per_dataset"] = dict(sorted(counts.items()))
    (folder / "SOURCE.json").write_text(json.dumps(source, indent=2) + "\n")
    return source


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mirrors", default="/work/.mirror")
    ap.add_argument("--out", default=str(Path.home() / ".cache" / "fedslice" / "data"))
    ap.add_argument("--sets", nargs="*", default=list(SETS))
    args = ap.parse_args(argv)
    for name in args.sets:
        spec = SETS[name]
        git = Path(args.mirrors) / spec["repository"].replace("/", "+") / "repo"
        raw = subprocess.run(["git", "-C", str(git), "show", f"{spec['commit']}:{spec['path']}"],
                             check=True, capture_output=True).stdout
        print(json.dumps({name: build(name, raw, Path(args.out))}, indent=2))


if __name__ == "__main__":
    main()
