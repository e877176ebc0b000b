"""Tensors to and from files in the safetensors format, with no pickle anywhere.

The format (https://github.com/huggingface/safetensors) is an 8-byte
little-endian header length, a JSON header mapping each name to its dtype,
shape and byte range, then the raw little-endian bytes. It is simple enough
to write here directly, so bundles need no extra dependency; files written
here load with the ``safetensors`` package and the other way round (a test
checks both directions when that package is installed).

Writes are atomic and durable (``atomic_file.py``: ``<path>.tmp``, fsync,
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


def save(path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> str:
    """Write ``tensors`` (any device; copied to CPU) and string ``metadata`` atomically; returns the file's sha256."""
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
    return write_atomic(Path(path), [struct.pack("<Q", len(text)), text, *blobs])


def read_header(path: str | os.PathLike) -> tuple[dict[str, dict], dict[str, str], int]:
    """``(entries, metadata, data_start)`` without reading the tensors."""
    path = Path(path)
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise CorruptFile(f"{path}: {size} bytes is too short to be a safetensors file")
        (length,) = struct.unpack("<Q", head)
        if length > min(MAX_HEADER, size - 8):
            raise CorruptFile(f"{path}: header length {length} does not fit a file of {size} bytes")
        try:
            header = json.loads(f.read(length))
        except ValueError as exc:
            raise CorruptFile(f"{path}: the header is not JSON ({exc})") from None
    if not isinstance(header, dict):
        raise CorruptFile(f"{path}: the header is not a JSON object")
    metadata = header.pop("__metadata__", {}) or {}
    data_start = 8 + length
    data_size = size - data_start
    for name, entry in header.items():
        try:
            begin, end = entry["data_offsets"]
            dtype = FROM_CODE[entry["dtype"]]
            count = 1
            for d in entry["shape"]:
                count *= int(d)
        except (KeyError, TypeError, ValueError):
            raise CorruptFile(f"{path}: entry {name!r} is malformed") from None
        if not 0 <= begin <= end <= data_size or end - begin != count * torch.empty(0, dtype=dtype).element_size():
            raise CorruptFile(f"{path}: entry {name!r} points outside the file or has the wrong size (truncated?)")
    return header, metadata, data_start


def load(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Every tensor (on CPU, in file order) and the metadata."""
    header, metadata, data_start = read_header(path)
    with open(path, "rb") as f:
        f.seek(data_start)
        data = bytearray(f.read())
    out = {}
    for name, entry in header.items():
        begin, end = entry["data_offsets"]
        dtype = FROM_CODE[entry["dtype"]]
        flat = (
            torch.frombuffer(data, dtype=torch.uint8, count=end - begin, offset=begin) if end > begin else torch.empty(0, dtype=torch.uint8)
        )
        out[name] = flat.view(dtype).reshape(entry["shape"]).clone()
    return out, metadata
