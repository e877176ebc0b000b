"""The step meter: a CPU rank's steps measured one by one, a GPU rank's in lagged groups."""

from __future__ import annotations

import math

import pytest
import torch

from flodl.rank.outcomes import NonFiniteLoss
from flodl.rank.step_meter import StepMeter

pytestmark = pytest.mark.timeout(60)


def test_a_cpu_step_is_measured_at_once():
    meter = StepMeter(torch.device("cpu"))
    t0 = meter.begin()
    [record] = meter.measured(t0, torch.tensor(0.25), epoch=2, step=7, samples=32, data_ms=0.5)
    assert (record.epoch, record.step, record.samples, record.loss, record.data_ms) == (2, 7, 32, 0.25, 0.5)
    assert record.compute_ms >= 0.0 and meter.pending == 0 and meter.drain() == []


def test_a_non_finite_cpu_loss_stops_the_step():
    meter = StepMeter(torch.device("cpu"))
    with pytest.raises(NonFiniteLoss, match="epoch 1, step 3"):
        meter.measured(meter.begin(), torch.tensor(math.nan), epoch=0, step=3, samples=1, data_ms=0.0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (on a host with a CUDA GPU these run)")
def test_gpu_steps_are_reported_in_groups_without_waiting_and_all_by_the_window_end():
    device = torch.device("cuda")
    meter = StepMeter(device)
    assert not meter.per_step
    out = []
    losses = [float(i) for i in range(100)]
    for step, value in enumerate(losses, start=1):
        t0 = meter.begin()
        loss = torch.tensor(value, device=device) * 1.0
        out += meter.measured(t0, loss, epoch=0, step=step, samples=4, data_ms=0.0, close=step == 1)
    out += meter.drain()
    assert [r.step for r in out] == list(range(1, 101)) and meter.pending == 0
    assert out[0].loss == 0.0  # the first step is a group of its own
    assert sum(r.loss for r in out) == pytest.approx(sum(losses))  # each group's mean, once per step
    assert all(r.compute_ms >= 0.0 for r in out)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (on a host with a CUDA GPU these run)")
def test_a_non_finite_gpu_loss_is_caught_by_the_window_end_at_the_latest():
    device = torch.device("cuda")
    meter = StepMeter(device)
    with pytest.raises(NonFiniteLoss):
        for step in range(1, 5):
            t0 = meter.begin()
            meter.measured(t0, torch.tensor(math.inf if step == 3 else 1.0, device=device), epoch=0, step=step, samples=1, data_ms=0.0)
        meter.drain()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (on a host with a CUDA GPU these run)")
def test_a_tensor_dataset_on_the_device_yields_the_same_batches_as_on_the_host():
    from torch.utils.data import TensorDataset

    from flodl.rank.data import BatchSource

    ds = TensorDataset(torch.arange(100).float().unsqueeze(1), torch.arange(100))
    grants = [[0, 0, 37], [0, 37, 30], [1, 0, 50]]  # a batch spans two grants; an epoch edge cuts one short
    host = list(BatchSource(ds, batch_size=16, seed=3).window_batches(grants))
    on_device = BatchSource(ds, batch_size=16, seed=3)
    on_device.place_on(torch.device("cuda"))
    gpu = list(on_device.window_batches(grants))
    assert len(host) == len(gpu)
    for (e1, p1, b1), (e2, p2, b2) in zip(host, gpu, strict=False):
        assert e1 == e2 and torch.equal(p1, p2) and p2.device.type == "cpu"  # the ledger's picks stay on the host
        assert all(t.device.type == "cuda" for t in b2) and all(torch.equal(a, b.cpu()) for a, b in zip(b1, b2, strict=False))


class _HeldEvent:
    """A stand-in CUDA event on a CPU: it has not passed until the test lets every event pass."""

    passed = False

    def record(self) -> None:
        pass

    def query(self) -> bool:
        return _HeldEvent.passed

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, other: object) -> float:
        return 1.0


def test_a_full_ring_reads_each_reused_slot_before_it_is_overwritten(monkeypatch):
    """More groups in flight than the pinned ring has slots: each slot is read before a new sum
    lands in it, so every group still reports its own loss (the device here is a stand-in: the
    ring's bookkeeping is host logic)."""
    import flodl.rank.step_meter as sm

    monkeypatch.setattr(sm, "RING", 3)
    monkeypatch.setattr(sm.torch.cuda, "Event", lambda enable_timing=True: _HeldEvent())
    monkeypatch.setattr(_HeldEvent, "passed", False)
    meter = StepMeter(torch.device("cpu"), per_step=False)
    meter._ring = torch.zeros(3)  # pinned memory needs CUDA; the slots' logic does not
    out = []
    for step in range(1, 9):  # one step per group: 8 groups through 3 slots
        out += meter.measured(meter.begin(), torch.tensor(float(step)), epoch=0, step=step, samples=1, data_ms=0.0, close=True)
    assert out == []  # nothing passed yet
    _HeldEvent.passed = True
    out = meter.drain()
    assert [r.loss for r in out] == [float(s) for s in range(1, 9)]
