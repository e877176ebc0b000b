"""The bulk plane's message shape: a signed header frame plus raw tensor frames.

Shared by the controller's averaging actor and the ranks. Tensors travel as
their raw bytes (one slice of one flat tensor per message, sent without copying), never
pickled and never inside msgpack; the header (a ``Snapshot`` or ``Update``
control frame, signed like every other) gives the model's layout and the
slice, and ``unpack_slice`` refuses any message whose frame disagrees with it,
naming the mismatch. Slicing keeps every end's in-flight memory to a few
slices per peer, whatever the model's size.

A bucket may also travel compressed (``--sync-compression``, quant.py): its
layout names the encoding (``int8-delta``, ``bfloat16-delta``) instead of a
dtype, each slice's frame is that slice's delta encoded on its own, and it is
read as bytes (uint8) for the receiver to decode.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..config.env import bulk_slice_bytes
from ..errors import ProtocolError
from .quant import BY_WIRE_NAME
from .shm import STATE_ROLE, checked_path

#: Floating dtypes a bulk frame may carry.
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float64": torch.float64,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
_NAMES = {v: k for k, v in DTYPES.items()}


def itemsize(name: str) -> int:
    """Bytes a value of layout entry ``name`` (a dtype, or an encoding) takes: slices are sized by it."""
    codec = BY_WIRE_NAME.get(name)
    return codec.itemsize if codec is not None else DTYPES[name].itemsize


def frame_bytes(name: str, count: int) -> int:
    """The bytes of a frame carrying ``count`` values of layout entry ``name``."""
    codec = BY_WIRE_NAME.get(name)
    return codec.nbytes(count) if codec is not None else count * DTYPES[name].itemsize


def dtype_name(dtype: torch.dtype) -> str:
    """Raises: ValueError for a dtype the bulk plane does not carry."""
    try:
        return _NAMES[dtype]
    except KeyError:
        raise ValueError(f"the bulk plane carries {sorted(DTYPES)}, not {dtype}") from None


def as_frame(t: torch.Tensor) -> memoryview:
    """The raw bytes of a contiguous CPU tensor, without copying (any dtype, bfloat16 included)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("bulk frames are contiguous CPU tensors")
    return memoryview(t.view(torch.uint8).numpy())  # type: ignore[arg-type]  # numpy's stubs: an ndarray is a buffer


#: A model travels as slices of at most this many bytes (both directions).
SLICE_BYTES = bulk_slice_bytes(8 << 20)  # FLODL_BULK_SLICE_BYTES: benchmarks and tuning only


#: ``ZMQ_MAXMSGSIZE`` of every bulk-plane socket: a message part is a header (a control frame, at
#: most the codec's 1 MiB) or one slice; libzmq closes a connection announcing a bigger part.
MAX_MSG_BYTES = SLICE_BYTES + (1 << 20) + 4096


def announcement(rank: int) -> Any:
    """The header a bulk socket sends first: no slice, round -1; it tells the receiver which
    connection reaches ``rank`` before its first snapshot (an abort may come before it)."""
    from .messages import Snapshot

    return Snapshot(
        rank=rank,
        round=-1,
        weight=0.0,
        groups=[],
        dtypes=[],
        numels=[],
        bucket=-1,
        start=0,
        count=0,
        shm="",
        shm_offset=0,
        ranks=0,
        folded=[],
    )


def is_announcement(header: Any) -> bool:
    announced: bool = header.round == -1 and header.bucket == -1 and header.count == 0
    return announced


