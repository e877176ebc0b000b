"""Script mode's API: keep your own training loop, let flodl run it on every rank.

``python -m flodl.controller --script train.py [options] [-- script args]``
starts ``train.py`` once per rank, as ``torchrun train.py`` does. The script
calls ``flodl.init()`` and trains in its own loop::

    import flodl
    run = flodl.init()
    model, optimizer = run.prepare(model, optimizer, dataset, batch_size=64)
    for epoch in run.epochs():
        for x, y in run.batches():
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            run.step(loss)
        run.report(accuracy=evaluate(model))

Underneath, the rank (``rank/script_rank.py``) runs on a thread of its own
and takes turns with the script's main thread (``rank/bridge.py``): the
rank's windows, averages, regroups and saves happen between the script's
batches, never during them. Between two averages, ``run.batches()`` runs
the rank's batch loop on the script's thread (``rank/script_round.py``): no
thread switch per batch. docs/script-mode.md says what the loop means
under Local SGD and what the rank's environment holds.
"""

from __future__ import annotations

import atexit
import logging
import signal
import sys
import threading
from collections.abc import Iterator
from typing import Any, NoReturn

import torch

from . import scalars, scriptspec
from .config.env import RankEnv
from .errors import EXIT_CONFIG, EXIT_TASK_ERROR
from .rank.bridge import BATCH, END, EPOCH, EPOCH_END, ROUND, Bridge, Item
from .rank.link import SAVE_GRACE_S
from .rank.output import LinePrefixed
from .rank.script_rank import Prepared, ScriptRank, Stepped
from .rank.script_round import InlineRound
from .rank.shard_source import ShardSource
from .shards import Shards
from .task import loader_problem

_USAGE = "start it with python -m flodl.controller --script SCRIPT.py [options] [-- script args]"
_run: Run | None = None


def init() -> Run:
    """Join the run this process was started for; returns its ``Run`` (the same one on a second call).

    Outside a flodl run (started as ``python train.py``) it prints one line and exits with status 2.
    """
    global _run
    if _run is None:
        _run = Run(_rank_env())
    return _run


def initialised() -> bool:
    """Has this process called ``flodl.init()``? (Before, a script's failure is reported by
    ``rank/script_start.py``; after, by its ``Run``.)"""
    return _run is not None


def _rank_env() -> RankEnv:
    try:
        env = RankEnv.from_environ()
        is_script = scriptspec.decode(env.task) is not None
    except (KeyError, ValueError) as exc:
        _refuse(f"this script calls flodl.init() but was not started by flodl (missing {exc}): {_USAGE}")
    if not is_script:
        _refuse(f"flodl.init() is for scripts run with --script; this process is a --task rank: {_USAGE}")
    return env


def _refuse(line: str) -> NoReturn:
    print(f"flodl: {line}", file=sys.stderr)
    raise SystemExit(EXIT_CONFIG)


