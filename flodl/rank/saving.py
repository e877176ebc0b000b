"""A rank's part of checkpointing: bundle files, the user's checkpoint_fn, and
the emergency save when the controller is lost.

Kept out of the training loop so the runner only decides *when*; here is *what*.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import torch

from ..checkpoint import CheckpointBundle, save_model, save_optimizer
from ..safetensors_io import write_atomic

log = logging.getLogger("flodl.rank")


def write_bundle_files(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None, stem: str) -> str:
    """``<stem>.fdl`` then ``<stem>.optim``, each atomic; returns the model file's sha256."""
    bundle = CheckpointBundle.at(stem)
    digest = save_model(model, bundle.model)
    if optimizer is not None:
        save_optimizer(optimizer, bundle.optim)
    return digest


def checkpoint(*, model, optimizer, stem: str, version: int, call_fn, handle: Any) -> tuple[str, float, str | None]:
    """Write the files (if ``stem``) and call ``checkpoint_fn`` (if given).

    Returns ``(model_sha256, elapsed_ms, error)``; a failure is reported, never raised:
    a checkpoint that could not be written must not end the training.
    """
    start = time.perf_counter()
    digest, errors = "", []
    if stem:
        try:
            digest = write_bundle_files(model, optimizer, stem)
        except Exception as exc:  # disk full, permissions: report, keep training
            errors.append(f"writing {stem}.fdl/.optim: {type(exc).__name__}: {exc}")
    if call_fn is not None:
        try:
            call_fn(version, handle)
        except Exception as exc:
            log.exception("checkpoint_fn(%d) raised; training goes on", version)
            errors.append(f"checkpoint_fn: {type(exc).__name__}: {exc}")
    return digest, (time.perf_counter() - start) * 1000.0, "; ".join(errors) or None


def emergency_save(*, model, optimizer, stem: str, rank: int, reason: str, why: str, epoch: int, global_step: int) -> None:
    """The controller is gone (or this rank was terminated): keep this replica as ``<stem>.rank<N>.fdl/.optim/.meta.json``.

    There is no coverage (only the controller knew it): resuming from such a
    file restarts the epoch it was in. Best effort: a failure is logged.
    """
    bundle = CheckpointBundle.at(stem)
    try:
        model_file = bundle.rank_file(rank, ".fdl")
        save_model(model, model_file)
        if optimizer is not None:
            save_optimizer(optimizer, bundle.rank_file(rank, ".optim"))
        meta = {"rank": rank, "save_reason": reason, "why": why, "epoch": epoch, "global_step": global_step,
                "model": model_file.name, "unix_time": time.time()}
        write_atomic(bundle.rank_file(rank, ".meta.json"), [json.dumps(meta, indent=2).encode() + b"\n"])
        log.error("rank %d: saved its replica to %s (%s: %s)", rank, model_file, reason, why)
    except Exception:
        log.exception("rank %d: could not save its replica to %s", rank, stem)
