"""Checkpoint bundles: the consensus model, an optimizer state, and the run's trajectory.

A bundle is three files next to each other, named from one *stem*:

* ``<stem>.fdl``       the consensus parameters and buffers (safetensors; keys
  ``p0, p1, ...`` for parameters and ``b0, ...`` for buffers in module order,
  their names kept in the metadata for people reading the file)
* ``<stem>.optim``     the writing rank's optimizer state (safetensors; the
  non-tensor part as JSON in the metadata; no pickle)
* ``<stem>.meta.json`` where the run stood: schema version, epoch, global
  step, sync rounds, ElChe state, data coverage, save reason, world at save,
  and the sha256 of the ``.fdl`` it belongs to

Every file is written atomically (temporary file, fsync, rename), and the
sidecar last: it is the commit marker, so a bundle whose sidecar names a
different ``.fdl`` than the one on disk is reported as torn, not loaded.

The controller writes the sidecar; the elected rank writes ``.fdl`` and
``.optim``. On several hosts the stem must be on storage every host sees.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import safetensors_io
from .safetensors_io import CorruptFile, write_atomic

SCHEMA_VERSION = 1
SAVE_REASONS = ("checkpoint", "final", "interrupted", "max_failure_exceeded", "single_survivor", "all_ranks_lost", "controller_lost")
_SUFFIXES = (".meta.json", ".fdl", ".optim")


class CheckpointError(ValueError):
    """A bundle that cannot be used: missing, corrupt, torn, or made for another model or run."""


def stem_of(path: str | os.PathLike) -> Path:
    """``ckpt``, ``ckpt.fdl`` and ``ckpt.meta.json`` all name the bundle ``ckpt``."""
    text = os.fspath(path)
    for suffix in _SUFFIXES:
        if text.endswith(suffix):
            return Path(text[: -len(suffix)])
    return Path(text)


@dataclass(frozen=True)
class CheckpointBundle:
    """The three paths of one bundle."""

    stem: Path

    @classmethod
    def at(cls, path: str | os.PathLike) -> "CheckpointBundle":
        return cls(stem_of(path))

    @property
    def model(self) -> Path:
        return self.stem.with_name(self.stem.name + ".fdl")

    @property
    def optim(self) -> Path:
        return self.stem.with_name(self.stem.name + ".optim")

    @property
    def meta(self) -> Path:
        return self.stem.with_name(self.stem.name + ".meta.json")

    def rank_file(self, rank: int, suffix: str) -> Path:
        """``<stem>.rank<N><suffix>``: what one rank saved on its own (controller lost)."""
        return self.stem.with_name(f"{self.stem.name}.rank{rank}{suffix}")


# ----------------------------------------------------------------- the model


def _model_tensors(model: torch.nn.Module) -> tuple[dict[str, torch.Tensor], list[str]]:
    tensors, names = {}, []
    for i, (name, p) in enumerate(model.named_parameters()):
        tensors[f"p{i}"] = p
        names.append(name)
    for j, (name, b) in enumerate(model.named_buffers()):
        tensors[f"b{j}"] = b
        names.append(name)
    return tensors, names


def save_model(model: torch.nn.Module, path: str | os.PathLike) -> str:
    """Write the model's parameters and buffers to ``path`` atomically; returns the file's sha256."""
    tensors, names = _model_tensors(model)
    safetensors_io.save(path, tensors, {"format": "flodl-consensus", "names": json.dumps(names)})
    return file_sha256(path)


def load_model(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Load a ``.fdl`` (or a bundle stem) into ``model`` in place, checking it fits first.

    Raises:
        CheckpointError: the file is missing or corrupt, or its tensors do not
            match the model's (count, shape or dtype), naming the first mismatch.
    """
    file = _model_path(path)
    check_model_file(model, file)  # from the header alone: refuse before reading the tensors
    try:
        stored, _ = safetensors_io.load(file)
    except CorruptFile as exc:
        raise CheckpointError(str(exc)) from None
    mine, _ = _model_tensors(model)
    with torch.no_grad():
        for key, tensor in mine.items():
            tensor.copy_(stored[key].to(tensor.device))


def check_fits(file: Path, stored: dict[str, tuple[list[int], torch.dtype]], mine: dict[str, torch.Tensor], names: list[str]) -> None:
    """Raise CheckpointError naming the first tensor the model and the file disagree on."""
    if set(stored) != set(mine):
        raise CheckpointError(
            f"{file} does not fit this model: it holds {sum(k[0] == 'p' for k in stored)} parameters and "
            f"{sum(k[0] == 'b' for k in stored)} buffers, the model has {sum(k[0] == 'p' for k in mine)} and "
            f"{sum(k[0] == 'b' for k in mine)} (was it saved from another model?)"
        )
    for i, (key, tensor) in enumerate(mine.items()):
        shape, dtype = stored[key]
        if shape != list(tensor.shape) or dtype != tensor.dtype:
            raise CheckpointError(
                f"{file} does not fit this model: {names[i]} is {dtype} {shape} in the file "
                f"but {tensor.dtype} {list(tensor.shape)} in the model"
            )


