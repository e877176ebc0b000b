"""Staging tiers and the prefetcher: codec round-trips, budgets, the cascade, threads."""

from __future__ import annotations

import gc
import logging
import math
import os
import threading
import time
import traceback

import numpy as np
import psutil
import pytest
import torch

from flodl.rank import disk_stage, staging
from flodl.rank.disk_stage import DiskStage
from flodl.rank.prefetch import Prefetcher
from flodl.rank.sample_codec import SampleCodec
from flodl.rank.staging import (
    RamCache,
    TieredSamples,
    VramPool,
    ram_budget,
    sample_nbytes,
    vram_budget,
)

MiB = 1 << 20


def wait_until(predicate, timeout_s: float = 2.0) -> None:
    """Spin (yielding the GIL) until ``predicate()``; fail instead of hanging."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition never came true"
        time.sleep(0)


# ---------------------------------------------------------------- helpers


def same(a, b) -> bool:
    """Bit-exact equality of two samples, types included (NaNs compare by bits)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and _bits(a) == _bits(b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    if isinstance(a, np.generic):
        return a.dtype == b.dtype and a.tobytes() == b.tobytes()
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b, strict=False))
    if isinstance(a, dict):
        return list(a) == list(b) and all(same(a[k], b[k]) for k in a)
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


def _bits(t: torch.Tensor) -> bytes:
    t = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)  # compare bfloat16 by its bits
    return t.view(torch.uint8).numpy().tobytes()


def _samples() -> list:
    g = torch.Generator().manual_seed(0)
    base = torch.randn(6, 5, generator=g)
    return [
        torch.randn(3, 4, generator=g),
        torch.randn(2, 3, generator=g).to(torch.bfloat16),
        torch.randn(4, generator=g).to(torch.float16),
        torch.randn(3, generator=g, dtype=torch.complex64),
        torch.randn(2, generator=g, dtype=torch.complex128).conj(),
        torch.tensor([True, False, True]),
        torch.arange(-5, 5, dtype=torch.int8),
        torch.arange(10, dtype=torch.int64).reshape(2, 5),
        torch.tensor(3.5),  # 0-d
        torch.tensor(7, dtype=torch.uint8),
        torch.empty(0),
        torch.empty(0, 3, dtype=torch.int32),
        base.t(),  # non-contiguous
        base[::2, 1:4],  # strided view
        torch.tensor([float("nan"), float("inf"), -0.0]),
        np.arange(12, dtype=np.float32).reshape(3, 4),
        np.asfortranarray(np.arange(6, dtype=">i4").reshape(2, 3)),
        np.array(2.5),
        np.array([], dtype=np.int16),
        np.array(["ab", "c"]),
        np.int64(7),
        np.float32(1.25),
        0,
        -1,
        2**70,
        1.5,
        float("nan"),
        True,
        False,
        "héllo",
        "",
        b"\x00\xff",
        None,
        (torch.ones(2), 3),
        [1, [2.0, (None, "x")], ()],
        {"image": torch.rand(2, 2, generator=g), "label": 4, "meta": {"ids": [1, 2], "tag": b"z"}},
        {},
        [],
    ]


@pytest.mark.parametrize("sample", _samples(), ids=lambda s: type(s).__name__)
def test_codec_round_trip_is_bit_exact(sample):
    codec = SampleCodec()
    out = codec.decode(codec.encode(sample))
    if isinstance(sample, torch.Tensor):  # decoded tensors are plain, contiguous, on CPU
        assert out.is_contiguous() and not out.is_conj()
    assert same(sample, out)


def test_codec_decoded_tensors_own_their_memory():
    codec = SampleCodec()
    buf = bytearray(codec.encode((torch.arange(4.0), torch.ones(3, dtype=torch.int32))))
    a, b = codec.decode(buf)
    buf[:] = b"\xff" * len(buf)  # the caller reuses its read buffer
    assert a.tolist() == [0.0, 1.0, 2.0, 3.0] and b.tolist() == [1, 1, 1]


