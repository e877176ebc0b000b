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
        self._perms: dict[tuple[int, int], torch.Tensor] = {}

    def batches(self, epoch: int, offset: int, size: int) -> Iterator[tuple[torch.Tensor, Any]]:
        """Yield ``(indices, batch)`` for each batch of the slice (last may be partial)."""
        indices = self._permutation(epoch)[offset : offset + size]
        for start in range(0, size, self.batch_size):
            idx = indices[start : start + self.batch_size]
            yield idx, self.fetch(idx)

    def window_batches(self, grants: list[list[int]]) -> Iterator[tuple[int, torch.Tensor, Any]]:
        """Yield ``(epoch, indices, batch)`` over ``[epoch, start, size]`` grants in order.

        A batch may span two grants of one epoch, never two epochs (each batch
        is one epoch's, so per-epoch metrics stay exact); a batch cut short by
        an epoch edge is simply smaller.
        """
        pending: list[torch.Tensor] = []
        have = 0
        epoch_of = None
        for epoch, start, size in grants:
            if epoch_of is not None and epoch != epoch_of and pending:
                yield (epoch_of, *self._emit(pending))
                pending, have = [], 0
            epoch_of = epoch
            idx = self._permutation(epoch)[start : start + size]
            while len(idx):
                take = self.batch_size - have
                pending.append(idx[:take])
                have += len(idx[:take])
                idx = idx[take:]
                if have == self.batch_size:
                    yield (epoch, *self._emit(pending))
                    pending, have = [], 0
        if pending:
            yield (epoch_of, *self._emit(pending))

    def _emit(self, pieces: list[torch.Tensor]) -> tuple[torch.Tensor, Any]:
        idx = pieces[0] if len(pieces) == 1 else torch.cat(pieces)
        return idx, self.fetch(idx)

    def _permutation(self, epoch: int) -> torch.Tensor:
        """The epoch's permutation, cached (a window may revisit it many times)."""
        key = (self.seed, epoch)
        perm = self._perms.get(key)
        if perm is None:
            if len(self._perms) >= 3:  # windows straddle at most two epochs
                self._perms.pop(next(iter(self._perms)))
            perm = self._perms[key] = slice_indices(self.length, self.seed, epoch, 0, self.length)
        return perm

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
