"""The unlabeled distillation corpus: server-side text, packed into fixed-length token chunks.

A corpus is a text file, a folder of text files, or a hub dataset id. ``.txt`` files hold one
passage per line (blank lines are skipped); ``.jsonl``/``.tsv``/``.csv`` files hold one passage
per row in ``text_column``. Lines are tokenized without special tokens, concatenated in file order
and cut into chunks of ``max_length - 2`` tokens wrapped in the tokenizer's CLS/SEP (or BOS/EOS) (like
the public FedPFT code's 512-token chunks of BookCorpus + Wikipedia).

The corpus is never a client's data: a corpus path equal to, inside, or containing the task's
``data.path`` folder is refused.
"""

from __future__ import annotations

import csv
import hashlib
import json
from collections.abc import Iterator
from pathlib import Path

import torch

from fedslice.config import DistillConfig
from fedslice.data.batching import TokenizedSplit, pad_token_id_of
from fedslice.data.locate import resolve_source
from fedslice.data.sources import data_search_dirs
from fedslice.errors import ConfigError, DataError

TEXT_SUFFIXES = (".txt", ".jsonl", ".tsv", ".csv")
#: ``distill.corpus`` of an image task: the training images the server keeps apart
HOLDOUT = "server_holdout"


def resolve_corpus(corpus: str, field: str, search_dirs: list[Path]) -> Path | str:
    """A corpus reference -> an existing file/folder, or a hub id (text without path syntax)."""
    text = corpus.strip()
    if not text:
        raise ConfigError(f"{field} is empty: give a text file, a folder or a hub dataset id")
    path = Path(text).expanduser()
    candidates = [path] if path.is_absolute() else [Path(d) / path for d in search_dirs]
    for c in candidates:
        if c.exists():
            return c.resolve()
    if text.startswith((".", "/", "~")) or text.count("/") > 1 or Path(text).suffix in TEXT_SUFFIXES:
        looked = ", ".join(str(c) for c in candidates)
        raise ConfigError(f"{field}: {text!r} does not exist (looked at: {looked})")
    return text


def check_not_client_data(corpus: Path | str, data_source: Path | str, field: str) -> None:
    """Refuse a corpus that is (or overlaps) the clients' data folder."""
    if not isinstance(corpus, Path) or not isinstance(data_source, Path):
        if corpus == data_source:
            raise ConfigError(f"{field}: {corpus!r} is the clients' data (data.path): distillation "
                              "must use server-side text")
        return
    a, b = corpus.resolve(), data_source.resolve()
    if a == b or b in a.parents or a in b.parents:
        raise ConfigError(f"{field}: {corpus} overlaps the clients' data folder {data_source} "
                          "(data.path): distillation must use server-side text")


def corpus_files(root: Path) -> list[Path]:
    """The text files of a corpus path, in a fixed (sorted) order."""
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)


def iter_passages(source: Path | str, cfg: DistillConfig) -> Iterator[str]:
    """Non-empty passages of the corpus, in order."""
    if isinstance(source, str):
        yield from _hub_passages(source, cfg)
        return
    for path in corpus_files(source):
        yield from _file_passages(path, cfg.text_column)


def _file_passages(path: Path, column: str) -> Iterator[str]:
    with open(path, encoding="utf-8", errors="replace", newline="") as f:
        if path.suffix == ".txt":
            rows = (line for line in f)
        elif path.suffix == ".jsonl":
            rows = (json.loads(line).get(column, "") for line in f if line.strip())
        else:
            reader = csv.DictReader(f, delimiter="\t" if path.suffix == ".tsv" else ",")
            rows = (row.get(column) or "" for row in reader)
        for text in rows:
            text = str(text).strip()
            if text:
                yield text


def _hub_passages(dataset_id: str, cfg: DistillConfig) -> Iterator[str]:
    """Passages of a hub dataset given as ``name`` or ``name:subset`` (needs network or cache)."""
    from datasets import load_dataset
    name, _, subset = dataset_id.partition(":")
    try:
        ds = load_dataset(name, subset or None, split=cfg.hub_split)
    except Exception as e:  # noqa: BLE001 - any hub failure is a config problem for the user
        raise ConfigError(f"distill.corpus: cannot load hub dataset {dataset_id!r}: "
                          f"{str(e).splitlines()[0]}") from None
    for row in ds:
        text = str(row.get(cfg.text_column) or "").strip()
        if text:
            yield text


