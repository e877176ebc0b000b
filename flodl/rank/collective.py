"""Parameter averaging through torch.distributed (the collective backend).

``build_group`` makes the rank's process group straight from the
controller's TCPStore, under a per-generation key prefix, without touching
torch's global default group, so a later membership generation can build a
fresh group without restarting the process. NCCL on CUDA devices, gloo
otherwise ("Nccl" modes mean this collective backend).

``FlatAverager`` packs the model's floating parameters and buffers into one
flat buffer per dtype, rebinding each tensor as a view into it. Averaging is
then one in-place all-reduce per dtype with no copies: every buffer carries
one extra slot for the rank's weight, so a single collective returns both
the weighted sum and the sum of weights. A rank that trained nothing since
the last average joins with weight 0 and simply receives the result.
"""

from __future__ import annotations

import datetime
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


def backend_for(device: torch.device) -> str:
    """``nccl`` for CUDA devices, ``gloo`` for everything else."""
    return "nccl" if device.type == "cuda" else "gloo"


def build_group(
    *,
    store_host: str,
    store_port: int,
    prefix: str,
    rank: int,
    world_size: int,
    device: torch.device,
    timeout_s: float,
) -> dist.ProcessGroup:
    """Join this generation's process group through the controller's store.

    Raises:
        RuntimeError: the group could not form within ``timeout_s`` (a peer
            never arrived); torch's own error text is kept.
    """
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(store_host, store_port, is_master=False, timeout=timeout, wait_for_workers=False)
    pstore = dist.PrefixStore(prefix, store)
    if backend_for(device) == "nccl":
        opts = dist.ProcessGroupNCCL.Options()
        opts._timeout = timeout
        return dist.ProcessGroupNCCL(pstore, rank, world_size, opts)
    return dist.ProcessGroupGloo(pstore, rank, world_size, timeout)


@dataclass
class Averaged:
    """What one average cost and, when measured, how far this replica had drifted."""

    ms: float
    divergence: float | None = None
    pre_norm: float | None = None
    post_norm: float | None = None


@dataclass
class _Bucket:
    flat: torch.Tensor  # n + 1 elements: the tensors' values, then the weight slot
    numel: int
    # tensors that cannot live in ``flat`` (they keep storage of their own) and
    # are copied in before and out after each average: (tensor, offset)
    copied: list[tuple[torch.Tensor, int]]


def _own_storage(model: torch.nn.Module) -> set[int]:
    """Tensors that must keep their own storage: cuDNN RNNs pack their weights
    into one buffer of their own (``flatten_parameters``); re-pointing them at
    views of ours would make cuDNN re-compact them on every call."""
    return {id(p) for mod in model.modules() if isinstance(mod, torch.nn.RNNBase) for p in mod.parameters(recurse=False)}


class FlatAverager:
    """Weighted in-place averaging of a model's floating tensors over a group.

    Integer buffers (such as BatchNorm's ``num_batches_tracked``) stay local:
    averaging a counter is meaningless. With no group (one rank) nothing is
    touched at all.
    """

    def __init__(self, model: torch.nn.Module, group: dist.ProcessGroup | None) -> None:
        self.group = group
        self.buckets: list[_Bucket] = []
        if group is None:
            return
        keep = _own_storage(model)
        tensors = [p for p in model.parameters()] + [b for b in model.buffers() if b.is_floating_point()]
        by_dtype: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for t in tensors:
            by_dtype.setdefault((t.dtype, t.device), []).append(t)
        for (dtype, device), group_tensors in by_dtype.items():
            self.buckets.append(self._flatten(group_tensors, dtype, device, keep))

    @staticmethod
    def _flatten(tensors: list[torch.Tensor], dtype: torch.dtype, device: torch.device, keep: set[int]) -> _Bucket:
        numel = sum(t.numel() for t in tensors)
        flat = torch.empty(numel + 1, dtype=dtype, device=device)
        copied = []
        offset = 0
        with torch.no_grad():
            for t in tensors:
                n = t.numel()
                flat[offset : offset + n].copy_(t.reshape(-1))
                if id(t) in keep:
                    copied.append((t, offset))
                else:
                    # rebinding .data keeps the Parameter object (and optimizer state keys) intact
                    t.data = flat[offset : offset + n].view_as(t)
                offset += n
        return _Bucket(flat, numel, copied)

    @staticmethod
    def _copy_in(bucket: _Bucket) -> None:
        for t, offset in bucket.copied:
            bucket.flat[offset : offset + t.numel()].copy_(t.reshape(-1))

    @staticmethod
    def _copy_out(bucket: _Bucket) -> None:
        for t, offset in bucket.copied:
            t.copy_(bucket.flat[offset : offset + t.numel()].view_as(t))

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buckets)

    def broadcast_from(self, root: int = 0) -> None:
        """Make every replica equal to ``root``'s (start of training)."""
        if self.group is None:
            return
        with torch.no_grad():
            for bucket in self.buckets:
                self._copy_in(bucket)
                self.group.broadcast(bucket.flat, root).wait()
                self._copy_out(bucket)

    def average(self, weight: float, *, measure: bool = False) -> Averaged:
        """Replace every replica's tensors by the weight-averaged ones.

        With ``measure`` the replica's drift is reported too:
        ``‖pre − post‖ / ‖post‖`` over all averaged tensors (one copy of them).

        Raises:
            RuntimeError: the collective failed (a peer died) or timed out.
        """
        if self.group is None:
            return Averaged(0.0, 0.0 if measure else None)
        collective_ms = 0.0  # what ElChe weighs against compute: the collective, not our bookkeeping
        diff_sq = pre_sq = post_sq = 0.0
        with torch.no_grad():
            for bucket in self.buckets:
                self._copy_in(bucket)
                values, slot = bucket.flat[: bucket.numel], bucket.flat[bucket.numel :]
                # the drift needs the pre-average values; a zero-weight rank needs
                # them too, in case every rank had zero weight and there is no average
                pre = values.clone() if measure or weight == 0 else None
                if weight != 1.0:
                    values.mul_(weight)
                slot.fill_(weight)
                start = time.perf_counter()
                self.group.allreduce([bucket.flat]).wait()
                total = float(slot.item())
                collective_ms += (time.perf_counter() - start) * 1000.0
                if total > 0:
                    values.div_(total)
                elif pre is not None:
                    values.copy_(pre)
                self._copy_out(bucket)
                if measure:
                    pre_sq += float(pre.norm()) ** 2
                    post_sq += float(values.norm()) ** 2
                    diff_sq += float(pre.sub_(values).norm()) ** 2
        if not measure:
            return Averaged(collective_ms)
        post = post_sq**0.5
        return Averaged(collective_ms, (diff_sq**0.5) / post if post > 1e-10 else None, pre_sq**0.5, post)

    def snapshot(self) -> list[torch.Tensor]:
        """Copies of the flat buffers (for tests and checkpoints)."""
        out = []
        for bucket in self.buckets:
            self._copy_in(bucket)
            out.append(bucket.flat[: bucket.numel].detach().clone())
        return out
