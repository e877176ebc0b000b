"""A model's floating tensors packed into a few flat buffers, for averaging.

``FlatModel`` groups the model's parameters (group ``p``) and floating buffers
(group ``b``) by dtype and device into flat "buckets", and re-points each
tensor at its slice (the ``Parameter`` objects, and so the optimizer's state,
are untouched). An average is then a handful of operations on a handful of
buffers, whichever backend runs it. Every bucket carries one spare element
after its values, which the collective backend uses to add up the weights in
the same all-reduce.

With ``--sync-fragments F`` (docs/fragments.md) the parameters of each dtype
and device, in ``model.parameters()`` order, are cut into F contiguous runs of
equal length (``cuts``), the same on every rank since they depend on the model
alone: one bucket per run, fragment k the k-th run of each. An average of
fragment k is an average of its buckets, and every per-bucket state (a
compressed average's anchor and residuals, the outer optimizer's anchor and
momentum) moves only when its fragment is averaged. A tensor that a cut goes
through keeps its own storage and is copied in and out of the buckets it
spans around each average, as a cuDNN RNN's weights are. Floating buffers
belong to no fragment (``EVERY``): every average takes them.

Integer buffers (BatchNorm's ``num_batches_tracked``) are not packed:
averaging a counter is meaningless. cuDNN RNN weights keep their own packed
storage and are copied in and out around each average instead.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

PARAMS, BUFFERS = "p", "b"
#: The fragment of a bucket every average takes (floating buffers; all buckets with one fragment).
EVERY = -1


def cuts(numel: int, fragments: int) -> list[int]:
    """Where ``fragments`` runs of about equal length start in ``numel`` elements, and the end:
    fragment k is ``[cuts[k], cuts[k + 1])``. Pure arithmetic: every rank cuts the model alike."""
    return [k * numel // fragments for k in range(fragments + 1)]


@dataclass
class Averaged:
    """What one average cost and, when measured, how far this replica had drifted."""

    ms: float
    divergence: float | None = None
    pre_norm: float | None = None
    post_norm: float | None = None


@dataclass
class WireTally:
    """What this rank's averages put on the network, since the run began (either backend): bytes
    it sent and received (the collective's by a ring's count), and the averages they carried.
    Reported with every window (``gauges``: the record stream's ``res`` and the summary)."""

    sent: int = 0
    received: int = 0
    averages: int = 0
    broadcast: int = 0  # bytes of the consensus handed out whole (the run's start, joins): no average's
    # the most bytes one average sent (``--sync-fragments``: a fragment's, the peak a link must carry),
    # and where the one in progress started (``begin``)
    peak: int = 0
    _started: int = 0

    def begin(self) -> None:
        """An average starts: what the previous one sent is weighed for the peak."""
        self._close()
        self.averages += 1
        self._started = self.sent

    def _close(self) -> None:
        self.peak = max(self.peak, self.sent - self._started)

    def add(self, sent: int, received: int | None = None) -> None:
        """``sent`` bytes out and ``received`` in (a collective's: as many as it sent)."""
        self.sent += sent
        self.received += sent if received is None else received

    def mark(self) -> tuple[int, int]:
        return self.sent, self.received

    def set_aside(self, mark: tuple[int, int]) -> None:
        """What moved since ``mark`` was a broadcast of the consensus, not an average."""
        self.broadcast += self.sent - mark[0] + self.received - mark[1]
        self.sent, self.received = mark
        self._started = min(self._started, self.sent)

    def gauges(self) -> dict[str, int]:
        if not self.averages:
            return {}
        self._close()
        out = {"sync_sent_bytes": self.sent, "sync_recv_bytes": self.received, "sync_averages": self.averages, "sync_peak_bytes": self.peak}
        return out | ({"sync_broadcast_bytes": self.broadcast} if self.broadcast else {})


@dataclass
class Bucket:
    group: str  # PARAMS (averaged by batches) or BUFFERS (equal weight among ranks that trained)
    flat: torch.Tensor  # numel + 1 elements: the values, then a spare slot
    numel: int
    # tensors that keep storage of their own, copied in/out around averages: (tensor, offset in the
    # bucket, first element of the tensor, elements) (a cut goes through it, or a cuDNN RNN's)
    copied: list[tuple[torch.Tensor, int, int, int]]
    # tensors whose .data is a view of ``flat``: (tensor, offset), re-pointed by ``FlatModel.rehome``
    bound: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    fragment: int = EVERY  # the fragment whose averages take this bucket (EVERY: all of them)

    @property
    def values(self) -> torch.Tensor:
        return self.flat[: self.numel]

    def copy_in(self) -> None:
        for t, offset, start, n in self.copied:
            self.flat[offset : offset + n].copy_(t.detach().reshape(-1)[start : start + n])

    def copy_out(self) -> None:
        for t, offset, start, n in self.copied:
            t.detach().view(-1)[start : start + n].copy_(self.flat[offset : offset + n])


def _own_storage(model: torch.nn.Module) -> set[int]:
    """cuDNN RNNs pack their weights into one buffer of their own
    (``flatten_parameters``); re-pointing them at views of ours would make cuDNN
    re-compact them on every call."""
    return {id(p) for mod in model.modules() if isinstance(mod, torch.nn.RNNBase) for p in mod.parameters(recurse=False)}


class FlatModel:
    """The model's floating tensors as views into flat buckets."""

    def __init__(self, model: torch.nn.Module, fragments: int = 1) -> None:
        keep = _own_storage(model)
        self.fragments = fragments
        self.buckets: list[Bucket] = []
        for group, tensors in ((PARAMS, list(model.parameters())), (BUFFERS, [b for b in model.buffers() if b.is_floating_point()])):
            by_kind: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
            for t in tensors:
                by_kind.setdefault((t.dtype, t.device), []).append(t)
            for (dtype, device), same in by_kind.items():
                if group == PARAMS and fragments > 1:
                    self.buckets += self._cut(same, dtype, device, keep, fragments)
                else:
                    self.buckets.append(self._pack(group, same, dtype, device, keep))

    @staticmethod
    def _cut(tensors: list[torch.Tensor], dtype: torch.dtype, device: torch.device, keep: set[int], fragments: int) -> list[Bucket]:
        """One kind's parameters as ``fragments`` buckets, one run of ``cuts`` each (an empty run: none)."""
        at = cuts(sum(t.numel() for t in tensors), fragments)
        out = []
        for k in range(fragments):
            lo, hi = at[k], at[k + 1]
            if hi <= lo:
                continue
            flat = torch.empty(hi - lo + 1, dtype=dtype, device=device)
            copied, bound = [], []
            first = 0  # the tensor's first element in the kind's run of all
            with torch.no_grad():
                for t in tensors:
                    n = t.numel()
                    start, end = max(first, lo), min(first + n, hi)
                    if start < end:
                        flat[start - lo : end - lo].copy_(t.detach().reshape(-1)[start - first : end - first])
                        if id(t) in keep or end - start < n:  # a cut goes through it: storage of its own
                            copied.append((t, start - lo, start - first, end - start))
                        else:
                            t.data = flat[start - lo : end - lo].view_as(t)
                            bound.append((t, start - lo))
                    first += n
            out.append(Bucket(PARAMS, flat, hi - lo, copied, bound, fragment=k))
        return out

    @staticmethod
    def _pack(group: str, tensors: list[torch.Tensor], dtype: torch.dtype, device: torch.device, keep: set[int]) -> Bucket:
        numel = sum(t.numel() for t in tensors)
        flat = torch.empty(numel + 1, dtype=dtype, device=device)
        copied, bound = [], []
        offset = 0
        with torch.no_grad():
            for t in tensors:
                n = t.numel()
                flat[offset : offset + n].copy_(t.reshape(-1))
                if id(t) in keep:
                    copied.append((t, offset, 0, n))
                else:
                    # rebinding .data keeps the Parameter object (and optimizer state keys) intact
                    t.data = flat[offset : offset + n].view_as(t)
                    bound.append((t, offset))
                offset += n
        return Bucket(group, flat, numel, copied, bound)

    def rehome(self, index: int, storage: torch.Tensor) -> None:
        """Move bucket ``index`` into ``storage`` (numel + 1 elements of its dtype and device).

        The model's tensors are re-pointed at the new storage (``.data`` again,
        so Parameter objects and the optimizer's references stay valid); the
        old storage is freed once nothing else holds it.
        """
        bucket = self.buckets[index]
        if storage.shape != bucket.flat.shape or storage.dtype != bucket.flat.dtype or storage.device != bucket.flat.device:
            raise ValueError(f"bucket {index} needs {tuple(bucket.flat.shape)} {bucket.flat.dtype} on {bucket.flat.device}")
        with torch.no_grad():
            storage.copy_(bucket.flat)
            for t, offset in bucket.bound:
                t.data = storage[offset : offset + t.numel()].view_as(t)
        bucket.flat = storage

    def chosen(self, fragment: int | None) -> list[bool]:
        """Which buckets an average of ``fragment`` takes (None: a full average, every bucket)."""
        return [fragment is None or b.fragment in (EVERY, fragment) for b in self.buckets]

    @property
    def numel(self) -> int:
        return sum(b.numel for b in self.buckets)

    @property
    def nbytes(self) -> int:
        return sum(b.numel * b.flat.element_size() for b in self.buckets)

    def snapshot(self) -> list[torch.Tensor]:
        """Detached copies of every bucket's values (on the buckets' devices)."""
        out = []
        with torch.no_grad():
            for bucket in self.buckets:
                bucket.copy_in()
                out.append(bucket.values.detach().clone())
        return out


def model_digest(model: torch.nn.Module) -> str:
    """sha256 over the parameters' and floating buffers' bytes: equal replicas, equal digests."""
    h = hashlib.sha256()
    with torch.no_grad():
        for t in [*model.parameters(), *(b for b in model.buffers() if b.is_floating_point())]:
            values = t.detach().to("cpu").contiguous().reshape(-1)
            h.update(values.view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def drift(pre: list[torch.Tensor], post: list[torch.Tensor]) -> tuple[float | None, float, float]:
    """``(‖pre − post‖ / ‖post‖, ‖pre‖, ‖post‖)`` over all tensors (None if ‖post‖ ≈ 0)."""
    pre_sq = post_sq = diff_sq = 0.0
    with torch.no_grad():
        for a, b in zip(pre, post, strict=False):
            pre_sq += float(a.norm()) ** 2
            post_sq += float(b.norm()) ** 2
            diff_sq += float((a - b).norm()) ** 2
    post_norm = post_sq**0.5
    return ((diff_sq**0.5) / post_norm if post_norm > 1e-10 else None), pre_sq**0.5, post_norm
