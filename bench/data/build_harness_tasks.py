"""Build the local data files of fedslice's offline lm-evaluation-harness tasks.

The tasks (``src/fedslice/harness_tasks/*.yaml``) read JSONL files from the folder
``$FEDSLICE_HARNESS_DATA`` (default ``~/.cache/fedslice/harness``); this script writes them there
from public GitHub repositories, each read at a fixed commit from a local git copy (the session's
``fetch`` tool puts them under /work/.mirror/OWNER+NAME/repo). Every source file is checked
against its recorded sha256, so the output is the same on every machine; ``MANIFEST.json`` in the
output folder records the source repository, commit, path, sha256, licence and row counts.

    python bench/data/build_harness_tasks.py [--mirrors /work/.mirror] [--out DIR]

Sources (the data sets' own licences; the repositories only carry copies):

* ARC-Easy / ARC-Challenge (AI2, CC BY-SA 4.0): the train and dev ("validation") splits from
  raybears/cot-transparency (its test files are Git LFS pointers, so the test split is absent).
* MMLU (Hendrycks et al., MIT): the 57 subjects' test and dev CSVs from raybears/cot-transparency.
* TruthfulQA (Lin et al., Apache-2.0): ``mc_task.json`` (MC1/MC2 targets) from the same repo.
* GSM8K (OpenAI, MIT): ``test.jsonl`` and ``train.jsonl`` from openai/grade-school-math.
* HellaSwag (Zellers et al., MIT): the 10,042 validation items, as klosax/hellaswag_text_data
  extracted them from rowanz/hellaswag's ``hellaswag_val.jsonl`` (6 lines per item).
"""

from __future__ import annotations

import argparse
import bz2
import csv
import hashlib
import io
import json
import os
import random
import subprocess
import sys
from pathlib import Path

COT = ("raybears/cot-transparency", "f6874394ba80a439237e4d7581dddc30d40c1830", "MIT (repository)")
GSM = ("openai/grade-school-math", "3101c7d5072418e28b9008a6636bde82a006892c", "MIT")
HSW = ("klosax/hellaswag_text_data", "1105d370f8340eac3c63a91fd1fa58e8999f9505", "none stated")

#: every source file: (repository, path) -> sha256
SHA256 = {
    (COT[0], "data/arc_easy/ARC-Easy-Dev.jsonl"):
        "f4364b808a68df6bf500ce1070fb0105d40cacd2391c210deb00ff83ba75d1f4",
    (COT[0], "data/arc_easy/ARC-Easy-Train.jsonl"):
        "c62e5482d8c01f2d5a7f24239ac9db3b12f9e47267c4e3f088c6ffe41d5545ef",
    (COT[0], "data/arc_challenge/ARC-Challenge-Dev.jsonl"):
        "55224364abd2477f66a9a57c5cbef109fb71d83019aa5e37aec0e7ab757746ca",
    (COT[0], "data/arc_challenge/ARC-Challenge-Train.jsonl"):
        "e02837c53ee86f6d73c259f91c77725c5062ef4531130b7f473a9d9b01118a77",
    (COT[0], "data/truthful_qa/mc_task.json"):
        "b3799639bc76c939836d587de7d30b48d91012cb34be04806d33106ce06c162a",
    (GSM[0], "grade_school_math/data/train.jsonl"):
        "17f347dc51477c50d4efb83959dbb7c56297aba886e5544ee2aaed3024813465",
    (GSM[0], "grade_school_math/data/test.jsonl"):
        "3730d312f6e3440559ace48831e51066acaca737f6eabec99bccb9e4b3c39d14",
    (HSW[0], "hellaswag_val_full.txt.bz2"):
        "50b637899e4263c2bc456c2dc726c95d2c8cd8e2a552ea5bd7719ce3cb03fe5b",
}
#: every file written (the MMLU subjects' CSVs are checked through these)
OUTPUT_SHA256 = {
    "arc_challenge/train.jsonl":
        "d9bb22c93de0979aa8b2419d08f3308b1b4270a532dad0d700d6885791ad673b",
    "arc_challenge/validation.jsonl":
        "16b59737cb520f748020546b5e3fa76f0893d1a1237bb350dd81dd43a09f151b",
    "arc_easy/train.jsonl":
        "e056196c54d10e57c57e48b09bc7618ac073da4c6e0cf5fafd0b2e4bf42d8062",
    "arc_easy/validation.jsonl":
        "af1b2dbf1546897c33872e9588f54db667133495a20d511ab0dc402a855e3a3d",
    "gsm8k/test.jsonl":
        "51b901a6559b123df91167acbe3ed6d6d5d404ee6fa0773a4da19fd9d44c767a",
    "gsm8k/train.jsonl":
        "9556bf9d7dba73d7fcaaeff6ca814c71684db1d8e8d485d83ec62f1c428b888d",
    "hellaswag/validation.jsonl":
        "5b9fb2eac5b7c08092e43b8e23b706359bacb06b58e47a46165d0dbb05a003b4",
    "mmlu/dev.jsonl":
        "79677d836f37b53ead5e582e5267e95763d830d5794a410f24273d52d7bdecd3",
    "mmlu/test.jsonl":
        "19e9edfa014786ce8c96b7a95ffd77375eda9f1c8768f2c1b3f8aded222dfde8",
    "truthfulqa/validation.jsonl":
        "4062695ee33727e52d16a1ecabd07a692596fa9ca9d2269d202a5753aa9e4e6e",
}


