"""Turning a granted slice of an epoch into batches on the rank's device.

The controller grants ``(epoch, offset, size)``; this module rebuilds the
sample indices from the shared seeded permutation, fetches them from the
task's dataset (a fast path for in-memory tensor datasets, ``__getitems__``
where the dataset has it, else one ``__getitem__`` per sample), collates and
moves the batch to the device. A failing ``__getitem__`` is re-raised naming
the sample index, so the user knows which sample is broken.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch
from torch.utils.data import TensorDataset, default_collate

from ..errors import TaskError
from ..schedule import slice_indices


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor inside a (nested) batch to ``device``."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, (list, tuple)):
        moved = [to_device(b, device) for b in batch]
        return type(batch)(moved) if not hasattr(batch, "_fields") else type(batch)(*moved)
    if isinstance(batch, dict):
        return {k: to_device(v, device) for k, v in batch.items()}
    return batch


class BatchSource:
    """Fetches batches of a slice of one epoch's permutation."""

    def __init__(self, dataset: Any, batch_size: int, seed: int, collate_fn: Callable[[list], Any] | None = None) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.collate = collate_fn or default_collate
        self.length = len(dataset)
        self._tensors = dataset.tensors if isinstance(dataset, TensorDataset) and collate_fn is None else None

    def batches(self, epoch: int, offset: int, size: int) -> Iterator[tuple[torch.Tensor, Any]]:
        """Yield ``(indices, batch)`` for each batch of the slice (last may be partial)."""
        indices = slice_indices(self.length, self.seed, epoch, offset, size)
        for start in range(0, size, self.batch_size):
            idx = indices[start : start + self.batch_size]
            yield idx, self.fetch(idx)

    def fetch(self, idx: torch.Tensor) -> Any:
        """Collate the samples at ``idx``.

        Raises:
            TaskError: the dataset raised on a sample; the message names its index.
        """
        if self._tensors is not None:
            return tuple(t[idx] for t in self._tensors)
        ids = idx.tolist()
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems is not None:
            try:
                return self.collate(getitems(ids))
            except Exception:
                pass  # fall back to one sample at a time to name the culprit
        samples = []
        for i in ids:
            try:
                samples.append(self.dataset[i])
            except Exception as exc:
                raise TaskError(f"dataset[{i}] raised {type(exc).__name__}: {exc}") from exc
        return self.collate(samples)
