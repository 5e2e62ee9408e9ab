"""``image_classification``: an image backbone (ViT, DeiT, DINOv2) with a classifier on its pooled
tokens, trained with cross-entropy; accuracy, loss and per-class accuracy as the text classifiers.

Data come from :mod:`fedslice.data.images` (IDX files, image folders, CSV/JSONL of paths, HF
datasets), preprocessed once with the backbone's image processor (``task.image_size`` overrides
its size). A batch is ``pixel_values`` + an all-ones ``attention_mask`` over the tokens the model
reads (patches + class token): token counts, FLOPs per token and every per-token mask of the
methods (APoZ, layer-level KD) work on images as on text.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from fedslice import progress
from fedslice.compute import model_device, to_device
from fedslice.data import num_batches
from fedslice.data.images import (ImageBank, ImageSplit, Preprocessor, RawImageSplit,
                                  encode_images, image_cache_dir, load_image_splits)
from fedslice.errors import ConfigError
from fedslice.tasks.base import Task
from fedslice.tasks.classification import evaluate_classifier


class ImageClassification(Task):
    kind = "image_classification"
    primary_metric = "accuracy"
    #: (channels, height, width) of the images after preprocessing (set by ``encode``)
    image_shape: tuple[int, int, int] | None = None

    def load_raw(self, carve_missing: bool = True):
        return load_image_splits(self.cfg.data, self.cfg.seed, carve_missing)

    def num_labels(self, raw) -> int:
        names = raw["train"].label_names
        highest = max(max(s.labels, default=0) for s in raw.values())
        return max(len(names), highest + 1) if names else highest + 1

    def preprocessor(self, loaded) -> Preprocessor:
        return Preprocessor(loaded.tokenizer, self.cfg.task.image_size,
                            self.arch.image.channels(loaded.model.config))

    def tokens_for(self, loaded):
        """``(height, width) -> tokens`` the model reads per image (patches + prefix tokens)."""
        config = loaded.model.config
        return lambda h, w: self.arch.image.tokens(config, h, w)

    def encode(self, raw, loaded):
        self.label_names = next(iter(raw.values())).label_names
        d = self.cfg.data
        out = encode_images(raw, self.preprocessor(loaded), self.tokens_for(loaded),
                            skip_bad=d.bad_rows == "skip", cache_dir=image_cache_dir(),
                            limits={"train": d.max_train_examples, "dev": d.max_dev_examples,
                                    "test": d.max_test_examples}, seed=self.cfg.seed)
        first = next(iter(out.values()))
        self.image_shape = (first.channels, *first.image_size)
        return out

    def holdout(self, loaded) -> ImageSplit:
        """The training images the server keeps apart (``data.server_holdout``), preprocessed:
        an unlabeled distillation corpus no client holds (from the cache ``encode`` filled)."""
        if self.cfg.data.server_holdout <= 0:
            raise ConfigError("method.distill.corpus = 'server_holdout' needs data.server_holdout > 0 "
                              "(the fraction of training images the server keeps apart)")
        return self.encode(self.load_raw(), loaded)["server"]

    def profile_batch(self, config, batch_size: int, seq_len: int, seed: int) -> dict[str, torch.Tensor]:
        """A batch of random images of the preprocessed size (costs depend on shapes only)."""
        c, h, w = self.image_shape or (self.arch.image.channels(config),
                                       *(2 * [getattr(config, self.arch.image.image_size_attr)]))
        g = torch.Generator().manual_seed(seed)
        tokens = self.arch.image.tokens(config, h, w)
        return {"pixel_values": torch.randn(batch_size, c, h, w, generator=g),
                "attention_mask": torch.ones(batch_size, tokens, dtype=torch.int64),
                "labels": torch.zeros(batch_size, dtype=torch.int64)}

    @torch.no_grad()
    def evaluate(self, model: nn.Module, split, batch_size: int, max_generations=None):
        return evaluate_classifier(model, split, batch_size)

    # -- inference ---------------------------------------------------------------------------
    def input_columns(self) -> list[str]:
        return [self.cfg.data.image_column]

    @torch.no_grad()
    def predict(self, model, loaded, rows, batch_size, source):
        """Class probabilities of the image of each row (``data.image_column``: a path,
        relative to the input file's folder); an image that cannot be decoded is an error
        naming the file."""
        column = self.cfg.data.image_column
        bank = ImageBank([r[column] for r in rows], Path(source).parent, source, "row",
                         list(range(1, len(rows) + 1)))
        raw = {"predict": RawImageSplit(bank, np.arange(len(rows)), [0] * len(rows), source)}
        split = encode_images(raw, self.preprocessor(loaded), self.tokens_for(loaded),
                              skip_bad=False, cache_dir=None)["predict"]
        device = model_device(model)
        was = model.training
        model.eval()
        probs = []
        with progress.task("predict", num_batches(len(split), batch_size)) as advance:
            for lo in range(0, len(split), batch_size):
                batch = split.collate(range(lo, min(lo + batch_size, len(split))))
                batch.pop("labels")
                probs += torch.softmax(model(**to_device(batch, device)).logits.float().cpu(), -1)
                advance()
        model.train(was)
        return [{"prediction": int(p.argmax()), "probabilities": p.tolist()} for p in probs]
