"""Turning a granted slice of an epoch into batches on the rank's device.

The controller grants ``(epoch, offset, size)``; this module rebuilds the
picks from the shared seeded shuffle of the epoch's pass (``schedule.Schedule``:
``augment`` copies of each sample, ``epoch_splits`` epochs per pass), fetches
the samples (a fast path for in-memory tensor datasets; otherwise through the
staging tiers, ``staging.py``: VRAM pool, RAM cache, disk stage, then the
dataset's ``__getitem__``, or worker processes that run it: ``loader.py``),
collates, applies the run's delivery ``transform`` with each row's
``PickKey``, and moves the batch to the device. A failing ``__getitem__`` is
re-raised naming the sample index, so the user knows which sample is broken.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch.utils.data import TensorDataset, default_collate

from ..errors import TaskError
from ..plan.schedule import PickKey, Schedule, epoch_permutation
from .loader import WHOLE, Failed, Whole, WorkerReads


def map_tensors(batch: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``batch`` with ``fn`` applied to every tensor inside it (nested lists, tuples, namedtuples, dicts)."""
    if isinstance(batch, torch.Tensor):
        return fn(batch)
    if isinstance(batch, (list, tuple)):
        moved = [map_tensors(b, fn) for b in batch]
        return type(batch)(moved) if not hasattr(batch, "_fields") else type(batch)(*moved)
    if isinstance(batch, dict):
        return {k: map_tensors(v, fn) for k, v in batch.items()}
    return batch


def to_device(batch: Any, device: torch.device) -> Any:
    """Move every tensor inside a (nested) batch to ``device``."""
    return map_tensors(batch, lambda t: t.to(device, non_blocking=True))


def pinned(batch: Any) -> Any:
    """The batch's host tensors in page-locked memory (``pin_memory``): their copy to a CUDA
    device is then asynchronous. Device tensors (from the VRAM pool) stay where they are."""
    return map_tensors(batch, lambda t: t.pin_memory() if t.device.type == "cpu" and not t.is_pinned() else t)


Transform = Callable[[Any, list[PickKey]], Any]

#: Threads reading one batch's samples in parallel through the staging tiers.
READERS = 8
#: In-memory batches gathered by one kernel per tensor (``BatchSource._chunked``) ...
CHUNK_BATCHES = 16
#: ... holding at most this many bytes of samples.
CHUNK_BYTES = 64 << 20


class PassShuffles:
    """Each pass's seeded shuffle (``epoch_permutation``), made once when a grant first needs it;
    windows straddle at most two passes, so only the last two are kept."""

    def __init__(self, pass_len: int, seed: int) -> None:
        self.pass_len, self.seed = pass_len, seed
        self._made: dict[int, torch.Tensor] = {}

    def __getitem__(self, pass_index: int) -> torch.Tensor:
        shuffle = self._made.get(pass_index)
        if shuffle is None:
            if len(self._made) >= 2:
                self._made.pop(next(iter(self._made)))
            shuffle = self._made[pass_index] = epoch_permutation(self.pass_len, self.seed, pass_index)
        return shuffle


def _cut(shuffle: torch.Tensor, spans: list[tuple[int, int]]) -> torch.Tensor:
    """The picks of ``spans`` out of a pass's shuffle: a view for one span, a copy for several."""
    if len(spans) == 1:
        at, n = spans[0]
        return shuffle[at : at + n]
    return torch.cat([shuffle[at : at + n] for at, n in spans])


