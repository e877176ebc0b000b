"""Scoring the model when the controller asks (``RunEval``): the ``Evaluator`` part.

It owns its counters: the evals taken (the link counts those asked), whether
averages left the BatchNorm statistics stale (it hears of every average:
``Group.on_average``), and the layers to re-estimate. The window's batch loop
asks it between two batches, so a ``RunEval`` is scored then, not after its
window. On the collective backend the eval scores exactly the
average of the window that closed the epoch (``_scored_model``), even when
this rank has trained on since; on the CPU backend likewise once it landed
(``CpuAverager.scoring``; all averages sent are landed before the final score). BatchNorm statistics
that averages left stale are re-estimated (norms.py); the user's ``eval_fn``
failing is reported, never fatal.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

from ..errors import DeadlineExceeded
from ..wire import messages as m
from .collective import CollectiveAverager
from .cpu_average import CpuAverager
from .data import to_device
from .determinism import traceless
from .norms import model_input, norm_layers, recalibrate

if TYPE_CHECKING:
    from .context import JoinedRun, RankContext
    from .data import BatchSource
    from .position import GroupPosition
    from .regroup import Group
    from .replica import Replica
    from .shard_source import ShardSource

log = logging.getLogger("flodl.rank.runner")

#: Deterministic runs: an eval of epoch e draws from RNG stream EVAL_STREAM + e (training's are 1..ranks).
EVAL_STREAM = 1 << 32


class Evaluator:
    """Evals, and the BatchNorm refresh before them."""

    def __init__(self, ctx: RankContext, run: JoinedRun, replica: Replica, group: Group, source: BatchSource | ShardSource) -> None:
        self.ctx = ctx
        self.link = ctx.link
        self.rank = ctx.rank
        self.device = ctx.device
        self.task = replica.task
        self.model = replica.model
        self.group = group
        self.source = source
        # deterministic: the eval falls between two batches where the clock puts it; it must
        # leave the RNGs and the BatchNorm statistics as training left them
        self.seed = run.welcome.seed if run.config.deterministic else None
        self.evals_taken = 0  # RunEvals scored (compared with the link's count between batches)
        task = self.task
        # BatchNorm layers to re-estimate before an eval (a task's own train_step: none)
        self.norm_layers = norm_layers(self.model) if task.bn_recalibration_batches and task.train_step is None else []
        self.norms_stale = False  # an average changed the model since they were last re-estimated
        group.on_average(self._averaged)

    def _averaged(self, at: GroupPosition) -> None:
        """An average of ``at``'s group: with others in it, it changed the model."""
        self.norms_stale = self.norms_stale or at.world_size > 1

    def asked(self) -> bool:
        """Has the controller asked for evals not scored yet? (Between batches: scored now, ``take_asked``.)"""
        return self.link.evals_asked > self.evals_taken

    def take_asked(self) -> None:
        """Between batches: score the evals the controller asked for now rather than after this
        window (the average they are for is still held then: ``CollectiveAverager.scoring``).
        Other commands taken on the way keep their order (the link holds them: ``take_eval``)."""
        busy = self.link.busy
        while self.asked():
            cmd = self.link.take_eval()
            if cmd is None:
                break
            self.evaluate(cmd)
        self.link.doing(busy)

    def evaluate(self, cmd: m.RunEval) -> None:
        """Score the model with the task's eval function and report it (errors included)."""
        self.evals_taken += 1  # between batches or between windows: compared with the link's count
        value, error = None, None
        start = time.perf_counter()
        self.link.doing("eval")
        averager = self.group.averager
        if isinstance(averager, CpuAverager):
            # CPU backend: land the averages already sent; before the final score, all of them
            if cmd.final:
                try:
                    averager.settle()
                except DeadlineExceeded as exc:
                    log.warning("rank %d: scoring without the last average: %s", self.rank, exc)
            averager.poll()
        if self.task.eval_fn is None:
            error = "the task has no eval_fn"
        else:
            seed = self.seed
            no_trace = traceless(self.model, seed, EVAL_STREAM + cmd.epoch) if seed is not None else contextlib.nullcontext()
            with no_trace, self._scored_model(getattr(cmd, "window", -1)):
                self._refresh_norms(cmd.epoch)
                was_training = self.model.training
                self.model.eval()
                try:
                    with torch.no_grad():
                        value = float(self.task.eval_fn(self.model, self.device))
                except Exception as exc:  # the user's eval failing is reported, not fatal
                    error = f"{type(exc).__name__}: {exc}"
                    log.error("rank %d: eval failed: %s", self.rank, error)
                finally:
                    self.model.train(was_training)
        self.link.send(
            m.EvalResult(
                rank=self.rank,
                epoch=cmd.epoch,
                final=cmd.final,
                value=value,
                elapsed_ms=(time.perf_counter() - start) * 1000.0,
                error=error,
            )
        )

    @contextlib.contextmanager
    def _scored_model(self, window: int) -> Iterator[None]:
        """The model an eval scores. Collective backend: the average of ``window`` (the one that
        closed the epoch), exactly, even when this rank has trained into the next window since;
        if that average is no longer held (rare: a later one already launched), the model as it
        is. Without a window: the model after its last average landed."""
        averager = self.group.averager
        if isinstance(averager, CpuAverager):
            with self._scored_cpu_average(averager, window):
                yield
            return
        if not isinstance(averager, CollectiveAverager):  # not set up
            yield
            return
        tag = averager.pending_tag()
        if window < 0 or (tag >= 0 and tag >> 16 == window):
            self.group.settle_background()  # every rank has launched it (the controller heard them all)
        landed = averager.landed_tag
        if window < 0 or landed < 0 or landed >> 16 != window:
            if window >= 0:
                log.debug("rank %d: window %d's average is gone; scoring the model as it is", self.rank, window)
            yield
            return
        with averager.scoring(landed):
            yield

    @contextlib.contextmanager
    def _scored_cpu_average(self, averager: CpuAverager, window: int) -> Iterator[None]:
        """CPU backend: the average of ``window``'s last round, as it came, once it landed here (a
        blended one: this rank keeps it, ``CpuAverager.scoring``); the model as it is without a
        window, when that average is gone (a later one landed), or when it was a blocking round
        (the model then is that average plus nothing trained since, unless a later window trained)."""
        if window < 0:
            yield
            return
        tag = max((p.tag for p in averager.pending.values() if p.tag >> 16 == window), default=-1)
        if tag >= 0:
            try:
                averager.wait_for_tag(tag)  # the controller heard every rank's report: it is on its way
            except DeadlineExceeded as exc:
                log.warning("rank %d: scoring without window %d's average: %s", self.rank, window, exc)
        tag = averager.kept_tag
        if tag < 0 or tag >> 16 != window:
            yield
            return
        with averager.scoring(tag):
            yield

    def track_norms(self) -> None:
        """Re-estimate the BatchNorm statistics though the task trains through its own step: script
        mode, whose batches are the script's, model input first (a model that takes them otherwise
        costs one warning, ``_refresh_norms``)."""
        if self.task.bn_recalibration_batches:
            self.norm_layers = norm_layers(self.model)

    def refresh_norms(self, epoch: int) -> None:
        """Re-estimate the BatchNorm statistics now if averages changed the model since they last were
        (script mode: before the script's code after an epoch's batches, and before its bundles)."""
        self._refresh_norms(epoch)

    def _refresh_norms(self, epoch: int) -> None:
        """Before scoring a model that averages changed: its BatchNorm statistics
        re-estimated from the first ``bn_recalibration_batches`` batches of this
        epoch's order (flodl/rank/norms.py says why)."""
        if not (self.norms_stale and self.norm_layers):
            return
        self.norms_stale = False
        size = min(self.task.bn_recalibration_batches * self.task.batch_size, self.source.schedule.epoch_len(epoch))
        # at most that many batches: a shard's batches are not counted ahead (shard_source.py)
        batches = itertools.islice(self.source.batches(epoch, 0, size), self.task.bn_recalibration_batches)
        inputs = (model_input(to_device(batch, self.device)) for _, batch in batches)
        try:
            recalibrate(self.model, self.norm_layers, inputs)
        except Exception as exc:  # a data or model error here must not cost the eval; it would recur
            self.norm_layers = []
            log.warning(
                "rank %d: BatchNorm statistics not re-estimated (%s: %s); kept as training leaves them for the rest of the run",
                self.rank,
                type(exc).__name__,
                exc,
            )
