"""A rank's line to the controller, kept alive by a thread of its own.

The training thread must never stall on the network and the network must
never stall on training: a background thread owns the DEALER socket. It
forwards frames the training thread queued (over an inproc pipe, already
signed), hands decoded commands back through a queue, beats every second
while the training thread computes or waits on a collective, and watches the
controller's own heartbeats.

No hang, ever: when the controller falls silent for the heartbeat timeout,
or orders an abort, the link tells the training thread, and if that thread
is stuck (in user code or a collective) past a grace period the link ends
the process itself with ``os._exit``.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import zmq

from ..errors import EXIT_CONTROLLER_LOST, EXIT_RANK_LOST, DeadlineExceeded, PeerLost
from ..probes import NONE, Probes
from ..wire.codec import FrameReader, FrameWriter
from ..wire.messages import EndWindow, Heartbeat, Regroup, RunEval, Shutdown, ShutdownWithSave, Window, WindowDone
from ..wire.transport import make_dealer
from .window_inbox import WindowInbox

log = logging.getLogger(__name__)

#: A rank beats twice a second (the controller and workers once): the controller judges a rank its peers
#: wait for by three missed beats (plan/progress.py ``WAITED_MIN_S``), so they must come this often.
HEARTBEAT_INTERVAL_S = 0.5
#: Lazy frames (per-batch reports) leave at least this often.
FLUSH_INTERVAL_S = 0.05
#: How long the training thread gets to wind down after an abort or a lost controller.
EXIT_GRACE_S = 3.0
SAVE_GRACE_S = 120.0  # a rank writing its checkpoint on the way out is not hung


class ControllerLink:
    """Owns the rank's socket on a background thread; used from the training thread."""

    def __init__(
        self,
        addr: str,
        *,
        secret: bytes,
        run_id: str,
        sender: str,
        silence_timeout_s: float,
        parent_pid: int = 0,
        exit_grace_s: float = EXIT_GRACE_S,
        probes: Probes = NONE,
    ) -> None:
        self.addr = addr
        self.sender = sender
        self.silence_timeout_s = silence_timeout_s
        self.parent_pid = parent_pid
        self.exit_grace_s = exit_grace_s
        self.writer = FrameWriter(secret, run_id, sender)
        self.reader = FrameReader(secret, run_id, name=sender, own=sender)  # our own frames reflected back: dropped
        self.commands: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._early: collections.deque[Any] = collections.deque()  # commands taken early (``take_eval``), in order
        self.windows = WindowInbox()  # windows in the order sent; reports kept to answer a re-sent window
        self.probes = probes  # tests: a lost Window or WindowDone (flodl/probes.py)
        self._lazy: collections.deque[bytes] = collections.deque()
        self.step = 0  # the training thread's step count (``progressed``), read by heartbeats
        # what the training thread is doing and when it last made progress in it (perf_counter):
        # heartbeats carry both, so the controller tells a thread stuck in user code from a busy one
        self.busy = "build"
        self.busy_since = time.perf_counter()
        self.step_ms = 0.0  # the recent slowest step (decays), for the controller's step deadline
        self.averaged = -1  # the generation of the last completed average (``averaged_in``)
        self._saving = False  # the training thread writes a checkpoint (``saving``, ``hold_exit``)
        self._saving_since: float | None = None
        self.lost: str | None = None  # why the controller is considered gone
        self.shutdown: Shutdown | ShutdownWithSave | None = None
        self.end_window = -1  # the highest window the controller asked to end
        self.evals_asked = 0  # RunEval commands received (the training thread takes them early)
        self.regroup: Regroup | None = None  # the newest membership change
        self._on_regroup: Callable[[Regroup], None] = lambda msg: None  # called on the link thread (``call_on_regroup``)
        self._ctx: zmq.Context[Any] = zmq.Context.instance()
        pipe = f"inproc://flodl-link-{id(self)}"
        self._pipe_in = self._ctx.socket(zmq.PAIR)
        self._pipe_in.setsockopt(zmq.LINGER, 0)
        self._pipe_in.bind(pipe)
        self._pipe_out = self._ctx.socket(zmq.PAIR)  # the training thread's end
        self._pipe_out.setsockopt(zmq.LINGER, 0)
        self._pipe_out.setsockopt(zmq.SNDHWM, 0)
        self._pipe_out.connect(pipe)
        self._beat_due = False
        self._queued = self._forwarded = 0  # frames sent through the pipe, and forwarded to the socket (``drain``)
        self._stop = threading.Event()
        self._done = threading.Event()  # the training thread finished its wind-down
        self._thread = threading.Thread(target=self._run, name="flodl-link", daemon=True)

    # ------------------------------------------------- training-thread side

    def start(self) -> None:
        self._thread.start()

    def send(self, msg: Any) -> None:
        """Sign ``msg`` and hand it to the link thread at once (never blocks)."""
        self._pipe_out.send(self.writer.encode(msg), copy=True)
        self._queued += 1

    def drain(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until the link thread has handed every frame sent so far to
        the socket, and a moment for ZeroMQ to write them (tests: a rank that dies right after a report)."""
        deadline = time.monotonic() + timeout_s
        while self._forwarded < self._queued and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(min(0.003, max(0.0, deadline - time.monotonic())))

    def send_report(self, report: WindowDone) -> None:
        """Send a window's report, and keep it: the controller sends the window again if a reset lost it."""
        self.windows.reported(report)
        if self.probes.reach("report") == "drop":
            return  # tests: lost on the way, as in a connection reset
        self.send(report)

    def send_lazy(self, msg: Any) -> None:
        """Sign ``msg`` and let it ride the link's next flush (at most FLUSH_INTERVAL_S).

        For per-batch reports: waking the link thread (and, through it, the
        controller) once per batch costs the training thread measurable time on
        small machines, while the controller only needs these at tens of hertz.
        ``deque.append`` is atomic, so no lock is taken.
        """
        self._lazy.append(self.writer.encode(msg))

    def next_command(self, timeout_s: float | None = None) -> Any:
        """Block for the next command from the controller.

        Raises:
            PeerLost: the controller went silent or the parent worker died.
            DeadlineExceeded: nothing arrived within ``timeout_s``.
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            if self.lost:
                raise PeerLost(self.lost)
            wait = 0.5 if deadline is None else min(0.5, deadline - time.monotonic())
            if wait <= 0:
                raise DeadlineExceeded(f"no command from the controller within {timeout_s:g} s")
            try:
                return self.commands.get(timeout=wait)
            except queue.Empty:
                continue

    def take_eval(self) -> RunEval | None:
        """The next ``RunEval`` queued, taken ahead of the commands queued before it (they keep
        their order: ``early_command``); None when none has arrived (never blocks)."""
        while True:
            try:
                cmd = self.commands.get_nowait()
            except queue.Empty:
                return None
            if isinstance(cmd, RunEval):
                return cmd
            self._early.append(cmd)

    def early_command(self) -> Any | None:
        """The first command ``take_eval`` took on its way to a ``RunEval`` (it goes before
        those still queued), or None."""
        return self._early.popleft() if self._early else None

    def doing(self, busy: str) -> None:
        """The training thread starts ``busy`` (progress.BUSY); its stall clock restarts."""
        self.busy_since = time.perf_counter()
        self.busy = busy

    def progressed(self, now: float, step_ms: float | None = 0.0, *, step: int) -> None:
        """The training thread finished its step number ``step`` at ``now`` (perf_counter); plain stores, no lock.
        ``step_ms`` None: no step's time is known yet (a GPU rank's are learnt a few steps late)."""
        self.step = step
        self.busy_since = now
        if step_ms is None:
            return
        if step_ms > self.step_ms:
            self.step_ms = step_ms
        else:  # decay, so one slow outlier does not stretch the deadline for ever
            self.step_ms -= (self.step_ms - step_ms) * 0.01

    def beat_now(self) -> None:
        """Send a heartbeat at once (after a first average in a new generation: recovery is timed by it)."""
        self._beat_due = True

    def averaged_in(self, generation: int) -> None:
        """An average of ``generation`` completed: heartbeats carry it, and the first in a new
        generation is reported at once (the controller times the recovery by it)."""
        if self.averaged < generation:
            self.averaged = generation
            self.beat_now()

    def call_on_regroup(self, hook: Callable[[Regroup], None]) -> None:
        """Call ``hook(msg)`` on the link thread when a newer generation is announced (before
        the training thread sees it: it may have to break a collective NCCL would hang in)."""
        self._on_regroup = hook

    def hold_exit(self) -> None:
        """The training thread starts writing a checkpoint: an abort or a lost controller must
        not hard-exit the process mid-write (for up to SAVE_GRACE_S)."""
        self._saving = True

    @contextlib.contextmanager
    def saving(self) -> Iterator[None]:
        """``hold_exit`` while the block writes a checkpoint, and no longer."""
        self.hold_exit()
        try:
            yield
        finally:
            self._saving = False

    @property
    def must_stop(self) -> bool:
        """True once the controller is gone or ordered an abort: stop at the next batch."""
        return self.lost is not None or (self.shutdown is not None and self.shutdown.abort)

    @property
    def ending(self) -> bool:
        """True once the controller is gone or sent a Shutdown of any kind: no new group is worth
        building (a peer that read the Shutdown first leaves instead of coming)."""
        return self.lost is not None or self.shutdown is not None

    def close(self, flush_s: float = 2.0) -> None:
        """Flush queued frames (bounded), stop the thread, close the sockets."""
        self._done.set()
        self._stop.set()
        self._thread.join(timeout=flush_s + 1.0)
        self._pipe_out.close(linger=0)

    # ---------------------------------------------------------- link thread

    def _run(self) -> None:
        dealer = make_dealer(self._ctx, self.addr)
        poller = zmq.Poller()
        poller.register(dealer, zmq.POLLIN)
        poller.register(self._pipe_in, zmq.POLLIN)
        last_heard: float | None = None  # the silence clock starts with the controller's first frame (below)
        next_beat = 0.0
        give_up_at: float | None = None
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(int(FLUSH_INTERVAL_S * 1000)))
                now = time.monotonic()
                self._flush_lazy(dealer)  # first: they were queued before any urgent frame now waiting
                if self._pipe_in in events:
                    self._forward(dealer)
                if dealer in events and self._receive(dealer):
                    last_heard = now
                if now >= next_beat or self._beat_due:
                    self._beat_due = False
                    self._beat(dealer)
                    next_beat = now + HEARTBEAT_INTERVAL_S
                if self.lost is None:
                    self._check_alive(now, last_heard)
                if give_up_at is None and self.must_stop:
                    give_up_at = now + (0.0 if self._nothing_to_keep() else self.exit_grace_s)
                if give_up_at is not None and now >= give_up_at and not self._done.is_set() and not self._saving_past(now):
                    self._hard_exit()
            self._flush_lazy(dealer)  # flush what the training thread queued last
            self._forward(dealer)
        finally:
            dealer.close(linger=1000)  # ZeroMQ keeps sending the flushed frames up to 1 s
            self._pipe_in.close(linger=0)

    def _forward(self, dealer: zmq.Socket) -> None:
        while True:
            try:
                frame = self._pipe_in.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            try:
                dealer.send(frame, zmq.NOBLOCK)
            except zmq.Again:
                log.warning("controller link full: dropped a frame")
            self._forwarded += 1

    def _flush_lazy(self, dealer: zmq.Socket) -> None:
        while self._lazy:
            try:
                dealer.send(self._lazy.popleft(), zmq.NOBLOCK)
            except zmq.Again:
                log.warning("controller link full: dropped a report")

    def _receive(self, dealer: zmq.Socket) -> bool:
        heard = False
        while True:
            try:
                frame = dealer.recv(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return heard
            env = self.reader.read(frame, "controller")
            if env is None:
                continue
            heard = True
            msg = env.msg
            if isinstance(msg, Heartbeat):
                continue
            if isinstance(msg, Regroup):
                # read by the training thread between batches or when its collective
                # fails; the hook lets it abort a collective NCCL would otherwise hang in
                if self.regroup is None or msg.generation > self.regroup.generation:
                    self.regroup = msg
                    self._on_regroup(msg)
                continue
            if isinstance(msg, EndWindow):
                # read by the training thread between batches, never queued: it
                # must not wait behind the window it is meant to end
                self.end_window = max(self.end_window, msg.window)
                continue
            if isinstance(msg, Window):
                self._sort_in(dealer, msg)
                continue
            if isinstance(msg, (Shutdown, ShutdownWithSave)):
                self.shutdown = msg
            self.commands.put(msg)
            if isinstance(msg, RunEval):
                # the training thread looks between batches and scores it at once, not after its window
                self.evals_asked += 1

    def _sort_in(self, dealer: zmq.Socket, window: Window) -> None:
        """A window goes to the training thread in the order sent; a copy of one already reported
        (the controller thinks a reset lost it) is answered with the report again."""
        if self.probes.reach("window") == "drop":
            return  # tests: lost on the way, as in a connection reset
        ready, again = self.windows.arrive(window)
        if again is not None:
            log.warning("%s: window %d came again: sending its report again", self.sender, window.window)
            try:
                dealer.send(self.writer.encode(again), zmq.NOBLOCK)
            except zmq.Again:
                pass  # the controller asks again
        for each in ready:
            self.commands.put(each)

    def _beat(self, dealer: zmq.Socket) -> None:
        busy = self.busy
        # idle too: how long it has waited for a command tells the controller a lost window (resend.py)
        stalled = max(0.0, time.perf_counter() - self.busy_since)
        beat = Heartbeat(step=self.step, sent_at=time.time(), busy=busy, busy_s=stalled, step_ms=self.step_ms, averaged=self.averaged)
        try:
            dealer.send(self.writer.encode(beat), zmq.NOBLOCK)
        except zmq.Again:
            pass

    def _check_alive(self, now: float, last_heard: float | None) -> None:
        # Before the controller's first frame (the rank still builds its task, which may take
        # longer than the heartbeat timeout) the rank relies on its worker, which watches the
        # controller and terminates its ranks when it goes, and on dying with that worker.
        if last_heard is not None and now - last_heard > self.silence_timeout_s:
            self.lost = f"heard nothing from the controller at {self.addr} for {now - last_heard:.1f} s"
        elif self.parent_pid and os.getppid() != self.parent_pid:
            self.lost = "its worker process is gone"
        if self.lost:
            log.error("%s: %s; stopping", self.sender, self.lost)

    def _saving_past(self, now: float) -> bool:
        """True while the training thread writes a checkpoint (bounded by SAVE_GRACE_S)."""
        if not self._saving:
            self._saving_since = None
            return False
        if self._saving_since is None:
            self._saving_since = now
        return now - self._saving_since < SAVE_GRACE_S

    def _nothing_to_keep(self) -> bool:
        """At an abort, nothing on this rank is worth the grace period: it is still building its task
        (the user's factory, torch's import), and would not look for the order before it is done; or
        it is built but has not trained a step (joining its group, waiting for a peer that failed)
        and the order saves nothing (a plain ``Shutdown``). It goes at once rather than racing its
        worker's own grace of the same length."""
        return self.busy == "build" or (self.step == 0 and isinstance(self.shutdown, Shutdown))

    def _hard_exit(self) -> None:
        code = EXIT_CONTROLLER_LOST if self.lost else EXIT_RANK_LOST
        if self.busy == "build":
            log.info("%s: the run stopped while this rank built its task; exiting", self.sender)
        elif self._nothing_to_keep():
            log.info("%s: the run stopped before this rank trained; exiting", self.sender)
        else:
            log.error("%s: training thread did not stop within %.1f s; exiting", self.sender, self.exit_grace_s)
        logging.shutdown()
        os._exit(code)
