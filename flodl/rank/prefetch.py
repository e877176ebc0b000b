"""Reading ahead of training: the batch prefetcher and the cache warmer.

``Prefetcher`` runs the batch producer of a window a few batches ahead in a
thread and measures how long training waited for data. ``CacheWarmer`` fills
the staging tiers in the background with samples the rank has not read yet,
so that a rank of a multi-rank run does not wait for the passes in which the
dispatcher first hands it each sample.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Iterator
from typing import Any

log = logging.getLogger(__name__)

_POLL_S = 0.05  # how often a blocked producer or consumer re-checks for shutdown


class Prefetcher:
    """Runs an iterator ``depth`` items ahead in a daemon thread.

    Iterating yields its items in order; an exception in the producer is
    raised here at the item where it happened, with its own traceback.
    ``wait_ms`` is the total time the consumer waited for items (the data
    starvation a rank reports). ``close()`` (or dropping the Prefetcher) stops
    the producer even when it is blocked on a full queue; a producer stuck
    inside ``next()`` is abandoned after ``join_timeout_s`` (it is a daemon).
    """

    def __init__(
        self,
        iterator: Iterable[Any],
        depth: int = 2,
        *,
        name: str = "flodl-prefetch",
        join_timeout_s: float = 5.0,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.wait_ms = 0.0
        self._queue: queue.Queue[tuple[str, Any]] = queue.Queue(maxsize=max(1, depth))
        self._stop = threading.Event()
        self._finished = False
        self._clock = clock
        self._join_timeout_s = join_timeout_s
        # the thread gets the queue and the event, not self: an abandoned
        # Prefetcher is collected, and its finalizer stops the producer
        self._thread = threading.Thread(target=_produce, args=(iter(iterator), self._queue, self._stop), name=name, daemon=True)
        self._finalizer = weakref.finalize(self, self._stop.set)
        self._thread.start()

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        start = self._clock()
        try:
            kind, value = self._take()
        finally:
            self.wait_ms += (self._clock() - start) * 1000.0
        if kind == "item":
            return value
        self._finished = True
        if kind == "error":
            raise value
        raise StopIteration

    def _take(self) -> tuple[str, Any]:
        while True:
            try:
                return self._queue.get(timeout=_POLL_S)
            except queue.Empty:
                if self._stop.is_set():
                    return ("done", None)
                if not self._thread.is_alive() and self._queue.empty():
                    raise RuntimeError("prefetch thread ended without a result") from None

    @property
    def abandoned(self) -> bool:
        """The producer is still inside its iterator after ``close``."""
        return self._thread.is_alive()

    def close(self) -> None:
        """Stop the producer and join it; safe to call twice."""
        self._finished = True
        self._finalizer()  # sets the stop event
        _drain(self._queue)  # frees a producer blocked on a full queue right away
        self._thread.join(self._join_timeout_s)
        _drain(self._queue)  # drop references to items produced meanwhile
        if self._thread.is_alive():
            log.warning("prefetch thread %s still inside its iterator after %.1fs; abandoned", self._thread.name, self._join_timeout_s)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def _produce(it: Iterator[Any], out: queue.Queue, stop: threading.Event) -> None:
    """The prefetch thread: items, then ``done`` or the ``error`` that ended it."""
    try:
        for item in it:
            if not _offer(out, stop, ("item", item)):
                break
        else:
            _offer(out, stop, ("done", None))
    except BaseException as exc:  # handed to the consumer, raised there
        _offer(out, stop, ("error", exc))
    if stop.is_set():
        close = getattr(it, "close", None)  # runs a generator's finally, in its own thread
        if close is not None:
            close()


def _offer(out: queue.Queue, stop: threading.Event, entry: tuple[str, Any]) -> bool:
    """Queue ``entry`` unless stopped; False once the consumer is gone."""
    while not stop.is_set():
        try:
            out.put(entry, timeout=_POLL_S)
            return True
        except queue.Full:
            continue
    return False


def _drain(q: queue.Queue) -> None:
    try:
        while True:
            q.get_nowait()
    except queue.Empty:
        pass


class CacheWarmer:
    """Fills the staging tiers in the background, in ``order``, until they are full.

    Each rank caches the samples it reads, and the dispatcher hands a rank a
    different share of every pass, so on its own a rank of an N-rank run
    meets a new sample for many passes. The warmer reads ahead of that with
    spare I/O: ``threads`` daemon threads call ``get(i)`` for every index not
    ``held(i)`` yet, and stop when ``full()`` (no tier takes more), when the
    order is exhausted, or on ``stop()``. A read that fails ends the warming
    quietly: training meets that sample itself and reports it properly.
    """

    def __init__(
        self,
        get: Callable[[int], Any],
        order: Iterable[int],
        *,
        held: Callable[[int], bool],
        full: Callable[[], bool],
        threads: int = 2,
        name: str = "flodl-warm",
    ) -> None:
        self._get, self._held, self._full = get, held, full
        self._order = iter(order)
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.warmed = 0
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(max(1, threads))]

    def start(self) -> None:
        for thread in self._threads:
            thread.start()

    def _next(self) -> int | None:
        with self._lock:
            return next(self._order, None)

    def _run(self) -> None:
        while not self._stop.is_set() and not self._full():
            i = self._next()
            if i is None:
                return
            if self._held(i):
                continue
            try:
                self._get(i)
            except Exception as exc:  # the training path names the index when it gets there
                log.debug("cache warmer stopped at sample %d: %s", i, exc)
                self._stop.set()
                return
            with self._lock:
                self.warmed += 1

    def stop(self, timeout_s: float = 2.0) -> None:
        """Stop reading (a read in progress finishes) and join, bounded."""
        self._stop.set()
        deadline = time.monotonic() + timeout_s
        for thread in self._threads:
            if thread.is_alive():
                thread.join(max(0.0, deadline - time.monotonic()))
