"""Where a checkpoint bundle's files live, and how a save replaces a bundle without tearing it.

A bundle is named by a *stem* (``ckpt/run``). Its sidecar ``<stem>.meta.json``
is the only fixed name and the commit marker: it names the data files it
commits, ``<stem>.<tag>.fdl`` and ``<stem>.<tag>.optim``, and their sha256.
The tag is fresh for every save, so a save never writes over a file that the
committed sidecar names. The order of a save is:

1. the rank writes the new data files under the new tag (each: temporary
   file, fsync, rename, fsync of the directory);
2. the sidecar is replaced the same way: this rename is the commit;
3. only then are the data files no sidecar names any more deleted: those of
   saves this run made (its tags) and those the replaced sidecar named,
   never another run's (the controller's lock, ``lock.py``, keeps a second
   run off the stem; this keeps a run that lost it from deleting blindly).

A crash before 2 leaves the previous bundle whole (plus unreferenced files a
later commit of that run deletes); a crash after it, the new one. A save that
fails has its files deleted (``remove_tag``). Sidecars of schema 1 (before
tags) name ``<stem>.fdl`` and ``<stem>.optim`` implicitly.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger("flodl.checkpoint")

SCHEMA_VERSION = 2  # 2: the sidecar names and checksums every data file (1: <stem>.fdl implied)
_SUFFIXES = (".meta.json", ".fdl", ".optim")
_TAG = "[0-9a-f]{12}"
KINDS = {"model": ".fdl", "optim": ".optim"}  # the data files of a bundle, by sidecar key prefix


class CheckpointError(ValueError):
    """A bundle that cannot be used: missing, corrupt, torn, or made for another model or run."""


def stem_of(path: str | os.PathLike) -> Path:
    """``ckpt``, ``ckpt.fdl`` and ``ckpt.meta.json`` all name the bundle ``ckpt``."""
    text = os.fspath(path)
    for suffix in _SUFFIXES:
        if text.endswith(suffix):
            return Path(text[: -len(suffix)])
    return Path(text)


def new_tag() -> str:
    """A fresh name part for one save's data files (unique enough never to meet an older one)."""
    return secrets.token_hex(6)


@dataclass(frozen=True)
class CheckpointBundle:
    """The paths of one bundle."""

    stem: Path

    @classmethod
    def at(cls, path: str | os.PathLike) -> CheckpointBundle:
        return cls(stem_of(path))

    def _named(self, suffix: str) -> Path:
        return self.stem.with_name(self.stem.name + suffix)

    @property
    def model(self) -> Path:
        """``<stem>.fdl``: the model file of a schema-1 bundle (or a bare file saved by hand)."""
        return self._named(".fdl")

    @property
    def optim(self) -> Path:
        """``<stem>.optim``: the optimizer file of a schema-1 bundle."""
        return self._named(".optim")

    @property
    def meta(self) -> Path:
        return self._named(".meta.json")

    def data_file(self, tag: str, suffix: str) -> Path:
        """``<stem>.<tag><suffix>``: one save's model or optimizer file."""
        return self._named(f".{tag}{suffix}")

    def rank(self, rank: int) -> CheckpointBundle:
        """``<stem>.rank<N>``: the bundle one rank saves on its own when the controller is lost."""
        return CheckpointBundle(self._named(f".rank{rank}"))

    def rank_file(self, rank: int, suffix: str) -> Path:
        """``<stem>.rank<N><suffix>``; ``.fdl``/``.optim`` name that bundle, found through its sidecar."""
        return self._named(f".rank{rank}{suffix}")


# ----------------------------------------------------------- the sidecar


def read_sidecar(bundle: CheckpointBundle) -> dict[str, Any]:
    """The sidecar's JSON, checked to be a flodl sidecar this version reads.

    Raises:
        CheckpointError: missing, not JSON, no schema_version, or too new.
    """
    try:
        meta = json.loads(bundle.meta.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"{bundle.meta}: no such file (a bundle is named by its stem: <stem>.meta.json and the data files it names)"
        ) from None
    except ValueError as exc:
        raise CheckpointError(f"{bundle.meta}: not JSON ({exc}); the bundle is corrupt") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("schema_version"), int):
        raise CheckpointError(f"{bundle.meta}: no schema_version; not a flodl checkpoint sidecar")
    if meta["schema_version"] > SCHEMA_VERSION:
        raise CheckpointError(
            f"{bundle.meta}: schema_version {meta['schema_version']} is newer than this flodl reads ({SCHEMA_VERSION}); upgrade flodl"
        )
    return meta


