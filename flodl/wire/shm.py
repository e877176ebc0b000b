"""Shared-memory segments: the bulk plane's same-host lane.

When a rank and the averager that serves it share a host (the embedded
default, and every host-local leg), a snapshot need not cross a socket: the
rank writes it into a segment of its own under ``/dev/shm`` and sends only
the header, naming the segment and the slice's byte offset; the averager folds
straight out of the mapping. The average comes back the same way: the
controller keeps its float32 accumulator in a segment of its own and an
``Update`` header names where a slice of it lies. The accumulator is reused
round after round: the controller starts writing round n+1 into it only once
every rank on the lane has sent a header of round n+1, and a rank sends that
only after it has read round n's average (``CpuAverager`` settles first), so
a slot is never rewritten under a reader; a round stamp in the segment's
header lets a reader prove it.
Nothing is copied through the kernel, so a round costs about one memory pass
per rank each way (``docs/cpu-averaging.md`` has the numbers).

Who may take the lane is decided by a **probe**: the controller creates a
small file holding a random nonce and names it, with the nonce, in every
``RankWelcome``. A rank uses the lane only if it can open that file, owns the
same uid and reads the same nonce, so a rank on another host (or in another
container, or under another user) stays on the wire without anyone guessing.

No segment outlives its run: the controller unlinks a rank's segment as soon
as it has mapped it (a rank killed with SIGKILL leaves no file behind), and
its own probe and update segment on close; a controller killed outright
leaves files that the next controller's ``sweep_stale`` removes (each name
carries its creator's pid).

Every path read from a header is checked against the run's naming pattern,
opened without following links, and must be a regular file of this uid and
large enough; the frames naming it are authenticated like every other, so
only the run's own processes can point an averager at a segment.
"""

from __future__ import annotations

import itertools
import mmap
import os
import re
import secrets
import stat
import struct
import threading
import warnings
from pathlib import Path
from typing import Self

import torch

from ..config.env import shm_lane_allowed
from ..errors import ProtocolError

#: Where segments live (tmpfs on every Linux).
from .shm_sweep import SHM_DIR as SHM_DIR  # `x as x`: an explicit re-export
from .shm_sweep import sweep_stale as sweep_stale  # re-exported (torch-free: the worker sweeps too)

#: The controller's segment header: magic, the round its slot holds.
MAGIC = b"FLODLSH1"
HEADER_BYTES = 64
#: Offsets inside a segment are aligned so every dtype's view is aligned.
ALIGN = 64

_fence_lock = threading.Lock()


def enabled() -> bool:
    """The lane is on unless ``FLODL_SHM=off`` (benchmarks compare both) or there is no /dev/shm."""
    return shm_lane_allowed() and SHM_DIR.is_dir()


def fence() -> None:
    """A full memory barrier (a mutex round trip): orders a stamp against the data it guards."""
    with _fence_lock:
        pass


def _safe(run_id: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]", "_", run_id)[:64]


def prefix(run_id: str) -> str:
    """Every segment of a run is named ``flodl-<run>-<pid>-...``."""
    return f"flodl-{_safe(run_id)}-"


_instances = itertools.count()


def path_for(run_id: str, role: str) -> Path:
    """A new segment name of this process for ``role`` (``probe``, ``update``, ``r<rank>``).

    ``<pid>.<n>``: one process may hold several averagers (a test, or one day a
    worker relaying two runs), each with its own probe and update segment.
    """
    return SHM_DIR / f"{prefix(run_id)}{os.getpid()}.{next(_instances)}-{role}"


def aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout_offsets(nbytes: list[int]) -> tuple[list[int], int]:
    """Byte offset of each flat tensor within one slot, and the slot's size."""
    offsets, at = [], 0
    for n in nbytes:
        offsets.append(at)
        at = aligned(at + n)
    return offsets, at


