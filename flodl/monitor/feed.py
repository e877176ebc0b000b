"""The live record feed: what the dashboard shows, held in memory.

`feed.py`: the controller publishes monitor records (meta, node, event; see
the reference, section 12.1) into a `Feed`; the dashboard server and the
archive writer read it. It keeps the latest meta record, a bounded ring of
records per node path and a bounded list of events, so memory (and the size
of an archive) stays bounded however long the run. Subscribers are bounded
queues of already-encoded JSON lines: a subscriber that falls behind is
dropped, the publisher never waits. No sockets, no tasks; `publish` is
synchronous and must be called on the event loop that owns the subscribers.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import re
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass
from heapq import merge
from typing import Any

from .records import encode as encode_record  # the stream's one encoding, shared with the log files

log = logging.getLogger(__name__)

DEFAULT_RECORDS_PER_PATH = 5_000
DEFAULT_MAX_EVENTS = 2_000
DEFAULT_SUBSCRIBER_QUEUE = 10_000
#: An archive keeps at most this many records per node path (the first and last ARCHIVE_ENDS
#: of them, evenly spaced between) and this many ``sync`` events, the latest: the page draws
#: at most 1,200 points a chart and lists no sync event, and a 1,500-epoch run's archive was 1.8 MB.
ARCHIVE_PER_PATH = 300
ARCHIVE_ENDS = 50


def parent_path(path: str) -> str | None:
    """The parent of a node path (``root/h1/rank0`` -> ``root/h1``); None for a top node."""
    head, sep, _ = path.rpartition("/")
    return head if sep else None


def path_sort_key(path: str) -> list[Any]:
    """Natural order, so ``rank2`` sorts before ``rank10``."""
    return [int(p) if p.isdigit() else p for p in re.split(r"(\d+)", path)]


@dataclass(frozen=True, slots=True)
class Entry:
    """A stored record, its global publish order and its encoded line."""

    seq: int
    record: dict[str, Any]
    line: str


def thin(items: list[Any], limit: int, ends: int) -> list[Any]:
    """At most ``limit`` of ``items``, in order: the first and last ``ends`` of them, and evenly
    spaced ones between (all of them while they fit).

    Raises:
        ValueError: ``limit`` is not above ``2 * ends``.
    """
    if limit <= 2 * ends:
        raise ValueError(f"limit ({limit}) must be above 2 * ends ({2 * ends})")
    if len(items) <= limit:
        return items
    middle, room = items[ends : len(items) - ends], limit - 2 * ends
    picked = [middle[i * len(middle) // room] for i in range(room)]
    return [*items[:ends], *picked, *items[len(items) - ends :]]


class Subscription:
    """A bounded queue of encoded records for one live reader.

    `get()` returns the next JSON line, or None once the subscription ended:
    the reader fell too far behind (dropped) or the feed was closed.
    """

    def __init__(self, maxsize: int) -> None:
        self._queue: asyncio.Queue[str | None] = asyncio.Queue(maxsize)
        self.dropped = False
        self.closed = False

    async def get(self) -> str | None:
        """The next line, or None when the subscription has ended."""
        if self.closed and self._queue.empty():
            return None
        return await self._queue.get()

    def get_nowait(self) -> str | None:
        """A line already queued, or None when there is none (or it ended)."""
        try:
            return self._queue.get_nowait()
        except asyncio.QueueEmpty:
            return None

    def _offer(self, line: str) -> bool:
        """Queue ``line``; False when the queue is full (the reader is too slow)."""
        try:
            self._queue.put_nowait(line)
            return True
        except asyncio.QueueFull:
            return False

    def _end(self) -> None:
        # Make room for the end marker: a dropped reader loses its backlog
        # anyway and replays the snapshot when it reconnects.
        while not self._queue.empty():
            self._queue.get_nowait()
        self.closed = True
        self._queue.put_nowait(None)


class Feed:
    """Bounded in-memory store of the record stream, plus live subscribers.

    Args:
        records_per_path: ring size per node path (oldest dropped first).
        max_events: how many event records are kept (oldest dropped first).
        subscriber_queue: queued lines a subscriber may lag before it is dropped.
    """

    def __init__(
        self,
        *,
        records_per_path: int = DEFAULT_RECORDS_PER_PATH,
        max_events: int = DEFAULT_MAX_EVENTS,
        subscriber_queue: int = DEFAULT_SUBSCRIBER_QUEUE,
    ) -> None:
        if min(records_per_path, max_events, subscriber_queue) < 1:
            raise ValueError("Feed bounds must be at least 1")
        self.records_per_path = records_per_path
        self.subscriber_queue = subscriber_queue
        self._seq = itertools.count()
        self._meta: Entry | None = None
        self._nodes: dict[str, deque[Entry]] = {}
        self._events: deque[Entry] = deque(maxlen=max_events)
        self._subscribers: set[Subscription] = set()
        self.dropped_subscribers = 0

    # -- publishing ---------------------------------------------------------

    def publish(self, record: dict[str, Any]) -> None:
        """Store ``record`` and hand it to every live subscriber; never blocks.

        Raises:
            TypeError: ``record`` is not a dict (a producer bug).
        """
        if not isinstance(record, dict):
            raise TypeError(f"a monitor record is a dict, not {type(record).__name__}")
        entry = Entry(next(self._seq), record, encode_record(record))
        if not self._store(entry):
            log.debug("feed: ignoring record without a known kind/path: %.200s", entry.line)
            return
        for sub in list(self._subscribers):
            if not sub._offer(entry.line):
                self._drop(sub)

    def _store(self, entry: Entry) -> bool:
        kind = entry.record.get("kind")
        if kind == "meta":
            self._meta = entry  # the latest declaration wins; replayed first
        elif kind == "event":
            self._events.append(entry)
        elif isinstance(entry.record.get("path"), str):
            ring = self._nodes.get(entry.record["path"])
            if ring is None:
                ring = self._nodes[entry.record["path"]] = deque(maxlen=self.records_per_path)
            ring.append(entry)
        else:
            return False
        return True

    def _drop(self, sub: Subscription) -> None:
        self._subscribers.discard(sub)
        sub.dropped = True
        sub._end()
        self.dropped_subscribers += 1
        log.warning("dashboard: dropped a subscriber that fell %d records behind", self.subscriber_queue)

    # -- subscribing --------------------------------------------------------

    def open_stream(self, maxsize: int | None = None) -> tuple[list[str], Subscription]:
        """The snapshot as encoded lines plus a subscription to what follows.

        Both are taken without an await in between, so a reader sees every
        record exactly once: in the snapshot or from the subscription.
        """
        sub = Subscription(maxsize or self.subscriber_queue)
        self._subscribers.add(sub)
        return [e.line for e in self._ordered()], sub

    def unsubscribe(self, sub: Subscription) -> None:
        """Stop delivering to ``sub`` and end it (safe to call twice or after a drop).

        A reader blocked in ``sub.get()`` wakes up with None.
        """
        self._subscribers.discard(sub)
        if not sub.closed:
            sub._end()

    @property
    def subscriber_count(self) -> int:
        return len(self._subscribers)

    def close(self) -> None:
        """End every subscription (their `get()` returns None)."""
        for sub in list(self._subscribers):
            self._subscribers.discard(sub)
            sub._end()

    # -- reading ------------------------------------------------------------

    @property
    def meta(self) -> dict[str, Any] | None:
        return self._meta.record if self._meta else None

    def _ordered(self) -> Iterable[Entry]:
        """Meta first, then every kept record in publish order."""
        if self._meta is not None:
            yield self._meta
        rings = [*self._nodes.values(), self._events]
        yield from merge(*rings, key=lambda e: e.seq)

    def snapshot(self) -> list[dict[str, Any]]:
        """Everything needed to redraw the page: meta first, then records in order."""
        return [e.record for e in self._ordered()]

    def snapshot_lines(self) -> list[str]:
        """`snapshot()` already encoded, one JSON text per record."""
        return [e.line for e in self._ordered()]

    def archive_lines(self, per_path: int = ARCHIVE_PER_PATH, ends: int = ARCHIVE_ENDS) -> list[str]:
        """`snapshot_lines()` thinned for an archive: each node path's records down to ``per_path``
        (its first and last ``ends`` whole, evenly spaced between), the ``sync`` events to the
        latest ``per_path``; every other event kept. Meta first, then publish order."""
        syncs = [e for e in self._events if e.record.get("class") == "sync"]
        kept_syncs = {id(e) for e in syncs[-per_path:]}
        events = [e for e in self._events if e.record.get("class") != "sync" or id(e) in kept_syncs]
        rings = [thin(list(ring), per_path, ends) for ring in self._nodes.values()]
        head = [self._meta.line] if self._meta is not None else []
        return head + [e.line for e in merge(*rings, events, key=lambda e: e.seq)]

    def paths(self) -> list[str]:
        """Every node path seen, in natural order."""
        return sorted(self._nodes, key=path_sort_key)

    def latest(self, path: str) -> dict[str, Any] | None:
        """The newest record of ``path``, or None when the path is unknown."""
        ring = self._nodes.get(path)
        return ring[-1].record if ring else None

    def children(self, path: str) -> list[str]:
        """Direct children of ``path``, in natural order."""
        return [p for p in self.paths() if parent_path(p) == path]

    def history(self, path: str, n: int) -> list[dict[str, Any]]:
        """The last ``n`` records of ``path`` (oldest first); [] when unknown."""
        ring = self._nodes.get(path, ())
        return [e.record for e in list(ring)[-n:]] if n > 0 else []

    def events(self) -> list[dict[str, Any]]:
        """The kept event records, oldest first."""
        return [e.record for e in self._events]
