"""The user's side of a run: what to train, on what, and how to score it.

A ``Task`` bundles the factories every rank calls to build its own replica
(model, optimizer), the dataset it draws its granted samples from, and how
one batch becomes a loss. Ranks never receive code over the network: each
rank imports the task factory by name (``module:function`` or
``path/to/file.py:function``) and calls it locally, see ``taskspec.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from .errors import TaskError
from .shards import Shards

#: ``model_factory() -> nn.Module`` (built on CPU; the rank moves it to its device).
ModelFactory = Callable[[], torch.nn.Module]
#: ``optimizer_factory(model) -> Optimizer`` (called after the model is on its device).
OptimizerFactory = Callable[[torch.nn.Module], torch.optim.Optimizer]
#: ``loss_fn(output, target) -> scalar loss``.
LossFn = Callable[[Any, Any], torch.Tensor]
#: ``train_step(model, batch, device) -> scalar loss`` (forward only; flodl does backward/step).
TrainStep = Callable[[torch.nn.Module, Any, torch.device], torch.Tensor]
#: ``eval_fn(model, device) -> float`` scores the (averaged) model.
EvalFn = Callable[[torch.nn.Module, torch.device], float]
#: ``lr_schedule(global_step) -> multiplier`` of the base learning rate.
LrSchedule = Callable[[int], float]
#: ``epoch_fn(epoch, worker)`` runs on every rank as it starts an epoch (see ``rank.handle.WorkerHandle``).
EpochFn = Callable[[int, Any], None]
#: ``checkpoint_fn(version, worker)`` runs on the elected rank every ``checkpoint_every`` epochs.
CheckpointFn = Callable[[int, Any], None]
#: ``scheduler(optimizer) -> torch.optim.lr_scheduler.LRScheduler`` (called once per optimizer).
SchedulerFactory = Callable[[torch.optim.Optimizer], Any]

#: ``Task.precision``: the autocast dtype of the forward (None: full precision, no autocast).
PRECISIONS: dict[str, torch.dtype | None] = {"32": None, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
#: ``Task.scheduler_interval``: what one scheduler step is (docs/task.md).
SCHEDULER_INTERVALS = ("global", "rank")

#: ``torch.compile`` modes a ``Task.compile`` string may name.
COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")
#: Modes that capture CUDA graphs (on a GPU): each step then starts with ``cudagraph_mark_step_begin``.
GRAPHED_MODES = ("reduce-overhead", "max-autotune")


def compile_kwargs(value: bool | str | dict[str, Any]) -> dict[str, Any] | None:
    """``Task.compile`` as ``torch.compile`` keyword arguments, None when off.

    ``True`` is torch's default mode, a string names a mode, a dict is passed
    through (``{"mode": ..., "backend": ..., "fullgraph": ..., "dynamic": ...}``).

    Raises:
        TaskError: anything else, or an unknown mode.
    """
    if value is False or value is None:
        return None
    if value is True:
        return {}
    if isinstance(value, str):
        if value not in COMPILE_MODES:
            raise TaskError(f"Task.compile: unknown mode {value!r} (one of {', '.join(COMPILE_MODES)}, True or a dict)")
        return {"mode": value}
    if isinstance(value, dict):
        mode = value.get("mode")
        if mode is not None and mode not in COMPILE_MODES:
            raise TaskError(f"Task.compile: unknown mode {mode!r} (one of {', '.join(COMPILE_MODES)})")
        return dict(value)
    raise TaskError(f"Task.compile must be True/False, a mode name or a dict of torch.compile arguments, got {value!r}")


def loader_problem(num_workers: Any, prefetch_factor: Any, pin_memory: Any) -> tuple[str, str] | None:
    """``(field, what is wrong)`` for bad loader options, None when they are fine (``Task`` and
    ``run.prepare`` name the field their own way)."""
    if not isinstance(num_workers, int) or isinstance(num_workers, bool) or num_workers < 0:
        return "num_workers", f"must be an int >= 0, got {num_workers!r}"
    if prefetch_factor is not None:
        if not isinstance(prefetch_factor, int) or isinstance(prefetch_factor, bool) or prefetch_factor < 1:
            return "prefetch_factor", f"must be an int >= 1 or None, got {prefetch_factor!r}"
        if num_workers == 0:
            return "prefetch_factor", "is how many batches each worker reads ahead: it needs num_workers > 0"
    if not isinstance(pin_memory, bool):
        return "pin_memory", f"must be True or False, got {pin_memory!r}"
    return None


@dataclass
class Task:
    """Everything a rank needs to train one replica.

    Attributes:
        model: zero-argument factory returning a fresh ``nn.Module``. Every rank
            calls it; the rank then overwrites its parameters with rank 0's so
            all replicas start identical, whatever the factory's seeding.
        optimizer: factory taking the model (already on its device) and
            returning its optimizer, or a list/tuple of optimizers (each over
            its own parameters): every one steps, zeroes, follows the LR
            schedule and is saved.
        dataset: a map-style dataset (``__len__`` + ``__getitem__``), a
            ``flodl.Shards`` (streamed shards: flodl grants shards instead of
            indices, docs/data.md), or a zero-argument factory returning one.
            Every rank must see the same samples (shards) in the same order;
            flodl decides which indices (shards) each trains.
        batch_size: samples per batch on each rank (an optimizer step takes
            ``accumulate_grad_batches`` batches).
        loss_fn: ``loss_fn(model(x), y)`` for datasets yielding ``(x, y)``.
            Give either ``loss_fn`` or ``train_step``.
        train_step: ``train_step(model, batch, device) -> loss`` for anything
            that is not ``(x, y)``; it must move the batch to ``device`` itself.
        eval_fn: optional ``eval_fn(model, device) -> float`` run on one rank
            at each epoch end and once at the end of the run.
        eval_metric: name printed and recorded for ``eval_fn``'s value.
        collate_fn: how samples become a batch (default: torch's default_collate).
        lr_schedule: ``lr_schedule(global_step) -> multiplier`` of every
            group's base learning rate, where ``global_step`` counts the batches
            of all ranks (so a schedule written for one process keeps its shape).
        epoch_fn: ``epoch_fn(epoch, worker)`` called once for every epoch of
            the run on every rank, in order, as it begins the epoch (one in
            which the rank trains no batch included; the epochs after its last
            batch, once the run completes), ``epoch`` being the 0-based index
            (the console's epoch ``epoch + 1``); ``worker`` can read and change
            the LR, swap the schedule, and reach the model and optimizer.
        checkpoint_fn: ``checkpoint_fn(version, worker)`` called on one rank
            (``epoch_callback_policy``) every ``checkpoint_every`` epochs, with
            ``worker.model`` holding the consensus parameters. Exceptions are
            logged and training goes on.
        bn_recalibration_batches: before an eval that follows averages, the
            eval rank re-estimates the model's BatchNorm running statistics
            from this many training batches (forward passes, no gradients):
            averaged statistics were measured under each replica's own weights
            and fit the averaged weights badly (docs/cadence.md). 0 turns it
            off; models without BatchNorm, solo runs and ``train_step`` tasks
            (whose model input flodl cannot know) skip it.
        compile: ``torch.compile`` the model's forward on every rank: ``True``
            (torch's default mode), a mode name (``"reduce-overhead"`` captures
            CUDA graphs on a GPU) or a dict of ``torch.compile`` arguments. flodl
            compiles after it has laid the parameters out in its flat buckets,
            so averages write into the very memory the compiled code (and its
            CUDA graphs) reads: nothing re-compiles or re-records at an average.
            The module stays the same object (``nn.Module.compile``), so saved
            state dicts keep their keys. The loss is computed outside the
            compiled forward (``loss_fn``, or your ``train_step``); see
            docs/compile.md.
        scheduler: ``scheduler(optimizer) -> LRScheduler`` (a
            ``torch.optim.lr_scheduler`` object), called once per optimizer
            after the LR factor is applied; stepped once per optimizer step as
            ``scheduler_interval`` counts them. Its state is saved with the
            optimizer's. Give ``scheduler`` or ``lr_schedule``, not both.
        scheduler_interval: ``"global"`` (default): the scheduler has taken as
            many steps as all ranks' optimizer steps (``lr_schedule``'s global
            step), so every rank agrees on the LR after each average;
            ``"rank"``: one scheduler step per this rank's own optimizer step.
        accumulate_grad_batches: batches whose gradients add up into one
            optimizer step (each batch's loss divided by it). Coverage still
            counts every batch; an average never falls inside an accumulation
            (docs/task.md).
        precision: ``"32"`` (default), ``"bf16-mixed"`` or ``"fp16-mixed"``:
            the forward (model and loss) runs under ``torch.autocast``; fp16
            adds a ``GradScaler`` whose state is saved, and counts the steps it
            skips (``amp_skipped_steps``).
        num_workers: worker processes that run the dataset's ``__getitem__``
            for the granted batches, as torch's DataLoader workers do (0, the
            default: threads of the rank read). Use it when ``__getitem__`` is
            CPU-bound Python (decoding, augmentation) that holds the GIL. The
            rank collates (what the workers read also fills the staging
            tiers); a ``TensorDataset`` is gathered in memory and uses none.
            Workers are forked and die with their rank (docs/data.md).
        prefetch_factor: batches each worker reads ahead (torch's default, 2,
            when None); only with ``num_workers`` > 0.
        pin_memory: collate each batch into page-locked host memory, so its
            copy to a CUDA device overlaps the step; ignored (with a note in
            the rank's log) on a CPU device.
    """

    model: ModelFactory
    optimizer: OptimizerFactory
    dataset: Any
    batch_size: int
    loss_fn: LossFn | None = None
    train_step: TrainStep | None = None
    eval_fn: EvalFn | None = None
    eval_metric: str = "eval"
    collate_fn: Callable[[list], Any] | None = None
    lr_schedule: LrSchedule | None = None
    epoch_fn: EpochFn | None = None
    checkpoint_fn: CheckpointFn | None = None
    bn_recalibration_batches: int = 16
    compile: bool | str | dict[str, Any] = False
    scheduler: SchedulerFactory | None = None
    scheduler_interval: str = "global"
    accumulate_grad_batches: int = 1
    precision: str = "32"
    num_workers: int = 0
    prefetch_factor: int | None = None
    pin_memory: bool = False

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Fail fast, naming the field, on a task that cannot train.

        Raises:
            TaskError: a required factory is missing or a value is out of range.
        """
        for name in ("model", "optimizer"):
            if not callable(getattr(self, name)):
                raise TaskError(f"Task.{name} must be a callable factory, got {getattr(self, name)!r}")
        if not isinstance(self.batch_size, int) or isinstance(self.batch_size, bool) or self.batch_size < 1:
            raise TaskError(f"Task.batch_size must be a positive int, got {self.batch_size!r}")
        if (self.loss_fn is None) == (self.train_step is None):
            raise TaskError("Task needs exactly one of loss_fn or train_step")
        for name in ("eval_fn", "lr_schedule", "epoch_fn", "collate_fn", "checkpoint_fn", "scheduler"):
            value = getattr(self, name)
            if value is not None and not callable(value):
                raise TaskError(f"Task.{name} must be callable, got {value!r}")
        if self.scheduler is not None and self.lr_schedule is not None:
            raise TaskError("Task.scheduler and Task.lr_schedule both set the LR: give one of them")
        if self.scheduler_interval not in SCHEDULER_INTERVALS:
            raise TaskError(f"Task.scheduler_interval must be one of {', '.join(SCHEDULER_INTERVALS)}, got {self.scheduler_interval!r}")
        if self.precision not in PRECISIONS:
            raise TaskError(f"Task.precision must be one of {', '.join(map(repr, PRECISIONS))}, got {self.precision!r}")
        for name, low in (("bn_recalibration_batches", 0), ("accumulate_grad_batches", 1)):
            n = getattr(self, name)
            if not isinstance(n, int) or isinstance(n, bool) or n < low:
                raise TaskError(f"Task.{name} must be an int >= {low}, got {n!r}")
        if not isinstance(self.eval_metric, str) or not self.eval_metric:
            raise TaskError("Task.eval_metric must be a non-empty string")
        compile_kwargs(self.compile)
        problem = loader_problem(self.num_workers, self.prefetch_factor, self.pin_memory)
        if problem is not None:
            raise TaskError(f"Task.{problem[0]} {problem[1]}")

    def build_dataset(self) -> Any:
        """Return the dataset, calling the factory if one was given.

        Raises:
            TaskError: the result has no ``__len__``/``__getitem__`` or is empty.
        """
        ds = self.dataset
        if not _dataset_like(ds) and callable(ds):
            ds = ds()
        if isinstance(ds, Shards):
            ds.check()  # an opener that gives no iterable fails here, before training
            return ds
        if not _dataset_like(ds):
            raise TaskError(f"Task.dataset must be a map-style dataset (len + getitem) or a flodl.Shards, got {type(ds).__name__}")
        if len(ds) == 0:
            raise TaskError("Task.dataset is empty")
        return ds


def _dataset_like(ds: Any) -> bool:
    """A dataset as it is, not a factory of one: map-style, or shards."""
    return isinstance(ds, Shards) or (hasattr(ds, "__len__") and hasattr(ds, "__getitem__"))