def slices(numels: Sequence[int], itemsizes: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(bucket, start, count)`` of every slice of a layout, in order."""
    out = []
    for bucket, (numel, size) in enumerate(zip(numels, itemsizes, strict=False)):
        step = max(1, SLICE_BYTES // size)
        for start in range(0, numel, step):
            out.append((bucket, start, min(step, numel - start)))
    return out


def check_layout(header: Any) -> None:
    """The header's layout lists agree in length and name known dtypes and groups.

    Raises:
        ProtocolError: ``bulk`` naming what disagrees.
    """
    n = len(header.numels)
    if len(header.dtypes) != n or len(header.groups) != n:
        raise ProtocolError("bulk", "header layout lists differ in length")
    for i, (group, name) in enumerate(zip(header.groups, header.dtypes, strict=False)):
        if name not in DTYPES and name not in BY_WIRE_NAME:
            raise ProtocolError("bulk", f"tensor {i}: dtype {name!r} is not one of {sorted(DTYPES) + sorted(BY_WIRE_NAME)}")
        if group not in ("p", "b"):
            raise ProtocolError("bulk", f"tensor {i}: group {group!r} is not p or b")


def check_slice(header: Any) -> torch.dtype:
    """A header that names a slice: its layout, bucket and bounds are sound; returns the slice's dtype
    (uint8 for an encoded bucket: its frame is bytes to decode).

    For slices whose bytes are not a frame (the same-host lane) as for those that are.

    Raises:
        ProtocolError: ``bulk`` naming what disagrees.
    """
    check_layout(header)
    n = len(header.numels)
    if not 0 <= header.bucket < n:
        raise ProtocolError("bulk", f"bucket {header.bucket} outside the {n} tensors of the layout")
    if header.start < 0 or header.count < 1 or header.start + header.count > header.numels[header.bucket]:
        raise ProtocolError(
            "bulk",
            f"slice [{header.start}, {header.start + header.count}) outside tensor {header.bucket} of {header.numels[header.bucket]} elements",
        )
    return DTYPES.get(header.dtypes[header.bucket], torch.uint8)


def unpack_slice(header: Any, frames: Sequence[Any]) -> torch.Tensor | None:
    """Check one slice message against its header; view its frame as a tensor (no copy).

    Returns None for a message that carries no slice (``bucket`` -1, no frame).

    Raises:
        ProtocolError: ``bulk`` naming what disagrees (layout lists, frame
            count, dtype, group, bucket or slice bounds, byte length).
    """
    if header.bucket == -1:
        check_layout(header)
        if frames or header.count:
            raise ProtocolError("bulk", "a message with no slice carries data")
        return None
    if len(frames) != 1:
        check_layout(header)  # a bad layout is named first, as before
        raise ProtocolError("bulk", f"a slice message carries exactly one frame, this one {len(frames)}")
    dtype = check_slice(header)
    buf = frames[0].buffer if hasattr(frames[0], "buffer") else memoryview(frames[0])
    want = frame_bytes(header.dtypes[header.bucket], header.count)
    if buf.nbytes != want:
        raise ProtocolError("bulk", f"slice of {buf.nbytes} bytes, header says {header.count} x {header.dtypes[header.bucket]} = {want}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only ZeroMQ buffer: we only ever read it
        return torch.frombuffer(buf, dtype=dtype)


# --------------------------------------------------- a donor's state (StateSlice)


def state_slices(total: int) -> list[tuple[int, int]]:
    """``(start, count)`` of every slice of a state of ``total`` bytes, in order."""
    return [(start, min(SLICE_BYTES, total - start)) for start in range(0, total, SLICE_BYTES)]


def check_state_segment(header: Any, frames: Sequence[Any], run_id: str) -> Path:
    """The shared-memory segment a ``StateSlice`` names (``shm``): the whole state, no frame, a
    state segment of this run (shm.py ``STATE_ROLE``).

    Raises:
        ProtocolError: ``bulk`` for a frame or a header that names part of the state, ``shm`` for
            a path that is not a state segment of this run.
    """
    if frames or header.start != 0 or header.total < 1 or header.count != header.total:
        raise ProtocolError("bulk", "a state segment's header names the whole state (start 0, count = total > 0) and carries no frame")
    path = checked_path(header.shm, run_id, STATE_ROLE)
    if path is None:
        raise ProtocolError("shm", f"{header.shm!r} is not a state segment of this run")
    return path


def check_state_slice(header: Any, frames: Sequence[Any]) -> memoryview | None:
    """Check one ``StateSlice`` message against its header; its frame's bytes (no copy), or None
    for the message that says no state comes (``total`` -1, no frame).

    Raises:
        ProtocolError: ``bulk`` naming what disagrees (frame count, byte length, bounds).
    """
    if header.shm:
        raise ProtocolError("bulk", "a state segment's header read as a slice")  # check_state_segment's
    if header.total == -1:
        if frames or header.count:
            raise ProtocolError("bulk", "a state message that says no state comes carries data")
        return None
    if len(frames) != 1:
        raise ProtocolError("bulk", f"a state slice carries exactly one frame, this one {len(frames)}")
    if header.start < 0 or header.count < 1 or header.start + header.count > header.total or header.count > SLICE_BYTES:
        raise ProtocolError("bulk", f"state slice [{header.start}, {header.start + header.count}) outside a state of {header.total} bytes")
    buf = frames[0].buffer if hasattr(frames[0], "buffer") else memoryview(frames[0])
    if buf.nbytes != header.count:
        raise ProtocolError("bulk", f"state slice of {buf.nbytes} bytes, header says {header.count}")
    return buf
