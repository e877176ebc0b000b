"""ResourceSampler: summary math on injected readings, device mapping, real host gauges, drivers."""

from __future__ import annotations

import asyncio
import math
import threading
import time

import pytest

from flodl.host.gauges import ResourceSampler, nvml_target

GPU_KEYS = {"gpu_util", "gpu_util_max", "vram_alloc", "vram_alloc_max", "vram_total"}


class FeedReader:
    """A ``read`` callable that returns queued readings, then the last one again."""

    def __init__(self, *readings: dict) -> None:
        self.readings = list(readings)
        self.calls = 0

    def __call__(self) -> dict:
        self.calls += 1
        return self.readings.pop(0) if len(self.readings) > 1 else self.readings[0]


def _fed(*readings: dict, **kw) -> ResourceSampler:
    return ResourceSampler(["cuda:0"], read=FeedReader(*readings), **kw)


def test_summary_means_maxes_and_lasts():
    s = _fed(
        {"gpu_util": 50.0, "vram_alloc": 1000, "vram_total": 8000, "cpu_util": 10.0, "rss_bytes": 100},
        {"gpu_util": 90.0, "vram_alloc": 3000, "vram_total": 8000, "cpu_util": 30.0, "rss_bytes": 300},
        {"gpu_util": 70.0, "vram_alloc": 2001, "vram_total": 8000, "cpu_util": 20.0, "rss_bytes": 200},
    )
    for _ in range(3):
        s.sample()
    assert s.summary() == {
        "gpu_util": pytest.approx(70.0),
        "gpu_util_max": 90.0,
        "vram_alloc": 2000,
        "vram_alloc_max": 3000,
        "vram_total": 8000,
        "cpu_util": pytest.approx(20.0),
        "rss_bytes": 200,
    }


def test_summary_resets_the_interval():
    s = _fed({"gpu_util": 10.0}, {"gpu_util": 30.0})
    s.sample()
    assert s.summary() == {"gpu_util": 10.0, "gpu_util_max": 10.0}
    assert s.summary() == {}  # no fresh reading ⇒ nothing, not zeros
    s.sample()
    assert s.summary() == {"gpu_util": 30.0, "gpu_util_max": 30.0}


def test_absent_keys_stay_absent_and_bad_values_are_skipped():
    s = _fed({"cpu_util": 40.0, "rss_bytes": 5}, {"cpu_util": math.nan, "gpu_util": math.inf, "bogus": 1.0})
    s.sample()
    s.sample()
    summary = s.summary()
    assert summary == {"cpu_util": 40.0, "rss_bytes": 5}
    assert isinstance(summary["rss_bytes"], int)


def test_a_failing_read_never_raises():
    def broken() -> dict:
        raise RuntimeError("NVML exploded")

    s = ResourceSampler(["cuda:0"], read=broken)
    s.sample()
    assert s.summary() == {}


def test_sample_stamps_the_injected_clock(clock):
    s = _fed({"cpu_util": 1.0}, clock=clock)
    assert s.last_sample_s is None
    clock.advance(3.0)
    s.sample()
    assert s.last_sample_s == clock()


def test_concurrent_samples_are_all_counted():
    s = _fed({"gpu_util": 1.0})
    workers = [threading.Thread(target=lambda: [s.sample() for _ in range(500)]) for _ in range(4)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=30)
    assert s._read.calls == 2000
    assert s.summary() == {"gpu_util": 1.0, "gpu_util_max": 1.0}


@pytest.mark.parametrize(
    ("device", "visible", "expected"),
    [
        ("cuda:1", None, 1),
        ("cuda:1", "3,5,7", 5),
        ("cuda:0", " 2 , 0 ", 2),
        ("cuda:3", "3,5,7", None),  # past the visible list
        ("cuda:0", "-1", None),
        ("cuda:0", "", None),
        ("cuda:0", "GPU-8a1b,GPU-ffff", "GPU-8a1b"),
        ("cuda:0", "MIG-1234", None),
        ("cpu", None, None),
        ("cuda:x", None, None),
    ],
)
def test_nvml_target_honours_cuda_visible_devices(device, visible, expected):
    assert nvml_target(device, visible) == expected


def _burn(seconds: float = 0.05) -> None:
    """Spend CPU so cpu_times() ticks (10 ms granularity) between two readings."""
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_real_machine_gives_host_gauges_and_no_gpu_keys():
    # No GPU (or no NVML) on this machine: the GPU device degrades to host-only gauges.
    with ResourceSampler(["cuda:0"], visible_devices="0") as s:
        _burn()
        s.sample()
        summary = s.summary()
    assert 0.0 <= summary["cpu_util"] <= 100.0
    assert summary["rss_bytes"] > 10 * 2**20
    assert not GPU_KEYS & summary.keys()


def test_real_process_cpu_and_children():
    with ResourceSampler([], process_cpu=True, include_children=True) as s:
        _burn()
        s.sample()
        summary = s.summary()
    assert summary["cpu_util"] >= 0.0 and summary["rss_bytes"] > 0


def _wait_for(predicate, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return False


def test_thread_samples_and_stops_promptly():
    s = _fed({"cpu_util": 5.0}, interval_s=10.0)  # long interval: stop must wake the wait
    thread = s.run_in_thread()
    assert _wait_for(lambda: s._read.calls >= 1)
    with pytest.raises(RuntimeError, match="already running"):
        s.run_in_thread()
    started = time.monotonic()
    assert s.stop(timeout_s=5.0)
    assert time.monotonic() - started < 1.0 and not thread.is_alive()
    assert s.summary()["cpu_util"] == 5.0


def test_thread_keeps_sampling_at_interval():
    s = _fed({"gpu_util": 1.0}, interval_s=0.01)
    s.run_in_thread()
    try:
        assert _wait_for(lambda: s._read.calls >= 3)
    finally:
        assert s.stop()


async def test_async_run_samples_off_loop_and_cancels():
    loop_thread = threading.get_ident()
    seen: list[int] = []

    def read() -> dict:
        seen.append(threading.get_ident())
        return {"cpu_util": 2.0}

    s = ResourceSampler([], read=read, interval_s=0.01)
    task = asyncio.create_task(s.run())
    async with asyncio.timeout(5):
        while len(seen) < 3:
            await asyncio.sleep(0.005)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert loop_thread not in seen
    assert s.summary()["cpu_util"] == 2.0


async def test_async_run_ends_on_stop():
    s = _fed({"cpu_util": 1.0}, interval_s=0.01)
    task = asyncio.create_task(s.run())
    async with asyncio.timeout(5):
        while s._read.calls < 1:
            await asyncio.sleep(0.005)
        s.stop()
        await task