class Segment:
    """One mapped file: created (read-write) by its owner, opened read-only by its peer."""

    fd: int | None  # the owner's descriptor, set by create (opened segments have none)

    def __init__(self, path: Path, mm: mmap.mmap) -> None:
        self.path = path
        self.mm = mm
        self.size = len(mm)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a read-only mapping: the peer only ever reads it
            self.bytes = torch.frombuffer(mm, dtype=torch.uint8) if self.size else torch.empty(0, dtype=torch.uint8)

    @classmethod
    def create(cls, path: Path, nbytes: int, *, reserve: int | None = None) -> Self:
        """A new zero-filled segment of ``nbytes`` (mode 0600), its first ``reserve`` bytes (all by default) backed now.

        Backing pages up front is what makes a full /dev/shm (a container's
        64 MiB default) an ``OSError`` here rather than a SIGBUS at the first
        write; pages past ``reserve`` are backed by ``reserve_range`` before use.

        Raises:
            OSError: no room (ENOSPC) or no /dev/shm; nothing is left behind.
        """
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.ftruncate(fd, nbytes)
            if nbytes and (reserve is None or reserve > 0):
                os.posix_fallocate(fd, 0, nbytes if reserve is None else min(reserve, nbytes))
            mm = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) if nbytes else mmap.mmap(-1, 1)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        seg = cls(path, mm)
        seg.fd = fd  # kept to back later ranges (``reserve_range``)
        return seg

    def reserve_range(self, offset: int, length: int) -> bool:
        """Back ``length`` bytes at ``offset`` with pages now; False when /dev/shm has no room."""
        assert self.fd is not None  # the owner's segment (create)
        try:
            os.posix_fallocate(self.fd, offset, length)
            return True
        except OSError:
            return False

    @classmethod
    def open(cls, path: Path, *, min_bytes: int = 0) -> Segment:
        """Map a peer's segment read-only.

        Raises:
            ProtocolError: ``shm`` when it is not a regular file of this uid of at least ``min_bytes``.
        """
        return cls(path, _map(path, min_bytes, private=False))

    def view(self, offset: int, count: int, dtype: torch.dtype) -> torch.Tensor:
        """``count`` elements of ``dtype`` at byte ``offset`` (no copy).

        Raises:
            ProtocolError: ``shm`` when the slice is misaligned or outside the segment.
        """
        size = torch.empty(0, dtype=dtype).element_size()
        end = offset + count * size
        if offset < 0 or count < 0 or offset % size or end > self.size:
            raise ProtocolError(
                "shm", f"slice [{offset}, {end}) of {dtype} outside or misaligned in segment {self.path} ({self.size} bytes)"
            )
        return self.bytes[offset:end].view(dtype)

    def unlink(self) -> None:
        unlink(self.path)
        fd, self.fd = getattr(self, "fd", None), None
        if fd is not None:
            os.close(fd)


class UpdateSegment(Segment):
    """The controller's averages: a header stamped with the round, then one float32 slot."""

    offsets: list[int]  # set by create_for
    numels: list[int]

    STAMP = struct.Struct("<8sq")

    @classmethod
    def create_for(cls, run_id: str, numels: list[int]) -> UpdateSegment:
        offsets, slot = layout_offsets([4 * n for n in numels])
        seg = cls.create(path_for(run_id, "update"), HEADER_BYTES + slot)
        seg.offsets, seg.numels = offsets, list(numels)
        seg.mm[: cls.STAMP.size] = cls.STAMP.pack(MAGIC, -1)
        return seg

    def offset(self, bucket: int, start: int) -> int:
        """Byte offset of element ``start`` of flat tensor ``bucket``."""
        return HEADER_BYTES + self.offsets[bucket] + 4 * start

    def accumulators(self, round_: int, numels: list[int]) -> list[torch.Tensor]:
        """The slot as one float32 tensor per flat tensor, stamped as round ``round_``'s."""
        self.stamp(round_)
        return [self.view(self.offset(b, 0), n, torch.float32) for b, n in enumerate(numels)]

    def stamp(self, round_: int) -> None:
        """Claim the slot for ``round_`` before a byte of it is written."""
        self.mm[8:16] = struct.pack("<q", round_)
        fence()

    @staticmethod
    def stamp_of(seg: Segment) -> int:
        """The round a reader's mapping says the slot holds now."""
        fence()
        round_: int
        magic, round_ = UpdateSegment.STAMP.unpack(bytes(seg.mm[: UpdateSegment.STAMP.size]))
        if magic != MAGIC:
            raise ProtocolError("shm", f"segment {seg.path} is not an update segment")
        return round_


