"""Rank-side staging tiers for raw samples.

A rank reads the same samples every data pass in a fresh order, so it keeps
what it can close by: ``VramPool`` (device memory) -> ``RamCache`` (host
memory) -> ``DiskStage`` (one local pack file, disk_stage.py) -> the user's dataset.
``TieredSamples`` walks that cascade for one sample index. Tiers hold raw
samples only (transforms run later). Never pickles: the disk tier writes
``SampleCodec`` frames (``sample_codec.py``); reading ahead is ``prefetch.py``.
"""

from __future__ import annotations

import logging
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import psutil
import torch

from .tier_stats import TierStats

if TYPE_CHECKING:
    import numpy as np
else:
    try:  # numpy is optional for flodl; arrays are only staged when it is there
        import numpy as np
    except ImportError:  # pragma: no cover - torch wheels normally bring numpy
        np = None

log = logging.getLogger(__name__)

if TYPE_CHECKING:
    from .disk_stage import DiskStage  # the disk tier (annotations only: it imports nothing from here)

# Rough per-object host costs (CPython + ATen headers), so budgets stay honest
# for datasets of many tiny samples; measured ~550 B per small CPU tensor.
_TENSOR_OVERHEAD = 512
_ARRAY_OVERHEAD = 112
_SCALAR_OVERHEAD = 32
_CONTAINER_OVERHEAD = 64
_SLOT_OVERHEAD = 8
# Arena slabs: big enough that allocations are rare, small enough that the
# last, partly used slab wastes little of a pinned or device budget.
_SLAB_BYTES = 64 << 20
_ALIGN = 64


# ---------------------------------------------------------------- sizes and budgets


def sample_nbytes(sample: Any) -> int:
    """Host bytes a sample holds: tensor/array data (its own elements, not the
    storage it may view) plus small fixed per-object overheads."""
    if isinstance(sample, torch.Tensor):
        return sample.nelement() * sample.element_size() + _TENSOR_OVERHEAD
    if np is not None and isinstance(sample, np.ndarray):
        return sample.nbytes + _ARRAY_OVERHEAD
    if isinstance(sample, (str, bytes, bytearray)):
        return len(sample) + _SCALAR_OVERHEAD
    if isinstance(sample, (list, tuple)):
        return _CONTAINER_OVERHEAD + sum(_SLOT_OVERHEAD + sample_nbytes(x) for x in sample)
    if isinstance(sample, dict):
        return _CONTAINER_OVERHEAD + sum(sample_nbytes(k) + sample_nbytes(v) for k, v in sample.items())
    nbytes = getattr(sample, "nbytes", None)  # numpy scalars and array-likes
    return int(nbytes) + _SCALAR_OVERHEAD if isinstance(nbytes, int) else sys.getsizeof(sample)


