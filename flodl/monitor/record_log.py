"""Bounded on-disk persistence of the record stream: one JSONL ring per node (docs/monitor.md, "Record stream").

A record's ``path`` is its file: ``root`` → ``<dir>/root.log``,
``root/h1.lan/rank0`` → ``<dir>/root/h1.lan/rank0.log`` (``.log`` is appended,
never substituted: dotted hostnames must not collide). Each node keeps two
segments, the active ``.log`` and the previous ``.log.1``, each at most
``max_bytes / 2``, so a node never holds more than ``max_bytes`` on disk and
the oldest records go first. A monitoring sink must never fail training: every
I/O error is logged once per node and swallowed. The node-local staging and
shipper of the reference are not here; records go straight to ``dir``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections import OrderedDict, deque
from pathlib import Path

from ..config import DEFAULT_MAX_LOG_BYTES
from .records import ROOT, encode

log = logging.getLogger(__name__)

SEGMENTS = 2
ACTIVE_SUFFIX = ".log"
ROTATED_SUFFIX = ".log.1"
DEFAULT_MAX_OPEN = 64


def safe_relative(path: object) -> Path | None:
    """The record path as a relative file path, or None when any segment could
    escape or alias the log dir (empty, ``.``, ``..``, absolute, backslashes)."""
    if not isinstance(path, str) or not path or path.startswith("/"):
        return None
    segments = path.split("/")
    if any(s in ("", ".", "..") or "\\" in s or "\0" in s for s in segments):
        return None
    return Path(*segments)


def active_path(dir: Path, rel: Path) -> Path:
    """``<dir>/<rel>.log``: the suffix is appended to the last segment."""
    return dir / rel.parent / (rel.name + ACTIVE_SUFFIX)


def rotated_path(active: Path) -> Path:
    return active.with_name(active.name + ".1")


class _NodeFile:
    """One node's open active segment and its byte count (drives rotation)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        # Unbuffered: each record is one write() call, so nothing sits in a
        # buffer when the process dies, and the byte count is what is on disk.
        self.file = open(path, "ab", buffering=0)
        self.bytes = self.file.seek(0, os.SEEK_END)  # reopen resumes the count

    def write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[self.file.write(view) :]
        self.bytes += len(data)

    def rotate(self) -> None:
        """Active → ``.log.1`` (replacing the older one: the drop-oldest), fresh active."""
        self.file.close()
        os.replace(self.path, rotated_path(self.path))
        self.file = open(self.path, "ab", buffering=0)
        self.bytes = 0

    def close(self) -> None:
        self.file.close()


class RecordLog:
    """Append records to their nodes' rings under ``dir``; safe across threads.

    ``max_bytes`` is per node (0 ⇒ ``DEFAULT_MAX_LOG_BYTES``); a tree of N nodes
    holds at most N × max_bytes. At most ``max_open`` files stay open, least
    recently written closed first. The ``meta`` record (it has no path) goes
    to ``root.log`` and is replayed at the head of every new root segment, so
    a reader always finds it however long the run.
    """

    def __init__(self, dir: str | os.PathLike, max_bytes: int = 0, *, max_open: int = DEFAULT_MAX_OPEN) -> None:
        self.dir = Path(dir)
        self.max_bytes = max(SEGMENTS, max_bytes or DEFAULT_MAX_LOG_BYTES)
        self.segment_limit = self.max_bytes // SEGMENTS
        self.max_open = max(1, max_open)
        self._open: OrderedDict[str, _NodeFile] = OrderedDict()
        self._warned: set[str] = set()
        self._meta: bytes | None = None
        self._lock = threading.Lock()
        self._closed = False

    def write(self, record: dict) -> None:
        """Append one record to its node's ring. Never raises."""
        path = ROOT if record.get("kind") == "meta" else record.get("path")
        rel = safe_relative(path)
        if rel is None:
            self._warn_once(f"<path {path!r}>", "record skipped: unsafe or missing path")
            return
        assert isinstance(path, str)  # safe_relative gave a path: it was a str
        try:
            data = (encode(record) + "\n").encode()
        except (TypeError, ValueError) as exc:  # not JSON-serializable: a producer bug
            self._warn_once(path, f"record not serializable ({exc}); skipped")
            return
        with self._lock:
            if self._closed:
                return  # may be called after close by a late producer
            if record.get("kind") == "meta":
                self._meta = data
            self._append(path, rel, data)

    def write_all(self, records) -> None:
        """``write`` each record in order."""
        for record in records:
            self.write(record)

    def _append(self, path: str, rel: Path, data: bytes) -> None:
        if len(data) > self.segment_limit:
            # Writing it would break the per-node bound that the ring promises.
            self._warn_once(path, f"a {len(data)}-byte record exceeds the {self.segment_limit}-byte segment; skipped")
            return
        try:
            node = self._node(path, rel)
            if node.bytes + len(data) > self.segment_limit:
                self._rotate(path, node, data)
            node.write(data)
        except OSError as exc:
            self._warn_once(path, f"write failed ({exc}); training continues")
            self._drop(path)

    def _rotate(self, path: str, node: _NodeFile, data: bytes) -> None:
        node.rotate()
        meta = self._meta
        if path == ROOT and meta is not None and data is not meta and len(meta) + len(data) <= self.segment_limit:
            node.write(meta)

    def _node(self, path: str, rel: Path) -> _NodeFile:
        node = self._open.get(path)
        if node is not None:
            self._open.move_to_end(path)
            return node
        while len(self._open) >= self.max_open:
            _, old = self._open.popitem(last=False)
            self._close_quietly(old)
        node = _NodeFile(active_path(self.dir, rel))
        self._open[path] = node
        return node

    def _drop(self, path: str) -> None:
        node = self._open.pop(path, None)
        if node is not None:
            self._close_quietly(node)

    def _close_quietly(self, node: _NodeFile) -> None:
        try:
            node.close()
        except OSError as exc:
            self._warn_once(str(node.path), f"close failed ({exc})")

    def _warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning("record log %s: %s (reported once)", key, message)

    def tail(self, path: str, n: int) -> list[dict]:
        """The last ``n`` records of ``path``, oldest first (``.log.1`` then ``.log``)."""
        rel = safe_relative(path)
        if rel is None or n <= 0:
            return []
        with self._lock:  # no half-rotated ring under our feet
            return read_node(active_path(self.dir, rel), n)

    def close(self) -> None:
        """Close every file; later writes are ignored. Idempotent."""
        with self._lock:
            self._closed = True
            while self._open:
                _, node = self._open.popitem(last=False)
                self._close_quietly(node)

    def __enter__(self) -> RecordLog:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_node(active: Path, n: int | None = None) -> list[dict]:
    """Records of one node's ring, oldest first; the last ``n`` when given.

    Lines that do not parse (a line torn by a crash mid-write) are skipped.
    """
    lines: deque[bytes] = deque(maxlen=n)
    for segment in (rotated_path(active), active):
        try:
            with open(segment, "rb") as f:
                lines.extend(line for line in f if line.strip())
        except FileNotFoundError:
            continue
    out = []
    for line in lines:
        try:
            out.append(json.loads(line))
        except ValueError:
            continue
    return out