def data_files(bundle: CheckpointBundle, meta: dict[str, Any]) -> dict[str, tuple[Path, str | None]]:
    """``{"model": (path, sha256), "optim": (path, sha256 or None)}`` as the sidecar names them.

    A schema-2 sidecar must name and checksum both files; a schema-1 one implies
    ``<stem>.fdl``/``<stem>.optim`` and checksums only the model.

    Raises:
        CheckpointError: a name or checksum is missing (the sidecar is refused, not trusted).
    """
    if meta["schema_version"] < 2:
        _require(bundle, meta, ("model_sha256",))
        return {"model": (bundle.model, meta["model_sha256"]), "optim": (bundle.optim, None)}
    _require(bundle, meta, ("model_file", "model_sha256", "optim_file", "optim_sha256"))
    files = {}
    for kind in KINDS:
        name = meta[f"{kind}_file"]
        if Path(name).name != name:  # names are relative to the sidecar: the bundle moves as one folder
            raise CheckpointError(f"{bundle.meta}: {kind}_file {name!r} is not a plain file name; the sidecar is corrupt")
        files[kind] = (bundle.stem.with_name(name), meta[f"{kind}_sha256"])
    return files


def _require(bundle: CheckpointBundle, meta: dict[str, Any], keys: tuple[str, ...]) -> None:
    for key in keys:
        if not isinstance(meta.get(key), str) or not meta[key]:
            raise CheckpointError(
                f"{bundle.meta}: field {key!r} is missing; a sidecar must name and checksum every "
                "file of its bundle, so this one is refused"
            )


def resolve(path: str | os.PathLike, kind: str) -> Path:
    """The ``kind`` ("model"/"optim") file meant by ``path``: a stem, a sidecar, or a data file.

    A bundle with a sidecar is read through it (``ckpt/run.fdl`` names the bundle,
    whatever tag its model file has); without one, ``path`` itself if it is a
    file of that kind, else ``<stem><suffix>``.
    """
    text, suffix = os.fspath(path), KINDS[kind]
    bundle = CheckpointBundle.at(text)
    if bundle.meta.exists():
        return data_files(bundle, read_sidecar(bundle))[kind][0]
    return Path(text) if text.endswith(suffix) else bundle._named(suffix)


def _data_entries(bundle: CheckpointBundle) -> Iterable[tuple[os.DirEntry, str | None, bool]]:
    """``(entry, tag or None, is a temporary)`` of each data file of the bundle's stem in its folder
    (``<stem>[.<tag>].fdl|.optim``, and their temporaries ``....tmp``); other bundles', rank bundles
    included, never match."""
    pattern = re.compile(rf"{re.escape(bundle.stem.name)}\.(?:({_TAG})\.)?(?:fdl|optim)(\.(?:[0-9]+\.[0-9a-f]+\.)?tmp)?")
    folder = bundle.stem.parent
    for entry in os.scandir(folder if str(folder) else "."):
        match = pattern.fullmatch(entry.name)
        if match is not None:
            yield entry, match.group(1), match.group(2) is not None


def _unlink_all(paths: Iterable[str], what: str) -> list[Path]:
    """Best effort: a file that cannot be deleted is logged and left. Returns what was deleted."""
    removed = []
    for path in paths:
        try:
            os.unlink(path)
            removed.append(Path(path))
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not delete the %s checkpoint file %s: %s", what, path, exc)
    return removed


def remove_superseded(
    bundle: CheckpointBundle, keep: Iterable[str], busy: Iterable[str] = (), owned: Iterable[str] = (), replaced: Iterable[str] = ()
) -> list[Path]:
    """After a commit: delete the data files the new sidecar no longer names, of this writer's saves only.

    ``keep`` are the file names the new sidecar names; ``busy`` the tags of
    saves still being written (their files are not garbage yet); ``owned`` the
    tags of every save this writer asked for (their files, temporaries
    included, go once superseded); ``replaced`` the file names the sidecar
    this commit replaced named (the bundle a resumed run continued from: its
    files go too). Any other file on the stem is another writer's: left alone.
    Returns what was deleted.
    """
    keep, busy, owned, replaced = set(keep), set(busy), set(owned), set(replaced)
    doomed = [
        entry.path
        for entry, tag, temporary in _data_entries(bundle)
        if entry.name not in keep and tag not in busy and ((tag is not None and tag in owned) or (not temporary and entry.name in replaced))
    ]
    return _unlink_all(doomed, "superseded")


def remove_tag(bundle: CheckpointBundle, tag: str) -> list[Path]:
    """A save that failed: delete what it left of its files (a model file whose optimizer file
    failed, temporaries), so nothing half-written stays. Only once its writer is done with them."""
    return _unlink_all((entry.path for entry, found, _ in _data_entries(bundle) if found == tag), "failed save's")
