"""Samples as bytes and back, bit-exact and without pickle: the disk tier's format.

A frame is a little-endian length, a msgpack header that mirrors the
sample's structure (scalars inline, tensors and numpy arrays as dtype, shape
and an offset), then the raw bytes of every tensor and array, back to back.
Only plain data travels: tensors, numpy arrays, numbers, strings, bytes,
None and tuples/lists/str-keyed dicts of them; anything else is refused with
a message naming where in the sample it sits.
"""

from __future__ import annotations

import ctypes
import struct
from typing import TYPE_CHECKING, Any, cast

import msgpack
import torch

if TYPE_CHECKING:
    import numpy as np
else:
    try:  # numpy is optional for flodl; arrays are only staged when it is there
        import numpy as np
    except ImportError:  # pragma: no cover - torch wheels normally bring numpy
        np = None

_HEADER_LEN = struct.Struct("<I")
_INT64_MIN, _UINT64_MAX = -(2**63), 2**64 - 1
_SCALARS = (type(None), bool, int, float, str, bytes)
_NUMPY_KINDS = "biufcmMSU"  # everything but object and structured/void dtypes
_UNSUPPORTED = "the disk tier stages tensors, numbers, strings and containers of them"


class SampleCodec:
    """Bit-exact, pickle-free bytes for one sample.

    A frame is ``u32 header length | msgpack header | raw tensor bytes``. The
    header mirrors the sample's structure; scalars sit in it as msgpack values,
    tensors and arrays as ``[tag, dtype, shape, offset, nbytes]`` into the raw
    part. Containers are always tagged lists, so a header list is never data.
    """

    def encode(self, sample: Any) -> bytes:
        """One frame for ``sample`` (CPU tensors come back from ``decode``).

        Raises:
            TypeError: a part of the sample is not a tensor, numpy array,
                number, string, bytes, None, or tuple/list/str-keyed dict of them.
        """
        payload = _Payload()
        tree = _encode_node(sample, payload, "sample")
        header = msgpack.packb(tree, use_bin_type=True)
        return b"".join([_HEADER_LEN.pack(len(header)), header, *payload.chunks])

    def decode(self, data: bytes | bytearray | memoryview) -> Any:
        """The sample of one frame; tensors own fresh memory (``data`` may be reused).

        Raises:
            ValueError: the frame is truncated or malformed.
        """
        view = memoryview(data)
        if len(view) < _HEADER_LEN.size:
            raise ValueError("sample frame shorter than its length prefix")
        (hlen,) = _HEADER_LEN.unpack_from(view)
        start = _HEADER_LEN.size + hlen
        if start > len(view):
            raise ValueError("sample frame shorter than its header")
        tree = msgpack.unpackb(view[_HEADER_LEN.size : start], raw=False, use_list=True)
        return _decode_node(tree, view[start:])


