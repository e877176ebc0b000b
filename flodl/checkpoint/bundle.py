"""Checkpoint bundles: the consensus model, an optimizer state, and the run's trajectory.

A bundle is a sidecar and the two data files it names (files.py
has the layout and the order of a save that never tears a bundle):

* ``<stem>.<tag>.fdl``   the consensus model: a plain safetensors state dict, keyed by
  the names ``model.state_dict()`` gives (parameters and persistent buffers), so
  ``model.load_state_dict(safetensors.torch.load_file(path))`` loads it
  (before 2026-12-07 the keys were ``p0, ..., b0, ...``: ``load_model`` still reads those)
* ``<stem>.<tag>.optim`` the writing rank's optimizer state (safetensors; the
  non-tensor part as JSON in the metadata; no pickle)
* ``<stem>.meta.json``   where the run stood: schema version, epoch, global
  step, sync rounds, ElChe state, data coverage, save reason, world at save,
  and the name and sha256 of each data file: the commit marker, written last

The controller writes the sidecar (``meta.py``, torch-free and
re-exported here); the elected rank writes the data files. On several hosts
the stem must be on storage every host sees. Non-finite values are refused
both ways: a rank does not save them, a resume does not load them.
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch

from . import safetensors_io
from .files import SCHEMA_VERSION, CheckpointBundle, CheckpointError, new_tag, resolve, stem_of
from .meta import SAVE_REASONS, file_sha256, read_meta, write_meta
from .safetensors_io import CorruptFile

#: A model file's format (its safetensors metadata): a plain state dict of the user's model.
MODEL_FORMAT = "flodl-state-dict"
#: The format before it: keys ``p<i>`` and ``b<j>`` in module order, the names in the metadata.
OLD_MODEL_FORMAT = "flodl-consensus"

__all__ = [
    "SAVE_REASONS",
    "SCHEMA_VERSION",
    "CheckpointBundle",
    "OUTER_PREFIX",
    "CheckpointError",
    "SavedOptimizer",
    "check_model_file",
    "file_sha256",
    "first_non_finite",
    "load_model",
    "load_optimizer",
    "new_tag",
    "optimizer_payload",
    "optimizer_tensors",
    "read_meta",
    "save_model",
    "save_optimizer",
    "stem_of",
    "write_meta",
]


def first_non_finite(tensors: Iterable[tuple[str, torch.Tensor]]) -> str | None:
    """The name of the first floating tensor holding NaN or Inf, else None (one reduction per tensor)."""
    for name, tensor in tensors:
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            return name
    return None


# ----------------------------------------------------------------- the model


def _model_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's state dict, by the names ``model.state_dict()`` gives them (parameters and
    persistent buffers; a tied weight under each of its names), holding the live tensors."""
    return dict(model.state_dict(keep_vars=True))


def _old_keys(model: torch.nn.Module) -> dict[str, str]:
    """A bundle written before 2026-12-07 (format ``flodl-consensus``) keys its tensors ``p0, p1,
    ...`` and ``b0, ...`` in module order: its key of each of the model's names."""
    keys = {name: f"p{i}" for i, (name, _) in enumerate(model.named_parameters())}
    keys.update({name: f"b{j}" for j, (name, _) in enumerate(model.named_buffers())})
    return keys


def save_model(model: torch.nn.Module, path: str | os.PathLike) -> str:
    """Write the model's state dict to ``path`` atomically, a plain safetensors file any tool loads
    (``safetensors.torch.load_file(path)`` then ``model.load_state_dict``); returns its sha256."""
    return safetensors_io.save(path, _model_tensors(model), {"format": MODEL_FORMAT})


