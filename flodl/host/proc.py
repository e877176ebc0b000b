"""Process hygiene: no orphan survives its parent, no child outlives a teardown.

``die_with_parent`` makes the kernel signal this process when its parent
dies (Linux ``PR_SET_PDEATHSIG``) and closes the race where the parent died
before the call. ``terminate_then_kill`` is the one teardown everybody uses:
SIGTERM, a grace period, SIGKILL. ``exit_now`` ends a rank without the
interpreter's teardown once everything it owes has been flushed.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import sys
from collections.abc import Sequence
from typing import Any, Protocol

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def die_with_parent(expected_parent: int, sig: int = signal.SIGTERM) -> None:
    """Ask the kernel to send ``sig`` when the parent exits; exit now if it already has.

    A no-op where ``prctl`` is unavailable (non-Linux); there the heartbeat
    timeout still ends the process.
    """
    if sys.platform.startswith("linux"):
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        except OSError:
            log.debug("prctl unavailable; relying on heartbeats")
    if expected_parent and os.getppid() != expected_parent:
        # the parent died between fork and prctl: nobody would ever signal us
        os._exit(1)


def pdeathsig_preexec(sig: int = signal.SIGTERM):
    """A ``preexec_fn`` that makes the child get ``sig`` when this process dies.

    For children that are not Python (ssh) and so cannot call
    ``die_with_parent`` themselves. libc is loaded here, in the parent:
    only the bare ``prctl`` call runs in the forked child.
    """
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
        if os.getppid() != parent:
            os._exit(1)  # the parent died between fork and prctl

    return preexec


class ChildProcess(Protocol):
    """What a supervisor uses of a child process: asyncio's handle, or a rank forked by the
    zygote (``host/zygote.ForkedChild``)."""

    @property
    def pid(self) -> int: ...
    @property
    def returncode(self) -> int | None: ...
    async def wait(self) -> int: ...
    def send_signal(self, sig: int) -> None: ...
    def kill(self) -> None: ...


async def terminate_then_kill(procs: Sequence[ChildProcess], grace_s: float) -> None:
    """SIGTERM every live process, wait up to ``grace_s``, SIGKILL the rest, reap all."""
    live = [p for p in procs if p.returncode is None]
    for p in live:
        _signal(p, signal.SIGTERM)
    if live:
        try:
            async with asyncio.timeout(grace_s):
                await asyncio.gather(*(p.wait() for p in live))
        except TimeoutError:
            for p in live:
                if p.returncode is None:
                    log.warning("pid %d ignored SIGTERM for %.1f s: SIGKILL", p.pid, grace_s)
                    _signal(p, signal.SIGKILL)
            await asyncio.gather(*(p.wait() for p in live))


def _signal(proc: ChildProcess, sig: int) -> None:
    try:
        proc.send_signal(sig)
    except ProcessLookupError:
        pass


async def nap(wake: asyncio.Event, timeout_s: float) -> None:
    """Sleep up to ``timeout_s``, cut short by ``wake`` (cleared first): an actor loop's
    pause between checks that a state change ends at once."""
    wake.clear()
    try:
        async with asyncio.timeout(timeout_s):
            await wake.wait()
    except TimeoutError:
        pass


#: How long ``exit_now`` lets ZeroMQ deliver what is still queued (the last report, ``Exiting``).
EXIT_FLUSH_S = 2.0


def exit_now(code: int) -> None:
    """Flush what this process owes the others, then leave without the interpreter's teardown.

    A rank's normal exit spends most of a second tearing down torch (gloo
    threads, allocator, module finalizers) after its work is done and said;
    every run and every test pays it per rank. Here ZeroMQ is given up to
    ``EXIT_FLUSH_S`` to deliver what is queued (``Context.destroy`` closes what
    is left with that linger and waits for the sends), logs and stdio are
    flushed, and the process ends at once. Files are already durable: bundles
    are fsynced before they are announced.
    """
    import threading

    try:
        import zmq

        ctx: zmq.Context[Any] = zmq.Context.instance()
        closer = threading.Thread(target=ctx.destroy, kwargs={"linger": int(EXIT_FLUSH_S * 1000)}, daemon=True)
        closer.start()
        closer.join(EXIT_FLUSH_S + 0.5)
    except Exception:  # noqa: BLE001 - leaving anyway: a flush that fails must not keep the process alive
        pass
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