def check_model_file(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Check a ``.fdl`` fits ``model`` reading only its header (cheap, for a fast refusal)."""
    file = _model_path(path)
    try:
        header, _, _ = safetensors_io.read_header(file)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: no such checkpoint file") from None
    except CorruptFile as exc:
        raise CheckpointError(str(exc)) from None
    mine, names = _model_tensors(model)
    check_fits(file, {k: (list(e["shape"]), safetensors_io.FROM_CODE[e["dtype"]]) for k, e in header.items()}, mine, names)


def _model_path(path: str | os.PathLike) -> Path:
    text = os.fspath(path)
    return Path(text) if text.endswith(".fdl") else CheckpointBundle.at(text).model


# ------------------------------------------------------------- the optimizer


def save_optimizer(optimizer: torch.optim.Optimizer, path: str | os.PathLike) -> None:
    """Write an optimizer's state: tensors as safetensors, everything else as JSON metadata."""
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, dict[str, Any]] = {}
    for pid, values in state["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{pid}.{key}"] = value
            else:
                plain.setdefault(str(pid), {})[key] = value
    safetensors_io.save(path, tensors, {"format": "flodl-optim", "param_groups": json.dumps(state["param_groups"]), "plain": json.dumps(plain)})


def load_optimizer(optimizer: torch.optim.Optimizer, path: str | os.PathLike) -> None:
    """Load a ``.optim`` (or a bundle stem) into ``optimizer``.

    Raises:
        CheckpointError: missing, corrupt, or made for other parameter groups.
    """
    text = os.fspath(path)
    file = Path(text) if text.endswith(".optim") else CheckpointBundle.at(text).optim
    try:
        tensors, metadata = safetensors_io.load(file)
        groups = json.loads(metadata["param_groups"])
        plain = json.loads(metadata.get("plain", "{}"))
    except FileNotFoundError:
        raise CheckpointError(f"{file}: no such optimizer file") from None
    except (CorruptFile, KeyError, ValueError) as exc:
        raise CheckpointError(f"{file}: not a flodl optimizer file ({exc})") from None
    mine = optimizer.state_dict()["param_groups"]
    if [len(g["params"]) for g in groups] != [len(g["params"]) for g in mine]:
        raise CheckpointError(f"{file} does not fit this optimizer: parameter groups of sizes "
                              f"{[len(g['params']) for g in groups]} in the file, {[len(g['params']) for g in mine]} here")
    for group, own in zip(groups, mine):
        for key, value in group.items():
            if isinstance(own.get(key), tuple) and isinstance(value, list):
                group[key] = tuple(value)  # JSON has no tuples (Adam's betas)
    state: dict[int, dict[str, Any]] = {}
    for name, tensor in tensors.items():
        _, pid, key = name.split(".", 2)
        state.setdefault(int(pid), {})[key] = tensor
    for pid, values in plain.items():
        state.setdefault(int(pid), {}).update(values)
    try:
        optimizer.load_state_dict({"state": state, "param_groups": groups})
    except (ValueError, KeyError, RuntimeError) as exc:
        raise CheckpointError(f"{file} does not fit this optimizer: {exc}") from None


# ------------------------------------------------------------------ the meta


def file_sha256(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def write_meta(bundle: CheckpointBundle, meta: dict[str, Any]) -> None:
    """Write the sidecar (the commit marker) atomically, pretty-printed."""
    if meta.get("save_reason") not in SAVE_REASONS:
        raise ValueError(f"save_reason must be one of {SAVE_REASONS}, got {meta.get('save_reason')!r}")
    write_atomic(bundle.meta, [json.dumps({"schema_version": SCHEMA_VERSION, **meta}, indent=2).encode() + b"\n"])


def read_meta(path: str | os.PathLike, *, verify_model: bool = True) -> dict[str, Any]:
    """Read and check a bundle's sidecar (and that its ``.fdl`` is the one it names).

    Raises:
        CheckpointError: what is missing or wrong, and with which file.
    """
    bundle = CheckpointBundle.at(path)
    try:
        meta = json.loads(bundle.meta.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{bundle.meta}: no such file (resume_from names a bundle stem: the files <stem>.fdl, .optim, .meta.json)") from None
    except ValueError as exc:
        raise CheckpointError(f"{bundle.meta}: not JSON ({exc}); the bundle is corrupt") from None
    if not isinstance(meta, dict) or not isinstance(meta.get("schema_version"), int):
        raise CheckpointError(f"{bundle.meta}: no schema_version; not a flodl checkpoint sidecar")
    if meta["schema_version"] > SCHEMA_VERSION:
        raise CheckpointError(f"{bundle.meta}: schema_version {meta['schema_version']} is newer than this flodl reads ({SCHEMA_VERSION}); upgrade flodl")
    for key in ("epoch", "global_step", "save_reason", "world_at_save", "coverage"):
        if key not in meta:
            raise CheckpointError(f"{bundle.meta}: field {key!r} is missing; the bundle is corrupt")
    if verify_model and meta.get("model_sha256"):
        if not bundle.model.exists():
            raise CheckpointError(f"{bundle.model}: missing (the sidecar {bundle.meta.name} expects it next to it)")
        if file_sha256(bundle.model) != meta["model_sha256"]:
            raise CheckpointError(f"{bundle.model} is not the file {bundle.meta.name} was written with (sha256 differs): "
                                  "corrupt, or torn by a save that did not finish")
    return meta
