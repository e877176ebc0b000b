"""The outer optimizer: a step on the averaged update, applied to each average before it lands.

Local SGD averages replicas: the average ``avg`` of a round replaces each
replica's values (a background average keeps the progress made since its
snapshot on top). With an outer optimizer the round's *pseudo-gradient*

    delta = anchor - avg        (anchor: the consensus the round started from)

is fed to an optimizer of its own, as DiLoCo does (arXiv 2311.08105):

* ``sgd``:      new = anchor - lr * delta             (lr 1: the plain average)
* ``sgd`` with momentum mu:  m = mu * m + delta; new = anchor - lr * m
* ``nesterov``: m = mu * m + delta; new = anchor - lr * (delta + mu * m)

and ``new`` lands instead of ``avg``, and becomes the next round's anchor.
Every rank computes the same step from the same average and the same state,
so the replicas stay alike without sending anything more; the state (anchor
and momentum) travels only where a rank's copy can differ or is missing: to a
joiner, across a regroup whose members disagree, and in a bundle.

``lr_factor`` multiplies the outer rate: with ``lr_scale_on = "average"`` the
run's LR factor (``1 + (W - 1) * lr_scale_ratio``) goes on the averaged update
instead of every local step (docs/cadence.md, *Combining replicas*).

Only parameter buckets take the outer step; floating buffers (BatchNorm
statistics) are averaged as they are. Pure tensor math, one bucket slice at a
time (the CPU backend lands an average slice by slice as it arrives).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..config.outer import OuterConfig

__all__ = ["OuterConfig", "OuterStep"]


class OuterStep:
    """The outer optimizer's state over a model's flat buckets, and its step on each average."""

    def __init__(self, config: OuterConfig, values: Sequence[torch.Tensor], params: Sequence[bool]) -> None:
        """``values``: each bucket's consensus values now (the first anchor); ``params``: which
        buckets hold parameters (the others are averaged as they are)."""
        self.config = config
        self.params = list(params)
        self.anchor = [v.detach().clone() if p else torch.empty(0) for v, p in zip(values, params, strict=True)]
        self.momentum: list[torch.Tensor] | None = None
        if config.kind == "nesterov" or config.momentum:
            self.momentum = [torch.zeros_like(a) for a in self.anchor]
        self.steps = 0  # averages stepped (for the summary and the bundle)

    def step_(self, bucket: int, average: torch.Tensor, start: int = 0, *, ranks: int = 1) -> None:
        """Turn ``average`` (bucket ``bucket``'s average at ``start``, a slice of it or all, of
        ``ranks`` ranks' replicas) into the outer step's result, in place, and move the anchor (and
        momentum) there."""
        if not self.params[bucket]:
            return
        cfg = self.config
        end = start + average.numel()
        anchor = self.anchor[bucket][start:end]
        with torch.no_grad():
            delta = anchor - average  # the pseudo-gradient
            if self.momentum is not None:
                m = self.momentum[bucket][start:end]
                m.mul_(cfg.momentum).add_(delta)
                if cfg.kind == "nesterov":
                    delta.add_(m, alpha=cfg.momentum)
                else:
                    delta = m.clone()
            anchor.sub_(delta, alpha=cfg.rate(ranks))
            average.copy_(anchor)

    def round_done(self) -> None:
        """A whole average was stepped (every bucket, every slice)."""
        self.steps += 1

    def rebase(self, values: Sequence[torch.Tensor], only: Sequence[bool] | None = None) -> None:
        """The consensus was set from outside the step (a broadcast, a joiner's adoption): it is the
        anchor now (``only``: of these buckets, an average of one fragment's; None: all)."""
        with torch.no_grad():
            for i, (anchor, v, p) in enumerate(zip(self.anchor, values, self.params, strict=True)):
                if p and (only is None or only[i]):
                    anchor.copy_(v.detach())

    # ------------------------------------------------------------ state

    def tensors(self) -> dict[str, torch.Tensor]:
        """The state as named tensors (a bundle's, or what a joiner is sent)."""
        out = {f"outer.anchor.{i}": a for i, (a, p) in enumerate(zip(self.anchor, self.params, strict=True)) if p}
        if self.momentum is not None:
            out.update({f"outer.momentum.{i}": m for i, (m, p) in enumerate(zip(self.momentum, self.params, strict=True)) if p})
        return out

    def load_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        """Take the state saved by ``tensors`` (missing momentum: zero, as a fresh one).

        Raises:
            ValueError: an anchor is missing or does not fit its bucket.
        """
        with torch.no_grad():
            for i, p in enumerate(self.params):
                if not p:
                    continue
                anchor = tensors.get(f"outer.anchor.{i}")
                if anchor is None or anchor.shape != self.anchor[i].shape:
                    raise ValueError(f"the outer optimizer's anchor of bucket {i} is missing or does not fit this model")
                self.anchor[i].copy_(anchor)
                if self.momentum is not None:
                    m = tensors.get(f"outer.momentum.{i}")
                    self.momentum[i].copy_(m) if m is not None and m.shape == self.momentum[i].shape else self.momentum[i].zero_()