def pack_chunks(passages: Iterator[str], tokenizer, max_length: int, max_chunks: int,
                field: str) -> TokenizedSplit:
    """Tokenize passages lazily and pack them into at most ``max_chunks`` chunks of ``max_length``."""
    first = tokenizer.cls_token_id if tokenizer.cls_token_id is not None else tokenizer.bos_token_id
    last = tokenizer.sep_token_id if tokenizer.sep_token_id is not None else tokenizer.eos_token_id
    wrap = ([first] if first is not None else [], [last] if last is not None else [])
    body = max_length - len(wrap[0]) - len(wrap[1])
    buffer: list[int] = []
    chunks: list[list[int]] = []
    batch: list[str] = []

    def flush() -> None:
        ids = tokenizer(batch, add_special_tokens=False)["input_ids"]
        for row in ids:
            buffer.extend(row)
        batch.clear()
        while len(buffer) >= body and len(chunks) < max_chunks:
            chunks.append(wrap[0] + buffer[:body] + wrap[1])
            del buffer[:body]

    for text in passages:
        batch.append(text)
        if len(batch) == 256:
            flush()
            if len(chunks) >= max_chunks:
                break
    if batch and len(chunks) < max_chunks:
        flush()
    if len(chunks) < max_chunks and len(buffer) >= 8:  # a final shorter chunk
        chunks.append(wrap[0] + buffer[:body] + wrap[1])
    if not chunks:
        raise ConfigError(f"{field}: the distillation corpus is empty (no text to distil on)")
    ids = [torch.tensor(c, dtype=torch.int64) for c in chunks]
    types = [torch.zeros_like(t) for t in ids] if "token_type_ids" in tokenizer.model_input_names else None
    return TokenizedSplit(input_ids=ids, token_type_ids=types,
                          labels=torch.zeros(len(ids), dtype=torch.int64),
                          pad_token_id=pad_token_id_of(tokenizer))


def fingerprint(source: Path | str) -> str:
    """Identity of a corpus for cache keys: its files' names and contents (a copy of the same
    files, or a re-synced folder with new modification times, keeps its cache entries)."""
    if isinstance(source, str):
        return f"hub:{source}"
    h = hashlib.sha256()
    for p in corpus_files(source):
        name = p.relative_to(source) if source.is_dir() else p.name
        h.update(f"{name}:{p.stat().st_size}:".encode())
        with p.open("rb") as f:
            for block in iter(lambda: f.read(1 << 20), b""):
                h.update(block)
    return h.hexdigest()[:16]


def resolve_checked(cfg: DistillConfig, *, field: str, data_path: str | None = None,
                    text: bool = True) -> Path | str:
    """Resolve the corpus of ``cfg`` like data paths and check it is not the clients' data
    (``field`` names it in errors); ``text=False``: a folder of images (an image task's)."""
    source = resolve_corpus(cfg.corpus, field, data_search_dirs())
    if data_path is not None:
        try:
            data_source = resolve_source(data_path, data_search_dirs())
        except DataError:
            data_source = None
        if data_source is not None:
            check_not_client_data(source, data_source, field)
    if not text:
        from fedslice.data.images import IMAGE_SUFFIXES, images_in
        if not isinstance(source, Path) or not source.is_dir() or not images_in(source):
            raise ConfigError(f"{field}: an image backbone distils on images; {cfg.corpus!r} is no "
                              f"folder of images ({', '.join(IMAGE_SUFFIXES)}): use {HOLDOUT!r} "
                              "(with data.server_holdout > 0) or a folder of images")
        return source
    if isinstance(source, Path) and not corpus_files(source):
        raise ConfigError(f"{field}: {source} holds no text files ({', '.join(TEXT_SUFFIXES)})")
    return source


def image_folder_corpus(folder: Path, prep, tokens_for, field: str):
    """Every image under ``folder`` (sorted; labels unused), preprocessed like the task's images
    (undecodable ones skipped)."""
    import numpy as np

    from fedslice.data.images import ImageBank, RawImageSplit, images_in, encode_images, image_cache_dir

    paths = [str(p) for p in images_in(folder)]
    bank = ImageBank(paths, folder, str(folder), "image", list(range(1, len(paths) + 1)))
    raw = RawImageSplit(bank, np.arange(len(paths)), [0] * len(paths), str(folder))
    return encode_images({"corpus": raw}, prep, tokens_for, skip_bad=True,
                         cache_dir=image_cache_dir())["corpus"]


def load_corpus(cfg: DistillConfig, tokenizer, max_chunks: int, *, field: str,
                data_path: str | None = None) -> tuple[TokenizedSplit, Path | str]:
    """Resolve, check and pack the corpus of ``cfg`` into at most ``max_chunks`` chunks."""
    source = resolve_checked(cfg, field=field, data_path=data_path)
    return pack_chunks(iter_passages(source, cfg), tokenizer, cfg.max_length, max_chunks, field), source