@pytest.mark.parametrize(
    "bad, named",
    [
        (object(), "builtins.object"),
        ({1: torch.ones(1)}, "dict key 1"),
        ([1, {"x": {3, 4}}], "builtins.set"),
        (torch.ones(2).to_sparse(), "sparse"),
        (np.array([None], dtype=object), "object"),
    ],
)
def test_codec_refuses_other_types_by_name(bad, named):
    with pytest.raises(TypeError) as err:
        SampleCodec().encode(bad)
    assert named in str(err.value)
    assert "stages tensors, numbers, strings and containers" in str(err.value)


def test_codec_rejects_truncated_frames():
    frame = SampleCodec().encode(torch.arange(100))
    with pytest.raises(ValueError):
        SampleCodec().decode(frame[:-10])


def test_sample_nbytes_counts_elements_not_storage():
    big = torch.zeros(1000, 256)
    assert sample_nbytes(big[3]) == sample_nbytes(torch.zeros(256))
    assert sample_nbytes((big[0], 1)) > 256 * 4
    assert sample_nbytes(np.zeros(10, dtype=np.float64)) >= 80


# ---------------------------------------------------------------- RAM / VRAM


def test_ram_cache_respects_its_budget_and_counts_exactly():
    per = sample_nbytes(torch.zeros(256))
    cache = RamCache(10 * per)
    taken = [cache.put(i, torch.full((256,), float(i))) for i in range(50)]
    assert taken == [True] * 10 + [False] * 40
    st = cache.stats()
    assert (st.items, st.bytes, st.puts_refused) == (10, 10 * per, 40)
    assert st.bytes <= cache.budget_bytes
    assert cache.get(3)[0].item() == 3.0 and cache.get(42) is None and cache.get(9) is not None
    st = cache.stats()
    assert (st.hits, st.misses, st.hit_rate) == (2, 1, 2 / 3)


def test_ram_cache_budget_zero_stores_nothing():
    cache = RamCache(0)
    assert not cache.put(0, 1) and cache.get(0) is None
    assert cache.stats().items == 0


def test_ram_cache_stores_compact_private_copies_of_views():
    big = torch.zeros(1000, 256)  # a dataset whose samples are rows of one tensor
    cache = RamCache(3 * sample_nbytes((big[0], 0)))
    for i in range(10):
        cache.put(i, (big[i], i))
    assert cache.stats().items == 3  # budgeted by the row, not the 1 MB storage
    row, label = cache.get(1)
    assert label == 1 and row.untyped_storage().data_ptr() != big.untyped_storage().data_ptr()
    big[1] += 5  # the dataset mutating its buffer does not reach the cache
    assert row.sum().item() == 0.0


def test_ram_cache_holds_every_kind_of_sample_exactly(monkeypatch):
    monkeypatch.setattr(staging, "_SLAB_BYTES", 256)  # force many slabs, and samples larger than one
    cache = RamCache(MiB)
    samples = [*_samples(), torch.arange(1000, dtype=torch.float64)]
    for i, s in enumerate(samples):
        assert cache.put(i, s) == (s is not None)
    for i, s in enumerate(samples):
        if s is not None:
            assert same(s.resolve_conj() if isinstance(s, torch.Tensor) else s, cache.get(i)), i


def test_ram_cache_pin_falls_back_without_cuda():
    cache = RamCache(MiB, pin=True)
    assert cache.pin is torch.cuda.is_available()
    assert cache.put(0, {"x": torch.ones(4), "n": np.ones(2)})
    assert cache.get(0)["x"].sum().item() == 4.0


def test_ram_cache_keeps_namedtuples_and_numpy():
    from collections import namedtuple

    Pair = namedtuple("Pair", "x y")
    cache = RamCache(MiB)
    cache.put(0, Pair(np.arange(3), torch.ones(1)))
    got = cache.get(0)
    assert isinstance(got, Pair) and got.x.tolist() == [0, 1, 2]


