"""How batches become optimizer updates when a task asks for more than the plain step.

The plain step (``Task.precision`` "32", one batch per step, no ``scheduler``)
stays inline in ``Replica.step`` (replica.py): it pays nothing for what is here. A task
that sets any of gradient accumulation, mixed precision or a torch LR scheduler
gets one ``Update`` at join, which runs each batch's forward and backward and
the optimizer step at the end of every accumulation. Several optimizers (a
factory returning a list) are ``Optimizers``: one object the runner, the LR
state and the checkpoint files treat as a single optimizer.

The unit of the controller (coverage, cadence quotas, ``global_step``) stays the
batch. An optimizer step's place among all ranks' steps is the global batch count
at its accumulation's start divided by ``accumulate_grad_batches``: exact while
accumulations end on window boundaries, which the runner keeps (docs/task.md).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import warnings
from collections.abc import Callable
from typing import Any

import torch

from ..checkpoint.files import CheckpointError
from ..errors import TaskError
from ..task import PRECISIONS, Task
from .handle import LrState


class Optimizers:
    """Several optimizers stepped, zeroed, scheduled and saved as one.

    ``param_groups`` are every optimizer's groups in order (the LR state scales
    them all); ``state_dict`` numbers their parameters on from one optimizer to
    the next, so the bundle's ``.optim`` file holds them as one optimizer would.
    """

    def __init__(self, optimizers: list[torch.optim.Optimizer]) -> None:
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict[Any, dict[str, Any]]:
        return {p: s for o in self.optimizers for p, s in o.state.items()}

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def state_dict(self) -> dict[str, Any]:
        groups: list[dict[str, Any]] = []
        state: dict[int, Any] = {}
        offset = 0
        for o in self.optimizers:
            sd = o.state_dict()
            groups.extend({**g, "params": [i + offset for i in g["params"]]} for g in sd["param_groups"])
            state.update({i + offset: s for i, s in sd["state"].items()})
            offset += sum(len(g["params"]) for g in sd["param_groups"])
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        groups, state = state_dict["param_groups"], state_dict["state"]
        at = offset = 0
        for o in self.optimizers:
            mine = groups[at : at + len(o.param_groups)]
            at += len(o.param_groups)
            count = sum(len(g["params"]) for g in mine)
            o.load_state_dict(
                {
                    "param_groups": [{**g, "params": [i - offset for i in g["params"]]} for g in mine],
                    "state": {i - offset: s for i, s in state.items() if offset <= i < offset + count},
                }
            )
            offset += count


def build_optimizer(task: Task, model: torch.nn.Module) -> tuple[Any, list[torch.optim.Optimizer]]:
    """Call the task's optimizer factory: (what the runner steps, the optimizers in it).

    Raises:
        TaskError: an empty list, or two optimizers sharing a parameter (it would step twice).
    """
    made = task.optimizer(model)
    if not isinstance(made, list | tuple):
        return made, [made]
    optimizers = list(made)
    if not optimizers or not all(isinstance(o, torch.optim.Optimizer) for o in optimizers):
        raise TaskError(f"Task.optimizer must return an optimizer or a non-empty list of them, got {made!r}")
    seen: set[int] = set()
    for o in optimizers:
        for g in o.param_groups:
            for p in g["params"]:
                if id(p) in seen:
                    raise TaskError("Task.optimizer: two of its optimizers hold the same parameter (it would step twice)")
                seen.add(id(p))
    return Optimizers(optimizers), optimizers


def needs_update(task: Task) -> bool:
    """Does the task ask for more than the plain step?"""
    return task.accumulate_grad_batches > 1 or task.precision != "32" or task.scheduler is not None


def check_precision(precision: str, device: torch.device) -> None:
    """Refuse, naming the field, a precision this torch cannot autocast on ``device``."""
    dtype = PRECISIONS[precision]
    if dtype is None:
        return
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # torch warns, and runs in full precision, on a dtype it cannot autocast
            with torch.autocast(device.type, dtype=dtype):
                pass
    except Exception as exc:
        raise TaskError(f"Task.precision {precision!r} is not supported on {device.type} by torch {torch.__version__}: {exc}") from None


class Update:
    """Accumulation, autocast, GradScaler and schedulers around one rank's optimizer steps."""

    def __init__(
        self,
        task: Task,
        optimizer: Any,
        optimizers: list[torch.optim.Optimizer],
        device: torch.device,
        lr: LrState,
        *,
        forward: Callable[[Any], torch.Tensor],
        grads_ready: Callable[[], None],
    ) -> None:
        check_precision(task.precision, device)
        self.n = task.accumulate_grad_batches
        self.optimizer, self.optimizers, self.lr = optimizer, optimizers, lr
        self.forward, self.grads_ready = forward, grads_ready
        self.params = [p for g in optimizer.param_groups for p in g["params"]]
        dtype = PRECISIONS[task.precision]
        self.autocast = functools.partial(torch.autocast, device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext
        self.scaler = torch.amp.GradScaler(device.type) if dtype is torch.float16 else None
        self.global_interval = task.scheduler_interval == "global"
        self.schedulers = [make_scheduler(task.scheduler, o) for o in optimizers] if task.scheduler is not None else []
        self.at = 0  # scheduler steps taken
        self.mark: dict[str, Any] | None = None  # the schedulers at the current window's start ("global")
        self.pending = 0  # batches accumulated since the last optimizer step
        self.steps = 0  # this rank's optimizer steps
        self.skipped = 0  # fp16 steps the scaler skipped (inf/NaN gradients), not yet reported
        self.window_steps = 0  # optimizer steps since the last report
        self._scale = self.scaler.get_scale() if self.scaler is not None else 0.0

    # ---------------------------------------------------------------- steps

    def batch(self, batch: Any, global_step: int) -> torch.Tensor:
        """Forward and backward of one batch; the optimizer steps when it ends an accumulation.

        ``global_step``: all ranks' batches before this one. Returns the batch's loss, unscaled.
        """
        with self.autocast():
            loss = self.forward(batch)
        scaled = loss / self.n if self.n > 1 else loss
        if self.scaler is not None:
            scaled = self.scaler.scale(scaled)
        scaled.backward()
        self.pending += 1
        if self.pending == self.n:
            self.finish(global_step + 1)
        return loss

    def finish(self, global_step: int) -> None:
        """The optimizer step of the accumulation so far; ``global_step``: all ranks' batches including it.

        A partial one (the window's grants ended inside it) is flushed, not dropped: its
        gradients are rescaled to the mean over the batches it holds.
        """
        k, self.pending = self.pending, 0
        if k == 0:
            return
        if k < self.n:
            for p in self.params:
                if p.grad is not None:
                    p.grad.mul_(self.n / k)
        if self.scaler is not None:
            for o in self.optimizers:
                self.scaler.unscale_(o)  # clipping sees true gradients
        self.grads_ready()
        index = (global_step - k) // self.n  # this step's place among all ranks' optimizer steps
        if self.schedulers:
            self.catch_up(index)
        else:
            self.lr.apply(index)
        if self.scaler is None:
            self.optimizer.step()
        else:
            self._note_scale()  # the previous step's verdict (scaler.step syncs here anyway)
            for o in self.optimizers:
                self.scaler.step(o)
            self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        self.window_steps += 1

    def catch_up(self, index: int) -> None:
        """Step the schedulers until they stand at optimizer step ``index`` (``"global"``), or at
        this rank's own step count (``"rank"``); never backwards (``window_start`` rewinds).

        Stepping (rather than setting ``last_epoch``) is exact for every scheduler, including the
        chainable ones that compute each LR from the previous; it costs about 10 us a step, and
        under ``"global"`` a rank steps its schedulers once per optimizer step of any rank.
        """
        target = index if self.global_interval else self.steps
        if self.at >= target:
            return
        with warnings.catch_warnings():
            # a scheduler stepped before this process's first optimizer step (a joiner or a
            # resumed run catching up) is what we mean here, not the misuse torch warns of
            warnings.simplefilter("ignore", UserWarning)
            for _ in range(target - self.at):
                for s in self.schedulers:
                    s.step()
        self.at = target

    def window_start(self, global_step: int) -> None:
        """A window starts at ``global_step`` (all ranks' batches): under ``"global"`` every rank's
        schedulers stand at ``global_step // accumulate_grad_batches``, so all agree on the LR.

        The controller's count lags the window in flight (it plans a window ahead), so a rank
        may have stepped past it on its own batches: the schedulers rewind to where the previous
        window started (a state kept then) and step on from there. The LR then follows the
        global step exactly as ``lr_schedule(global_step)`` does.
        """
        if not (self.schedulers and self.global_interval):
            return
        target = global_step // self.n
        if self.mark is not None and self.mark["at"] <= target < self.at:
            self._restore(self.mark)
        self.catch_up(target)
        self.mark = self._snapshot()

    def _snapshot(self) -> dict[str, Any]:
        """Where the schedulers stand: their states and the LRs they set (chainable ones read them back)."""
        return {
            "at": self.at,
            "states": copy.deepcopy([s.state_dict() for s in self.schedulers]),
            "lrs": [float(g["lr"]) for g in self.optimizer.param_groups],
        }

    def _restore(self, mark: dict[str, Any]) -> None:
        for s, state in zip(self.schedulers, mark["states"], strict=True):
            s.load_state_dict(copy.deepcopy(state))
        for g, lr in zip(self.optimizer.param_groups, mark["lrs"], strict=True):
            g["lr"] = lr
        self.at = mark["at"]

    def window_end(self, global_step: int, *, flush: bool) -> None:
        """A window ends: settle the last step's skip verdict, and before an average (``flush``) step
        a partial accumulation. A solo rank carries it into its next window instead (nothing reads
        the replica in between), so its steps are exactly a single process's."""
        if flush:
            self.finish(global_step)
        if self.scaler is not None:
            self._note_scale()

    def _note_scale(self) -> None:
        """The scaler backs off (``backoff_factor`` < 1) exactly when it skipped a step."""
        assert self.scaler is not None
        scale = self.scaler.get_scale()
        if scale < self._scale:
            self.skipped += 1
        self._scale = scale

    def report(self, scalars: dict[str, list[float]], data: dict[str, int]) -> None:
        """fp16: the window's skipped steps, as a count (summary ``data``) and a rate (epoch records)."""
        if self.scaler is not None:
            data["amp_skipped_steps"] = self.skipped
            if self.window_steps:
                scalars["amp_skip_rate"] = [float(self.skipped), float(self.window_steps)]
        self.skipped = self.window_steps = 0

    # ---------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """Schedulers and scaler, for the bundle's ``.optim`` metadata (JSON)."""
        out: dict[str, Any] = {}
        if self.schedulers:
            # "global": where the window started (the resumed run steps on from there to its global step)
            out["schedulers"] = self.mark if self.mark is not None else self._snapshot()
        if self.scaler is not None:
            out["scaler"] = self.scaler.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what ``state_dict`` saved (a bundle without it keeps the fresh state)."""
        saved = state.get("schedulers")
        if self.schedulers and saved is not None:
            if len(saved["states"]) != len(self.schedulers):
                raise CheckpointError(f"the bundle holds {len(saved['states'])} schedulers' states, this task has {len(self.schedulers)}")
            self._restore(saved)
            self.mark = saved if self.global_interval else None
        if self.scaler is not None and "scaler" in state:
            self.scaler.load_state_dict(state["scaler"])
            self._scale = self.scaler.get_scale()


def make_scheduler(factory: Callable[[torch.optim.Optimizer], Any], optimizer: torch.optim.Optimizer) -> Any:
    """``Task.scheduler(optimizer)``, refused (naming the field) unless it is a steppable LR scheduler."""
    sched = factory(optimizer)
    if isinstance(sched, torch.optim.lr_scheduler.ReduceLROnPlateau):
        raise TaskError("Task.scheduler: ReduceLROnPlateau steps on a metric, not on steps; change the LR from epoch_fn instead")
    if not isinstance(sched, torch.optim.lr_scheduler.LRScheduler):
        raise TaskError(f"Task.scheduler must return a torch.optim.lr_scheduler.LRScheduler, got {type(sched).__name__}")
    return sched


def train_state(optimizers: list[torch.optim.Optimizer], update: Update | None, *, lr_base: list[float] | None = None) -> dict[str, Any]:
    """What a bundle's ``.optim`` file keeps beside the optimizer state: how its parameter groups split
    between the task's optimizers, the base LRs (before the LR factor and schedule: the groups' own
    LRs have both applied), and the schedulers' and scaler's state."""
    out: dict[str, Any] = {"optimizers": [len(o.param_groups) for o in optimizers]}
    if lr_base is not None:
        out["lr_base"] = list(lr_base)
    if update is not None:
        out.update(update.state_dict())
    return out
