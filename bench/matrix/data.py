"""The matrix's data: everything ships with Python or scikit-learn, or is generated.

* ``digits()``: scikit-learn's bundled 8x8 handwritten digits (1,797 images), a
  fixed seeded split of 1,500 train / 297 test, as ``examples/digits.py`` does.
* ``text()``: the source code of a fixed list of standard-library modules,
  concatenated in that order, encoded over newline + printable ASCII, cut into
  non-overlapping windows of ``CONTEXT`` characters (inputs) each paired with
  the same window shifted by one (targets); the last 5% of the text is held out.
  The text is the running interpreter's own stdlib, so every rank of a run
  must use the same Python (3.11 here) to see the same samples.
* ``images(n, seed)``: deterministic synthetic 32x32 RGB images in 10 classes
  for the CNNs (no image data set can be fetched here): each image is a
  sinusoidal grating whose orientation is the class (18 degrees apart), with a
  random frequency, phase, colour, contrast, a random Gaussian window (where
  the pattern sits) and pixel noise, so a model must learn orientation
  invariant to everything else.

Every generator is a pure function of its arguments (seeded numpy
``Generator``s), cached per process (the images also on disk, see ``images``);
callers must treat the tensors as read-only.
"""

from __future__ import annotations

import functools
import importlib
import math
import os
import tempfile
from pathlib import Path

import numpy as np
import torch

#: Newline plus printable ASCII (the same alphabet as ``examples/charlm.py``); anything else is UNK.
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
UNK_ID = len(ALPHABET)
VOCAB_SIZE = len(ALPHABET) + 1
CONTEXT = 64
HELDOUT_FRACTION = 0.05
#: Standard-library modules whose source is the language models' corpus, in this order.
TEXT_MODULES = (
    "textwrap",
    "string",
    "heapq",
    "bisect",
    "fractions",
    "functools",
    "colorsys",
    "shlex",
    "difflib",
    "calendar",
    "json.decoder",
    "json.encoder",
    "argparse",
    "pprint",
    "random",
)

IMAGE_SIZE, IMAGE_CLASSES = 32, 10


@functools.cache
def digits() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_test, y_test)``: 1x8x8 float images in [0, 1], int64 labels."""
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:  # pragma: no cover - scikit-learn is a test/examples extra
        raise ImportError("bench.matrix needs scikit-learn for the digits data set: pip install 'flodl[examples]'") from exc
    d = load_digits()
    images = torch.from_numpy((d.images / 16.0).astype(np.float32)).unsqueeze(1)
    labels = torch.from_numpy(d.target.astype(np.int64))
    order = torch.from_numpy(np.random.default_rng(0).permutation(len(labels)))
    train, test = order[:1500], order[1500:]
    return images[train], labels[train], images[test], labels[test]


def corpus() -> str:
    """The raw text: the listed stdlib modules' source files, joined in list order."""
    parts = []
    for name in TEXT_MODULES:
        with open(importlib.import_module(name).__file__, encoding="utf-8") as fh:
            parts.append(fh.read())
    return "\n".join(parts)


def encode(text: str) -> torch.Tensor:
    """Each character's id in ``ALPHABET`` (``UNK_ID`` if absent), int64."""
    lookup = np.full(128, UNK_ID, dtype=np.int64)
    for i, ch in enumerate(ALPHABET):
        lookup[ord(ch)] = i
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    return torch.from_numpy(np.where(codes < 128, lookup[np.minimum(codes, 127)], UNK_ID).astype(np.int64))


def _windows(ids: torch.Tensor, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    chunks = ids.unfold(0, CONTEXT + 1, CONTEXT)
    if len(chunks) > limit:  # evenly spaced, so every module stays represented
        chunks = chunks[torch.linspace(0, len(chunks) - 1, limit).long()]
    return chunks[:, :-1].clone(), chunks[:, 1:].clone()


@functools.cache
def text(max_train: int = 1 << 30, max_eval: int = 256) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(x_train, y_train, x_eval, y_eval)`` as ``(n, CONTEXT)`` int64 windows (targets shifted by one)."""
    ids = encode(corpus())
    split = int(len(ids) * (1 - HELDOUT_FRACTION))
    x, y = _windows(ids[:split], max_train)
    xe, ye = _windows(ids[split:], max_eval)
    return x, y, xe, ye


@functools.cache
def images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` synthetic 3x32x32 float32 images and their int64 labels (0..9), a pure function of (n, seed).

    Generating 8,192 images takes about a second, and every rank of every run
    needs them, so the arrays are kept in ``FLODL_MATRIX_CACHE`` (default: a
    ``flodl-matrix-cache`` folder in the temp dir; ``off`` to always generate),
    keyed by (n, seed, generator version). A file that cannot be read is
    generated again.
    """
    cache = os.environ.get("FLODL_MATRIX_CACHE", os.path.join(tempfile.gettempdir(), "flodl-matrix-cache"))
    if cache.lower() in ("off", "0", ""):
        return generate_images(n, seed)
    path = Path(cache) / f"images-v{IMAGES_VERSION}-{n}-{seed}.npz"
    try:
        with np.load(path) as z:
            x, y = z["x"], z["y"]
        if len(x) == n == len(y):
            return torch.from_numpy(x), torch.from_numpy(y)
    except (OSError, KeyError, ValueError):
        pass
    x, y = generate_images(n, seed)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".npz")
        with os.fdopen(fd, "wb") as fh:
            np.savez(fh, x=x.numpy(), y=y.numpy())
        os.replace(tmp, path)  # atomic: ranks racing to write it each leave a whole file
    except OSError:
        pass
    return x, y


#: bump when ``generate_images`` changes, so stale cached arrays are not used
IMAGES_VERSION = 1


def generate_images(n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The images behind ``images`` (no cache)."""
    rng = np.random.default_rng(seed)
    y = rng.integers(0, IMAGE_CLASSES, size=n)
    theta = y * (math.pi / IMAGE_CLASSES) + rng.normal(0.0, 0.06, size=n)  # orientation = class, a little jitter
    freq = rng.uniform(0.08, 0.22, size=n)  # cycles per pixel
    phase = rng.uniform(0.0, 2 * math.pi, size=n)
    colour = rng.uniform(-1.0, 1.0, size=(n, 3))
    contrast = rng.uniform(0.6, 1.0, size=n)
    cx, cy = rng.uniform(6, 26, size=n), rng.uniform(6, 26, size=n)
    width = rng.uniform(7.0, 13.0, size=n)
    grid = np.arange(IMAGE_SIZE, dtype=np.float64)
    yy, xx = np.meshgrid(grid, grid, indexing="ij")  # (32, 32)
    c, s = np.cos(theta)[:, None, None], np.sin(theta)[:, None, None]
    wave = np.sin(2 * math.pi * freq[:, None, None] * (xx * c + yy * s) + phase[:, None, None])
    window = np.exp(-((xx - cx[:, None, None]) ** 2 + (yy - cy[:, None, None]) ** 2) / (2 * width[:, None, None] ** 2))
    pattern = (contrast[:, None, None] * wave * window)[:, None] * colour[:, :, None, None]  # (n, 3, 32, 32)
    img = pattern + rng.normal(0.0, 0.25, size=pattern.shape)
    return torch.from_numpy(img.astype(np.float32)), torch.from_numpy(y.astype(np.int64))