@pytest.fixture
def one_torch_thread():
    """Intra-op threads spin against other load and make 1 MiB fills 10-50x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_ram_cache_rss_is_bounded_by_its_budget(one_torch_thread):
    proc = psutil.Process()
    gc.collect()
    before = proc.memory_info().rss
    cache = RamCache(64 * MiB)
    for i in range(256):  # a 256 MiB flood of fresh, touched 1 MiB tensors
        cache.put(i, torch.full((MiB // 4,), float(i)))
    gc.collect()
    grew = proc.memory_info().rss - before
    assert cache.stats().bytes <= 64 * MiB
    assert cache.stats().items == 63  # 64 MiB minus per-tensor overheads
    assert grew <= 64 * MiB + 32 * MiB, f"RSS grew {grew / MiB:.1f} MiB"


def test_vram_pool_on_cpu_device_keeps_copies_under_budget():
    pool = VramPool(torch.device("cpu"), 4 * 64)
    src = torch.zeros(10, 8)
    assert pool.put(0, (src[0], "label"))
    x, label = pool.get(0)
    assert label == "label" and x.device.type == "cpu" and x.data_ptr() != src.data_ptr()
    taken = sum(pool.put(i, (src[i], "l")) for i in range(1, 10))
    assert taken == 3 and pool.stats().bytes == 4 * 64  # device bytes only, 64-byte aligned


def test_vram_budget_is_zero_off_cuda_and_with_the_kill_switch():
    cpu = torch.device("cpu")
    assert vram_budget(cpu, max_usage=0.9, gpu_ram_share=None, kill_switch=False) == 0
    assert vram_budget(torch.device("cuda"), max_usage=0.9, gpu_ram_share=None, kill_switch=True) == 0
    assert vram_budget(cpu, max_usage=0.9, gpu_ram_share=0.5, kill_switch=False) == 0


def test_vram_budget_math_with_faked_cuda(monkeypatch):
    gib = 1 << 30
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (30 * gib, 80 * gib))
    dev = torch.device("cuda", 0)
    # 90% of 80 GiB = 72 GiB ceiling, 50 GiB already used -> 22 GiB left
    assert vram_budget(dev, max_usage=0.9, gpu_ram_share=None, kill_switch=False) == int(0.9 * 80 * gib) - 50 * gib
    assert vram_budget(dev, max_usage=0.5, gpu_ram_share=None, kill_switch=False) == 0  # over the ceiling already
    monkeypatch.setattr(psutil, "virtual_memory", lambda: type("VM", (), {"total": 128 * gib})())
    assert vram_budget(dev, max_usage=0.9, gpu_ram_share=0.5, kill_switch=False) == 14 * gib


def test_ram_budget_math():
    assert ram_budget(0.5, 4, available=8000) == 1000
    assert ram_budget(0.5, 1, available=8000) == 4000
    assert ram_budget(0.0, 1, available=8000) == 0
    assert ram_budget(0.5, 0, available=10) == 5
    assert 0 < ram_budget(0.1, 1) <= psutil.virtual_memory().total


# ---------------------------------------------------------------- disk


def _fd_targets() -> list[str]:
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return out


def _holds(path: str) -> bool:
    """Whether this process still holds the (unlinked) pack file open."""
    return any(t.startswith(path) for t in _fd_targets())


pytestmark_linux = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")


def test_disk_stage_round_trips_many_samples(tmp_path):
    samples = {i: s for i, s in enumerate(_samples()) if s is not None}
    disk = DiskStage(str(tmp_path), 16 * MiB)
    for i, s in samples.items():
        assert disk.put(i, s), i
    for i, s in reversed(samples.items()):
        assert same(s, disk.get(i)), i
    st = disk.stats()
    assert st.items == len(samples) and st.hits == len(samples) and st.misses == 0
    assert disk.get(10_000) is None and disk.stats().misses == 1
    disk.close()


def test_disk_stage_refuses_beyond_budget(tmp_path):
    one = len(SampleCodec().encode(torch.zeros(256)))
    disk = DiskStage(str(tmp_path), 3 * one + 10)
    assert [disk.put(i, torch.zeros(256)) for i in range(5)] == [True, True, True, False, False]
    st = disk.stats()
    assert st.bytes == 3 * one <= disk.budget_bytes and st.puts_refused == 2
    disk.close()


def test_disk_stage_skips_unencodable_samples_with_one_warning(tmp_path, caplog):
    disk = DiskStage(str(tmp_path), MiB)
    with caplog.at_level(logging.WARNING, logger="flodl.rank.staging"):
        assert not disk.put(0, {"x": {1, 2}})
        assert not disk.put(1, {"x": {3}})
    assert disk.put(2, 5) and disk.enabled
    assert len(caplog.records) == 1 and "builtins.set" in caplog.text
    disk.close()


@pytestmark_linux
def test_disk_stage_leaves_no_file_and_frees_it_on_close(tmp_path):
    disk = DiskStage(str(tmp_path), MiB)
    assert os.path.basename(disk.path).startswith("flodl-stage-")
    assert os.listdir(tmp_path) == []  # unlinked at once: nothing to leak, even on SIGKILL
    disk.put(0, torch.ones(10))
    assert _holds(disk.path)
    disk.close()
    assert not _holds(disk.path) and disk.get(0) is None and not disk.put(1, 1)
    disk.close()  # twice is fine


@pytestmark_linux
def test_disk_stage_frees_its_file_when_collected(tmp_path):
    disk = DiskStage(str(tmp_path), MiB)
    disk.put(0, torch.ones(10))
    path = disk.path
    del disk
    gc.collect()
    assert not _holds(path)


def test_disk_stage_in_a_missing_directory_is_off_with_a_warning(tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="flodl.rank.staging"):
        disk = DiskStage(str(tmp_path / "gone"), MiB)
    assert not disk.enabled and "disk stage off" in caplog.text
    assert not disk.put(0, 1) and disk.get(0) is None
    disk.close()


def test_disk_stage_write_error_turns_the_tier_off(tmp_path, monkeypatch, caplog):
    disk = DiskStage(str(tmp_path), MiB)
    assert disk.put(0, torch.ones(3))

    def full(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(disk_stage.os, "pwrite", full)
    with caplog.at_level(logging.WARNING, logger="flodl.rank.staging"):
        assert not disk.put(1, torch.ones(3))
        assert not disk.put(2, torch.ones(3))
        assert disk.get(0) is None
    assert not disk.enabled and len(caplog.records) == 1 and "No space left" in caplog.text
    assert disk.stats().bytes == 0


def test_disk_stage_read_error_turns_the_tier_off(tmp_path, monkeypatch, caplog):
    disk = DiskStage(str(tmp_path), MiB)
    disk.put(0, torch.ones(3))
    monkeypatch.setattr(disk_stage.os, "pread", lambda fd, n, off: b"\x00" * (n - 1))
    with caplog.at_level(logging.WARNING, logger="flodl.rank.staging"):
        assert disk.get(0) is None
    assert not disk.enabled and "short read" in caplog.text


def test_disk_stage_concurrent_reads(tmp_path):
    disk = DiskStage(str(tmp_path), 8 * MiB)
    for i in range(64):
        disk.put(i, torch.full((100,), i))
    bad = []

    def reader(seed: int) -> None:
        for k in range(300):
            i = (seed * 7 + k * 13) % 64
            if disk.get(i)[0].item() != i:
                bad.append(i)

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    assert not bad and disk.stats().hits == 1200
    disk.close()


# ---------------------------------------------------------------- the cascade


class Source:
    """A dataset that counts fetches; ``gate`` can hold fetches until released."""

    def __init__(self, n: int = 100, width: int = 64) -> None:
        self.width = width
        self.calls: list[int] = []
        self.lock = threading.Lock()
        self.gate: threading.Event | None = None
        self.n = n

    def __call__(self, i: int):
        if not 0 <= i < self.n:
            raise IndexError(f"no sample {i}")
        with self.lock:
            self.calls.append(i)
        if self.gate is not None:
            self.gate.wait(5)
        return torch.full((self.width,), float(i)), i


def _per(width: int = 64) -> int:
    return sample_nbytes((torch.zeros(width), 0))


def test_tiered_fills_the_first_tier_with_room_then_hits_it(tmp_path):
    src = Source()
    ram = RamCache(2 * _per())
    disk = DiskStage(str(tmp_path), MiB)
    tiers = TieredSamples(src, vram=None, ram=ram, disk=disk)
    for i in range(5):
        assert tiers.get(i)[1] == i
    assert ram.stats().items == 2 and disk.stats().items == 3
    for i in range(5):
        assert tiers.get(i)[1] == i
    assert src.calls == [0, 1, 2, 3, 4]  # the second pass never reached the source
    st = tiers.stats()
    assert st["ram"]["hits"] == 2 and st["disk"]["hits"] == 3 and st["source"]["fetches"] == 5
    assert st["vram"]["items"] == 0 and set(st) == {"vram", "ram", "disk", "source"}
    disk.close()


def test_tiered_looks_up_vram_then_ram_then_disk(tmp_path):
    src = Source()
    vram = VramPool(torch.device("cpu"), 1 << 20)
    ram = RamCache(1 << 20)
    disk = DiskStage(str(tmp_path), MiB)
    vram.put(0, ("v", 0))
    ram.put(0, ("r", 0))
    ram.put(1, ("r", 1))
    disk.put(1, ("d", 1))
    disk.put(2, ("d", 2))
    tiers = TieredSamples(src, vram=vram, ram=ram, disk=disk)
    assert [tiers.get(i)[0] for i in (0, 1, 2)] == ["v", "r", "d"]
    assert src.calls == []
    disk.close()


def test_tiered_promotes_disk_hits_when_there_is_room(tmp_path):
    src = Source()
    ram = RamCache(0)
    disk = DiskStage(str(tmp_path), MiB)
    tiers = TieredSamples(src, vram=None, ram=ram, disk=disk)
    tiers.get(7)
    assert disk.stats().items == 1
    ram.budget_bytes = MiB  # room appears (e.g. a rank left the host)
    tiers.get(7)
    tiers.get(7)
    assert ram.stats().items == 1 and disk.stats().hits == 1 and ram.stats().hits == 1
    disk.close()


def test_tiered_without_tiers_always_fetches_and_propagates_errors():
    src = Source(n=3)
    tiers = TieredSamples(src, vram=None, ram=None, disk=None)
    tiers.get(1)
    tiers.get(1)
    assert src.calls == [1, 1]
    with pytest.raises(IndexError, match="no sample 9"):
        tiers.get(9)
    assert tiers.stats()["source"] == {"fetches": 2, "shared": 0, "errors": 1}


def test_tiered_concurrent_gets_fetch_each_index_once():
    src = Source(n=50)
    ram = RamCache(MiB)
    tiers = TieredSamples(src, vram=None, ram=ram, disk=None)
    bad = []

    def worker(seed: int) -> None:
        for k in range(200):
            i = (seed * 11 + k * 7) % 50
            x, label = tiers.get(i)
            if label != i or x[0].item() != i:
                bad.append(i)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(5)
    st = tiers.stats()
    assert not bad
    # single-flight: with room in the tiers every index reaches the source exactly once,
    # and every get ends as one tier hit, one fetch or one shared result
    assert sorted(src.calls) == list(range(50))
    assert st["ram"]["hits"] + st["source"]["fetches"] + st["source"]["shared"] == 800


def test_tiered_waiters_share_one_inflight_fetch():
    src = Source()
    src.gate = threading.Event()
    tiers = TieredSamples(src, vram=None, ram=RamCache(MiB), disk=None)
    got = []
    threads = [threading.Thread(target=lambda: got.append(tiers.get(5)[1])) for _ in range(3)]
    for t in threads:
        t.start()
    wait_until(lambda: src.calls and tiers._inflight)  # the leader is inside fetch
    src.gate.set()
    for t in threads:
        t.join(5)
    assert got == [5, 5, 5] and src.calls == [5]


def test_tiered_followers_retry_when_the_leader_fails():
    calls = []
    gate = threading.Event()

    def flaky(i):
        calls.append(i)
        if len(calls) == 1:
            gate.wait(5)
            raise OSError("transient read error")
        return torch.ones(1), i

    tiers = TieredSamples(flaky, vram=None, ram=RamCache(MiB), disk=None)
    errors, got = [], []

    def lead():
        try:
            tiers.get(3)
        except OSError as exc:
            errors.append(exc)

    leader = threading.Thread(target=lead)
    leader.start()
    wait_until(lambda: calls)
    follower = threading.Thread(target=lambda: got.append(tiers.get(3)[1]))
    follower.start()
    gate.set()
    leader.join(5)
    follower.join(5)
    assert len(errors) == 1 and got == [3] and len(calls) == 2


# ---------------------------------------------------------------- prefetch


def test_prefetcher_keeps_order():
    with Prefetcher(iter(range(100)), depth=3) as items:
        assert list(items) == list(range(100))


def test_prefetcher_raises_at_the_failing_item_with_its_traceback():
    def produce():
        yield 0
        yield 1
        raise ValueError("sample 2 is broken")

    got = []
    with Prefetcher(produce()) as items, pytest.raises(ValueError, match="sample 2 is broken") as err:
        for x in items:
            got.append(x)
    assert got == [0, 1]
    assert "produce" in [f.name for f in traceback.extract_tb(err.value.__traceback__)]


def test_prefetcher_close_frees_a_producer_blocked_on_a_full_queue():
    finished = threading.Event()

    def endless():
        try:
            k = 0
            while True:
                yield k
                k += 1
        finally:
            finished.set()

    pf = Prefetcher(endless(), depth=2)
    assert next(pf) == 0
    start = time.monotonic()
    pf.close()
    assert time.monotonic() - start < 1.0
    assert not pf._thread.is_alive() and finished.is_set()
    with pytest.raises(StopIteration):
        next(pf)
    pf.close()


def test_prefetcher_wait_ms_measures_starvation():
    def slow():
        for k in range(3):
            time.sleep(0.02)  # a slow dataset
            yield k

    with Prefetcher(slow(), depth=2) as pf:
        assert list(pf) == [0, 1, 2]
    assert pf.wait_ms >= 40  # the consumer did nothing but wait for ~60 ms of reads


def test_prefetcher_wait_ms_uses_the_injected_clock():
    ticks = iter(range(0, 1000, 5))
    with Prefetcher(iter("ab"), clock=lambda: next(ticks)) as pf:
        assert list(pf) == ["a", "b"]
    assert pf.wait_ms == 3 * 5 * 1000  # three takes (two items, the end), 5 s each on the fake clock


def test_prefetcher_dropped_without_close_stops_its_thread():
    pf = Prefetcher(iter(range(10**9)), depth=1)
    thread = pf._thread
    assert next(pf) == 0
    del pf
    gc.collect()
    thread.join(1.0)
    assert not thread.is_alive()


def test_tiered_serves_a_sample_a_tier_fails_to_hold(caplog):
    class Broken(RamCache):
        def _copy(self, sample, room):
            raise RuntimeError("copy failed")

    src = Source()
    tiers = TieredSamples(src, vram=None, ram=Broken(MiB), disk=None)
    with caplog.at_level(logging.WARNING, logger="flodl.rank.staging"):
        assert tiers.get(1)[1] == 1 and tiers.get(2)[1] == 2
    assert len(caplog.records) == 1 and "copy failed" in caplog.text
    assert tiers._inflight == {} and tiers.stats()["source"]["fetches"] == 2
