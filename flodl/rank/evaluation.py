"""Scoring the model when the controller asks (``RunEval``).

A mixin of ``RankRunner`` (runner.py), which holds the state these methods
read and write. The runner takes a ``RunEval`` between two batches, not
after its window. On the collective backend the eval scores exactly the
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
from .norms import model_input, recalibrate

if TYPE_CHECKING:
    from ..task import Task
    from .averager import Averager
    from .data import BatchSource
    from .link import ControllerLink
    from .shard_source import ShardSource

log = logging.getLogger("flodl.rank.runner")

#: Deterministic runs: an eval of epoch e draws from RNG stream EVAL_STREAM + e (training's are 1..ranks).
EVAL_STREAM = 1 << 32


class Evaluating:
    """Evals, and the BatchNorm refresh before them."""

    # RankRunner's state that these methods read and write (runner.py sets it up)
    rank: int
    device: torch.device
    link: ControllerLink
    task: Task
    model: torch.nn.Module
    averager: Averager | None
    source: BatchSource | ShardSource | None
    evals_taken: int
    norm_layers: list
    norms_stale: bool
    deterministic: bool
    welcome: m.RankWelcome | None

    if TYPE_CHECKING:

        def _settle_background(self) -> None: ...  # regroup.py

    def _evaluate(self, cmd: m.RunEval) -> None:
        """Score the model with the task's eval function and report it (errors included)."""
        self.evals_taken += 1  # between batches or between windows: the runner compares it with the link's count
        value, error = None, None
        start = time.perf_counter()
        self.link.doing("eval")
        if isinstance(self.averager, CpuAverager):
            # CPU backend: land the averages already sent; before the final score, all of them
            if cmd.final:
                try:
                    self.averager.settle()
                except DeadlineExceeded as exc:
                    log.warning("rank %d: scoring without the last average: %s", self.rank, exc)
            self.averager.poll()
        if self.task.eval_fn is None:
            error = "the task has no eval_fn"
        else:
            # deterministic: the eval falls between two batches where the clock puts it; it
            # must leave the RNGs and the BatchNorm statistics as training left them
            seed = self.welcome.seed if self.deterministic and self.welcome is not None else None
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
        if isinstance(self.averager, CpuAverager):
            with self._scored_cpu_average(self.averager, window):
                yield
            return
        if not isinstance(self.averager, CollectiveAverager):  # not set up
            yield
            return
        tag = self.averager.pending_tag()
        if window < 0 or (tag >= 0 and tag >> 16 == window):
            self._settle_background()  # every rank has launched it (the controller heard them all)
        landed = self.averager.landed_tag
        if window < 0 or landed < 0 or landed >> 16 != window:
            if window >= 0:
                log.debug("rank %d: window %d's average is gone; scoring the model as it is", self.rank, window)
            yield
            return
        with self.averager.scoring(landed):
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

    def _refresh_norms(self, epoch: int) -> None:
        """Before scoring a model that averages changed: its BatchNorm statistics
        re-estimated from the first ``bn_recalibration_batches`` batches of this
        epoch's order (flodl/rank/norms.py says why)."""
        if not (self.norms_stale and self.norm_layers):
            return
        assert self.source is not None  # set up: norm_layers came after it
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