class Source:
    """Files of one repository at one commit, read from its local git copy."""

    def __init__(self, mirrors: Path, repo: str, commit: str, licence: str):
        self.repo, self.commit, self.licence = repo, commit, licence
        root = mirrors / repo.replace("/", "+") / "repo"
        self.git_dir = root / ".git" if (root / ".git").is_dir() else root
        if not self.git_dir.is_dir():
            sys.exit(f"no local copy of {repo} at {root}: fetch github:{repo} first")
        self.files: list[dict] = []

    def read(self, path: str) -> bytes:
        out = subprocess.run(["git", f"--git-dir={self.git_dir}", "show", f"{self.commit}:{path}"],
                             capture_output=True, check=False)
        if out.returncode != 0:
            sys.exit(f"{self.repo}@{self.commit[:12]}:{path}: {out.stderr.decode().strip()}")
        data = out.stdout
        if data.startswith(b"version https://git-lfs"):
            sys.exit(f"{self.repo}:{path} is a Git LFS pointer, not the data")
        digest = hashlib.sha256(data).hexdigest()
        want = SHA256.get((self.repo, path))
        if want is not None and digest != want:
            sys.exit(f"{self.repo}:{path}: sha256 {digest}, expected {want}")
        self.files.append({"path": path, "sha256": digest, "bytes": len(data)})
        return data

    def listing(self, folder: str) -> list[str]:
        out = subprocess.run(["git", f"--git-dir={self.git_dir}", "ls-tree", "--name-only",
                              f"{self.commit}:{folder}"], capture_output=True, text=True, check=True)
        return sorted(f"{folder}/{n}" for n in out.stdout.split())

    def record(self) -> dict:
        return {"repository": f"github:{self.repo}", "commit": self.commit,
                "repository_licence": self.licence, "files": self.files}


def jsonl(data: bytes) -> list[dict]:
    return [json.loads(line) for line in data.decode("utf-8").splitlines() if line.strip()]


def arc(src: Source, name: str, stem: str) -> dict[str, list[dict]]:
    """HF ``allenai/ai2_arc`` layout: id, question, choices {text, label}, answerKey."""
    out = {}
    for split, part in (("train", "Train"), ("validation", "Dev")):
        rows = []
        for r in jsonl(src.read(f"data/{name}/{stem}-{part}.jsonl")):
            ch = r["question"]["choices"]
            rows.append({"id": r["id"], "question": r["question"]["stem"],
                         "choices": {"text": [c["text"] for c in ch],
                                     "label": [c["label"] for c in ch]},
                         "answerKey": r["answerKey"]})
        out[split] = rows
    return out


def mmlu(src: Source) -> dict[str, list[dict]]:
    """HF ``cais/mmlu`` layout: question, subject, choices (4), answer (0-3). The test rows are
    shuffled once (seed 0) so that ``--limit N`` takes a sample across the 57 subjects."""
    out = {}
    for split in ("test", "dev"):
        rows = []
        for path in src.listing(f"data/mmlu/{split}"):
            subject = Path(path).name[: -len(f"_{split}.csv")]
            for rec in csv.reader(io.StringIO(src.read(path).decode("utf-8"))):
                if not rec:
                    continue
                q, a, b, c, d, key = rec
                rows.append({"question": q, "subject": subject, "choices": [a, b, c, d],
                             "answer": "ABCD".index(key.strip())})
        if split == "test":
            random.Random(0).shuffle(rows)
        out[split] = rows
    return out


