"""Tensors to and from files in the safetensors format, with no pickle anywhere.

The format (https://github.com/huggingface/safetensors) is an 8-byte
little-endian header length, a JSON header mapping each name to its dtype,
shape and byte range, then the raw little-endian bytes. It is simple enough
to write here directly, so bundles need no extra dependency; files written
here load with the ``safetensors`` package and the other way round (a test
checks both directions when that package is installed).

``dumps``/``loads`` do the same in memory (a joiner's state, handed over by
a live peer: rank/handoff.py). Writes are atomic and durable (``atomic_file.py``: ``<path>.tmp``, fsync,
rename, fsync of the directory); they return the sha256 of what they wrote,
so a checkpoint needs no second read to checksum its files. A reader that
finds a truncated or inconsistent file raises ``CorruptFile`` naming the path.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import torch

from .atomic_file import write_atomic

DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
FROM_CODE = {code: dtype for dtype, code in DTYPES.items()}
MAX_HEADER = 100 * 1024 * 1024


class CorruptFile(ValueError):
    """A tensor file that is truncated, garbled or not in the safetensors format."""


def encode(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> list[bytes | memoryview]:
    """``tensors`` (any device; copied to CPU) and string ``metadata`` in the format, as the chunks
    that make it up in order (the header's length, the header, each tensor's bytes: no copy on CPU)."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    blobs: list[memoryview] = []
    offset = 0
    for name, tensor in tensors.items():
        if tensor.dtype not in DTYPES:
            raise TypeError(f"{name}: dtype {tensor.dtype} cannot be stored in a safetensors file")
        data = tensor.detach().to("cpu").contiguous()
        # numpy's stubs give ndarray ``__buffer__`` only for Python >= 3.12; it is a buffer on 3.11 too.
        raw = memoryview(data.reshape(-1).view(torch.uint8).numpy()) if data.numel() else memoryview(b"")  # type: ignore[arg-type]
        header[name] = {"dtype": DTYPES[tensor.dtype], "shape": list(tensor.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data section starts 8-byte aligned
    return [struct.pack("<Q", len(text)), text, *blobs]


def save(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """Write ``tensors`` (any device; copied to CPU) and string ``metadata`` atomically; returns the file's sha256."""
    return write_atomic(Path(path), encode(tensors, metadata))


def dumps(tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> bytearray:
    """``save``'s bytes, in memory (a state handed to another process: rank/handoff.py); writable,
    so a tensor can view them without a copy."""
    return bytearray().join(encode(tensors, metadata))


def _checked_header(raw: bytes, size: int, origin: object) -> tuple[dict[str, dict], dict[str, str], int]:
    """Parse and check the header ``raw`` of a file of ``size`` bytes: ``(entries, metadata, data_start)``.

    Raises:
        CorruptFile: naming ``origin``, when it is not JSON or an entry is malformed or out of bounds.
    """
    try:
        header = json.loads(raw)
    except ValueError as exc:
        raise CorruptFile(f"{origin}: the header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CorruptFile(f"{origin}: the header is not a JSON object")
    metadata = header.pop("__metadata__", {}) or {}
    data_start = 8 + len(raw)
    data_size = size - data_start
    for name, entry in header.items():
        try:
            begin, end = entry["data_offsets"]
            dtype = FROM_CODE[entry["dtype"]]
            count = 1
            for d in entry["shape"]:
                count *= int(d)
        except (KeyError, TypeError, ValueError):
            raise CorruptFile(f"{origin}: entry {name!r} is malformed") from None
        if not 0 <= begin <= end <= data_size or end - begin != count * torch.empty(0, dtype=dtype).element_size():
            raise CorruptFile(f"{origin}: entry {name!r} points outside the file or has the wrong size (truncated?)")
    return header, metadata, data_start


def _header_length(head: bytes, size: int, origin: object) -> int:
    if len(head) < 8:
        raise CorruptFile(f"{origin}: {size} bytes is too short to be a safetensors file")
    (length,) = struct.unpack("<Q", head)
    if length > min(MAX_HEADER, size - 8):
        raise CorruptFile(f"{origin}: header length {length} does not fit a file of {size} bytes")
    return int(length)


def _tensors(header: dict[str, dict], data: bytearray | memoryview, data_start: int, *, copy: bool = True) -> dict[str, torch.Tensor]:
    """The tensors ``header`` names in ``data`` (whose byte ``data_start`` begins the data section):
    copied out, or (``copy`` False) views of ``data`` where its alignment allows, which keep it alive."""
    out = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        dtype = FROM_CODE[entry["dtype"]]
        flat = (
            torch.frombuffer(data, dtype=torch.uint8, count=end - begin, offset=data_start + begin)
            if end > begin
            else torch.empty(0, dtype=torch.uint8)
        )
        size = flat.new_empty(0, dtype=dtype).element_size()
        if copy or flat.data_ptr() % size:  # a view must be aligned to its dtype
            flat = flat.clone()
        out[name] = flat.view(dtype).reshape(entry["shape"])
    return out


def loads(data: bytes | bytearray | memoryview, origin: str = "the state") -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """``load`` from bytes in memory (``dumps``'s), ``origin`` naming them in errors. The tensors
    are views of ``data`` when it is writable (a ``bytearray``, a writable ``memoryview``: no copy
    of a large state), which they keep alive; otherwise copies.

    Raises:
        CorruptFile: truncated, garbled or not in the format.
    """
    length = _header_length(bytes(data[:8]), len(data), origin)
    header, metadata, data_start = _checked_header(bytes(data[8 : 8 + length]), len(data), origin)
    writable = isinstance(data, bytearray) or (isinstance(data, memoryview) and not data.readonly)
    buffer = data if writable else bytearray(data)  # torch.frombuffer wants a writable buffer
    return _tensors(header, buffer, data_start, copy=False), metadata  # type: ignore[arg-type]  # writable here


def read_header(path: str | os.PathLike) -> tuple[dict[str, dict], dict[str, str], int]:
    """``(entries, metadata, data_start)`` without reading the tensors."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        length = _header_length(f.read(8), size, path)
        return _checked_header(f.read(length), size, path)


def load(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor (on CPU, in file order) and the metadata."""
    header, metadata, data_start = read_header(path)
    with open(path, "rb") as f:
        f.seek(data_start)
        data = bytearray(f.read())
    return _tensors(header, data, 0), metadata