def _device_nbytes(sample: Any) -> int:
    """Device bytes the tensors of a sample take in an arena (aligned)."""
    return sum(-(-t.nelement() * t.element_size() // _ALIGN) * _ALIGN for t in _tensors(sample))


def _tensors(sample: Any) -> Iterator[torch.Tensor]:
    if isinstance(sample, torch.Tensor):
        yield sample
    elif isinstance(sample, (list, tuple)):
        for x in sample:
            yield from _tensors(x)
    elif isinstance(sample, dict):
        for x in sample.values():
            yield from _tensors(x)


def _map_leaves(sample: Any, on_tensor: Callable[[torch.Tensor], Any], on_array: Callable[[Any], Any]) -> Any:
    """``sample`` rebuilt with new containers and mapped tensors/arrays."""
    if isinstance(sample, torch.Tensor):
        return on_tensor(sample)
    if np is not None and isinstance(sample, np.ndarray):
        return on_array(sample)
    if isinstance(sample, (list, tuple)):
        items = [_map_leaves(x, on_tensor, on_array) for x in sample]
        if hasattr(sample, "_fields"):  # namedtuple
            return type(sample)(*items)
        return items if isinstance(sample, list) else tuple(items)
    if isinstance(sample, dict):
        return {k: _map_leaves(v, on_tensor, on_array) for k, v in sample.items()}
    return sample  # immutable scalars; unknown objects are kept by reference


def ram_budget(max_usage: float, local_world: int, *, available: int | None = None) -> int:
    """This rank's share of host RAM for staging: ``max_usage`` x available RAM,
    split equally across the ``local_world`` ranks on the host (0 disables)."""
    if max_usage <= 0:
        return 0
    if available is None:
        available = psutil.virtual_memory().available
    return int(max_usage * available) // max(1, local_world)


def vram_budget(device: torch.device, *, max_usage: float, gpu_ram_share: float | None, kill_switch: bool) -> int:
    """Bytes left for the VRAM pool under the usage ceiling.

    Call after the model and the first step hold their memory: whatever the
    device already uses (``total - free``) comes off the ceiling, which is
    ``max_usage x total`` VRAM, or ``gpu_ram_share x host RAM`` on an APU whose
    GPU memory is host RAM. 0 off CUDA or with the kill switch (the caller
    reads ``FLODL_VRAM_POOL``).
    """
    device = torch.device(device)
    if kill_switch or device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    ceiling = gpu_ram_share * psutil.virtual_memory().total if gpu_ram_share is not None else max_usage * total
    return max(0, int(ceiling) - (total - free))


# ---------------------------------------------------------------- memory tiers


class _Arena:
    """Bump allocator over large slabs of host or device memory.

    One allocation per slab rather than per tensor: per-sample copies
    interleaved with the dataset's own short-lived buffers fragment the heap
    (measured: a 64 MiB cache of 1 MiB clones grew RSS by 90-128 MiB), pinning
    is one page-locking call per slab instead of power-of-two rounded blocks,
    and the CUDA caching allocator sees a few big blocks. Nothing is freed
    before the whole arena goes (the tiers never evict).
    """

    def __init__(self, device: torch.device, *, pin: bool = False) -> None:
        self.device = device
        self.pin = pin
        self._slab: torch.Tensor | None = None
        self._used = 0
        self._lock = threading.Lock()

    def place(self, t: torch.Tensor, room: int) -> torch.Tensor:
        """A compact copy of ``t`` in the arena; a new slab takes at most
        ``max(nbytes, room)`` bytes, so slabs stay within the caller's budget."""
        t = t.detach()
        nbytes = t.nelement() * t.element_size()
        if nbytes == 0:
            return torch.empty(t.shape, dtype=t.dtype, device=self.device)
        region = self._alloc(nbytes, room)
        return region.view(t.dtype).reshape(t.shape).copy_(t)

    def _alloc(self, nbytes: int, room: int) -> torch.Tensor:
        with self._lock:
            if self._slab is None or self._used + nbytes > self._slab.numel():
                self._slab = self._new_slab(max(nbytes, min(_SLAB_BYTES, room)))
                self._used = 0
            region = self._slab[self._used : self._used + nbytes]
            # aligned so that any dtype can view the region (complex128 needs 16)
            self._used += -(-nbytes // _ALIGN) * _ALIGN
            return region

    def _new_slab(self, nbytes: int) -> torch.Tensor:
        if self.pin:
            try:
                return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            except RuntimeError as exc:  # page-locked memory is scarcer than RAM
                log.warning("pinned allocation of %d bytes failed (%s); continuing unpinned", nbytes, exc)
                self.pin = False
        return torch.empty(nbytes, dtype=torch.uint8, device=self.device)


class _BudgetedStore:
    """Index -> sample under a byte budget; keeps what arrives, refuses once full.

    No eviction: every pass reshuffles uniformly, so without lookahead no
    replacement policy beats a static resident set, and churn only costs
    copies. Thread-safe; the (possibly slow) copy runs outside the lock.
    """

    def __init__(self, budget_bytes: int) -> None:
        self.budget_bytes = max(0, int(budget_bytes))
        self._items: dict[int, Any] = {}
        self._pending: set[int] = set()
        self._lock = threading.Lock()
        self._stats = TierStats()
        self._frozen = False  # set when the memory turned out scarcer than the budget

    def _size(self, sample: Any) -> int:
        raise NotImplementedError

    def _copy(self, sample: Any, room: int) -> Any:
        raise NotImplementedError

    def get(self, i: int) -> Any | None:
        """The held sample (shared: do not mutate it in place), or None."""
        with self._lock:
            sample = self._items.get(i)
            self._stats.record(sample is not None)
            return sample

    def peek(self, i: int) -> Any | None:
        """Like ``get`` but uncounted."""
        with self._lock:
            return self._items.get(i)

    def __contains__(self, i: int) -> bool:
        with self._lock:
            return i in self._items

    def put(self, i: int, sample: Any) -> bool:
        """Hold a private copy of ``sample``; False when it does not fit (or is None)."""
        if sample is None:
            return False
        size = self._size(sample)
        with self._lock:
            if i in self._items or i in self._pending:
                return True
            room = self.budget_bytes - self._stats.bytes
            if self._frozen or size > room:
                self._stats.puts_refused += 1
                return False
            self._stats.bytes += size  # reserve now, so concurrent puts cannot overshoot
            self._pending.add(i)
        copy = None
        try:
            copy = self._copy(sample, room)
        finally:
            self._settle(i, size, copy)
        return copy is not None

    def _settle(self, i: int, size: int, copy: Any) -> None:
        with self._lock:
            self._pending.discard(i)
            if copy is None:  # the copy failed: give the reservation back
                self._stats.bytes -= size
                self._stats.puts_refused += 1
            else:
                self._items[i] = copy
                self._stats.items += 1

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(**asdict(self._stats))


class RamCache(_BudgetedStore):
    """Host-memory sample cache; ``pin=True`` holds tensors in pinned memory.

    Stored tensors are compact private copies in the arena: a dataset handing
    out views of one big tensor would otherwise keep the whole storage alive
    while the budget counted only the view, and a dataset that reuses its
    buffers would change what we hold.
    """

    def __init__(self, budget_bytes: int, *, pin: bool = False) -> None:
        super().__init__(budget_bytes)
        # pinning needs a CUDA driver; without one it is a plain host copy
        self._arena = _Arena(torch.device("cpu"), pin=pin and torch.cuda.is_available())

    @property
    def pin(self) -> bool:
        """Whether tensors land in pinned memory (false without CUDA or after a failed pin)."""
        return self._arena.pin

    def _size(self, sample: Any) -> int:
        return sample_nbytes(sample)

    def _copy(self, sample: Any, room: int) -> Any:
        return _map_leaves(sample, lambda t: self._arena.place(t, room), _copy_array)


def _copy_array(a: Any) -> Any:
    return np.array(a, copy=True, order="C")


class VramPool(_BudgetedStore):
    """Device-resident copies of samples (tensors moved; other parts kept as is).

    The budget counts device bytes only. A CUDA OOM while filling freezes the
    pool at its size: the budget was optimistic.
    """

    def __init__(self, device: torch.device, budget_bytes: int) -> None:
        super().__init__(budget_bytes)
        self.device = torch.device(device)
        self._arena = _Arena(self.device)

    def _size(self, sample: Any) -> int:
        return _device_nbytes(sample)

    def _copy(self, sample: Any, room: int) -> Any:
        try:
            return _map_leaves(sample, lambda t: self._arena.place(t, room), lambda a: a)
        except torch.OutOfMemoryError as exc:
            self._frozen = True  # the budget was optimistic: keep what we have
            log.warning("VRAM pool stops growing after a CUDA OOM (%s)", exc)
            return None


# ---------------------------------------------------------------- the cascade


class _Flight:
    """One source fetch in progress; other threads wanting the index wait on it."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.ok = False
        self.sample: Any = None


class TieredSamples:
    """``get(i)``: VRAM -> RAM -> disk -> ``fetch(i)``, filling the first tier with room.

    Concurrent gets of one index share a single source fetch (single-flight):
    every get ends as exactly one tier hit, one source fetch, or one "shared"
    result, and with room in the tiers each index is fetched once. The lock
    covers bookkeeping only, never ``fetch``.
    """

    def __init__(self, fetch: Callable[[int], Any], *, vram: VramPool | None, ram: RamCache | None, disk: DiskStage | None) -> None:
        self._fetch = fetch
        self.vram, self.ram, self.disk = vram, ram, disk
        self._lock = threading.Lock()
        self._inflight: dict[int, _Flight] = {}
        self._source = {"fetches": 0, "shared": 0, "errors": 0}
        self._warned: set[str] = set()

    def add_vram(self, pool: VramPool) -> None:
        """Open the VRAM tier (after the first step, once what the model takes is known)."""
        self.vram = pool

    def _tiers(self) -> list[Any]:
        return [t for t in (self.vram, self.ram, self.disk) if t is not None]

    def get(self, i: int) -> Any:
        """The sample at ``i`` (may live on the pool's device: move before collating).

        Raises:
            Exception: whatever ``fetch(i)`` raised, unchanged.
        """
        for tier in (self.vram, self.ram):
            sample = tier.get(i) if tier is not None else None
            if sample is not None:
                return sample
        sample = self.disk.get(i) if self.disk is not None else None
        if sample is not None:
            self._promote(i, sample)
            return sample
        return self._from_source(i)

    def _from_source(self, i: int) -> Any:
        while True:
            with self._lock:
                # re-checked under the lock: a racing fetch may have landed it
                holder = next((t for t in self._tiers() if i in t), None)
                flight = self._inflight.get(i) if holder is None else None
                leader = holder is None and flight is None
                if leader:
                    flight = self._inflight[i] = _Flight()
            if leader:
                assert flight is not None  # the leader just made it
                return self._lead(i, flight)
            if holder is not None:
                sample = holder.peek(i)
            else:
                assert flight is not None  # no holder and not the leader: another fetch is in flight
                sample = self._follow(flight)
            if sample is not None:
                with self._lock:
                    self._source["shared"] += 1
                return sample
            # the holder turned off or the leader's fetch failed: go round again

    def _follow(self, flight: _Flight) -> Any | None:
        flight.done.wait()
        return flight.sample if flight.ok else None

    def _lead(self, i: int, flight: _Flight) -> Any:
        sample, fetched = None, False
        try:
            sample = self._fetch(i)
            fetched = True
            self._place(i, sample)  # before the flight ends, so late comers find it in a tier
            return sample
        finally:
            # on any exit: followers must never wait on a flight nobody will end
            with self._lock:
                self._source["fetches" if fetched else "errors"] += 1
                del self._inflight[i]
            flight.sample, flight.ok = sample, fetched and sample is not None
            flight.done.set()  # after a failure, followers retry and raise their own error

    def offer(self, i: int, sample: Any) -> None:
        """A sample the source gave elsewhere (a loader worker, ``loader.py``): counted as a source
        fetch and kept in the first tier with room, as ``get`` would have."""
        with self._lock:
            self._source["fetches"] += 1
            held = any(i in tier for tier in self._tiers())
        if not held:
            self._place(i, sample)

    def fetched_elsewhere(self, count: int) -> None:
        """Count ``count`` samples the source gave a loader worker that collated them itself."""
        with self._lock:
            self._source["fetches"] += count

    def _place(self, i: int, sample: Any) -> None:
        for tier in self._tiers():
            if self._put(tier, i, sample):
                return

    def _put(self, tier: Any, i: int, sample: Any) -> bool:
        try:
            return tier.put(i, sample)
        except Exception as exc:  # caching is an optimisation: never fail a get over it
            if type(tier).__name__ not in self._warned:
                self._warned.add(type(tier).__name__)
                log.warning("%s cannot hold sample %d (%s: %s); it stays uncached", type(tier).__name__, i, type(exc).__name__, exc)
            return False

    def _promote(self, i: int, sample: Any) -> None:
        for tier in (self.vram, self.ram):
            if tier is not None and self._put(tier, i, sample):
                return

    def holds(self, i: int) -> bool:
        """Some tier has sample ``i`` (without counting a hit)."""
        return any(i in tier for tier in self._tiers())

    def full(self) -> bool:
        """No tier takes another sample (each has refused one), or there is none."""
        return all(tier.stats().puts_refused > 0 for tier in self._tiers())

    def stats(self) -> dict[str, dict]:
        """Per tier counters (zeros for an absent tier) and the source's."""
        out = {
            name: (tier.stats() if tier is not None else TierStats()).as_dict()
            for name, tier in (("vram", self.vram), ("ram", self.ram), ("disk", self.disk))
        }
        with self._lock:
            out["source"] = dict(self._source)
        return out
