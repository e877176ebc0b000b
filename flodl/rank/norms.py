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

A ``Task`` re-estimates them on its eval rank before each eval (evaluation.py);
a script (script mode) before its code after an epoch's batches and before the
final bundle (script_rank.py), on every rank, since that code may score or save
the model.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.nn.modules.batchnorm import _BatchNorm


def norm_layers(model: torch.nn.Module) -> list[_BatchNorm]:
    """The model's BatchNorm layers that keep running statistics (none: nothing to re-estimate)."""
    return [m for m in model.modules() if isinstance(m, _BatchNorm) and m.track_running_stats]


def model_input(batch: Any) -> Any:
    """What the model is called with for ``batch``: its first element (``(x, y)`` batches), or the
    batch itself when it is one tensor.

    Raises:
        TypeError: a batch of another shape (a dict...), whose model input flodl cannot know.
    """
    if isinstance(batch, torch.Tensor):
        return batch
    if isinstance(batch, list | tuple) and batch:
        return batch[0]
    raise TypeError(f"cannot tell the model's input in a batch of type {type(batch).__name__} (not a tensor, list or tuple)")


def recalibrate(model: torch.nn.Module, layers: list[_BatchNorm], inputs: Iterable[torch.Tensor]) -> int:
    """Re-estimate ``layers``' running statistics from ``inputs`` (model inputs); returns batches used.

    The statistics are reset only once the first input is at hand, so an empty
    ``inputs`` leaves them as they were; an input or a forward pass that raises
    puts them back as they were before raising (a model that takes its input
    otherwise is left as training left it, not with reset statistics).
    """
    momenta = [m.momentum for m in layers]
    kept = [[b.detach().clone() for b in m.buffers(recurse=False)] for m in layers]
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
    except BaseException:
        with torch.no_grad():  # in place: the buffers may be views of the flat buckets (flat.py)
            for m, saved in zip(layers, kept, strict=True):
                for live, old in zip(m.buffers(recurse=False), saved, strict=True):
                    live.copy_(old)
        raise
    finally:
        for m, momentum in zip(layers, momenta, strict=False):
            m.momentum = momentum
        model.train(was_training)
    return used