class BatchSource:
    """Fetches batches of granted slices of the run's epochs."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int,
        seed: int,
        collate_fn: Callable[[list], Any] | None = None,
        *,
        schedule: Schedule | None = None,
        transform: Transform | None = None,
        tiers: Any = None,
    ) -> None:
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.collate = collate_fn or default_collate
        self.length = len(dataset)
        self.schedule = schedule or Schedule(self.length)
        self.transform = transform
        self.tiers = tiers  # staging.TieredSamples, or None: straight from the dataset
        self.device: torch.device | None = None  # set once a VRAM pool may hand back device-resident samples
        self._readers: ThreadPoolExecutor | None = None  # parallel dataset reads (staged path), made on first use
        self.workers: WorkerReads | None = None  # worker processes reading the tiers' misses (num_workers)
        self.pin = False  # collated batches into pinned memory (pin_memory on a CUDA rank)
        self._tensors = dataset.tensors if isinstance(dataset, TensorDataset) and collate_fn is None else None
        self._perms = PassShuffles(self.schedule.pass_len, seed)
        # the same shuffles as dataset indices (picks modulo the dataset: augmented passes are
        # longer), where the tensors live: on the device after place_on
        self._index_perms: dict[int, torch.Tensor] = {}

    def stage(self, tiers: Any) -> None:
        """Fetch samples through ``tiers`` (``staging.TieredSamples``) instead of straight from the dataset."""
        self.tiers = tiers

    def read_with(self, workers: WorkerReads | None, *, pin: bool) -> None:
        """Have ``workers`` read the samples the tiers lack (``loaded_batches``); ``pin``: deliver
        batches in pinned memory."""
        self.workers, self.pin = workers, pin

    def pool_in_vram(self, pool: Any) -> None:
        """Add ``pool`` (``staging.VramPool``) to the tiers: samples may now come back resident on
        its device, so every batch is collated there."""
        self.tiers.add_vram(pool)
        self.device = pool.device

    @property
    def resident_bytes(self) -> int:
        """Bytes of an in-memory dataset's tensors (0 for any other dataset)."""
        return sum(t.numel() * t.element_size() for t in self._tensors) if self._tensors is not None else 0

    def place_on(self, device: torch.device) -> None:
        """Keep an in-memory dataset on ``device``: a batch is then a gather there, with no
        host round trip (each pass's shuffle goes up once: ``_index_shuffle``)."""
        if self._tensors is None:
            return
        self._tensors = tuple(t.to(device) for t in self._tensors)
        self.device = device
        self._index_perms.clear()  # host copies: the next batch takes them up once

    @property
    def in_memory(self) -> bool:
        """A tensor dataset: a batch is one indexing op, nothing to stage or prefetch."""
        return self._tensors is not None

    def batches(self, epoch: int, offset: int, size: int) -> Iterator[tuple[torch.Tensor | int, Any]]:
        """Yield ``(picks, batch)`` for each batch of the slice (last may be partial)."""
        for _, picks, batch in self.window_batches([[epoch, offset, size]]):
            yield picks, batch

    def window_batches(self, grants: list[list[int]], *, places: bool = True) -> Iterator[tuple[int, torch.Tensor | int, Any]]:
        """Yield ``(epoch, picks, batch)`` over ``[epoch, start, size]`` grants in order (``_plan``).
        ``places=False``: picks may be their count alone, where nothing needs the places (``_emit``)."""
        if self._tensors is not None and not places and self._as_stored:
            yield from self._chunked(grants)
            return
        for epoch, pass_index, spans in self._plan(grants):
            yield (epoch, *self._emit(pass_index, spans, places))

    def _chunked(self, grants: list[list[int]]) -> Iterator[tuple[int, int, Any]]:
        """In-memory batches, each run of consecutive ones gathered at once: ``(epoch, count, batch)``.

        Consecutive batches of one grant are one contiguous span of the pass's shuffle, so up to
        ``CHUNK_BATCHES`` of them (``CHUNK_BYTES`` at most) are one slice and one gather per
        tensor, and each batch a view of that (a slice, no kernel). A per-batch gather is a
        kernel launch per tensor and step, which at ~1 ms host-bound GPU steps is a few percent
        of the step. The batches and their order are exactly the per-batch path's; a window that
        ends inside a chunk leaves its rest gathered and untrained (never counted: only what
        training takes is)."""
        limit = self._chunk_batches()
        run: list[tuple[int, int, int]] = []  # (epoch, place in the pass's shuffle, count) of the run's batches
        run_pass = -1
        for epoch, pass_index, spans in self._plan(grants):
            single = len(spans) == 1
            if run and (not single or pass_index != run_pass or spans[0][0] != run[-1][1] + run[-1][2] or len(run) >= limit):
                yield from self._gathered(run_pass, run)
                run = []
            if not single:  # a batch cut across two grants: gathered on its own
                yield epoch, sum(n for _, n in spans), self._emit(pass_index, spans, places=False)[1]
                continue
            run_pass = pass_index
            run.append((epoch, *spans[0]))
        if run:
            yield from self._gathered(run_pass, run)

    def _gathered(self, pass_index: int, run: list[tuple[int, int, int]]) -> Iterator[tuple[int, int, Any]]:
        """The batches of one contiguous ``run`` of ``(epoch, at, count)``: one gather, then views."""
        _, whole = self._emit(pass_index, [(run[0][1], sum(n for _, _, n in run))], places=False)  # the per-batch gather, once
        offset = 0
        for epoch, _, n in run:
            yield epoch, n, tuple(t[offset : offset + n] for t in whole)
            offset += n

    def _chunk_batches(self) -> int:
        """How many batches one gather may take: ``CHUNK_BATCHES``, fewer for big samples."""
        row = sum(t[0].numel() * t.element_size() for t in self._tensors or ()) if self.length else 0
        return max(1, min(CHUNK_BATCHES, CHUNK_BYTES // max(1, row * self.batch_size)))

    def _plan(self, grants: list[list[int]]) -> Iterator[tuple[int, int, list[tuple[int, int]]]]:
        """``(epoch, pass_index, spans)`` of each batch of the grants, in order.

        A batch may span two grants of one epoch, never two epochs (each batch
        is one epoch's, so per-epoch metrics stay exact); a batch cut short by
        an epoch edge is simply smaller. Batches are cut as integer spans of the
        pass's shuffle; tensors are made once per batch (``_emit``), since each
        tensor op costs microseconds a step.
        """
        pending: list[tuple[int, int]] = []  # spans (place in the pass's shuffle, length) of the next batch
        have = 0
        epoch_of = pass_of = 0
        for epoch, start, size in grants:
            if pending and epoch != epoch_of:
                yield epoch_of, pass_of, pending
                pending, have = [], 0
            epoch_of = epoch
            pass_of, at = self._span(epoch, start, size)
            while size:
                take = min(size, self.batch_size - have)
                pending.append((at, take))
                have += take
                at += take
                size -= take
                if have == self.batch_size:
                    yield epoch, pass_of, pending
                    pending, have = [], 0
        if pending:
            yield epoch_of, pass_of, pending

    def loaded_batches(self, grants: list[list[int]]) -> Iterator[tuple[int, torch.Tensor, Any]]:
        """``window_batches`` with the samples the tiers lack read by the worker processes.

        The window's reads start now, in the calling thread (the first window
        forks the workers, which die with that thread: call it from the one
        that trains); the batches may then be taken in another (the prefetcher's).
        """
        assert self.workers is not None, "loaded_batches needs worker reads (num_workers > 0)"
        ahead: deque[tuple[int, int, torch.Tensor, list[int], list[int]]] = deque()
        ending = threading.Event()

        def reads() -> Iterator[list[int]]:
            # run by the loader as far ahead as its workers read: each batch's plan waits in `ahead`
            for epoch, pass_index, spans in self._plan(grants):
                if ending.is_set():
                    return  # the window ended: no more reads, those in flight are kept (_merged)
                picks = _cut(self._perms[pass_index], spans)
                ids = (picks % self.length).tolist()
                asked = self._to_read(ids)
                ahead.append((epoch, pass_index, picks, ids, asked))
                yield asked

        return self._merged(self.workers.open(reads()), ahead, ending)

    def _to_read(self, ids: list[int]) -> list[int]:
        """What the workers read of a batch: the samples the tiers lack, or, once the tiers take no
        more, a batch they hold none of whole (``WHOLE``: the worker collates it)."""
        tiers = self.tiers
        if tiers is None:
            return [WHOLE, *ids]
        misses = [i for i in dict.fromkeys(ids) if not tiers.holds(i)]
        return [WHOLE, *ids] if len(misses) == len(set(ids)) and tiers.full() else misses

    def _merged(self, results: Iterator[Any], ahead: deque, ending: threading.Event) -> Iterator[tuple[int, torch.Tensor, Any]]:
        """Each batch from what the workers read (kept in the tiers) and what the tiers held.

        Closed before its end (the window ended), it stops the reads and waits for those in
        flight (as the loader's reset at the next window would) to keep their samples in the
        tiers: read ahead, never trained, never reported as trained.
        """
        try:
            for got in results:
                epoch, pass_index, picks, ids, asked = ahead.popleft()
                if isinstance(got, Whole):
                    self._count_whole(ids)
                    yield epoch, picks, self._delivered(pass_index, picks, got.batch)
                    continue
                read = self._kept(got, asked)
                batch = self._collated([read[i] if i in read else self._one(i) for i in ids])
                yield epoch, picks, self._delivered(pass_index, picks, batch)
        except GeneratorExit:
            ending.set()
            for got in results:
                _, _, _, ids, asked = ahead.popleft()
                if isinstance(got, Whole):
                    self._count_whole(ids)
                elif any(isinstance(sample, Failed) for sample in got):
                    break  # raised when a window trains that sample
                else:
                    self._kept(got, asked)
            raise

    def _count_whole(self, ids: list[int]) -> None:
        if self.tiers is not None:
            self.tiers.fetched_elsewhere(len(ids))

    def _kept(self, got: list[Any], asked: list[int]) -> dict[int, Any]:
        """The samples the workers read for ``asked``, by index, each kept in the tiers.

        Raises:
            TaskError: a sample's ``__getitem__`` raised in the worker; the message names its index.
        """
        # the samples asked for (a whole batch comes back as samples when one of them failed)
        read = dict(zip(asked[1:] if asked[:1] == [WHOLE] else asked, got, strict=True))
        for i, sample in read.items():
            if isinstance(sample, Failed):
                raise TaskError(f"dataset[{i}] raised {sample.error}")
            if self.tiers is not None:
                self.tiers.offer(i, sample)
        return read

    def _emit(self, pass_index: int, spans: list[tuple[int, int]], places: bool = True) -> tuple[torch.Tensor | int, Any]:
        """``(picks, batch)`` of one batch; picks are places in the pass (beyond the dataset when
        augmented), on the host. Without ``places``, an in-memory batch that nothing transforms or
        pins gives their count only (an int): training counts samples and needs no places, and
        cutting them was a tensor op a step."""
        if self._tensors is not None:
            # in memory: the pass's shuffle as dataset indices sits where the tensors are (on the
            # device after place_on), so a batch's indices are a slice of it (a view) and the batch
            # one gather per tensor, as a hand-written loop does it: no modulo, no host-to-device
            # copy per step
            idx = _cut(self._index_shuffle(pass_index), spans)
            batch: Any = tuple(t[idx] for t in self._tensors)
            if not places and self._as_stored:
                return spans[0][1] if len(spans) == 1 else sum(n for _, n in spans), batch
            picks = _cut(self._perms[pass_index], spans)
        else:
            picks = _cut(self._perms[pass_index], spans)
            batch = self.fetch(picks % self.length)
        return picks, self._delivered(pass_index, picks, batch)

    def delivers_on(self, device: torch.device) -> bool:
        """Every batch comes out as the dataset's tensors, already on ``device`` (in memory,
        nothing transforms or pins them): training need not move them (``to_device`` costs a
        call per tensor and step even when they stay put)."""
        return self._tensors is not None and self._as_stored and all(t.device == device for t in self._tensors)

    @property
    def _as_stored(self) -> bool:
        """A batch reaches training as gathered: no transform applies and nothing pins it."""
        return self.transform is None and not self.pin

    def _delivered(self, pass_index: int, picks: torch.Tensor, batch: Any) -> Any:
        """The batch as training gets it: the run's transform applied, pinned when asked."""
        if self.transform is not None:
            batch = self._transformed(batch, self.schedule.keys(pass_index, picks))
        return pinned(batch) if self.pin else batch

    def _index_shuffle(self, pass_index: int) -> torch.Tensor:
        """The pass's shuffle as dataset indices, where the tensors are (made, and uploaded, once per pass)."""
        shuffle = self._index_perms.get(pass_index)
        if shuffle is None:
            if len(self._index_perms) >= 2:  # windows straddle at most two passes
                self._index_perms.pop(next(iter(self._index_perms)))
            perm = self._perms[pass_index]
            shuffle = perm if self.schedule.pass_len == self.length else perm % self.length
            if self.device is not None and self.device.type == "cuda":
                # pinned and non-blocking: a plain copy to CUDA waits for the device (the launch queue drains)
                shuffle = shuffle.pin_memory().to(self.device, non_blocking=True)
            elif self.device is not None:
                shuffle = shuffle.to(self.device)
            self._index_perms[pass_index] = shuffle
        return shuffle

    def _transformed(self, batch: Any, keys: list[PickKey]) -> Any:
        assert self.transform is not None  # called only when there is one
        try:
            return self.transform(batch, keys)
        except Exception as exc:
            raise TaskError(
                f"the transform raised {type(exc).__name__}: {exc} (picks of samples {[k.sample for k in keys][:8]}...)"
            ) from exc

    def _span(self, epoch: int, start: int, size: int) -> tuple[int, int]:
        """``(pass_index, at)`` of a grant, ``at`` its first pick's place in the pass's shuffle
        (``_emit`` cuts it from the shuffle, made on first use)."""
        return self.schedule.span(epoch, start, size)

    def fetch(self, idx: torch.Tensor) -> Any:
        """Collate the samples at dataset indices ``idx`` (any dataset but an in-memory tensor
        one, whose batches ``_emit`` gathers from the pass's index shuffle).

        Raises:
            TaskError: the dataset raised on a sample; the message names its index.
        """
        ids = idx.tolist()
        if self.tiers is not None:
            return self._collated(self._staged(ids))
        getitems = getattr(self.dataset, "__getitems__", None)
        if getitems is not None:
            try:
                return self.collate(getitems(ids))
            except Exception:
                pass  # fall back to one sample at a time to name the culprit
        return self.collate([self._one(i) for i in ids])

    def _collated(self, samples: list[Any]) -> Any:
        if self.device is not None:  # some may come from the VRAM pool: collate them all on the device
            samples = [to_device(sample, self.device) for sample in samples]
        return self.collate(samples)

    def _staged(self, ids: list[int]) -> list[Any]:
        """A batch's samples through the tiers: hits in this thread, misses read in parallel.

        Reads are I/O (files, decoders that release the GIL), so a batch's misses
        overlap like a DataLoader's workers; a hit is a dictionary lookup, cheaper
        than handing it to a thread. ``map`` keeps the order and raises the first failure.
        """
        misses = [k for k, i in enumerate(ids) if not self.tiers.holds(i)]
        if len(misses) < 2:
            return [self._one(i) for i in ids]
        if self._readers is None:
            self._readers = ThreadPoolExecutor(max_workers=READERS, thread_name_prefix="flodl-read")
        read = dict(zip(misses, self._readers.map(self._one, [ids[k] for k in misses]), strict=False))
        return [read[k] if k in read else self._one(i) for k, i in enumerate(ids)]

    def _one(self, i: int) -> Any:
        try:
            return self.tiers.get(i) if self.tiers is not None else self.dataset[i]
        except Exception as exc:
            raise TaskError(f"dataset[{i}] raised {type(exc).__name__}: {exc}") from exc
