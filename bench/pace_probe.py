"""The machine's pace right now: a fixed, small CPU workload, timed.

A shared VM's speed drifts with its neighbours: this project's 2-core dev VM
ran the probe below at 0.31 ms per step one morning and at 0.43–0.76 ms for
hours after, with no steal time reported and nothing else running. A ratio
taken across such a change (a 4:1 pair paced from a solo run measured before
it) is wrong, and nothing in the run's own numbers says so. So the matrix
probes the machine before every run and reports the spread
(``bench/matrix/report.py``), and this module tells you whether to start a long
bench at all:

    python -m bench.pace_probe        # one line: the probe's ms per step

The workload is a one-thread MLP training step (64-256-256-10, batch 32, SGD;
too few steps to reach subnormal floats), the best mean of a few short
repeats: small ops, like the matrix's sub-millisecond models, so it feels
what slows them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

STEPS = 300  # per repeat: about 0.1 s on a healthy core
REPEATS = 3
#: a run whose probe read this much over the suite's median ran on a slowed machine
SLOW_FACTOR = 1.15


def probe_ms(steps: int = STEPS, repeats: int = REPEATS) -> float:
    """The best mean step time (ms) over ``repeats`` runs of ``steps`` steps, on one thread
    (the caller's intra-op thread count is put back afterwards)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        gen = torch.Generator().manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.01)
        x, y = torch.randn(32, 64, generator=gen), torch.randint(0, 10, (32,), generator=gen)

        def timed(n: int) -> float:
            start = time.perf_counter()
            for _ in range(n):
                loss = torch.nn.functional.cross_entropy(model(x), y)
                opt.zero_grad()
                loss.backward()
                opt.step()
            return (time.perf_counter() - start) / n * 1e3

        timed(max(1, steps // 3))  # warm: allocator, first-call dispatch
        return min(timed(steps) for _ in range(repeats))
    finally:
        torch.set_num_threads(threads)


def spread(values: list[float]) -> dict | None:
    """``{min, median, max, slow}`` of some probes (``slow``: how many read over
    ``SLOW_FACTOR`` × the median), or None for none."""
    if not values:
        return None
    median = statistics.median(values)
    return {
        "min": min(values),
        "median": median,
        "max": max(values),
        "slow": sum(v > SLOW_FACTOR * median for v in values),
    }


def wait_for_pace(
    limit_ms: float,
    patience_s: float,
    *,
    probe: Callable[[], float] = probe_ms,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    say: Callable[[str], None] = print,
    every_s: float = 20.0,
) -> tuple[float, float]:
    """Probe until the machine reads at or under ``limit_ms``, or ``patience_s`` has passed (then
    the caller goes on at the pace there is, and the probe says so): ``(last probe, seconds waited)``.
    A long bench calls it before each run, so that it pauses through a slow patch of a shared VM
    instead of taking its ratios there."""
    start = clock()
    ms = probe()
    while ms > limit_ms and clock() - start < patience_s:
        say(
            f"  machine slow: probe {ms:.3f} ms > {limit_ms:.3f}; probing again in {every_s:.0f} s ({clock() - start:.0f}/{patience_s:.0f} s waited)"
        )
        sleep(every_s)
        ms = probe()
    return ms, clock() - start


def steady_run(
    run: Callable[[], T],
    limit_ms: float | None,
    patience_s: float,
    *,
    reruns: int = 2,
    probe: Callable[[], float] = probe_ms,
    wait: Callable[..., tuple[float, float]] = wait_for_pace,
    say: Callable[[str], None] = print,
) -> tuple[T, dict]:
    """``run()`` between two probes: ``(its result, {pace_probe_ms, pace_probe_after_ms,
    pace_waited_s, pace_reruns})``. With ``limit_ms``, the machine's pace is waited for before
    (``wait_for_pace``), and a run whose probe after reads over the limit is run again, up to
    ``reruns`` times (the last one is kept, its probes saying how slow it was): a slow patch
    that began during a run took part of its timing, and the probe before could not see it."""
    waited_total, rerun = 0.0, 0
    while True:
        if limit_ms:
            before, waited = wait(limit_ms, patience_s, probe=probe, say=say)
            waited_total += waited
        else:
            before = probe()
        result = run()
        after = probe()
        if not limit_ms or after <= limit_ms or rerun >= reruns:
            return result, {
                "pace_probe_ms": before,
                "pace_probe_after_ms": after,
                "pace_waited_s": waited_total,
                "pace_reruns": rerun,
            }
        rerun += 1
        say(
            f"  machine slowed during the run: probe {before:.3f} ms before, {after:.3f} after > {limit_ms:.3f}; running it again ({rerun}/{reruns})"
        )


def main() -> int:
    print(f"pace probe: {probe_ms():.3f} ms per step (1-thread MLP step, best of {REPEATS} x {STEPS})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