def truthfulqa(src: Source) -> dict[str, list[dict]]:
    """HF ``truthful_qa`` multiple_choice layout: question, mc1_targets / mc2_targets
    {choices, labels}, in the file's order of answers."""
    rows = []
    for r in json.loads(src.read("data/truthful_qa/mc_task.json")):
        rows.append({"question": r["question"],
                     **{k: {"choices": list(r[k]), "labels": list(r[k].values())}
                        for k in ("mc1_targets", "mc2_targets")}})
    return {"validation": rows}


def gsm8k(src: Source) -> dict[str, list[dict]]:
    return {split: [{"question": r["question"], "answer": r["answer"]}
                    for r in jsonl(src.read(f"grade_school_math/data/{split}.jsonl"))]
            for split in ("train", "test")}


def hellaswag(src: Source) -> dict[str, list[dict]]:
    """6 lines per item: ``activity_label: ctx`` (bracket tags removed), the gold ending's index,
    the 4 endings. Written as ctx, endings, label."""
    lines = bz2.decompress(src.read("hellaswag_val_full.txt.bz2")).decode("utf-8").split("\n")
    if lines and lines[-1] == "":
        lines.pop()
    if len(lines) % 6:
        sys.exit(f"{src.repo}: {len(lines)} lines, not 6 per item")
    rows = [{"ctx": lines[i], "label": int(lines[i + 1]), "endings": lines[i + 2:i + 6]}
            for i in range(0, len(lines), 6)]
    return {"validation": rows}


def write(out: Path, name: str, splits: dict[str, list[dict]]) -> dict[str, dict]:
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    files = {}
    for split, rows in splits.items():
        path = folder / f"{split}.jsonl"
        text = "".join(json.dumps(r, ensure_ascii=False, sort_keys=True) + "\n" for r in rows)
        digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
        want = OUTPUT_SHA256.get(f"{name}/{split}.jsonl")
        if want is not None and digest != want:
            sys.exit(f"{path}: sha256 {digest}, expected {want} (a changed source or builder)")
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text(text, encoding="utf-8")
        tmp.replace(path)
        files[split] = {"file": f"{name}/{split}.jsonl", "rows": len(rows), "sha256": digest}
    return files


DATASETS = {  # name: (source, builder, licence of the data set)
    "arc_easy": (COT, lambda s: arc(s, "arc_easy", "ARC-Easy"), "CC BY-SA 4.0"),
    "arc_challenge": (COT, lambda s: arc(s, "arc_challenge", "ARC-Challenge"), "CC BY-SA 4.0"),
    "mmlu": (COT, mmlu, "MIT"),
    "truthfulqa": (COT, truthfulqa, "Apache-2.0"),
    "gsm8k": (GSM, gsm8k, "MIT"),
    "hellaswag": (HSW, hellaswag, "MIT"),
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mirrors", type=Path, default=Path("/work/.mirror"),
                   help="folder of the fetched repositories (OWNER+NAME/repo)")
    p.add_argument("--out", type=Path, default=Path(os.environ.get("FEDSLICE_HARNESS_DATA") or
                                                     Path.home() / ".cache/fedslice/harness"))
    p.add_argument("--only", nargs="*", choices=sorted(DATASETS), help="build only these")
    args = p.parse_args(argv)
    manifest = {"builder": "bench/data/build_harness_tasks.py", "datasets": {}}
    old = args.out / "MANIFEST.json"
    if old.is_file():
        manifest["datasets"].update(json.loads(old.read_text())["datasets"])
    for name in args.only or sorted(DATASETS):
        (repo, commit, repo_licence), build, licence = DATASETS[name]
        src = Source(args.mirrors, repo, commit, repo_licence)
        files = write(args.out, name, build(src))
        manifest["datasets"][name] = {"licence": licence, "source": src.record(), "splits": files}
        print(f"{name}: " + ", ".join(f"{s} {f['rows']} rows" for s, f in files.items()))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "MANIFEST.json").write_text(json.dumps(manifest, indent=2) + "\n")
    print(f"written: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
