"""One round of a script rank's batch loop, run on the script's own thread.

The driver thread (``ScriptRank``'s runner) runs the rank: commands, windows,
averages, regroups, saves. A round of its batch loop (the batches between two
averages, ``Windows.round_steps``) is handed to the script's thread whole, and
``run.batches()`` runs it there: the rank's checks and bookkeeping between
batches (quota, stop, a landed average, a regroup, the step's records) run on
the script's thread between its batches, so a batch costs no thread switch
(two switches per batch cost ~10% of a 5 ms CPU step on a loaded host:
issue 18). The driver waits, blocked, until the round ends, and then gets its
outcome: None, or the error the loop raised (a stop, a lost peer), which it
raises where the loop would have raised it. Heartbeats and the stuck-script
watch stay on the link's own threads, as for every rank.

An epoch that ends inside a round is handed to the script as ``EPOCH_END``:
its code after ``for batch in run.batches()`` runs (watched as a callback is),
and the round goes on at the script's next ``run.batches()``. An epoch this
rank trains no batch of (its share of it was nothing) still begins (``EPOCH``)
and ends, in order, before the next batch's epoch.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from .bridge import BATCH, EPOCH, EPOCH_END, Item
from .data import to_device
from .round_loop import Due
from .step_meter import StepRecord

if TYPE_CHECKING:
    from .script_rank import ScriptRank, Stepped
    from .windows import Windows


class Raised:
    """A round that ended raising: the driver raises ``error`` (the loop's own exception)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


class InlineRound:
    """A round of the rank's batch loop, stepped one batch at a time by the script's thread."""

    def __init__(self, rank: ScriptRank, windows: Windows, steps: Generator[Due, list[StepRecord], None]) -> None:
        self.rank = rank
        self.windows = windows  # the rank's window training: its steps, epochs and the link they tell
        self.steps = steps
        self.due: Due | None = None  # the batch the loop gave, not yet trained
        self.records: list[StepRecord] | None = None  # the last trained batch's, for the loop
        self.t0 = 0.0  # the handed-out batch's step clock
        self.training = False  # a batch is out: the next call carries its step
        self.busy: str | None = None  # the script runs its code between epochs: the link's state to restore
        self.outcome: Raised | None = None  # once ended: None, or what the loop raised

    def next(self, stepped: Stepped | None) -> Item | None:
        """The script's next item (a batch, an epoch's end), running the rank's bookkeeping up to
        it; ``stepped`` is the last batch's step. None: the round ended (``outcome`` says how)."""
        rank, windows = self.rank, self.windows
        link = windows.link
        try:
            if self.training:
                self.training = False
                due, self.due = self.due, None
                assert due is not None and stepped is not None  # run.step is checked before the next batch
                loss = rank.stepped(stepped)
                self.records = windows.steps.ended(self.t0, loss, epoch=due.epoch, samples=due.samples, data_ms=due.data_ms)
            if self.due is None:
                records, self.records = self.records, None
                self.due = next(self.steps) if records is None else self.steps.send(records)
            due = self.due
            if self.busy is not None:  # the script's code between epochs is done: that epoch's reports go
                rank.epoch_ended(windows, self.busy)
                self.busy = None
            elif 0 <= windows.current_epoch < due.epoch:  # the script's epoch ends: its code after the batches runs
                self.busy = link.busy
                link.doing("callback")  # watched as epoch_fn is
                self.rank.fresh_norms(windows)  # that code may score or save the model
                return Item(EPOCH_END, epoch=windows.current_epoch)
            empty = windows.epoch_before(due.epoch)
            if empty is not None:  # an epoch this rank trains no batch of: it begins, and ends at the next call
                windows.enter_epoch(empty)
                return Item(EPOCH, epoch=empty)
            windows.enter_epoch(due.epoch)
            rank.norms_pass()
            self.t0 = windows.steps.begin()
            self.training = True
            # batches already where the model is (in memory, on the device) are handed as gathered
            replica = windows.replica
            return Item(BATCH, epoch=due.epoch, batch=due.batch if replica.resident else to_device(due.batch, replica.device))
        except StopIteration:
            return None
        except Exception as exc:  # the loop's (a stop, a lost peer, a failed average): the driver's to raise
            self.outcome = Raised(exc)
            return None

    def ended(self) -> Any:
        """What the driver gets once the round ended."""
        return self.outcome
