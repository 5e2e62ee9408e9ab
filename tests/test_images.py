"""Image classification (issue 26): image sources (IDX, folders, CSV/JSONL, HF datasets), the
backbone's image processor, cached preprocessing, bad input, the task and its costs on tiny
ViT / DeiT / DINOv2 models."""

from __future__ import annotations

import gzip
import json
import math
import random
import struct
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import SHARED, VISION, stripes, write_image_folder
from fedslice.config import DataConfig
from fedslice.experiment import validate_config
from fedslice.data.images import preprocess as img_preprocess
from fedslice.data.images import sources as img_sources
from fedslice.data.images import ImageSplit, Preprocessor, encode_images, load_image_splits
from fedslice.data.images.sources import read_idx
from fedslice.errors import ConfigError, DataError

FMNIST = SHARED / "data" / "fashion_mnist"


def write_idx(path: Path, array: np.ndarray, compress: bool = True) -> Path:
    """An unsigned-byte IDX file of ``array`` (magic 0x0000 08 ndim, big-endian sizes)."""
    head = bytes([0, 0, 8, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    data = head + np.ascontiguousarray(array, dtype=np.uint8).tobytes()
    path.write_bytes(gzip.compress(data) if compress else data)
    return path


def write_idx_folder(folder: Path, n_train: int = 40, n_test: int = 10, seed: int = 0,
                     compress: bool = True) -> Path:
    """MNIST-style files of 28 x 28 :func:`stripes` images, two classes."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    gz = ".gz" if compress else ""
    for stem, n in (("train", n_train), ("t10k", n_test)):
        labels = np.array([i % 2 for i in range(n)], dtype=np.uint8)
        x = np.stack([np.asarray(stripes(int(l), (28, 28), rng, "L")) for l in labels])
        write_idx(folder / f"{stem}-images-idx3-ubyte{gz}", x, compress)
        write_idx(folder / f"{stem}-labels-idx1-ubyte{gz}", labels, compress)
    return folder


def processor_of(model_dir: Path):
    from fedslice.models.arch import arch_for
    from fedslice.models.loading import load_config, load_preprocessor
    from fedslice.config import ModelConfig
    config, path = load_config(ModelConfig(name=str(model_dir)))
    return load_preprocessor(path, arch_for(config)), config


# --------------------------------------------------------------------------------------------
# IDX files (the MNIST family), Debian's location
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("compress", [True, False])
def test_idx_round_trip_and_errors(tmp_path, compress):
    x = np.arange(2 * 3 * 4, dtype=np.uint8).reshape(2, 3, 4)
    p = write_idx(tmp_path / f"a-idx3-ubyte{'.gz' if compress else ''}", x, compress)
    assert np.array_equal(read_idx(p), x)
    bad = tmp_path / "bad-idx1-ubyte"
    bad.write_bytes(b"\x01\x02\x03\x04")
    with pytest.raises(DataError, match="bad-idx1-ubyte: not an IDX file"):
        read_idx(bad)
    short = tmp_path / "short-idx3-ubyte"
    short.write_bytes(p.read_bytes()[:-3] if not compress else gzip.decompress(p.read_bytes())[:-3])
    with pytest.raises(DataError, match=r"short-idx3-ubyte: IDX header says 2x3x4 = 24 bytes, the file holds 21"):
        read_idx(short)


def test_idx_folder_splits_and_label_names(tmp_path):
    folder = write_idx_folder(tmp_path / "mnistish")
    d = DataConfig(path=str(folder), labels=["left", "right"], holdout_fraction=0.25)
    splits = load_image_splits(d, seed=1)
    assert [len(splits[s]) for s in ("train", "dev", "test")] == [30, 10, 10]
    assert splits["test"].source.endswith("t10k-images-idx3-ubyte.gz")
    assert splits["train"].label_names == ["left", "right"]
    # train and dev are disjoint rows of the train file, test is the t10k file
    assert not set(splits["train"].rows) & set(splits["dev"].rows)
    assert splits["train"].bank is splits["dev"].bank is not splits["test"].bank
    (folder / "t10k-labels-idx1-ubyte.gz").unlink()
    with pytest.raises(DataError, match="t10k-images-idx3-ubyte.gz has no matching t10k labels"):
        load_image_splits(d)


def test_debian_fashion_mnist_location_is_searched(tmp_path, monkeypatch):
    """Debian's dataset-fashion-mnist installs /usr/share/datasets/fashion-mnist/: a system data
    folder searched last, where 'fashion_mnist' also finds 'fashion-mnist'."""
    from fedslice.data import locate as loading
    system = tmp_path / "usr-share-datasets"
    write_idx_folder(system / "fashion-mnist", 8, 4)
    assert loading.SYSTEM_DATA_DIRS == (Path("/usr/share/datasets"),)
    monkeypatch.setattr(loading, "SYSTEM_DATA_DIRS", (system,))
    assert loading.data_search_dirs()[-1] == system
    found = loading.resolve_source("fashion_mnist", [tmp_path / "elsewhere", system])
    assert found == (system / "fashion-mnist").resolve()
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(img_sources, "data_search_dirs", lambda: [tmp_path / "elsewhere", system])
    splits = load_image_splits(DataConfig(path="fashion_mnist"))
    assert len(splits["test"]) == 4 and splits["test"].source.startswith(str(system))


@pytest.mark.skipif(not FMNIST.is_dir(), reason="../shared/data/fashion_mnist not present")
def test_shared_fashion_mnist():
    splits = load_image_splits(DataConfig(path="fashion_mnist"), seed=0)
    assert [len(splits[s]) for s in ("train", "dev", "test")] == [54000, 6000, 10000]
    assert splits["train"].bank.cells[0].shape == (28, 28)
    assert sorted(set(splits["test"].labels)) == list(range(10))


# --------------------------------------------------------------------------------------------
# Folders, CSV/JSONL of paths, HF datasets
# --------------------------------------------------------------------------------------------

def test_image_folder_with_mixed_sizes_and_modes(tmp_path, tiny_vision_dirs):
    folder = write_image_folder(tmp_path / "imgs", sizes=(12, 4, 4))
    splits = load_image_splits(DataConfig(path=str(folder)))
    assert splits["train"].label_names == ["left", "right"]
    proc, config = processor_of(tiny_vision_dirs["dinov2"])
    out = encode_images(splits, Preprocessor(proc, 16, 3), lambda h, w: (h // 8) * (w // 8) + 1,
                        skip_bad=False, cache_dir=None)
    batch = out["train"].collate(range(12))
    assert batch["pixel_values"].shape == (12, 3, 16, 16)  # 20x20, 24x16, 32x40 -> 16x16
    assert batch["attention_mask"].shape == (12, 5) and bool(batch["attention_mask"].all())
    assert out["train"].lengths.tolist() == [5] * 12
    # a single split of class folders: dev and test are carved off it
    flat = tmp_path / "flat"
    for cls in ("cat", "dog"):
        for i in range(10):
            (flat / cls).mkdir(parents=True, exist_ok=True)
            stripes(i % 2, (8, 8), random.Random(i)).save(flat / cls / f"{i}.jpg")
    splits = load_image_splits(DataConfig(path=str(flat), holdout_fraction=0.1))
    assert [len(splits[s]) for s in ("train", "dev", "test")] == [16, 2, 2]
    assert splits["dev"].label_names == ["cat", "dog"]


def test_pixels_equal_the_processors_own_output(tmp_path, tiny_vision_dirs):
    """Geometry by the processor on the decoded image, rescale + normalisation per batch: the
    numbers of the processor's full pipeline on the RGB image (grayscale replicated), for the
    table's DINOv2 processor and a checkpoint's ViT processor."""
    rng = random.Random(0)
    folder = tmp_path / "imgs"
    modes = ["L", "RGB", "RGBA", "P", "L"]
    for i, mode in enumerate(modes):
        (folder / "train" / str(i % 2)).mkdir(parents=True, exist_ok=True)
        stripes(i % 2, (30 + 3 * i, 22 + i), rng, mode).save(folder / "train" / str(i % 2) / f"{i}.png")
    from PIL import Image
    from transformers.image_transforms import convert_to_rgb
    splits = load_image_splits(DataConfig(path=str(folder), holdout_fraction=0.2))
    for arch, size in (("dinov2", 28), ("vit", None)):
        proc, _ = processor_of(tiny_vision_dirs[arch])
        prep = Preprocessor(proc, size, 3)
        out = encode_images({"train": splits["train"]}, prep, lambda h, w: 1, skip_bad=False,
                            cache_dir=None)["train"]
        bank = splits["train"].bank
        for j, row in enumerate(splits["train"].rows):
            image = convert_to_rgb(Image.open(bank.cells[row]), return_numpy=True)
            kw = {k: v for k, v in prep.geometry().items() if k in ("size", "crop_size")}
            want = proc(image, return_tensors="pt", **kw)["pixel_values"][0]
            got = out.collate([j])["pixel_values"][0]
            assert got.shape == want.shape and float((got - want).abs().max()) < 1e-5, (arch, j)
        assert out.image_size == ((28, 28) if size else (16, 16))


def test_csv_and_jsonl_of_paths(tmp_path):
    folder = tmp_path / "tab"
    (folder / "pics").mkdir(parents=True)
    rng = random.Random(1)
    rows = []
    for i in range(12):
        stripes(i % 2, (10, 10), rng).save(folder / "pics" / f"{i}.png")
        rows.append((f"pics/{i}.png", ["sandal", "boot"][i % 2]))
    (folder / "train.csv").write_text("file,kind\n" + "".join(f"{p},{c}\n" for p, c in rows[:8]))
    (folder / "test.jsonl").write_text("".join(json.dumps({"file": p, "kind": c}) + "\n" for p, c in rows[8:]))
    d = DataConfig(path=str(folder), image_column="file", label_column="kind", holdout_fraction=0.25)
    splits = load_image_splits(d)
    assert [len(splits[s]) for s in ("train", "dev", "test")] == [6, 2, 4]
    assert splits["test"].label_names == ["boot", "sandal"]
    assert splits["test"].bank.where(0) == str(folder / "pics" / "8.png")
    with pytest.raises(DataError, match=r"no image column 'image' \(set by data.image_column\)"):
        load_image_splits(DataConfig(path=str(folder), label_column="kind"))


def test_saved_hf_dataset_and_hub_image_column(tmp_path, monkeypatch, tiny_vision_dirs):
    datasets = pytest.importorskip("datasets")
    rng = random.Random(2)
    images = [stripes(i % 2, (12, 12), rng) for i in range(10)]
    ds = datasets.Dataset.from_dict({"img": images, "label": [i % 2 for i in range(10)]})
    ds = ds.cast_column("img", datasets.Image()).cast_column(
        "label", datasets.ClassLabel(names=["off", "on"]))
    saved = tmp_path / "saved"
    datasets.DatasetDict({"train": ds, "test": ds.select(range(4))}).save_to_disk(str(saved))
    splits = load_image_splits(DataConfig(path=str(saved), image_column="img", holdout_fraction=0.2))
    assert [len(splits[s]) for s in ("train", "dev", "test")] == [8, 2, 4]
    assert splits["train"].label_names == ["off", "on"]
    proc, _ = processor_of(tiny_vision_dirs["dinov2"])
    out = encode_images(splits, Preprocessor(proc, 16, 3), lambda h, w: 5, skip_bad=False, cache_dir=None)
    assert out["test"].collate([0])["pixel_values"].shape == (1, 3, 16, 16)
    # a hub id goes through datasets.load_dataset (offline here: the saved splits stand in)
    loaded = datasets.load_from_disk(str(saved))
    monkeypatch.setattr(datasets, "load_dataset", lambda name, subset, split: loaded[split])
    splits = load_image_splits(DataConfig(path="someone/pictures", image_column="img"))
    assert len(splits["test"]) == 4 and splits["test"].source == "someone/pictures:test"


# --------------------------------------------------------------------------------------------
# Bad input
# --------------------------------------------------------------------------------------------

def _broken_folder(tmp_path) -> Path:
    folder = write_image_folder(tmp_path / "imgs", sizes=(8, 4, 4), mixed=False)
    (folder / "train" / "left" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    (folder / "train" / "right" / "empty.jpg").write_bytes(b"")
    return folder


def test_undecodable_image_is_an_error_naming_the_file_or_skipped(tmp_path, tiny_vision_dirs, caplog):
    folder = _broken_folder(tmp_path)
    proc, _ = processor_of(tiny_vision_dirs["dinov2"])
    prep = Preprocessor(proc, 16, 3)
    splits = load_image_splits(DataConfig(path=str(folder)))
    with pytest.raises(DataError, match=r"train/left/broken.png: cannot decode the image \(not an "
                                        r"image file PIL can read\); set data.bad_rows = \"skip\""):
        encode_images(splits, prep, lambda h, w: 5, skip_bad=False, cache_dir=None)
    with caplog.at_level("WARNING"):
        out = encode_images(splits, prep, lambda h, w: 5, skip_bad=True, cache_dir=None)
    assert len(out["train"]) == 8 and len(splits["train"]) == 10
    assert "skipped 2 image(s) that cannot be decoded" in caplog.text and "broken.png" in caplog.text
    # a CSV naming a file that does not exist: the error names it
    good = "".join(f"train/left/{i:03d}.png,0\n" for i in (0, 2, 4, 6))
    (folder / "train.csv").write_text(f"image,label\n{good}missing/x.png,1\n")
    splits = load_image_splits(DataConfig(path=str(folder / "train.csv"), holdout_fraction=0.2))
    with pytest.raises(DataError, match=r"missing/x.png: cannot decode the image \(no such file\)"):
        encode_images(splits, prep, lambda h, w: 5, skip_bad=False, cache_dir=None)


def test_text_task_on_image_backbone_and_the_reverse(tiny_img_cfg_dict, tiny_cfg_dict):
    from fedslice.api import setup
    text_on_image = dict(tiny_img_cfg_dict, task={"kind": "classification"})
    with pytest.raises(ConfigError, match=r"task.kind = 'classification' reads text, but model.name "
                                          r".* is a dinov2 model that reads images: use task.kind = "
                                          r"'image_classification'"):
        setup(validate_config(text_on_image))
    image_on_text = dict(tiny_cfg_dict, task={"kind": "image_classification"})
    with pytest.raises(ConfigError, match=r"task.kind = 'image_classification' reads images, but "
                                          r"model.name .* is a bert model that reads text: use an "
                                          r"image backbone \(vit, deit, dinov2\)"):
        setup(validate_config(image_on_text))
    with pytest.raises(ConfigError, match="image_size is for kind = 'image_classification'"):
        validate_config(dict(tiny_cfg_dict, task={"image_size": 32}))


def test_image_task_refuses_a_text_distillation_corpus(tiny_img_cfg_dict, tmp_path):
    from fedslice.api import setup
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("some text\n" * 20)
    cfg = dict(tiny_img_cfg_dict, method={"name": "fedpft", "whole_layers": [0],
                                          "distill": {"corpus": str(corpus), "steps": 1}})
    with pytest.raises(ConfigError, match=r"method.distill.corpus: an image backbone distils on "
                                          r"images; .*corpus.txt' is no folder of images"):
        setup(validate_config(cfg))
    cfg["method"]["distill"]["corpus"] = "server_holdout"
    with pytest.raises(ConfigError, match=r"'server_holdout' needs data.server_holdout > 0"):
        setup(validate_config(cfg))


# --------------------------------------------------------------------------------------------
# Caching and the server's held-apart images
# --------------------------------------------------------------------------------------------

def test_preprocessing_is_cached_on_disk_and_deterministic(tmp_path, tiny_vision_dirs, monkeypatch):
    folder = write_image_folder(tmp_path / "imgs", sizes=(10, 4, 4))
    proc, _ = processor_of(tiny_vision_dirs["dinov2"])
    cache = tmp_path / "cache"
    splits = load_image_splits(DataConfig(path=str(folder)))
    first = encode_images(splits, Preprocessor(proc, 16, 3), lambda h, w: 5, skip_bad=False, cache_dir=cache)
    files = list((cache / "images").glob("*.pt"))
    assert len(files) == 3  # one per source folder (train, dev, test)
    img_preprocess._PROCESSED.clear()
    calls = []
    monkeypatch.setattr(img_preprocess, "_preprocess", lambda *a: calls.append(a))
    again = encode_images(splits, Preprocessor(proc, 16, 3), lambda h, w: 5, skip_bad=False, cache_dir=cache)
    assert not calls  # read from disk
    for s in first:
        assert torch.equal(first[s].collate(range(len(first[s])))["pixel_values"],
                           again[s].collate(range(len(again[s])))["pixel_values"])
    monkeypatch.undo()
    other = encode_images(splits, Preprocessor(proc, 24, 3), lambda h, w: 10, skip_bad=False, cache_dir=cache)
    assert other["train"].image_size == (24, 24) and len(list((cache / "images").glob("*.pt"))) == 6


def test_server_holdout_is_apart_from_every_client(tiny_img_cfg_dict):
    """data.server_holdout: seeded training images no client partition holds; FedPFT's layer
    distillation reads exactly them."""
    from fedslice.api import setup
    tiny_img_cfg_dict["data"]["server_holdout"] = 0.25
    tiny_img_cfg_dict["method"] = {"name": "fedpft", "keep_ratio": 0.5, "whole_layers": [0],
                                   "distill": {"corpus": "server_holdout", "steps": 1, "batch_size": 4,
                                               "cache_dir": ""}}
    method, data = setup(validate_config(tiny_img_cfg_dict))
    raw = method.task.load_raw()
    held = set(raw["server"].rows.tolist())
    assert len(held) == 12 and not held & set(raw["train"].rows.tolist())
    assert len(data.train) == 36 and sum(len(p) for p in data.partitions) == 36
    corpus = method.corpus.split
    assert len(corpus) == 12 and corpus.pixels is data.train.pixels  # preprocessed once
    assert not set(corpus.rows.tolist()) & set(data.train.rows.tolist())
    assert method.kd_before is not None and method.kd_before.steps == 1
    again = setup(validate_config(tiny_img_cfg_dict))[0].task.load_raw()["server"]
    assert again.rows.tolist() == raw["server"].rows.tolist()  # seeded


# --------------------------------------------------------------------------------------------
# The task end to end: labels.json, per-class accuracy, costs (tokens = patches + class token)
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("arch", VISION)
def test_run_on_each_backbone(arch, tiny_img_cfg_dict, tiny_vision_dirs, tmp_path):
    from fedslice.api import run_experiment
    tiny_img_cfg_dict["model"]["name"] = str(tiny_vision_dirs[arch])
    run = run_experiment(validate_config(tiny_img_cfg_dict), tmp_path / "out", progress=False)
    summary = json.loads((run / "summary.json").read_text())
    assert json.loads((run / "labels.json").read_text()) == {"names": ["left", "right"],
                                                             "ids": {"left": 0, "right": 1}}
    assert set(summary["test_accuracy_per_class"]) == {"left", "right"}
    assert summary["task"] == "image_classification" and 0 <= summary["test_accuracy"] <= 1
    metrics = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    prefix = 2 if arch == "deit" else 1
    for m in metrics[0]["client_metrics"]:
        # 16 px images, 8 px patches: 4 patches + the class (and distillation) token(s) per image
        assert m["tokens"] == m["examples_trained"] * (4 + prefix)
        assert m["flops_measured"] > 0 and m["bytes_up"] > 0
        assert abs(m["flops_measured"] - m["flops_analytic"]) / m["flops_analytic"] < 0.35


def test_measured_flops_per_token_follow_the_image_size(tiny_img_cfg_dict, tiny_vision_dirs):
    """Tokens = (S/patch)^2 + 1: 16 px -> 5 tokens, 32 px -> 17; the measured FLOPs of a step
    grow with the tokens (linear layers) and the analytic estimate follows."""
    from fedslice.api import setup
    from fedslice.fl.client import train_local
    out = {}
    for size in (16, 32):
        tiny_img_cfg_dict["task"]["image_size"] = size
        method, data = setup(validate_config(tiny_img_cfg_dict))
        client = data.client(0)
        assert client.tokens == (size // 8) ** 2 + 1
        model, params = method.client_model(method.strategy.configure_train(1, method.initial_state(), [0])[0])
        res = train_local(model, params, client, {"lr": 1e-3, "batch_size": 4, "local_steps": 1}, 0,
                          method.task.loss)
        assert res.tokens == 4 * client.tokens
        out[size] = res.flops_measured / res.tokens
    assert 0.9 < out[32] / out[16] < 1.6  # per token nearly constant (attention grows with T)


def test_vit_reads_images_of_any_size(tiny_img_cfg_dict, tiny_vision_dirs):
    """ViT's position table is for 16 px here; 24 px images (9 patches) run: the embeddings
    interpolate the table (set once at load), and at 16 px they are unchanged."""
    from fedslice.api import setup
    tiny_img_cfg_dict["model"]["name"] = str(tiny_vision_dirs["vit"])
    tiny_img_cfg_dict["task"]["image_size"] = 24
    method, data = setup(validate_config(tiny_img_cfg_dict))
    batch = data.train.collate([0, 1])
    assert batch["attention_mask"].shape == (2, 10)
    assert torch.isfinite(method.model(**batch).loss)


def test_cli_validate_run_and_compare_on_images(tiny_img_cfg_dict, tmp_path, capsys):
    import tomli_w
    from fedslice.cli import main
    path = tmp_path / "img.toml"
    path.write_text(tomli_w.dumps(tiny_img_cfg_dict))
    assert main(["validate", str(path)]) == 0
    out = capsys.readouterr().out
    assert "left" in out and "train" in out
    assert main(["run", str(path), "--out", str(tmp_path / "r"), "--no-progress"]) == 0
    assert (tmp_path / "r" / "fedpetuning" / "summary.json").is_file()
    base = dict(tiny_img_cfg_dict)
    base.pop("method")
    base["variants"] = [{"name": "lora", "method": {"name": "fedpetuning"}},
                        {"name": "heads", "method": {"name": "heads", "sparsity": 0.5}}]
    suite = tmp_path / "suite.toml"
    suite.write_text(tomli_w.dumps(base))
    assert main(["compare", str(suite), "--out", str(tmp_path / "cmp"), "--name", "c", "--no-progress"]) == 0
    rows = json.loads((tmp_path / "cmp" / "c" / "results.json").read_text())
    assert [r["run"] for r in rows] == ["lora", "heads"]


@pytest.mark.slow
@pytest.mark.skipif(not (FMNIST.is_dir() and (SHARED / "models" / "dinov2-small").is_dir()),
                    reason="../shared Fashion-MNIST or DINOv2-S not present")
def test_fmnist_dinov2_config_runs_on_the_shared_data(tmp_path, monkeypatch, capsys):
    """`fedslice run configs/fmnist_dinov2.toml` (FedPFT, real DINOv2-S, real Fashion-MNIST IDX
    files) with small overrides for time: 10 named classes, 17 tokens per image, the layer KD on
    the server's held-apart images. The CLI's main in this process (a fresh interpreter imported
    torch and transformers again: ~5 CPU-s; `python -m fedslice.cli` itself: tests/test_cli.py)."""
    from fedslice.cli import main

    repo = Path(__file__).resolve().parents[1]
    sets = ["data.max_train_examples=300", "data.max_dev_examples=64", "data.max_test_examples=100",
            "federation.num_clients=4", "federation.clients_per_round=2", "federation.rounds=1",
            "federation.local_steps=1", "federation.batch_size=8", "method.distill.steps=2",
            "method.distill.batch_size=8", f"method.distill.cache_dir=\"{tmp_path / 'kd'}\"",
            f"output.dir=\"{tmp_path / 'runs'}\"", "output.plots=false"]
    monkeypatch.chdir(repo)
    code = main(["run", "configs/fmnist_dinov2.toml", "--no-progress",
                 *[a for s in sets for a in ("--set", s)]])
    assert code == 0, capsys.readouterr().err[-3000:]
    run = tmp_path / "runs" / "fmnist-dinov2-fedpft"
    summary = json.loads((run / "summary.json").read_text())
    assert summary["task"] == "image_classification" and len(summary["test_accuracy_per_class"]) == 10
    assert "Ankle boot" in json.loads((run / "labels.json").read_text())["names"]
    metrics = [json.loads(l) for l in (run / "metrics.jsonl").read_text().splitlines()]
    for m in metrics[0]["client_metrics"]:
        assert m["tokens"] == 17 * m["examples_trained"]  # 4 x 4 patches of 14 px + [CLS]
    assert summary["kd_before_steps"] == 2 and summary["proxy_param_fraction"] < 0.7


def test_predict_evaluate_and_export_an_image_run(tiny_img_cfg_dict, tiny_images_dir, tmp_path, capsys):
    """`fedslice predict` on a CSV of image paths (relative to the file): class names and
    probabilities, the run's own test accuracy; `fedslice evaluate` on the image folder: each of
    its splits, nothing carved or held apart, the run's test accuracy again; the merged export is
    a plain transformers image classifier with the run's label names; an undecodable image in
    the input is an error naming the file."""
    import shutil

    import transformers

    from fedslice.api import run_experiment
    from fedslice.cli import main
    from fedslice.export import export_run
    tiny_img_cfg_dict["data"]["server_holdout"] = 0.1
    run = run_experiment(validate_config(tiny_img_cfg_dict))
    summary = json.loads((run / "summary.json").read_text())
    pics = tmp_path / "in" / "pics"
    pics.mkdir(parents=True)
    rows = []
    for i, p in enumerate(sorted((tiny_images_dir / "test").glob("*/*.png"))):
        shutil.copy(p, pics / f"{i}.png")
        rows.append((f"pics/{i}.png", p.parent.name))
    inp = tmp_path / "in" / "images.csv"
    inp.write_text("image,label\n" + "".join(f"{a},{b}\n" for a, b in rows))
    out = tmp_path / "pred.jsonl"
    assert main(["predict", str(run), "--input", str(inp), "--output", str(out)]) == 0
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["image"] for r in recs] == [a for a, _ in rows]  # input order, columns kept
    for r in recs:
        assert set(r["probabilities"]) == {"left", "right"}
        assert abs(sum(r["probabilities"].values()) - 1) < 1e-5
        assert r["prediction"] == max(r["probabilities"], key=r["probabilities"].get)
    right = sum(r["prediction"] == r["label"] for r in recs)
    assert right / len(recs) == summary["test_accuracy"]
    assert main(["evaluate", str(run), "--data", str(tiny_images_dir), "--name", "again"]) == 0
    ev = json.loads((run / "eval-again.json").read_text())
    assert ev["examples"] == {"train": 48, "dev": 16, "test": 16}  # no server holdout, no carving
    assert ev["metrics"]["test"]["accuracy"] == summary["test_accuracy"]
    assert set(ev["metrics"]["test"]["per_class_accuracy"]) == {"left", "right"}
    merged = export_run(run, "merged")
    plain = transformers.AutoModelForImageClassification.from_pretrained(merged)
    assert plain.config.id2label == {0: "left", 1: "right"}
    assert (merged / "preprocessor_config.json").is_file()
    (pics / "0.png").write_bytes(b"not a png")
    capsys.readouterr()
    assert main(["predict", str(run), "--input", str(inp)]) == 2
    assert "0.png" in capsys.readouterr().err


def test_activation_salience_on_the_servers_images(tiny_img_cfg_dict):
    """fedpft's ``salience = "activation"`` on a ViT: the activation pass reads the server's
    held-apart images (no client's), W_out's columns count with DINOv2's LayerScale, and it
    ranks differently from Eq. 8's weight norms."""
    from fedslice.api import setup
    tiny_img_cfg_dict["data"]["server_holdout"] = 0.25
    method_opts = {"name": "fedpft", "keep_ratio": 0.5, "whole_layers": [0], "kd": "none",
                   "distill": {"corpus": "server_holdout", "steps": 1, "batch_size": 4, "cache_dir": ""}}
    tiny_img_cfg_dict["method"] = {**method_opts, "salience": "activation", "calibration_examples": 8}
    method, _ = setup(validate_config(tiny_img_cfg_dict))
    A, split = method.arch, method.corpus.split
    batch = split.collate(list(range(8)))
    seen = {}
    handles = [A.ffn_part(method.model, k, l, "ffn_out").register_forward_pre_hook(
        lambda _m, args, g=g: seen.__setitem__(g, args[0].detach().abs())) for g, (k, l) in method.units.items()]
    method.model.eval()
    with torch.no_grad():
        method.model(pixel_values=batch["pixel_values"])
    for h in handles:
        h.remove()
    tiny_img_cfg_dict["method"] = method_opts
    l2, _ = setup(validate_config(tiny_img_cfg_dict))
    for g, (k, l) in method.units.items():
        out = A.ffn_part(method.model, k, l, "ffn_out")
        scale = A.blocks(method.model, k)[l].layer_scale2.lambda1  # (d,) DINOv2's LayerScale
        w = scale[:, None] * out.weight  # (d, F): the FFN's contribution to the residual
        score = seen[g].mean((0, 1)) * w.abs().sum(0)  # every patch token is real
        kept = method.spec.stacks[k].neurons[l]
        assert kept == tuple(sorted(torch.argsort(score, descending=True)[:len(kept)].tolist()))
        assert kept != l2.spec.stacks[k].neurons[l]
