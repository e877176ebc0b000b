"""A checkpoint bundle's sidecar (``<stem>.meta.json``): commit it, read it back, check its files.

Torch-free, so the controller (which writes and reads sidecars, never
tensors) starts without torch; ``bundle.py`` re-exports everything here
next to the tensor side (model and optimizer files). The sidecar is the
commit marker of a save (``files.py`` has the layout and order).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .atomic_file import write_atomic
from .files import SCHEMA_VERSION, CheckpointBundle, CheckpointError, data_files, read_sidecar, remove_superseded

__all__ = ["SAVE_REASONS", "file_sha256", "progress_text", "read_meta", "write_meta"]

SAVE_REASONS = ("checkpoint", "final", "interrupted", "max_failure_exceeded", "single_survivor", "all_ranks_lost", "controller_lost")


def progress_text(epoch_index: int, total: int) -> str:
    """Where a bundle stands, in the console's words. The sidecar's ``epoch`` is a 0-based index
    (the first epoch not complete, so also the number complete); people read "epoch 3/10"."""
    if epoch_index >= total:
        return f"all {total} epoch(s) complete"
    return f"{epoch_index} of {total} epoch(s) complete, continues in epoch {epoch_index + 1}/{total}"


def file_sha256(path: str | os.PathLike) -> str:
    """The sha256 of a file, read 1 MiB at a time."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_meta(bundle: CheckpointBundle, meta: dict[str, Any], *, busy: Iterable[str] = (), owned: Iterable[str] = ()) -> list[Path]:
    """Commit a bundle: write its sidecar atomically, then delete the data files it superseded.

    ``meta`` must name and checksum both data files (``model_file``,
    ``model_sha256``, ``optim_file``, ``optim_sha256``); ``busy`` are tags of
    saves still being written, whose files stay; ``owned`` the tags of every
    save of this writer (``remove_superseded``: its files, and those of the
    sidecar replaced, are the only ones deleted). Returns the deleted files.
    """
    if meta.get("save_reason") not in SAVE_REASONS:
        raise ValueError(f"save_reason must be one of {SAVE_REASONS}, got {meta.get('save_reason')!r}")
    record = {"schema_version": SCHEMA_VERSION, **meta}
    try:
        files = data_files(bundle, record)
    except CheckpointError as exc:
        raise ValueError(str(exc)) from None
    replaced = _named_files(bundle)
    write_atomic(bundle.meta, [json.dumps(record, indent=2).encode() + b"\n"])
    # only now: until the rename above, the files of the previous commit are the bundle
    return remove_superseded(bundle, keep={path.name for path, _ in files.values()}, busy=busy, owned=owned, replaced=replaced)


def _named_files(bundle: CheckpointBundle) -> set[str]:
    """The file names the bundle's current sidecar names (none if there is none, or it is unreadable)."""
    try:
        return {path.name for path, _ in data_files(bundle, read_sidecar(bundle)).values()}
    except CheckpointError:
        return set()


def read_meta(path: str | os.PathLike, *, verify: bool = True, weights_only: bool = False) -> dict[str, Any]:
    """Read and check a bundle's sidecar and (``verify``) the data files it names.

    Every data file must be present with the sha256 the sidecar records; with
    ``weights_only`` the optimizer file is not needed (a resume that starts
    a fresh optimizer on purpose).

    Raises:
        CheckpointError: what is missing or wrong, and with which file.
    """
    bundle = CheckpointBundle.at(path)
    meta = read_sidecar(bundle)
    for key in ("epoch", "global_step", "save_reason", "world_at_save", "coverage"):
        if key not in meta:
            raise CheckpointError(f"{bundle.meta}: field {key!r} is missing; the bundle is corrupt")
    files = data_files(bundle, meta)
    if verify:
        for kind, (file, digest) in files.items():
            if kind == "optim" and weights_only:
                continue
            _verify(bundle, kind, file, digest)
    return meta


def _verify(bundle: CheckpointBundle, kind: str, file: Path, digest: str | None) -> None:
    if not file.exists():
        if kind == "optim":
            raise CheckpointError(
                f"{file}: missing. The sidecar {bundle.meta.name} names it as the bundle's optimizer state, and "
                "resuming without it would silently restart the optimizer (momentum, Adam moments) from zero. "
                "Put the file back, or resume the weights alone on purpose with --resume-weights-only "
                "(resume_weights_only = true)"
            )
        raise CheckpointError(f"{file}: missing (the sidecar {bundle.meta.name} names it as the bundle's model)")
    if digest is not None and file_sha256(file) != digest:
        raise CheckpointError(
            f"{file} is not the file {bundle.meta.name} was written with (sha256 differs): corrupt, or replaced after the save"
        )
