"""A rank's part of checkpointing: bundle files, the user's checkpoint_fn, and
the emergency save when the controller is lost.

Kept out of the training loop so the rank only decides *when* (saves.py); here is *what*.
A rank writes data files under the tag it is given and never over a file a
committed sidecar names (flodl/checkpoint/files.py); it refuses to write a model or
optimizer state holding NaN/Inf, so a diverged run cannot replace a good bundle.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from ..checkpoint.bundle import CheckpointBundle, first_non_finite, new_tag, optimizer_tensors, save_model, save_optimizer, write_meta
from ..checkpoint.files import remove_tag
from ..wire import messages as m

log = logging.getLogger("flodl.rank")


class NonFinite(ValueError):
    """The model or optimizer state holds NaN/Inf: saving it would replace a usable bundle with a useless one."""


def write_bundle_files(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    stem: str,
    tag: str,
    train_state: dict[str, Any] | None = None,
    outer: dict[str, torch.Tensor] | None = None,
) -> tuple[str, str]:
    """``<stem>.<tag>.fdl`` then ``<stem>.<tag>.optim`` (with ``train_state``: schedulers, scaler; and
    ``outer``: the outer optimizer's state), each atomic; returns their sha256.

    Raises:
        NonFinite: naming the first tensor holding NaN/Inf (nothing is written).
    """
    bad = first_non_finite([*model.named_parameters(), *model.named_buffers()])
    if bad is not None:
        raise NonFinite(f"parameter or buffer {bad} holds NaN or Inf")
    bad = first_non_finite([*optimizer_tensors(optimizer, model), *(outer or {}).items()])
    if bad is not None:
        raise NonFinite(f"optimizer state {bad} holds NaN or Inf")
    bundle = CheckpointBundle.at(stem)
    return save_model(model, bundle.data_file(tag, ".fdl")), save_optimizer(optimizer, bundle.data_file(tag, ".optim"), train_state, outer)


def checkpoint(
    *,
    rank: int,
    model,
    optimizer,
    stem: str,
    tag: str,
    version: int,
    call_fn,
    handle: Any,
    train_state: dict[str, Any] | None = None,
    outer: dict[str, torch.Tensor] | None = None,
) -> m.CheckpointDone:
    """Write the files (if ``stem``) and call ``checkpoint_fn`` (if given); the answer for the controller.

    A failure is reported in the answer, never raised: a checkpoint that could
    not be written must not end the training (the previous bundle stays).
    """
    start = time.perf_counter()
    digests, errors = ("", ""), []
    if stem:
        try:
            digests = write_bundle_files(model, optimizer, stem, tag, train_state, outer)
        except NonFinite as exc:
            errors.append(f"refused to save {stem}: {exc}; the previous bundle is kept")
        except Exception as exc:  # disk full, permissions: report, keep training
            errors.append(f"writing {stem}.{tag}.fdl/.optim: {type(exc).__name__}: {exc}")
    if call_fn is not None:
        try:
            call_fn(version, handle)
        except Exception as exc:
            log.exception("checkpoint_fn(%d) raised; training goes on", version)
            errors.append(f"checkpoint_fn: {type(exc).__name__}: {exc}")
    return m.CheckpointDone(
        rank=rank,
        version=version,
        model_sha256=digests[0],
        optim_sha256=digests[1],
        elapsed_ms=(time.perf_counter() - start) * 1000.0,
        error="; ".join(errors) or None,
    )


def emergency_save(
    *,
    model,
    optimizer,
    stem: str,
    rank: int,
    reason: str,
    why: str,
    epoch: int,
    global_step: int,
    train_state: dict[str, Any] | None = None,
    outer: dict[str, torch.Tensor] | None = None,
) -> None:
    """The controller is gone (or this rank was terminated): keep this replica as the bundle ``<stem>.rank<N>``.

    Same crash safety as a consensus bundle: new data files, then the sidecar
    ``<stem>.rank<N>.meta.json``, then the previous files go. There is no
    coverage (only the controller knew it): resuming from such a file restarts
    the epoch it was in. Best effort: a failure is logged.
    """
    bundle = CheckpointBundle.at(stem).rank(rank)
    tag = new_tag()
    try:
        model_sha, optim_sha = write_bundle_files(model, optimizer, str(bundle.stem), tag, train_state, outer)
        write_meta(
            bundle,
            {
                "rank": rank,
                "save_reason": reason,
                "why": why,
                "epoch": epoch,
                "global_step": global_step,
                "model_file": bundle.data_file(tag, ".fdl").name,
                "model_sha256": model_sha,
                "optim_file": bundle.data_file(tag, ".optim").name,
                "optim_sha256": optim_sha,
                "unix_time": time.time(),
            },
        )
        log.error("rank %d: saved its replica to %s (%s: %s)", rank, bundle.stem, reason, why)
    except Exception:
        remove_tag(bundle, tag)  # a model file whose optimizer file failed is no replica: nothing half-written stays
        log.exception("rank %d: could not save its replica to %s", rank, bundle.stem)
