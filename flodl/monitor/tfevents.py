"""TensorBoard's event files, written without TensorBoard, TensorFlow or protobuf installed.

An event file is a TFRecord stream of ``Event`` protocol buffers: each record is
its length (uint64), the masked CRC-32C of that length, the bytes, and their
masked CRC-32C. A scalar is an ``Event`` with ``wall_time``, ``step`` and a
``Summary`` holding one ``Value`` (``tag``, ``simple_value``). The few protobuf
fields involved are encoded here by hand (the controller imports no torch and
needs no new dependency to write them); TensorBoard, ``tensorboard.backend``'s
readers and ``torch.utils.tensorboard`` read them as their own
(tests/test_loggers.py reads them with TensorBoard's own loader).
"""

from __future__ import annotations

import os
import socket
import struct
import time
from pathlib import Path


def _crc32c_table() -> list[int]:
    poly, table = 0x82F63B78, []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ poly if c & 1 else c >> 1
        table.append(c)
    return table


_TABLE = _crc32c_table()


def crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), as TFRecord checksums its records."""
    c = 0xFFFFFFFF
    for b in data:
        c = _TABLE[(c ^ b) & 0xFF] ^ (c >> 8)
    return c ^ 0xFFFFFFFF


def _masked(data: bytes) -> int:
    c = crc32c(data)
    return ((c >> 15 | c << 17) + 0xA282EAD8) & 0xFFFFFFFF


def _varint(n: int) -> bytes:
    out = bytearray()
    n &= (1 << 64) - 1  # a negative int64 as protobuf encodes it
    while True:
        low, n = n & 0x7F, n >> 7
        out.append(low | (0x80 if n else 0))
        if not n:
            return bytes(out)


def _field(number: int, wire: int) -> bytes:
    return _varint(number << 3 | wire)


def _bytes_field(number: int, payload: bytes) -> bytes:
    return _field(number, 2) + _varint(len(payload)) + payload


def event(*, wall_time: float, step: int = 0, file_version: str | None = None, scalar: tuple[str, float] | None = None) -> bytes:
    """One ``Event`` message: the file's version record, or a scalar at ``step``."""
    out = _field(1, 1) + struct.pack("<d", wall_time) + _field(2, 0) + _varint(step)
    if file_version is not None:
        out += _bytes_field(3, file_version.encode())
    if scalar is not None:
        tag, value = scalar
        summary_value = _bytes_field(1, tag.encode()) + _field(2, 5) + struct.pack("<f", value)
        out += _bytes_field(5, _bytes_field(1, summary_value))
    return out


def record(payload: bytes) -> bytes:
    """``payload`` as one TFRecord."""
    length = struct.pack("<Q", len(payload))
    return length + struct.pack("<I", _masked(length)) + payload + struct.pack("<I", _masked(payload))


class EventFileWriter:
    """Scalars into one TensorBoard event file under ``directory`` (created); flushed per call."""

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        folder = Path(directory)
        folder.mkdir(parents=True, exist_ok=True)
        now = time.time()
        self.path = folder / f"events.out.tfevents.{int(now)}.{socket.gethostname()}.{os.getpid()}.flodl"
        self._file = open(self.path, "ab")  # held open for the run, closed by close()
        self._file.write(record(event(wall_time=now, file_version="brain.Event:2")))
        self._file.flush()

    def scalars(self, values: dict[str, float], step: int, wall_time: float | None = None) -> None:
        """Each ``tag: value`` at ``step``."""
        when = time.time() if wall_time is None else wall_time
        for tag, value in values.items():
            self._file.write(record(event(wall_time=when, step=step, scalar=(tag, float(value)))))
        self._file.flush()

    def close(self) -> None:
        self._file.close()