class SnapshotSegment(Segment):
    """A rank's segment: its CPU buckets' live values, then one snapshot slot.

    The live area holds the flat buckets the model trains in (``FlatModel.rehome``),
    so a blocking round sends them as they are, with no copy at all; the slot
    holds the snapshot copy of a round that overlaps training (a rank has at
    most one round in flight on the lane), in the model's own dtypes. Pages
    are backed only once written, so a Sync run never pays for the slot.
    """

    live_offsets: list[int]  # set by create_for
    offsets: list[int]
    live_size: int
    slot_bytes: int
    slot_ready: bool

    @classmethod
    def create_for(cls, run_id: str, rank: int, nbytes: list[int], live_bytes: list[int]) -> SnapshotSegment:
        """``nbytes``: each flat tensor's snapshot size; ``live_bytes``: its live storage here (0: not here)."""
        live_offsets, live_size = layout_offsets(live_bytes)
        offsets, slot = layout_offsets(nbytes)
        # the live area is written at once; the slot is backed when a round first needs it
        seg = cls.create(path_for(run_id, f"r{rank}"), live_size + slot, reserve=live_size)
        seg.live_offsets, seg.offsets, seg.live_size, seg.slot_bytes = live_offsets, offsets, live_size, slot
        seg.slot_ready = slot == 0
        return seg

    def ready_slot(self) -> bool:
        """Back the snapshot slot (once); False when /dev/shm has no room for it."""
        if not self.slot_ready:
            self.slot_ready = self.reserve_range(self.live_size, self.slot_bytes)
        return self.slot_ready

    def live_offset(self, bucket: int, start_byte: int = 0) -> int:
        return self.live_offsets[bucket] + start_byte

    def offset(self, bucket: int, start_byte: int) -> int:
        """Byte offset in the snapshot slot."""
        return self.live_size + self.offsets[bucket] + start_byte


def unlink(path: str | Path) -> None:
    """Remove a segment's name if it is still there."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


#: The role of a donor's state segment (a joiner's optimizer state: rank/state_lane.py), and of the
#: controller's link to it for one joiner (averaging/server.py).
STATE_ROLE = "state"


def write_state(run_id: str, data: bytes | bytearray | memoryview) -> Path:
    """A new segment of this process holding ``data`` (mode 0600): a donor's state for its joiners.

    Raises:
        OSError: no room (ENOSPC) or no /dev/shm; nothing is left behind.
    """
    path = path_for(run_id, STATE_ROLE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        view = memoryview(data).cast("B")
        while view:  # tmpfs takes it in one write; a short write goes on where it stopped
            view = view[os.write(fd, view) :]
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)
    return path


def map_private(path: Path, nbytes: int) -> memoryview:
    """A peer's segment of at least ``nbytes`` mapped copy-on-write, writable (a joiner's optimizer
    state lives in it: its steps write its own pages, never the segment), its first ``nbytes``.

    Raises:
        ProtocolError: ``shm`` when it is not a regular file of this uid of at least ``nbytes``.
    """
    if nbytes < 1:
        raise ProtocolError("shm", f"segment {path}: {nbytes} bytes named")
    return memoryview(_map(path, nbytes, private=True))[:nbytes]


def _map(path: Path, min_bytes: int, *, private: bool) -> mmap.mmap:
    """Map a peer's segment whole: read-only and shared, or (``private``) writable copy-on-write.

    Raises:
        ProtocolError: ``shm`` when it is not a regular file of this uid of at least ``min_bytes``.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError as exc:
        raise ProtocolError("shm", f"cannot open segment {path}: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            raise ProtocolError("shm", f"segment {path} is not a regular file of this user")
        if st.st_size < max(min_bytes, 1):
            raise ProtocolError("shm", f"segment {path} holds {st.st_size} bytes, at least {min_bytes} needed")
        if private:
            return mmap.mmap(fd, st.st_size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
        return mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ)
    finally:
        os.close(fd)


def create_probe(run_id: str) -> tuple[Path, str]:
    """The controller's probe file and its nonce (hex)."""
    nonce = secrets.token_hex(16)
    path = path_for(run_id, "probe")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.write(fd, nonce.encode())
    finally:
        os.close(fd)
    return path, nonce


def probe_ok(path: str, nonce: str, run_id: str) -> bool:
    """True when this process sees the controller's probe: same host, same /dev/shm, same user."""
    if not path or not nonce or not enabled() or not checked_path(path, run_id, "probe"):
        return False
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid() and os.read(fd, 64).decode(errors="replace") == nonce
    finally:
        os.close(fd)


def checked_path(path: str, run_id: str, role: str) -> Path | None:
    """``path`` if it names a segment of this run with ``role`` in the shm directory, else None."""
    p = Path(path)
    name = p.name
    if p.parent != SHM_DIR or not name.startswith(prefix(run_id)) or not name.endswith(f"-{role}"):
        return None
    pid = name[len(prefix(run_id)) : -len(role) - 1]
    return p if re.fullmatch(r"\d+\.\d+", pid) else None
