"""The outer optimizer's step on the averaged update (flodl/rank/outer.py): pure tensor math
checked against torch's own SGD on the pseudo-gradient."""

from __future__ import annotations

import pytest
import torch

from flodl.rank.outer import OuterConfig, OuterStep

pytestmark = pytest.mark.timeout(30)


@pytest.mark.parametrize(
    ("kind", "lr", "momentum", "factor"),
    [("sgd", 1.0, 0.0, 1.0), ("sgd", 0.5, 0.0, 2.0), ("sgd", 0.7, 0.9, 1.0), ("nesterov", 0.7, 0.9, 1.0), ("nesterov", 0.5, 0.8, 3.0)],
)
def test_the_outer_step_is_torchs_sgd_on_the_pseudo_gradient(kind, lr, momentum, factor):
    g = torch.Generator().manual_seed(0)
    start = torch.randn(50, generator=g, dtype=torch.float64)
    buffer = torch.randn(7, generator=g, dtype=torch.float64)
    outer = OuterStep(OuterConfig(kind, lr, momentum, factor), [start, buffer], [True, False])
    ref = torch.nn.Parameter(start.clone())
    opt = torch.optim.SGD([ref], lr=lr * factor, momentum=momentum, nesterov=kind == "nesterov")
    for _ in range(5):
        average = ref.detach() + 0.1 * torch.randn(50, generator=g, dtype=torch.float64)  # where the replicas went
        ref.grad = ref.detach() - average  # the pseudo-gradient, from the anchor
        opt.step()
        # the average lands slice by slice (the CPU backend), the buffer bucket untouched
        got = average.clone()
        outer.step_(0, got[:20], 0)
        outer.step_(0, got[20:], 20)
        buf = buffer.clone()
        outer.step_(1, buf)
        outer.round_done()
        assert torch.allclose(got, ref.detach(), atol=1e-12) and torch.equal(buf, buffer)
    assert outer.steps == 5


def test_the_plain_average_is_no_step_and_the_state_round_trips():
    v = [torch.arange(4.0)]
    assert not OuterConfig().active and OuterConfig("none", 1.0, 0.0, 2.0).active  # the LR factor on the average
    outer = OuterStep(OuterConfig("nesterov", 0.7, 0.9), v, [True])
    avg = torch.ones(4)
    outer.step_(0, avg)
    other = OuterStep(OuterConfig("nesterov", 0.7, 0.9), [torch.zeros(4)], [True])
    other.load_tensors(outer.tensors())
    a, b = torch.full((4,), 2.0), torch.full((4,), 2.0)
    outer.step_(0, a)
    other.step_(0, b)
    assert torch.equal(a, b)  # the same state gives the same step: a joiner steps as its peers do
    with pytest.raises(ValueError, match="anchor of bucket 0"):
        other.load_tensors({})