class _Payload:
    """The raw part of a frame being built: chunks and their running length."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.size = 0

    def add(self, raw: bytes) -> int:
        """Append ``raw``; its offset in the raw part."""
        offset = self.size
        if raw:
            self.chunks.append(raw)
            self.size += len(raw)
        return offset


def _encode_node(obj: Any, chunks: _Payload, path: str) -> Any:
    """Header node for ``obj``; raw buffers go to ``chunks``."""
    if isinstance(obj, torch.Tensor):
        return _encode_tensor(obj, chunks, path)
    if np is not None and isinstance(obj, (np.ndarray, np.generic)):
        return _encode_numpy(obj, chunks, path)
    kind = type(obj)  # exact types: a subclass (IntEnum, namedtuple) would not round-trip
    if kind is int and not _INT64_MIN <= obj <= _UINT64_MAX:
        return ["I", str(obj)]  # msgpack ints stop at 64 bits
    if kind in _SCALARS:
        return obj
    if kind is list or kind is tuple:
        items = [_encode_node(x, chunks, f"{path}[{k}]") for k, x in enumerate(obj)]
        return ["l" if kind is list else "u", items]
    if kind is dict:
        return _encode_dict(obj, chunks, path)
    raise TypeError(f"{path}: cannot stage a {kind.__module__}.{kind.__qualname__} on disk; {_UNSUPPORTED}")


def _encode_dict(obj: dict, chunks: _Payload, path: str) -> Any:
    keys = list(obj)
    for key in keys:
        if type(key) is not str:
            raise TypeError(f"{path}: dict key {key!r} is a {type(key).__name__}, not str; {_UNSUPPORTED}")
    return ["d", keys, [_encode_node(obj[k], chunks, f"{path}[{k!r}]") for k in keys]]


def _encode_tensor(t: torch.Tensor, chunks: _Payload, path: str) -> list:
    if t.layout != torch.strided or t.is_quantized:
        raise TypeError(f"{path}: cannot stage a {t.layout} / quantized tensor on disk; {_UNSUPPORTED}")
    flat = t.detach().resolve_conj().resolve_neg().cpu().contiguous()
    nbytes = flat.nelement() * flat.element_size()
    offset = chunks.add(ctypes.string_at(flat.data_ptr(), nbytes) if nbytes else b"")
    return ["t", str(t.dtype).removeprefix("torch."), list(t.shape), offset, nbytes]


def _encode_numpy(a: Any, chunks: _Payload, path: str) -> list:
    if a.dtype.kind not in _NUMPY_KINDS:
        raise TypeError(f"{path}: cannot stage a numpy {a.dtype} value on disk; {_UNSUPPORTED}")
    flat = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
    offset = chunks.add(flat.tobytes())
    tag = "a" if isinstance(a, np.ndarray) else "g"
    return [tag, a.dtype.str, list(np.shape(a)), offset, flat.nbytes]


def _decode_node(node: Any, raw: memoryview) -> Any:
    if not isinstance(node, list):
        return node
    tag = node[0]
    if tag == "l":
        return [_decode_node(x, raw) for x in node[1]]
    if tag == "u":
        return tuple(_decode_node(x, raw) for x in node[1])
    if tag == "d":
        return {k: _decode_node(v, raw) for k, v in zip(node[1], node[2], strict=False)}
    if tag == "I":
        return int(node[1])
    if tag == "t":
        # the casts say how many fields the star argument holds: mypy cannot count a list
        return _decode_tensor(*cast("tuple[str, list, int, int]", node[1:]), raw)
    if tag in ("a", "g"):
        return _decode_numpy(tag, *cast("tuple[str, list, int, int]", node[1:]), raw)
    raise ValueError(f"unknown sample frame tag {tag!r}")


def _raw_slice(raw: memoryview, offset: int, nbytes: int) -> memoryview:
    if offset < 0 or nbytes < 0 or offset + nbytes > len(raw):
        raise ValueError("sample frame shorter than its tensor data")
    return raw[offset : offset + nbytes]


def _decode_tensor(dtype_name: str, shape: list, offset: int, nbytes: int, raw: memoryview) -> torch.Tensor:
    dtype = getattr(torch, dtype_name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown tensor dtype {dtype_name!r} in sample frame")
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype)
    # from_buffer copies into a fresh storage: the tensor owns its bytes
    storage = torch.UntypedStorage.from_buffer(_raw_slice(raw, offset, nbytes), byte_order="native", dtype=torch.uint8)
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(dtype).reshape(shape)


def _decode_numpy(tag: str, dtype_str: str, shape: list, offset: int, nbytes: int, raw: memoryview) -> Any:
    if np is None:
        raise ValueError("sample frame holds a numpy value but numpy is not installed")
    dtype = np.dtype(dtype_str)
    out = np.empty(shape, dtype=dtype)
    if nbytes:
        out.reshape(-1).view(np.uint8)[:] = np.frombuffer(_raw_slice(raw, offset, nbytes), dtype=np.uint8)
    return out if tag == "a" else out[()]
