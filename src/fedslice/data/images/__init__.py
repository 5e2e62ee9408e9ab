"""Image classification data: read images as users keep them, preprocess them once with the
backbone's image processor, and batch them.

Sources (``data.path``), told apart by their layout:

* **IDX files** (the MNIST family: MNIST, Fashion-MNIST, KMNIST): ``train-images-idx3-ubyte``
  and ``train-labels-idx1-ubyte`` (``.gz`` or not; ``train-images.idx3-ubyte`` too), ``t10k-*``
  for test. ``fashion_mnist`` finds ``../shared/data/fashion_mnist`` or Debian's
  ``/usr/share/datasets/fashion-mnist`` (package ``dataset-fashion-mnist``).
* **an image folder**: ``train/``, ``dev/`` (``validation/``, ``val/``) and ``test/``, each with one
  sub-folder per class (torchvision's ``ImageFolder`` layout, per split), or the class
  sub-folders directly (one split). The class of an image is its folder's name.
* **split files** (``train.csv``, ``dev.jsonl``, ...) or one file, read like text data: the image
  is ``data.image_column`` (a path, relative to the data folder), the class ``data.label_column``.
* **a Hugging Face dataset** with an image feature in ``data.image_column``: a hub id, or a folder
  written by ``Dataset(Dict).save_to_disk``.

Missing dev/test splits are carved off train, labels may be names (``data.labels`` fixes their
order) and ``data.server_holdout`` keeps training images on the server, as for text data
(:func:`~fedslice.data.locate.check_and_carve`).

Preprocessing runs the backbone's image processor for the geometry (resize, centre crop: mixed
sizes and aspect ratios all come out S x S) on decoded images (grayscale images stay one channel
and are replicated to the model's channels when batched; other modes become RGB as the
processor's ``convert_rgb`` does) and keeps the result as uint8; a batch is rescaled and
normalised with the processor's constants (:class:`ImageSplit`): the same numbers as the
processor's full output (tested), at a quarter of the memory (a twelfth for grayscale). Each
source table (an IDX file, a folder, a split file: the rows *before* carving, so every seed shares
it) is preprocessed once per processor setting and cached, in the process and on disk
(``$FEDSLICE_CACHE_DIR``, default ``~/.cache/fedslice``, ``images/``): deterministic, keyed by the
source's files (names, sizes, modification times) or pixels, and the processor's settings.

An image that cannot be decoded (missing file, not an image, truncated) stops the run naming the
file, or with ``data.bad_rows = "skip"`` is skipped and counted in the log.

Modules: :mod:`.sources` (reading), :mod:`.preprocess` (decoding, the processor, the cache),
:mod:`.batches` (batching, a run's encoding).
"""

from fedslice.data.images.batches import ImageSplit, encode_images, image_cache_dir
from fedslice.data.images.preprocess import Preprocessor
from fedslice.data.images.sources import (IMAGE_SUFFIXES, ImageBank, RawImageSplit, images_in,
                                          load_image_splits)

__all__ = ["IMAGE_SUFFIXES", "ImageBank", "ImageSplit", "Preprocessor", "RawImageSplit",
           "encode_images", "image_cache_dir", "images_in", "load_image_splits"]
