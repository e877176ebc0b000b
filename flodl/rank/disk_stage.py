"""The disk tier of the staging cascade: one local, unlinked pack file.

``DiskStage`` holds samples that fit neither device nor host memory as
``SampleCodec`` frames in one append-only file (never pickled), with an
in-memory index; staging.py's ``TieredSamples`` reaches it after VRAM and
RAM. Its space lives exactly as long as the rank's descriptor.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import weakref
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from .sample_codec import SampleCodec
from .tier_stats import TierStats

log = logging.getLogger("flodl.rank.staging")


def _close_pack(fd: int) -> None:
    """Finalizer: closing the (already unlinked) pack file frees its disk space."""
    try:
        os.close(fd)
    except OSError:
        pass


class DiskStage:
    """Local-disk overflow: one append-only pack file plus an in-memory index.

    The file is unlinked right after ``mkstemp``: its space lives exactly as
    long as our descriptor, so close, garbage collection, interpreter exit and
    even SIGKILL leave nothing behind. Any I/O or decode failure logs one
    warning and turns the tier off; it never raises into training. Reads use
    ``os.pread`` outside the lock, so threads read concurrently.
    """

    def __init__(self, directory: str | None, budget_bytes: int) -> None:
        self.budget_bytes = max(0, int(budget_bytes))
        self.path: str | None = None
        self.enabled = False
        self._codec = SampleCodec()
        self._lock = threading.Lock()
        self._index: dict[int, tuple[int, int]] = {}
        self._pending: set[int] = set()
        self._stats = TierStats()
        self._end = 0
        self._users = 0  # reads/writes in flight: the fd must outlive them
        self._closing = False
        self._warned: set[str] = set()
        self._finalizer: Callable[[], None] = lambda: None
        if self.budget_bytes:
            self._open(directory)

    def _open(self, directory: str | None) -> None:
        where = directory or tempfile.gettempdir()
        try:
            fd, self.path = tempfile.mkstemp(prefix="flodl-stage-", dir=directory)
        except OSError as exc:
            log.warning("disk stage off: cannot create a pack file in %s: %s", where, exc)
            return
        try:
            os.unlink(self.path)
        except OSError as exc:  # a file we cannot unlink now would outlive a killed rank
            os.close(fd)
            log.warning("disk stage off: cannot unlink %s: %s", self.path, exc)
            return
        self._fd = fd
        self._finalizer = weakref.finalize(self, _close_pack, fd)
        self.enabled = True

    def __contains__(self, i: int) -> bool:
        with self._lock:
            return i in self._index

    def put(self, i: int, sample: Any) -> bool:
        """Append ``sample``; False when off, over budget or not encodable."""
        with self._lock:
            if i in self._index or i in self._pending:
                return True
            if not self.enabled or sample is None:
                self._stats.puts_refused += 1
                return False
            self._pending.add(i)  # a concurrent put of ``i`` must not append it twice
        try:
            return self._append(i, sample)
        finally:
            with self._lock:
                self._pending.discard(i)

    def _append(self, i: int, sample: Any) -> bool:
        data = self._encode(sample)
        offset = self._reserve(len(data)) if data is not None else None
        if offset is None:
            return False
        assert data is not None  # an offset is reserved only for data
        ok = self._write(data, offset)
        with self._lock:
            stored = ok and self.enabled  # closed meanwhile: the record is gone with the file
            if stored:
                self._index[i] = (offset, len(data))
                self._stats.items += 1
        self._release()
        return stored

    def _encode(self, sample: Any) -> bytes | None:
        try:
            return self._codec.encode(sample)
        except TypeError as exc:
            reason = str(exc).split(": ", 1)[-1]  # without the path: one warning per kind of value
            with self._lock:
                self._stats.puts_refused += 1
                first = reason not in self._warned
                self._warned.add(reason)
            if first:
                log.warning("disk stage skips samples: %s", exc)
            return None

    def _reserve(self, length: int) -> int | None:
        """The file offset a record goes to, or None when it does not fit."""
        with self._lock:
            if not self.enabled or self._end + length > self.budget_bytes:
                self._stats.puts_refused += 1
                return None
            offset, self._end = self._end, self._end + length
            self._stats.bytes = self._end  # the file's size is what we hold on disk
            self._users += 1
            return offset

    def _write(self, data: bytes, offset: int) -> bool:
        try:
            view = memoryview(data)
            while view:
                view = view[os.pwrite(self._fd, view, offset + len(data) - len(view)) :]
            return True
        except OSError as exc:  # disk full, device gone
            self._fail(exc)
            return False

    def get(self, i: int) -> Any | None:
        """The staged sample, or None (never staged, or the tier is off)."""
        sample = self._read(i)
        with self._lock:
            self._stats.record(sample is not None)
        return sample

    def peek(self, i: int) -> Any | None:
        """Like ``get`` but uncounted."""
        return self._read(i)

    def _read(self, i: int) -> Any | None:
        with self._lock:
            where = self._index.get(i) if self.enabled else None
            if where is None:
                return None
            self._users += 1
        offset, length = where
        try:
            data = os.pread(self._fd, length, offset)
            if len(data) != length:
                raise OSError(f"short read: {len(data)} of {length} bytes at offset {offset}")
            return self._codec.decode(data)
        except Exception as exc:  # a tier that cannot read its own bytes has nothing to tell training
            self._fail(exc)
            return None
        finally:
            self._release()

    def _fail(self, exc: BaseException) -> None:
        with self._lock:
            first = self.enabled
            self._shutdown_locked()
        if first:
            log.warning("disk stage %s off after %s: %s; samples now come from the other tiers", self.path, type(exc).__name__, exc)

    def close(self) -> None:
        """Drop the pack file (its space is freed once in-flight reads finish)."""
        with self._lock:
            self._shutdown_locked()
        self._release(0)

    def _shutdown_locked(self) -> None:
        self.enabled = False
        self._closing = True
        self._index.clear()
        self._stats.items = self._stats.bytes = 0

    def _release(self, users: int = 1) -> None:
        # the descriptor is closed by the last user, never under a reader's pread
        with self._lock:
            self._users -= users
            done = self._closing and self._users == 0
        if done:
            self._finalizer()

    def stats(self) -> TierStats:
        with self._lock:
            return TierStats(**asdict(self._stats))