def load_model(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Load a bundle's model (named by its stem, sidecar or ``.fdl``) into ``model`` in place.

    The file is found through the sidecar when there is one; its checksum is
    the controller's to check (``read_meta``), the fit and the values are
    checked here. A bundle of the earlier format (``p0, b0, ...`` keys) loads too.

    Raises:
        CheckpointError: the file is missing or corrupt, its tensors do not
            match the model's (names, shape or dtype), or one holds NaN/Inf,
            naming the first such tensor.
    """
    file = resolve(path, "model")
    check_model_file(model, file)  # from the header alone: refuse before reading the tensors
    try:
        stored, metadata = safetensors_io.load(file)
    except CorruptFile as exc:
        raise CheckpointError(str(exc)) from None
    mine = _model_tensors(model)
    keys = _file_keys(model, metadata)
    bad = first_non_finite((name, stored[keys[name]]) for name in mine)
    if bad is not None:
        raise CheckpointError(f"{file}: {bad} holds NaN or Inf; the run diverged before this save. Resume from an earlier bundle")
    with torch.no_grad():
        for name, tensor in mine.items():
            tensor.copy_(stored[keys[name]].to(tensor.device))


def _file_keys(model: torch.nn.Module, metadata: dict[str, str]) -> dict[str, str]:
    """The file's key of each of the model's state-dict names (the name itself, or the old format's ``p<i>``)."""
    if metadata.get("format") == OLD_MODEL_FORMAT:
        old = _old_keys(model)
        return {name: old[name] for name in _model_tensors(model)}
    return {name: name for name in _model_tensors(model)}


def check_fits(file: Path, stored: dict[str, tuple[list[int], torch.dtype]], mine: dict[str, torch.Tensor], keys: dict[str, str]) -> None:
    """Raise CheckpointError naming the first tensor the model and the file disagree on."""
    missing = [name for name in mine if keys[name] not in stored]
    extra = sorted(set(stored) - set(keys.values()))
    if missing or extra:
        raise CheckpointError(
            f"{file} does not fit this model: "
            + "; ".join(
                part
                for part in (
                    f"the model's {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} not in the file" if missing else "",
                    f"the file's {', '.join(extra[:5])}{' ...' if len(extra) > 5 else ''} not in the model" if extra else "",
                )
                if part
            )
            + " (was it saved from another model?)"
        )
    for name, tensor in mine.items():
        shape, dtype = stored[keys[name]]
        if shape != list(tensor.shape) or dtype != tensor.dtype:
            raise CheckpointError(
                f"{file} does not fit this model: {name} is {dtype} {shape} in the file but {tensor.dtype} {list(tensor.shape)} in the model"
            )


def check_model_file(model: torch.nn.Module, path: str | os.PathLike) -> None:
    """Check a ``.fdl`` fits ``model`` reading only its header (cheap, for a fast refusal)."""
    file = resolve(path, "model")
    try:
        header, metadata, _ = safetensors_io.read_header(file)
    except FileNotFoundError:
        raise CheckpointError(f"{file}: no such checkpoint file") from None
    except CorruptFile as exc:
        raise CheckpointError(str(exc)) from None
    stored = {k: (list(e["shape"]), safetensors_io.FROM_CODE[e["dtype"]]) for k, e in header.items()}
    check_fits(file, stored, _model_tensors(model), _file_keys(model, metadata))


# ------------------------------------------------------------- the optimizer


def optimizer_tensors(optimizer: torch.optim.Optimizer, model: torch.nn.Module | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` of every tensor in the optimizer's state, named after the model's parameter when given."""
    names = {id(p): n for n, p in model.named_parameters()} if model is not None else {}
    for param, values in optimizer.state.items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                yield f"{names.get(id(param), 'a parameter')}'s {key}", value


#: Names of the outer optimizer's tensors (rank/outer.py ``OuterStep.tensors``) in an ``.optim`` file:
#: kept beside the optimizer's state, never loaded into it.
OUTER_PREFIX = "outer."


def optimizer_payload(
    optimizer: torch.optim.Optimizer, train_state: dict[str, Any] | None = None, extra: dict[str, torch.Tensor] | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """An optimizer's state as an ``.optim`` file holds it: ``(tensors, metadata)`` (tensors as
    ``state.<param>.<key>``, the rest as JSON metadata; no pickle).

    ``train_state``: JSON kept beside it (the LR schedulers', the GradScaler's, how the
    parameter groups split between several optimizers: ``flodl.rank.update.train_state``);
    ``extra``: tensors kept beside it, each named with ``OUTER_PREFIX`` (the outer optimizer's).

    Raises:
        TypeError: ``train_state`` is not JSON.
    """
    state = optimizer.state_dict()
    tensors: dict[str, torch.Tensor] = {}
    plain: dict[str, dict[str, Any]] = {}
    for pid, values in state["state"].items():
        for key, value in values.items():
            if isinstance(value, torch.Tensor):
                tensors[f"state.{pid}.{key}"] = value
            else:
                plain.setdefault(str(pid), {})[key] = value
    for name, tensor in (extra or {}).items():
        assert name.startswith(OUTER_PREFIX), f"an .optim file's extra tensor {name!r} must start with {OUTER_PREFIX!r}"
        tensors[name] = tensor
    metadata = {"format": "flodl-optim", "param_groups": json.dumps(state["param_groups"]), "plain": json.dumps(plain)}
    if train_state:
        try:
            metadata["train_state"] = json.dumps(train_state)
        except TypeError as exc:  # a scheduler holding a function: flodl saves no pickle
            raise TypeError(f"the LR schedulers', scaler's or script's registered state cannot be saved as JSON ({exc})") from None
    return tensors, metadata


def save_optimizer(
    optimizer: torch.optim.Optimizer,
    path: str | os.PathLike,
    train_state: dict[str, Any] | None = None,
    extra: dict[str, torch.Tensor] | None = None,
) -> str:
    """Write an optimizer's state (``optimizer_payload``: tensors as safetensors, the rest as JSON
    metadata, ``extra`` tensors beside it); returns the file's sha256."""
    return safetensors_io.save(path, *optimizer_payload(optimizer, train_state, extra))


class SavedOptimizer:
    """An optimizer's state as read from an ``.optim`` file or handed over in memory (``optimizer_payload``'s)."""

    def __init__(self, tensors: dict[str, torch.Tensor], metadata: dict[str, str], origin: str, *, check_finite: bool = True) -> None:
        """``check_finite``: refuse NaN/Inf (a file may hold a diverged run's state; a live donor's
        cannot go unnoticed: its next step's loss would stop the run, so a handoff skips the pass).

        Raises:
            CheckpointError: naming ``origin``, when it is not a flodl optimizer state or holds NaN/Inf."""
        try:
            self.groups = json.loads(metadata["param_groups"])
            self.plain = json.loads(metadata.get("plain", "{}"))
            self.train_state: dict[str, Any] = json.loads(metadata.get("train_state", "{}"))
        except (KeyError, ValueError) as exc:
            raise CheckpointError(f"{origin}: not a flodl optimizer file ({exc})") from None
        bad = first_non_finite(tensors.items()) if check_finite else None
        if bad is not None:
            raise CheckpointError(
                f"{origin}: optimizer state tensor {bad} holds NaN or Inf; the run diverged before this "
                "save. Resume from an earlier bundle, or this one's weights alone (resume_weights_only)"
            )
        self.tensors = {k: v for k, v in tensors.items() if not k.startswith(OUTER_PREFIX)}
        #: the outer optimizer's state kept beside it (rank/outer.py), by its own names; empty when none
        self.outer = {k: v for k, v in tensors.items() if k.startswith(OUTER_PREFIX)}
        self.origin = origin

    @classmethod
    def read(cls, path: str | os.PathLike) -> SavedOptimizer:
        """A bundle's optimizer state (named by its stem, sidecar or ``.optim``).

        Raises:
            CheckpointError: missing, corrupt, or holding NaN/Inf (naming the tensor).
        """
        file = resolve(path, "optim")
        try:
            tensors, metadata = safetensors_io.load(file)
        except FileNotFoundError:
            raise CheckpointError(f"{file}: no such optimizer file") from None
        except CorruptFile as exc:
            raise CheckpointError(f"{file}: not a flodl optimizer file ({exc})") from None
        return cls(tensors, metadata, str(file))

    def load_into(self, optimizer: torch.optim.Optimizer, *, fits: list[int] | None = None) -> dict[str, Any]:
        """Load the state into ``optimizer``; returns the ``train_state`` kept with it (``{}`` when none).

        ``fits``: the parameter groups of each of the task's optimizers, checked against the
        split the state was saved with (when it says).

        Raises:
            CheckpointError: made for other parameter groups or optimizers.
        """
        origin, groups, train_state = self.origin, copy.deepcopy(self.groups), self.train_state
        if fits is not None and train_state.get("optimizers", fits) != fits:
            raise CheckpointError(
                f"{origin} does not fit this task's optimizers: saved from optimizers of {train_state['optimizers']} "
                f"parameter groups, this task's have {fits}"
            )
        mine = optimizer.state_dict()["param_groups"]
        if [len(g["params"]) for g in groups] != [len(g["params"]) for g in mine]:
            raise CheckpointError(
                f"{origin} does not fit this optimizer: parameter groups of sizes "
                f"{[len(g['params']) for g in groups]} in the file, {[len(g['params']) for g in mine]} here"
            )
        for group, own in zip(groups, mine, strict=False):
            for key, value in group.items():
                if isinstance(own.get(key), tuple) and isinstance(value, list):
                    group[key] = tuple(value)  # JSON has no tuples (Adam's betas)
        state: dict[int, dict[str, Any]] = {}
        for name, tensor in self.tensors.items():
            _, pid, key = name.split(".", 2)
            state.setdefault(int(pid), {})[key] = tensor
        for pid, values in self.plain.items():
            state.setdefault(int(pid), {}).update(copy.deepcopy(values))
        try:
            optimizer.load_state_dict({"state": state, "param_groups": groups})
        except (ValueError, KeyError, RuntimeError) as exc:
            raise CheckpointError(f"{origin} does not fit this optimizer: {exc}") from None
        return train_state


def load_optimizer(optimizer: torch.optim.Optimizer, path: str | os.PathLike, *, fits: list[int] | None = None) -> dict[str, Any]:
    """Load a bundle's optimizer state (named by its stem, sidecar or ``.optim``) into ``optimizer``;
    returns the ``train_state`` saved with it (``{}`` when none).

    ``fits``: the parameter groups of each of the task's optimizers, checked against the
    split the file was saved with (when it says).

    Raises:
        CheckpointError: missing, corrupt, made for other parameter groups or
            optimizers, or holding NaN/Inf (naming the tensor).
    """
    return SavedOptimizer.read(path).load_into(optimizer, fits=fits)
