"""Reading samples in worker processes, DataLoader-style, for a window's granted batches.

A rank's batches are its grants cut ``batch_size`` at a time (``data.py``);
``num_workers`` > 0 has worker processes run ``dataset[i]`` for them, as
torch's DataLoader does, so a ``__getitem__`` that holds the GIL (decoding,
Python-level augmentation) no longer serialises the rank. It *is* torch's
DataLoader, with persistent workers, fed by a batch sampler that yields
exactly the samples of the window's batches that the staging tiers do not
hold yet, in order: the rank puts what the workers read into the tiers, takes
the rest from them and collates (the tiers keep raw samples, so collating
comes after that merge). Once the tiers take nothing more, a batch none of
whose samples they hold is read and collated whole in a worker (``Whole``),
as torch's DataLoader does it. Batches come back in the order they were granted;
when a window ends, the reads stop and those in flight land in the tiers
(``BatchSource._merged``): read ahead, never trained, never reported as trained.

Workers are forked (a task file's classes need not be importable by name in
a fresh interpreter) from the thread that trains, and die with the rank: the
kernel SIGKILLs them when it dies (``PR_SET_PDEATHSIG``, ``host/proc.py``),
and torch's own watchdog ends a worker whose parent changed.
"""

from __future__ import annotations

import logging
import os
import signal
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, default_collate

from ..host.proc import die_with_parent

log = logging.getLogger(__name__)


class Failed:
    """What a worker sends back for a sample whose ``__getitem__`` raised: the exception may not
    pickle, so its name and message travel, and the rank raises them naming the index."""

    def __init__(self, error: str) -> None:
        self.error = error


class _Reads(Dataset):
    """The user's dataset as the workers see it: a failure becomes a ``Failed`` value."""

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int) -> Any:
        try:
            return self.dataset[i]
        except Exception as exc:
            return Failed(f"{type(exc).__name__}: {exc}")

    def __getitems__(self, ids: list[int]) -> list[Any]:
        if ids and ids[0] == WHOLE:
            return [_MARK, *self._read(ids[1:])]
        return self._read(ids)

    def _read(self, ids: list[int]) -> list[Any]:
        # the dataset's batched read when it has one; one at a time otherwise, or to find the culprit
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems is not None and ids:
            try:
                return list(getitems(ids))
            except Exception:
                pass
        return [self[i] for i in ids]


#: The first index of a read that the worker collates itself (``Whole``); dataset indices are >= 0.
WHOLE = -1
_MARK = object()  # what ``_Reads`` puts before the samples of such a read, for ``_Collate``: never pickled


class Whole:
    """A batch a worker read and collated whole: the tiers take no more samples, so they need
    not come back one by one (each tensor crossing processes costs a shared-memory segment)."""

    def __init__(self, batch: Any) -> None:
        self.batch = batch


class _Collate:
    """The workers' collate: a ``WHOLE`` read collated with the task's ``collate_fn``; other
    reads go back as samples (the rank keeps them in the tiers, and collates)."""

    def __init__(self, collate: Callable[[list], Any]) -> None:
        self.collate = collate

    def __call__(self, samples: list[Any]) -> Any:
        if not samples or samples[0] is not _MARK:
            return samples
        samples = samples[1:]
        if any(isinstance(s, Failed) for s in samples):
            return samples  # the rank raises, naming the index
        return Whole(self.collate(samples))


class _Feed:
    """The loader's batch sampler: ``iter`` gives the current window's reads (the one iterator:
    torch's loader calls ``iter`` twice as it starts its first iteration)."""

    def __init__(self) -> None:
        self.reads: Iterator[list[int]] = iter(())

    def __iter__(self) -> Iterator[list[int]]:
        return self.reads


class _DieWithRank:
    """A worker's init: SIGKILL it when the rank dies (it holds nothing worth a flush)."""

    def __init__(self, rank_pid: int) -> None:
        self.rank_pid = rank_pid

    def __call__(self, worker_id: int) -> None:
        die_with_parent(self.rank_pid, signal.SIGKILL)


class WorkerReads:
    """``num_workers`` persistent worker processes reading a window's samples, batch by batch, in order."""

    def __init__(
        self, dataset: Any, *, workers: int, prefetch_factor: int | None, seed: int, collate_fn: Callable[[list], Any] | None = None
    ) -> None:
        self.workers = workers
        self._collate = _Collate(collate_fn or default_collate)
        self._feed = _Feed()
        self._dataset = dataset
        self._prefetch_factor = prefetch_factor
        self._seed = seed
        self._loader: DataLoader | None = None

    def _make(self) -> DataLoader:
        return DataLoader(
            _Reads(self._dataset),
            batch_sampler=self._feed,
            num_workers=self.workers,
            collate_fn=self._collate,
            prefetch_factor=self._prefetch_factor,
            persistent_workers=True,
            worker_init_fn=_DieWithRank(os.getpid()),
            multiprocessing_context="fork",
            # the workers' base seed comes from here, not from torch's global generator: starting
            # them must not move the RNG the model's dropout draws from
            generator=torch.Generator().manual_seed(self._seed),
        )

    def open(self, reads: Iterator[list[int]]) -> Iterator[list[Any]]:
        """Start a window: the workers read each list of ``reads`` in order; iterate the result for
        their samples. Call it from the thread that trains: the first call forks the workers, and
        a worker dies with the thread that forked it. Reads of an earlier window still in flight
        (none once that window's batches were closed) are waited for and dropped."""
        if self._loader is None:
            self._loader = self._make()
        self._feed.reads = reads
        return iter(self._loader)

    @property
    def pids(self) -> list[int]:
        """The worker processes' ids (empty before the first window)."""
        it = self._loader._iterator if self._loader is not None else None
        return [w.pid for w in getattr(it, "_workers", [])]

    def discard(self) -> None:
        """Stop the workers; the next window starts new ones (after a reader thread was abandoned
        inside the loader: two threads must never drive one loader)."""
        loader, self._loader = self._loader, None
        it = loader._iterator if loader is not None else None
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            shutdown()

    close = discard
