"""Atomic, durable file writes (torch-free): a temporary file, fsync, rename, fsync of the directory.

The temporary file's name is the writer's own (``<path>.<pid>.<random>.tmp``), so two writers never
share one, and a write that fails (a full disk) deletes it: nothing half-written stays.

Shared by the tensor files (``safetensors_io.py``) and the checkpoint sidecar
(``meta.py``); kept apart from them so the controller, which writes
only sidecars, never imports torch.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import secrets
from pathlib import Path

__all__ = ["fsync_dir", "write_atomic"]


def write_atomic(path: Path, chunks: list[bytes | memoryview]) -> str:
    """Write ``chunks`` to ``path`` through a temporary file and a rename (never half a file); returns their sha256."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    digest = hashlib.sha256()
    try:
        with open(tmp, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
                digest.update(chunk)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):  # ENOSPC, EDQUOT, EIO: the caller is told; no partial file is left
            tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return digest.hexdigest()


def fsync_dir(folder: Path) -> None:
    """Make a rename in ``folder`` survive a power cut (the entry lives in the directory)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some network filesystems refuse fsync on a directory: the rename is as durable as they make it
        pass
    finally:
        os.close(fd)
