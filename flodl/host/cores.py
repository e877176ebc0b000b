"""Which CPU cores each rank of a host runs on, when GPU ranks and CPU ranks share the host.

A GPU rank's pace is its launch thread's: one Python thread that queues
kernels, and a prefetch thread that gathers the next batch. CPU ranks beside it
run OpenMP teams that take every core they are allowed, so the GPU rank's
threads wait for a core at every step (measured by users on an H100 host with
CPU ranks beside it: the GPU rank at 40-76% of its alone rate). Here each
accelerator rank gets cores of its own (``ACCELERATOR_CORES``, fewer when the
host is small), and the CPU ranks share the rest, each a contiguous block; the
worker pins every rank to its set (``FLODL_CPU_SET``) and the rank sizes its
intra-op threads to it (rank/runner.py ``cpu_threads``).

Only a host with both kinds is pinned: ranks of one kind share the cores as
before (a thread count each, no pinning). Pure logic: no processes, no clock.
"""

from __future__ import annotations

#: Cores each accelerator rank keeps to itself: its launch thread and its batch prefetcher.
ACCELERATOR_CORES = 2


def is_accelerator(device: str) -> bool:
    """A rank on a GPU (or another accelerator), not on the CPU."""
    return not device.startswith("cpu")


def core_plan(devices: list[str], cores: list[int]) -> list[list[int]] | None:
    """Each rank's cores (in ``devices`` order), or None: leave the ranks unpinned (one kind only,
    or fewer cores than ranks). Accelerator ranks first take ``ACCELERATOR_CORES`` each (one each
    when the CPU ranks would otherwise have less than one core apiece), then the CPU ranks split
    what is left in contiguous blocks, the first ones one core more when it does not divide."""
    accel = [i for i, d in enumerate(devices) if is_accelerator(d)]
    cpu = [i for i, d in enumerate(devices) if not is_accelerator(d)]
    free = sorted(cores)
    if not accel or not cpu or len(free) < len(devices):
        return None
    per_accel = ACCELERATOR_CORES
    while per_accel > 1 and len(free) - per_accel * len(accel) < len(cpu):
        per_accel -= 1
    plan: list[list[int]] = [[] for _ in devices]
    for n, i in enumerate(accel):
        plan[i] = free[n * per_accel : (n + 1) * per_accel]
    rest = free[per_accel * len(accel) :]
    base, extra = divmod(len(rest), len(cpu))
    at = 0
    for n, i in enumerate(cpu):
        size = base + (1 if n < extra else 0)
        plan[i] = rest[at : at + size]
        at += size
    return plan


def format_cores(cores: list[int]) -> str:
    """``[0, 1, 2, 5]`` as ``"0-2,5"`` (the form ``taskset -c`` and ``FLODL_CPU_SET`` take)."""
    parts: list[str] = []
    run: list[int] = []
    for c in sorted(cores):
        if run and c == run[-1] + 1:
            run.append(c)
            continue
        if run:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [c]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)


def parse_cores(text: str) -> list[int]:
    """``"0-2,5"`` as ``[0, 1, 2, 5]``.

    Raises:
        ValueError: not such a list.
    """
    out: list[int] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        low, dash, high = part.partition("-")
        first, last = int(low), int(high) if dash else int(low)
        if first < 0 or last < first:
            raise ValueError(f"a core list such as 0-3,8: {text!r}")
        out.extend(range(first, last + 1))
    return sorted(set(out))
