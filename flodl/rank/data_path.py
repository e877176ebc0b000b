"""A rank's data path: the batches a window's grants name, from the dataset to the device (``DataPath``).

Set up at the welcome: the run's schedule (augment, epoch_splits), its delivery
transform, the staging tiers for datasets not already in memory (RAM cache,
disk stage; the VRAM pool after the first step, when what the steps take is
known), the loader workers (``Task.num_workers``); a ``flodl.Shards`` dataset
streams through a ``ShardSource`` instead (no tiers: each grant is read once).
A window's batches come through a prefetcher unless the dataset is in memory;
once a window has trained, a cache warmer reads the rest into the tiers.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from ..config import DdpRunConfig
from ..config.env import vram_pool_disabled
from ..errors import TaskError
from ..plan.schedule import Schedule
from ..shards import Shards
from ..taskspec import resolve as resolve_spec
from .data import BatchSource
from .disk_stage import DiskStage
from .loader import WorkerReads
from .outcomes import UserError
from .prefetch import CacheWarmer, Prefetcher
from .shard_source import ShardSource
from .staging import RamCache, TieredSamples, VramPool, ram_budget, vram_budget

if TYPE_CHECKING:
    from ..task import Task
    from .context import JoinedRun, RankContext

log = logging.getLogger("flodl.rank.runner")

#: Batches fetched ahead of training, for datasets not already in memory.
PREFETCH_DEPTH = 4
#: How long a window's end waits for its reader thread to leave a batch it is reading.
READER_JOIN_S = 30.0
#: A tensor dataset up to this share of the VRAM budget goes to the device before training
#: (the rest of the budget is left to what the steps take, unknown before the first one).
EARLY_PLACE_SHARE = 0.5


class DataPath:
    """The rank's batch source and what feeds it: staging tiers, loader workers, prefetcher, cache warmer."""

    def __init__(self, ctx: RankContext, run: JoinedRun, task: Task) -> None:
        """The rank's data path for ``task`` under the run's options; a tensor dataset that is small
        beside the VRAM budget goes to the device now (``_place_before_training``).

        Raises:
            UserError: an option the dataset cannot take (stage ``config``).
        """
        self.ctx = ctx
        self.device = ctx.device
        self.config = run.config
        self.task = task
        self.warmer: CacheWarmer | None = None
        self._seen: dict[str, int] = {}  # staging-tier counters already reported
        self.source = self._batch_source(run.config, run.welcome.seed)
        self._place_before_training()

    @property
    def sharded(self) -> bool:
        """A ``flodl.Shards`` dataset: positions are shards; windows stop, average (Sync) and count coverage at shard ends."""
        return isinstance(self.source, ShardSource)

    def resident(self) -> bool:
        """This window's batches come out on the device already (in memory, placed there)."""
        return isinstance(self.source, BatchSource) and self.source.delivers_on(self.device)

    def _batch_source(self, config: DdpRunConfig, seed: int) -> BatchSource | ShardSource:
        """The rank's data path: the run's schedule (augment, epoch_splits), its
        delivery transform, and the staging tiers for datasets not already in memory;
        shards stream through a ``ShardSource`` (no tiers: each grant is read once)."""
        task = self.task
        dataset = task.build_dataset()
        if isinstance(dataset, Shards):
            if config.transform is not None:  # its PickKeys name samples, which a stream of shards has no index for
                raise UserError("config", TaskError("transform: not available with a flodl.Shards dataset (transform in open_shard)"))
            if task.num_workers:  # the loader workers read samples by index; a shard is one stream
                raise UserError("config", TaskError("num_workers: not available with a flodl.Shards dataset (read ahead in open_shard)"))
            schedule = Schedule(len(dataset), config.augment, config.epoch_splits)
            return ShardSource(dataset, task.batch_size, seed=seed, collate_fn=task.collate_fn, schedule=schedule)
        transform = config.transform
        if isinstance(transform, str):
            try:
                transform = resolve_spec(transform)
            except TaskError as exc:
                raise UserError("config", TaskError(f"transform: {exc}")) from exc
        schedule = Schedule(len(dataset), config.augment, config.epoch_splits)
        source = BatchSource(dataset, task.batch_size, seed=seed, collate_fn=task.collate_fn, schedule=schedule, transform=transform)
        if not source.in_memory:  # a tensor dataset is already in memory: nothing to stage
            source.stage(self._staging_tiers(config, dataset))
        self._loading(source, dataset, seed)
        return source

    def _loading(self, source: BatchSource, dataset: Any, seed: int) -> None:
        """The task's DataLoader-style options: worker processes reading the samples, pinned batches."""
        task = self.task
        if source.in_memory:
            if task.num_workers or task.pin_memory:
                log.warning("rank %d: a TensorDataset is gathered in memory: Task.num_workers/pin_memory go unused", self.ctx.rank)
            return
        if task.pin_memory and self.device.type != "cuda":
            log.warning(
                "rank %d: Task.pin_memory has no effect on a %s device (it pins for copies to CUDA)", self.ctx.rank, self.device.type
            )
        workers = None
        if task.num_workers:
            workers = WorkerReads(
                dataset, workers=task.num_workers, prefetch_factor=task.prefetch_factor, seed=seed, collate_fn=task.collate_fn
            )
            self.ctx.closing.callback(workers.close)
        source.read_with(workers, pin=task.pin_memory and self.device.type == "cuda")

    def _staging_tiers(self, config: DdpRunConfig, dataset: Any) -> TieredSamples:
        """RAM cache (pinned on CUDA ranks) and disk stage now; the VRAM pool after the
        first step, when what the model and its activations take is known."""
        budget = ram_budget(config.ram_max_usage, self.ctx.env.local_world) if config.sample_cache else 0
        ram = RamCache(budget, pin=self.device.type == "cuda") if budget > 0 else None
        disk = DiskStage(config.disk_stage_dir, config.disk_stage_gb * 10**9) if config.disk_stage_gb > 0 else None
        if disk is not None:
            self.ctx.closing.callback(disk.close)
        return TieredSamples(dataset.__getitem__, vram=None, ram=ram, disk=disk)

    def _place_before_training(self) -> None:
        """A tensor dataset that is small beside the VRAM budget goes to the device now, during
        start-up, as a hand-written loop uploads its data before its first step: uploading it
        after the first step (``open_vram_pool``) put a copy of the whole dataset (a gigabyte
        for the 1 ms overhead case) inside the first window. Only at most ``EARLY_PLACE_SHARE``
        of the budget: what the model's steps will take is not known yet."""
        source = self.source
        if isinstance(source, BatchSource) and source.in_memory:  # asked first: the budget asks the device
            self._place_if_fits(source, EARLY_PLACE_SHARE * self._vram_budget())

    def _place_if_fits(self, source: BatchSource, limit: float) -> None:
        """A tensor dataset of at most ``limit`` bytes goes to the device whole: batches are then gathered there."""
        if 0 < source.resident_bytes <= limit:
            source.place_on(self.device)

    def _vram_budget(self) -> int:
        """Bytes the VRAM pool may take now (0: no pool: not CUDA, or switched off)."""
        config = self.config
        if self.device.type != "cuda" or not config.vram_pool:
            return 0
        return vram_budget(
            self.device, max_usage=config.vram_max_usage, gpu_ram_share=config.gpu_ram_share, kill_switch=vram_pool_disabled()
        )

    def open_vram_pool(self) -> None:
        """After the first step: keep samples in the VRAM left under ``vram_max_usage`` (a tensor
        dataset that fits goes there whole: batches are then gathered on the device)."""
        source = self.source
        if not isinstance(source, BatchSource):  # streamed shards: nothing staged
            return
        if (source.tiers is None and not source.in_memory) or source.device == self.device:  # nothing to pool, or placed already
            return
        budget = self._vram_budget()
        if not budget:
            return
        if source.in_memory:
            self._place_if_fits(source, budget)
            return
        source.pool_in_vram(VramPool(self.device, budget))

    @contextlib.contextmanager
    def window_batches(self, grants: list[list[int]]) -> Iterator[Any]:
        """The window's ``(epoch, picks, batch)`` stream: read ahead on a thread of its own unless the
        dataset is in memory; what was read ahead and not trained is dropped at the block's end."""
        source = self.source
        if source.in_memory:
            # the loop counts samples: an in-memory batch's places are not cut (BatchSource._emit)
            yield source.window_batches(grants, places=False)
            return
        # worker reads start here, in the training thread (their processes die with it)
        produced: Any  # a batch source's or a shard source's (epoch, picks, batch) stream
        if isinstance(source, BatchSource) and source.workers is not None:
            produced = source.loaded_batches(grants)
        else:
            produced = source.window_batches(grants)
        prefetch = Prefetcher(produced, depth=PREFETCH_DEPTH, join_timeout_s=READER_JOIN_S)
        try:
            yield iter(prefetch)
        finally:
            prefetch.close()  # what it read ahead is not trained, nor reported: only trained batches are
            if prefetch.abandoned and isinstance(source, BatchSource) and source.workers is not None:
                source.workers.discard()  # never two threads in one loader: the next window starts new workers

    def start_warmer(self) -> None:
        """Once the first window trained: read the rest of the dataset into the tiers in the background.

        Not with loader workers: the warmer reads in the rank's threads, under its GIL, which is
        what workers are there to spare it (``__getitem__`` holding the GIL); the workers' reads
        fill the tiers instead."""
        source = self.source
        tiers = source.tiers
        loading = isinstance(source, BatchSource) and source.workers is not None
        if self.warmer is not None or tiers is None or loading or tiers.full():
            return
        order = torch.randperm(source.length, generator=torch.Generator().manual_seed(source.seed + 7919 * self.ctx.rank))
        self.warmer = CacheWarmer(tiers.get, order.tolist(), held=tiers.holds, full=tiers.full)
        self.warmer.start()
        self.ctx.closing.callback(self.warmer.stop)

    def stats(self) -> dict[str, int]:
        """The staging tiers over the last window: hits and source fetches (deltas), bytes held now."""
        tiers = self.source.tiers
        if tiers is None:
            return {}
        now = tiers.stats()
        counts = {f"{name}_hits": now[name]["hits"] for name in ("vram", "ram", "disk")}
        counts["source_fetches"] = now["source"]["fetches"]
        out = {key: value - self._seen.get(key, 0) for key, value in counts.items()}
        out.update({f"{name}_bytes": int(now[name]["bytes"]) for name in ("vram", "ram", "disk")})
        self._seen = counts
        return out
