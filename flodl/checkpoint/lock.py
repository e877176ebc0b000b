"""One run per save path: an exclusive lock on ``<stem>.lock`` for the run's life (torch-free).

Two runs saving to one stem would replace each other's sidecar and delete
each other's data files: the controller takes this lock before anything
starts and holds it to the end, and a second run on the stem is refused at
the door, told which run holds it (run id, pid, host). The lock is
``flock(2)`` on an open file, so the kernel drops it with the process: a
controller that was killed leaves no stale lock to clear by hand (the file
may stay; it is locked by no one). Only the controller locks: the ranks
that write the data files, on any host, write under names it chose.
"""

from __future__ import annotations

import errno
import fcntl
import json
import logging
import os
import socket
import time
from pathlib import Path

from ..errors import FlodlError

log = logging.getLogger("flodl.checkpoint")

__all__ = ["SaveLock", "SavePathBusy"]


class SavePathBusy(FlodlError):
    """Another live run holds the save path; the message names it."""


class SaveLock:
    """The held lock of one stem; ``release()`` (idempotent) gives it back."""

    def __init__(self, path: Path, fd: int | None) -> None:
        self.path = path
        self._fd = fd  # None: the filesystem has no locks (warned), nothing is held

    @classmethod
    def take(cls, stem: str | os.PathLike, run_id: str) -> SaveLock:
        """Lock ``<stem>.lock`` for this process, writing who holds it into the file.

        Raises:
            SavePathBusy: another process holds it (the message names its run, pid and host).
            OSError: the lock file cannot be made (the folder is not writable, say).
        """
        stem = Path(stem)
        path = stem.with_name(stem.name + ".lock")
        path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as exc:
                holder = _holder(fd)
                os.close(fd)
                if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                    raise SavePathBusy(f"{stem} is the save path of another run that is still going ({holder})") from None
                if exc.errno in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    log.warning(
                        "%s: this filesystem has no file locks (%s): a second run on this save path would not be refused", path, exc
                    )
                    return cls(path, None)
                raise
            # a holder releasing unlinks the file: the one we locked must still be the one at the path
            try:
                here, locked = os.stat(path), os.fstat(fd)
                if (here.st_dev, here.st_ino) == (locked.st_dev, locked.st_ino):
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        record = {"run_id": run_id, "pid": os.getpid(), "host": socket.gethostname(), "since_unix": time.time()}
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, json.dumps(record).encode() + b"\n", 0)
        except OSError as exc:  # a full disk: the lock holds all the same, a refused run is told less
            log.warning("%s: could not write who holds it (%s)", path, exc)
        return cls(path, fd)

    def release(self) -> None:
        """Unlink the file, then unlock: a run waiting on this inode sees it is no longer the path's."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            os.unlink(self.path)
        except OSError:
            pass  # a lock file left behind is harmless: it is locked by no one
        os.close(fd)


def _holder(fd: int) -> str:
    """Who holds the lock, as its file says: ``run r1 (pid 42 on host h, since 12:01:02)``."""
    try:
        record = json.loads(os.pread(fd, 4096, 0) or b"{}")
        since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(float(record["since_unix"])))
        return f"run {record['run_id']}, pid {record['pid']} on host {record['host']}, since {since}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a run that has not written its name into the lock file yet"
