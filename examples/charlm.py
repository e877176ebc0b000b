"""Character-level language model on text that ships with Python itself.

Trains a one-layer GRU to predict the next character of Python's own help
texts (``pydoc_data.topics``: ~465k characters of English prose and code
samples, no download), and scores it by next-character accuracy on a
held-out tail of the text.

Run it with flodl::

    python -m flodl.controller --task examples/charlm.py:task --nproc-per-node 2 --epochs 3

Data: the topics are joined in sorted-key order; the last 5% of the text
(the alphabetically last topics, so prose the model never trains on) is held
out. The rest is cut into non-overlapping 64-character windows (6,901 on
Python 3.11), each paired with the same window shifted by one character. At
most ``MAX_TRAIN_WINDOWS`` windows are kept (the cap does not bind on 3.11;
it guards epoch time should a future Python ship much longer help texts).

The help text differs between Python versions, so every rank of a run must
use the same Python minor version to see the same samples (as flodl
requires); the vocabulary is a fixed alphabet and does not depend on it.

Timing on 2 CPU cores: one epoch is 216 steps of batch 32, 5-7 s in a plain
single-process loop, ~3 s of compute per rank when two single-threaded ranks
split it. One epoch reaches ~0.58 held-out character accuracy (loss ~1.7).
For longer epochs on the same text, lower ``STRIDE`` (overlapping windows).
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset

from flodl.task import Task

#: Newline plus printable ASCII, sorted. Fixed rather than derived from the text so
#: the model's shape is the same under every Python version; the handful of
#: typographic characters outside it (curly quotes, dashes, ...) map to UNK_ID.
ALPHABET = "\n" + "".join(chr(c) for c in range(32, 127))
UNK_ID = len(ALPHABET)
VOCAB_SIZE = len(ALPHABET) + 1

SEED = 0
#: Characters of context per sample.
CONTEXT = 64
#: Distance between window starts; equal to CONTEXT means no overlap, every character seen once per epoch.
STRIDE = CONTEXT
#: Fraction of the text, taken from its end, held out for ``eval_fn``.
HELDOUT_FRACTION = 0.05
#: Cap on training windows: bounds epoch time (~1 ms of single-core CPU per window).
MAX_TRAIN_WINDOWS = 8192
#: Cap on evaluation windows (16k characters): keeps ``eval_fn`` well under 1 s on CPU.
MAX_EVAL_WINDOWS = 256
BATCH_SIZE = 32
LEARNING_RATE = 3e-3
EMBED_DIM = 64
HIDDEN_DIM = 128


def _encode(text: str) -> torch.Tensor:
    """Map each character to its id in ``ALPHABET`` (``UNK_ID`` if absent)."""
    lookup = np.full(128, UNK_ID, dtype=np.int64)
    for i, ch in enumerate(ALPHABET):
        lookup[ord(ch)] = i
    # UTF-32 gives one code point per character without a Python-level loop.
    codes = np.frombuffer(text.encode("utf-32-le"), dtype=np.uint32)
    ids = np.where(codes < 128, lookup[np.minimum(codes, 127)], UNK_ID)
    return torch.from_numpy(ids)


def _windows(ids: torch.Tensor, stride: int, limit: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Cut ``ids`` into ``(inputs, targets)`` of shape ``(n, CONTEXT)``, ``n <= limit``.

    Targets are the inputs shifted by one character. When there are more than
    ``limit`` windows, evenly spaced ones are kept so every part of the text
    (every help topic) stays represented.
    """
    chunks = ids.unfold(0, CONTEXT + 1, stride)  # (n, CONTEXT + 1): each target window needs one char more
    if len(chunks) > limit:
        chunks = chunks[torch.linspace(0, len(chunks) - 1, limit).long()]
    # clone: unfold returns a view of the whole text; samples should own compact storage.
    return chunks[:, :-1].clone(), chunks[:, 1:].clone()


@functools.cache
def _data() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Return ``(x_train, y_train, x_eval, y_eval)``, built once per process.

    Callers must treat the tensors as read-only since they are shared.
    """
    from pydoc_data.topics import topics

    # Sorted keys: dict order is an implementation detail we must not depend on.
    text = "".join(topics[key] for key in sorted(topics))
    ids = _encode(text)
    split = int(len(ids) * (1 - HELDOUT_FRACTION))
    x_train, y_train = _windows(ids[:split], STRIDE, MAX_TRAIN_WINDOWS)
    # Eval windows never overlap, whatever STRIDE is: overlap would count characters twice.
    x_eval, y_eval = _windows(ids[split:], CONTEXT, MAX_EVAL_WINDOWS)
    return x_train, y_train, x_eval, y_eval


class CharGRU(nn.Module):
    """Embedding -> one-layer GRU -> per-position logits over the vocabulary."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB_SIZE, EMBED_DIM)
        self.rnn = nn.GRU(EMBED_DIM, HIDDEN_DIM, batch_first=True)
        self.head = nn.Linear(HIDDEN_DIM, VOCAB_SIZE)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``(batch, time)`` character ids -> ``(batch, time, VOCAB_SIZE)`` logits."""
        hidden, _ = self.rnn(self.embed(ids))
        return self.head(hidden)


def build_model() -> nn.Module:
    """A ~100k-parameter CharGRU with reproducible initial weights."""
    # fork_rng: seed the init without resetting the caller's global RNG.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        return CharGRU()


def build_optimizer(model: nn.Module) -> torch.optim.Optimizer:
    """Adam at 3e-3, a robust default for small recurrent nets."""
    return torch.optim.Adam(model.parameters(), lr=LEARNING_RATE)


def sequence_cross_entropy(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy over every position of every sequence in the batch."""
    return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def evaluate(model: nn.Module, device: torch.device) -> float:
    """Held-out next-character accuracy in [0, 1]; restores the model's mode."""
    _, _, x_eval, y_eval = _data()
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            predicted = model(x_eval.to(device)).argmax(dim=-1)
        return (predicted == y_eval.to(device)).float().mean().item()
    finally:
        model.train(was_training)


def task() -> Task:
    """The flodl task factory: ``examples/charlm.py:task``."""
    x_train, y_train, _, _ = _data()
    return Task(
        model=build_model,
        optimizer=build_optimizer,
        dataset=TensorDataset(x_train, y_train),
        batch_size=BATCH_SIZE,
        loss_fn=sequence_cross_entropy,
        eval_fn=evaluate,
        eval_metric="char_accuracy",
    )