class Run:
    """This rank of the run, as the script sees it."""

    def __init__(self, env: RankEnv) -> None:
        from .host.proc import die_with_parent
        from .wire import curve

        die_with_parent(env.parent_pid)
        if curve.requested():
            curve.enable(env.secret)
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the process group; the controller drives shutdown
        named = isinstance(sys.stderr, LinePrefixed)  # script_start named the rank's lines already
        logging.basicConfig(
            level=logging.WARNING, format=("" if named else f"[rank {env.rank}] ") + "%(levelname)s %(message)s", stream=sys.stderr
        )
        self._bridge = Bridge()
        self._rank = ScriptRank(env, self._bridge)
        signal.signal(signal.SIGTERM, self._rank.on_sigterm)  # only the main thread may trap it
        if self._rank.device.type == "cuda":
            torch.cuda.set_device(self._rank.device)  # the current device is per thread: the script's too
        self._pending: Item | None = None  # the next item (a batch, an epoch's end, the end), not yet taken
        self._round: InlineRound | None = None  # the round of the rank's batch loop this thread runs now
        self._loss: Stepped | None = None  # the last batch's loss (and whether the optimizer stepped), for the driver's next turn
        self._outstanding = False  # a batch was given out and its run.step is due
        self._in_epoch = False
        self._prepared = False
        self.epoch = -1
        self._previous_hook = sys.excepthook
        sys.excepthook = self._on_uncaught
        atexit.register(self._on_exit)
        self._rank.start()

    # ------------------------------------------------------------ properties

    @property
    def rank(self) -> int:
        """This rank's number in the run (never reused: a restarted rank gets a new one)."""
        return self._rank.rank

    @property
    def world_size(self) -> int:
        """How many ranks train now (live: it changes when a rank dies or joins; 1 until ``prepare()``)."""
        return self._rank.world_size

    @property
    def device(self) -> torch.device:
        """This rank's device; ``run.batches()`` puts the batches' tensors on it."""
        return self._rank.device

    @property
    def num_epochs(self) -> int:
        """How many epochs ``run.epochs()`` yields in all (``--epochs`` x ``--epoch-splits``; a resumed
        run's too, counted from the first): what a schedule's length needs, without an ``--epochs``
        of the script's own.

        Raises:
            RuntimeError: before ``prepare()`` (the run's welcome says it).
        """
        self._need_prepared("run.num_epochs")
        return self._rank.epochs

    # ------------------------------------------------------------ the loop

    def prepare(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        dataset: Any,
        *,
        batch_size: int,
        collate_fn: Any = None,
        num_workers: int = 0,
        prefetch_factor: int | None = None,
        pin_memory: bool = False,
        accumulate_grad_batches: int = 1,
        bn_recalibration_batches: int = 16,
    ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        """Join the run with this model, optimizer and dataset; returns the model and optimizer.

        The model moves to ``run.device`` and takes rank 0's weights; its
        parameters keep their identity (the optimizer stays valid). Every rank
        must give the same dataset (same samples, same order): flodl grants
        each rank its indices, ``batch_size`` at a time; a ``flodl.Shards``
        is granted shard by shard, each streamed into batches of ``batch_size``
        that end where the shard ends (docs/data.md). ``num_workers``,
        ``prefetch_factor`` and ``pin_memory`` are torch DataLoader's: worker
        processes run ``dataset[i]`` for the granted batches (``Task``'s fields
        of those names, docs/task.md). ``accumulate_grad_batches``: the
        script steps its optimizer once every this many batches (``run.step`` may say so
        batch by batch instead); no average then falls inside an accumulation.
        ``bn_recalibration_batches``: where averages changed the model since, its
        BatchNorm statistics are re-estimated from this many training batches
        before the script's code after an epoch's batches and before the final
        bundle (averaged statistics fit the averaged weights badly:
        docs/script-mode.md); 0 turns it off.

        Raises:
            TypeError, ValueError: naming the bad argument.
            RuntimeError: called twice.
            SystemExit: the run refused this rank or ended before it joined.
        """
        if self._prepared:
            raise RuntimeError("flodl: run.prepare() is called once")
        _check_prepare(model, optimizer, dataset, batch_size, accumulate_grad_batches, bn_recalibration_batches)
        problem = loader_problem(num_workers, prefetch_factor, pin_memory)
        if problem is not None:
            raise ValueError(f"flodl: run.prepare(..., {problem[0]}=...): {problem[0]} {problem[1]}")
        self._prepared = True
        item = self._bridge.call(
            Prepared(
                model,
                optimizer,
                dataset,
                batch_size,
                collate_fn,
                num_workers,
                prefetch_factor,
                pin_memory,
                accumulate_grad_batches,
                bn_recalibration_batches,
            )
        )
        if item.kind == END:
            self._end(item)
        if self._rank.threads:
            torch.set_num_threads(self._rank.threads)  # the rank's share of the host's cores, on this thread too
        return model, optimizer

    def epochs(self) -> Iterator[int]:
        """Every epoch of the run, in order (0-based), on every rank, one it trains no batch of
        included (its ``run.batches()`` is then empty); ends when the run does, after the last.

        Raises:
            SystemExit: the run ended abnormally (this rank lost, an abort, a NaN loss), once this
                rank's part (its saves) is done, with the rank's exit code.
        """
        self._need_prepared("run.epochs()")
        while True:
            item = self._peek()
            if item.kind == END:
                self._end(item)
                return
            if self._in_epoch:
                raise RuntimeError("flodl: each epoch runs `for batch in run.batches()` to its end (every granted batch is trained once)")
            self._in_epoch = True
            self.epoch = item.epoch
            if item.kind == EPOCH:
                self._pending = None  # an epoch this rank trains no batch of: its end comes next
            yield item.epoch

    def batches(self) -> Batches:
        """This rank's granted batches of the current epoch, their tensors on ``run.device``: iterate
        it (a ``Batches``), and ``len()`` it for this rank's expected share of an epoch.

        A batch taken and not stepped (a peek, ``next(iter(run.batches()))``) is handed again
        by the next iteration: it is still trained once, when ``run.step`` is called for it.

        Raises:
            SystemExit: as ``epochs()``.
        """
        return Batches(self)

    def _batches(self) -> Iterator[Any]:
        """An iteration of ``run.batches()``."""
        self._need_prepared("run.batches()")
        if not self._in_epoch:
            raise RuntimeError("flodl: iterate run.batches() inside `for epoch in run.epochs()`")
        while True:
            item = self._peek()
            if item.kind == BATCH:
                self._outstanding = True  # and the item stays pending until its run.step
                yield item.batch
                if self._outstanding:  # this loop came back for the next batch without run.step
                    raise RuntimeError("flodl: call run.step(loss) for every batch before taking the next")
                continue
            self._in_epoch = False
            if item.kind == EPOCH_END:
                self._pending = None
                return
            self._end(item)  # END: a completed run's last epoch ends here, its end stays for epochs()
            return

    def step(self, loss: torch.Tensor, *, optimizer_stepped: bool | None = None) -> None:
        """This batch is trained; ``loss`` is its loss.

        ``optimizer_stepped``: did the script step its optimizer after this batch? Unsaid, it
        did every ``accumulate_grad_batches`` batches (every batch without accumulation). While
        it has not, the rank averages nothing: an average never falls inside an accumulation.
        The loss is read later, off the step's path (no device sync here).

        Raises:
            RuntimeError: outside ``run.batches()``, or twice for one batch.
            TypeError: ``loss`` is not a one-element tensor.
        """
        if not self._outstanding:
            raise RuntimeError("flodl: run.step(loss) is called once per batch, inside `for batch in run.batches()`")
        if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
            raise TypeError(f"flodl: run.step(loss) takes the batch's loss, a one-element tensor; got {type(loss).__name__}")
        if optimizer_stepped is not None and not isinstance(optimizer_stepped, bool):
            raise TypeError(f"flodl: run.step(loss, optimizer_stepped=...) takes a bool, got {type(optimizer_stepped).__name__}")
        self._loss, self._outstanding, self._pending = Stepped(loss.detach(), optimizer_stepped), False, None

    def register_state(self, name: str, obj: Any) -> None:
        """Keep ``obj``'s state (``state_dict`` / ``load_state_dict``: an LR scheduler, a GradScaler,
        a counter) in the run's bundles, and restore it when the run is resumed.

        Register before ``run.epochs()``: on a resumed run the saved state is loaded into
        ``obj`` at once (``obj`` registered before ``prepare()``: at ``prepare()``). The bundle
        holds the saving rank's copy, as it does the optimizer's state; every rank of the
        resumed run loads that one. The state must be JSON (flodl writes no pickle).

        Raises:
            TypeError, ValueError: naming the bad argument (a state that is not JSON, a name used twice).
            RuntimeError: called once the epochs began.
            flodl.checkpoint.files.CheckpointError: the bundle's state does not load into ``obj``.
        """
        if self.epoch >= 0:
            raise RuntimeError(f"flodl: run.register_state({name!r}, ...) comes before `for epoch in run.epochs()`")
        self._rank.states.register(name, obj)

    def report(self, **metrics: float) -> None:
        """Record user metrics (``run.report(accuracy=0.93)``) for the epoch rows, the record stream
        and the dashboard, averaged across ranks. Reported after an epoch's batches, they land in
        that epoch's row (the rank sends them once this code is done: ``EpochEnd``); inside the
        batch loop, in the epoch the window report covers."""
        for key, value in metrics.items():
            scalars.record_scalar(key, value)

    # ------------------------------------------------------------ internals

    def _need_prepared(self, what: str) -> None:
        if not self._prepared:
            raise RuntimeError(f"flodl: call run.prepare(model, optimizer, dataset, batch_size=...) before {what}")

    def _peek(self) -> Item:
        """The next item: the one pending (a batch given out and not stepped yet is), or a new one
        (from the round, or the driver's turn)."""
        if self._pending is None:
            self._pending = self._next_item()
        return self._pending

    def _expected_batches(self) -> int:
        """``len(run.batches())``: DistributedSampler's share of an epoch, for the live world.

        Raises:
            RuntimeError: before ``prepare()``.
            TypeError: a ``flodl.Shards`` dataset (a shard holds any number of samples).
        """
        self._need_prepared("len(run.batches())")
        source = self._rank.source
        if source is None or isinstance(source, ShardSource):
            raise TypeError("flodl: len(run.batches()) is not known for a flodl.Shards dataset (a shard holds any number of samples)")
        samples = source.schedule.epoch_len(max(self.epoch, 0))
        share = -(-samples // max(self._rank.world_size, 1))  # ceil, as DistributedSampler's num_samples
        return -(-share // source.batch_size)  # and DataLoader's len (drop_last=False)

    def _next_item(self) -> Item:
        """The round in progress runs on, here, to its next item; once it ended (or with none),
        the driver takes its turn and hands the next: a round, an epoch's end, the end."""
        loss, self._loss = self._loss, None
        while True:
            if self._round is not None:
                item = self._round.next(loss)
                if item is not None:
                    return item
                payload, self._round = self._round.ended(), None
            else:
                payload = loss
            loss = None
            item = self._bridge.call(payload)
            if item.kind != ROUND:
                return item
            self._round = item.round

    @staticmethod
    def _end(item: Item) -> None:
        if item.code:
            raise SystemExit(item.code)

    def _on_uncaught(self, kind: type[BaseException], exc: BaseException, tb: Any) -> None:
        """The script's code raised: the rank reports it with its traceback (the controller prints
        it) and the process exits with the rank's code. After the run ended, an error is only the
        script's own: Python's usual traceback and exit."""
        if self._bridge.ended is not None:
            self._previous_hook(kind, exc, tb)
            return
        self._leave(exc)

    def _on_exit(self) -> None:
        """The script returned: fine once the run ended; before, the rank reports it (the run stops)."""
        if self._bridge.ended is None:
            self._leave(RuntimeError("the script returned before the run ended (leave the loop over run.epochs() only when it ends)"))

    def _leave(self, reason: BaseException) -> None:
        from .host.proc import exit_now

        if threading.current_thread() is not threading.main_thread():
            return
        self._bridge.fail(reason)
        ended = self._bridge.wait_ended(self._rank.deadlines.verdict_wait_s + SAVE_GRACE_S)
        exit_now(ended.code if ended is not None and ended.code else EXIT_TASK_ERROR)


class Batches:
    """What ``run.batches()`` returns: iterable (this rank's batches of the epoch), and sized.

    ``len()`` is what ``len(loader)`` is under torchrun with a ``DistributedSampler``: the
    epoch's samples divided among the ranks training now (rounded up), in batches (rounded up).
    It is an estimate of this rank's share: progressive dispatch grants a faster rank more of
    each epoch, so the batches this rank actually trains may be more or fewer.
    """

    __slots__ = ("_run",)

    def __init__(self, run: Run) -> None:
        self._run = run

    def __iter__(self) -> Iterator[Any]:
        return self._run._batches()

    def __len__(self) -> int:
        return self._run._expected_batches()


def _check_prepare(model: Any, optimizer: Any, dataset: Any, batch_size: Any, accumulate: Any, bn_batches: Any) -> None:
    """Raises: TypeError / ValueError naming the bad argument of ``run.prepare``."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"flodl: run.prepare(model, ...): model must be a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"flodl: run.prepare(..., optimizer, ...): must be a torch.optim.Optimizer, got {type(optimizer).__name__}")
    mine = {id(p) for p in model.parameters()}
    if any(id(p) not in mine for group in optimizer.param_groups for p in group["params"]):
        raise ValueError("flodl: run.prepare: the optimizer holds tensors that are not the model's parameters")
    if not isinstance(dataset, Shards) and not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")):
        raise TypeError(
            f"flodl: run.prepare(..., dataset): a map-style dataset (len + getitem) or a flodl.Shards, got {type(dataset).__name__}"
        )
    if not isinstance(batch_size, int) or isinstance(batch_size, bool) or batch_size < 1:
        raise ValueError(f"flodl: run.prepare(..., batch_size=...): a positive int, got {batch_size!r}")
    if not isinstance(accumulate, int) or isinstance(accumulate, bool) or accumulate < 1:
        raise ValueError(f"flodl: run.prepare(..., accumulate_grad_batches=...): a positive int, got {accumulate!r}")
    if not isinstance(bn_batches, int) or isinstance(bn_batches, bool) or bn_batches < 0:
        raise ValueError(f"flodl: run.prepare(..., bn_recalibration_batches=...): an int >= 0, got {bn_batches!r}")
