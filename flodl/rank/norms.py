"""Re-estimate the BatchNorm running statistics of an averaged model before it is scored.

Averaging replicas averages their BatchNorm running means and variances too, but
each replica measured those under its own weights, not under the averaged
weights: the averaged model would be scored with statistics that belong to no
model. The fewer the averages (Cadence, Async, unequal ranks), the further the
replicas drift and the worse that gets. Measured by ``bench/bn_recal.py``
(ResNet-20, 2 replicas at 4:1): after the 8th average, eval 87.3% with the
averaged statistics, 93.1% re-estimated; 25-33 points apart after the first three.

The remedy is the one SWA uses (``torch.optim.swa_utils.update_bn``): forward
passes in train mode over a few training batches, no gradients, every layer's
statistics reset and re-accumulated as a plain mean (``momentum=None``), then
each layer's momentum put back. Only the statistics change; no parameter does.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch.nn.modules.batchnorm import _BatchNorm


def norm_layers(model: torch.nn.Module) -> list[_BatchNorm]:
    """The model's BatchNorm layers that keep running statistics (none: nothing to re-estimate)."""
    return [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]


def recalibrate(model: torch.nn.Module, layers: list[_BatchNorm], inputs: Iterable[torch.Tensor]) -> int:
    """Re-estimate ``layers``' running statistics from ``inputs`` (model inputs); returns batches used.

    The statistics are reset only once the first input is at hand, so an empty
    ``inputs`` leaves them as they were.
    """
    momenta = [m.momentum for m in layers]
    was_training = model.training
    used = 0
    try:
        model.train()
        with torch.no_grad():
            for x in inputs:
                if used == 0:
                    for m in layers:
                        m.reset_running_stats()
                        m.momentum = None  # a plain mean over the batches seen
                model(x)
                used += 1
    finally:
        for m, momentum in zip(layers, momenta, strict=False):
            m.momentum = momentum
        model.train(was_training)
    return used
