"""Frame codec of the control protocol: bounded, authenticated, schema-checked.

Pure functions and two small stateful helpers; no sockets. ``pack_frame`` /
``unpack_frame`` implement the byte layout of ``proto/README.md``;
``FrameWriter`` numbers a sender's frames; ``FrameReader`` is what every
receiving actor holds: it turns bytes into an ``Envelope`` or drops the frame,
counting the reason and logging it once per peer, so a bad frame can never
raise into an actor's loop or change its state.

Where ``_framec.c`` is built (``NATIVE``), a writer's frame and a reader's sound
frame each take one call into it; everything it does not take comes through the
Python path here, which remains the reference: ``pack_frame`` and
``unpack_frame`` never use the compiled half, and the tests hold the two to each
other (``tests/test_native_codec.py``).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import hmac
import itertools
import logging
import struct
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import msgpack

from ..config.env import pure_codec_requested
from ..errors import ProtocolError
from .messages import PROTOCOL_VERSION, SCHEMA

log = logging.getLogger(__name__)

MAGIC = b"\xf1\x0d"
HEADER = struct.Struct("<2sHHI")  # magic, version, kind, body length
TAG_LEN = 16
MIN_FRAME = HEADER.size + TAG_LEN
DEFAULT_MAX_FRAME = 1 << 20  # control frames are small; bulk data has its own plane

MAX_STR = 64 * 1024  # a string's UTF-8 bytes, writing and reading alike (msgpack's max_str_len counts bytes)
MAX_BIN = 1 << 20
MAX_ARRAY = 65_536
MAX_MAP = 4_096
MAX_DEPTH = 8
MAX_SENDER = 256
REPLAY_WINDOW = 1024
_INT_MIN, _INT_MAX = -(1 << 63), (1 << 64) - 1

#: Every reason a frame can be dropped for, in the order they are checked.
DROP_REASONS = (
    "truncated",
    "oversized",
    "bad_magic",
    "unknown_version",
    "bad_tag",
    "unknown_kind",
    "malformed",
    "schema",
    "wrong_run",
    "replayed",
    "reflected",
)
#: A peer's dropped frames are logged at most once per this many seconds (the rest are counted and summed up).
DROP_LOG_INTERVAL_S = 5.0
#: Lines about dropped frames per interval, all peers together (a thousand strangers write no thousand lines).
DROP_LOG_BURST = 10


class _Invalid(Exception):
    """Internal: a value does not match its wire type (becomes reason ``schema``)."""


# ---------------------------------------------------------------- validators
# Each wire type compiles to a function that returns the normalised value
# (floats widened, map keys sorted) or raises _Invalid. The same functions run
# on encode (so we never emit a frame our peers would drop) and on decode.


def _printable(text: str, limit: int) -> str:
    """``text`` with every non-printable character escaped (newlines, ANSI escapes), cut at ``limit``."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text[:limit])


def _check_int(x: Any) -> int:
    if type(x) is int and _INT_MIN <= x <= _INT_MAX:
        return x
    raise _Invalid(f"expected int, got {type(x).__name__}")


def _check_float(x: Any) -> float:
    tx = type(x)
    if tx is float:
        checked: float = x
        return checked
    if tx is int:  # another encoder may write 0 for 0.0
        return float(x)
    raise _Invalid(f"expected float, got {tx.__name__}")


def _check_bool(x: Any) -> bool:
    if type(x) is bool:
        return x
    raise _Invalid(f"expected bool, got {type(x).__name__}")


#: A string of at most this many characters is within MAX_STR bytes whatever they are (UTF-8: <= 4 bytes each).
_STR_SURE = MAX_STR // 4


def _str_too_long(x: str) -> bool:
    """Whether ``x`` is over ``MAX_STR`` bytes of UTF-8, the reader's limit (msgpack's ``max_str_len``).
    Only a string past ``_STR_SURE`` characters is encoded to count; one that cannot be encoded (a
    lone surrogate) passes here and is refused by the packer, as a short one is."""
    try:
        return len(x.encode()) > MAX_STR
    except UnicodeEncodeError:
        return False


def _check_str(x: Any) -> str:
    if type(x) is str and (len(x) <= _STR_SURE or not _str_too_long(x)):
        return x
    raise _Invalid(f"expected str of at most {MAX_STR} bytes (UTF-8), got {type(x).__name__} of {len(x) if type(x) is str else '?'}")


def _check_bytes(x: Any) -> bytes:
    if type(x) in (bytes, bytearray) and len(x) <= MAX_BIN:
        return bytes(x)
    raise _Invalid(f"expected bytes of at most {MAX_BIN}, got {type(x).__name__}")


def _check_value(x: Any, depth: int = 0) -> Any:
    """Any plain msgpack value, nesting bounded by MAX_DEPTH."""
    if x is None or type(x) in (bool, float):
        return x
    if type(x) is int:
        return _check_int(x)
    if type(x) is str:
        return _check_str(x)
    if type(x) in (bytes, bytearray):
        return _check_bytes(x)
    if depth >= MAX_DEPTH:
        raise _Invalid(f"value nested deeper than {MAX_DEPTH}")
    if type(x) in (list, tuple):
        if len(x) > MAX_ARRAY:
            raise _Invalid("array too long")
        return [_check_value(i, depth + 1) for i in x]
    if type(x) is dict:
        if len(x) > MAX_MAP:
            raise _Invalid("map too large")
        return {_check_str(k): _check_value(x[k], depth + 1) for k in sorted(x, key=_map_key)}
    raise _Invalid(f"unsupported value type {type(x).__name__}")


def _map_key(k: Any) -> str:
    if type(k) is not str:
        raise _Invalid("map keys must be strings")
    if len(k) > _STR_SURE and _str_too_long(k):  # a key is a string the reader bounds too
        raise _Invalid(f"map key of more than {MAX_STR} bytes (UTF-8)")
    return k


_SCALAR_CHECKS: dict[str, Callable[[Any], Any]] = {
    "int": _check_int,
    "float": _check_float,
    "bool": _check_bool,
    "str": _check_str,
    "bytes": _check_bytes,
    "value": _check_value,
}


def compile_type(wire_type: str) -> Callable[[Any], Any]:
    """Return the validator of a schema type such as ``map<str,list<float>>``."""
    if wire_type in _SCALAR_CHECKS:
        return _SCALAR_CHECKS[wire_type]
    if wire_type.startswith("opt<") and wire_type.endswith(">"):
        inner = compile_type(wire_type[4:-1])
        return lambda x: None if x is None else inner(x)
    if wire_type.startswith("list<") and wire_type.endswith(">"):
        item = compile_type(wire_type[5:-1])

        def check_list(x: Any) -> list[Any]:
            if type(x) not in (list, tuple) or len(x) > MAX_ARRAY:
                raise _Invalid(f"expected array of at most {MAX_ARRAY}")
            return [item(i) for i in x]

        return check_list
    if wire_type.startswith("map<str,") and wire_type.endswith(">"):
        val = compile_type(wire_type[8:-1])

        def check_map(x: Any) -> dict[str, Any]:
            if type(x) is not dict or len(x) > MAX_MAP:
                raise _Invalid(f"expected map of at most {MAX_MAP}")
            return {k: val(x[k]) for k in sorted(x, key=_map_key)}

        return check_map
    raise ValueError(f"unknown wire type {wire_type!r}")


class Envelope(NamedTuple):
    """A decoded, authenticated frame.

    A named tuple, not a class with slots: the codec builds one per frame with one C call
    (``tuple.__new__``), where a dataclass runs its Python ``__init__`` (its cost shows on the
    round trip, where every step runs right after a wake-up on cold caches).
    """

    version: int
    kind: int
    sender: str
    seq: int
    run_id: str
    msg: Any
    newest: bool = False  # by FrameReader: the highest seq ever accepted from this sender (a route may follow it)


#: The calls between this module and ``_framec.c`` (its ``ABI``): raised with any change to them, never by a
#: protocol bump, whose version, bounds and messages the compiled half is handed here (``_load_native``).
_FRAMEC_ABI = 2
#: How deep the compiled reader decodes a body (the body, a field, then the schema's ``MAX_DEPTH``, with room):
#: anything deeper goes to the Python path, which drops what the schema does not allow.
_NATIVE_NESTING = 2 * MAX_DEPTH


def _protocol() -> dict[str, Any]:
    """What ``_framec.configure`` is handed: the protocol as this module speaks it."""
    return {
        "version": PROTOCOL_VERSION,
        "magic": MAGIC,
        "header_len": HEADER.size,
        "tag_len": TAG_LEN,
        "max_str": MAX_STR,
        "max_bin": MAX_BIN,
        "max_array": MAX_ARRAY,
        "max_map": MAX_MAP,
        "max_sender": MAX_SENDER,
        "max_nesting": _NATIVE_NESTING,
        "replay_window": REPLAY_WINDOW,
        "envelope": Envelope,
    }


def _load_native() -> Any:
    """The compiled half of the codec (``_framec.c``), configured with this protocol, or None: not built (no
    C compiler where flodl was installed), built from other sources (its ``ABI``: a stale build, warned),
    unable to serve this protocol (another frame layout: warned), or ``FLODL_PURE_CODEC=1``. Both halves
    write and accept the same frames; the compiled one signs and opens a frame in one call each, which is
    most of what a round trip costs in the codec."""
    if pure_codec_requested():
        return None
    try:
        from . import _framec  # type: ignore[attr-defined]
    except ImportError:
        return None
    abi = getattr(_framec, "ABI", None)
    if abi != _FRAMEC_ABI:
        log.warning(
            "flodl.wire._framec was built from other sources (interface %s, this codec calls %s); using the pure-Python codec: "
            "reinstall flodl",
            abi,
            _FRAMEC_ABI,
        )
        return None
    try:
        _framec.configure(**_protocol())
    except (TypeError, ValueError) as exc:
        log.warning("flodl.wire._framec cannot serve protocol %d (%s); using the pure-Python codec", PROTOCOL_VERSION, exc)
        return None
    return _framec


_native = _load_native()
#: Whether frames are sealed and opened by the compiled codec (``_framec.c``) in this process.
NATIVE = _native is not None

#: Headers kept per message kind for bodies shorter than this many bytes (longer ones are packed per frame).
_HEADS_CACHED = 4096


_HEADER_SIZE = HEADER.size
#: Frames up to this size are sliced as bytes (three views cost three times as much as three copies of a
#: control frame); a larger one is viewed, never copied.
_COPY_BELOW = 4096
_compare_digest = hmac.compare_digest
_unpackb = msgpack.unpackb


def _no_ext(code: int, data: bytes) -> Any:
    raise ValueError("msgpack ext types are not allowed")


def _verified_body(mac: Any, data: bytes, end: int) -> Any:
    """The checks of a frame whose header and length are sound, from ``bad_tag`` to ``malformed``: the tag
    (``mac``: the keyed BLAKE2b state, ``Signer``), nothing after it, the body's msgpack; returns the body.

    The bounds are msgpack's own arguments. A reader's control frame (``_take``, under ``_COPY_BELOW``)
    leaves out all but ``max_ext_len=0`` (which also refuses msgpack's own timestamps, ext -1, that no
    hook sees) and the defaults: ``unpackb`` then bounds every length by the body's size (a map's by half
    of it), which for a body that short is tighter than each of these, so the outcome is the same, the
    call cheaper.
    """
    view = data if len(data) <= _COPY_BELOW else memoryview(data)
    tag = mac.copy()
    tag.update(view[:end])
    if not _compare_digest(tag.digest(), view[end : end + TAG_LEN]):
        raise ProtocolError("bad_tag")
    if len(data) > end + TAG_LEN:
        raise ProtocolError("malformed", f"{len(data) - end - TAG_LEN} bytes after the tag")
    try:
        return _unpackb(
            view[_HEADER_SIZE:end],
            raw=False,
            strict_map_key=True,
            ext_hook=_no_ext,
            max_str_len=MAX_STR,
            max_bin_len=MAX_BIN,
            max_array_len=MAX_ARRAY,
            max_map_len=MAX_MAP,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises several unrelated types; all mean the same here
        raise ProtocolError("malformed", f"{type(exc).__name__}: {exc}") from None


@dataclass(frozen=True, slots=True)
class _Spec:
    kind: int
    name: str
    cls: type
    encode: Callable[[Any], list[Any]]  # message object -> validated wire values
    frame: Callable[..., bytes]  # (message, sender, seq, run, pack, mac) -> the signed frame (FrameWriter's path)
    frame_of: Callable[..., bytes]  # (sender, seqs, run, pack, mac, *field values) -> the same frame, numbered next(seqs)
    open: Callable[..., Envelope]  # (signer, frame, end, version, run id or None) -> Envelope: every check from bad_tag on
    take: Callable[..., Envelope]  # (reader, frame, end, peer, answer) -> Envelope: ``open``, the replay check (FrameReader.read)


# Straight-line code per message: the codec sits on the controller's ingest
# path and on every round trip, where each step runs right after a wake-up on
# cold caches, so a frame costs roughly what it executes. A generated function
# per message checks scalar fields inline (composite types call their
# closure) and does a frame's whole job in one call: validate, pack and sign
# (``_frame``); verify, unpack, check and build the message and its envelope
# (``_open``, and ``_take``: the same for a ``FrameReader``, its replay check
# included). A decoded message is built as its dataclass ``__init__`` would,
# one store per field, without calling it (``_generate`` checks that it would
# do nothing else): a Python frame fewer per frame.
_INLINE = {
    "int": "if type({v}) is not int or not _INT_MIN <= {v} <= _INT_MAX: raise _Invalid('{f}: expected int')",
    "float": "if type({v}) is not float:\n    if type({v}) is int: {v} = float({v})\n    else: raise _Invalid('{f}: expected float')",
    "bool": "if type({v}) is not bool: raise _Invalid('{f}: expected bool')",
    "str": "if type({v}) is not str or (len({v}) > _STR_SURE and _str_too_long({v})): "
    "raise _Invalid('{f}: expected str of at most %d bytes (UTF-8)' % MAX_STR)",
}

#: A decoded body's checks, the same in both read paths (``_open``, ``_take``): its shape, envelope fields and values.
_BODY_CHECKS = """
    if type(body) is not list or len(body) != {items}:
        raise ProtocolError("schema", "{name}: expected {items} items")
    sender, seq, frame_run, {values} = body
    if type(sender) is not str or not sender or len(sender) > MAX_SENDER:
        raise ProtocolError("schema", "bad sender")
    if type(seq) is not int or not 1 <= seq <= _INT_MAX or type(frame_run) is not str:
        raise ProtocolError("schema", "bad seq or run id")
    try:
    {checks_in_try}
    except _Invalid as exc:
        raise ProtocolError("schema", "{name}: %s" % exc) from None
"""

#: ``_take``'s replay check: the usual frame (the next from its sender) inline, as ``ReplayWindow.accept`` takes it.
_REPLAY = """    window = reader._windows.get(sender)
    if window is not None and seq == window.top + 1:  # the usual frame, the next from its sender (ReplayWindow.accept)
        window.top = seq
        newest = True
    else:
        newest = reader._admit(sender, seq)
"""
#: The same with the compiled codec's windows (their ``top`` is theirs to move): the frames ``_framec.Reader.take`` left.
_REPLAY_NATIVE = """    newest = reader._admit(sender, seq)
"""

#: ``_take``'s run check: a frame of another run is dropped as ``wrong_run``.
_RUN_CHECK = """    if frame_run != reader.run_id:
        raise ProtocolError("wrong_run", frame_run[:64])
"""

# The signing tail of ``_frame`` (from a message) and ``_frame_of`` (from its field values),
# written once: generated inline in both, since a call per frame would cost the hot path.
_SIGN = """    body = pack([sender, seq, run, {values}])
    n = len(body)
    unsigned = (_heads.get(n) or _head_for(n)) + body
    mac = mac.copy()
    mac.update(unsigned)
    return unsigned + mac.digest()
"""

#: The compiled codec's signing tail (``_framec.seal``): validated values in, the signed frame out, one call.
_SIGN_NATIVE = """    return _seal(mac, {kind}, sender, seq, run, {values})
"""

#: How ``_take`` gets a frame's body: the tag, then the msgpack.
_TAKE_BODY = """    if end < _COPY_BELOW:  # a control frame: ``_verified_body``'s steps inline, the tag then the body
        mac = reader._mac.copy()
        mac.update(data[:end])
        if not _compare_digest(mac.digest(), data[end:]):
            raise ProtocolError("bad_tag")
        try:
            body = _unpackb(data[_HEADER_SIZE:end], ext_hook=_no_ext, max_ext_len=0)
        except Exception as exc:
            raise ProtocolError("malformed", "%s: %s" % (type(exc).__name__, exc)) from None
    else:
        body = _verified_body(reader._mac, data, end)
"""


def _template(native: bool) -> str:
    """The source of a message's five functions (``_generate``); ``native``: ``_frame`` and ``_frame_of`` sign
    with the compiled codec (the reading functions are the Python path either way: the compiled one is
    ``_framec.Reader.take``, before them)."""
    sign = _SIGN_NATIVE if native else _SIGN
    replay = _REPLAY_NATIVE if native else _REPLAY
    return (
        """
def _enc(msg):
{loads}
{checks}
    return [{values}]


def _frame(msg, sender, seq, run, pack, mac):
{loads}
{checks}
"""
        + sign
        + """

def _frame_of(sender, seqs, run, pack, mac{params}):
    seq = next(seqs)
    try:
    {checks_in_try}
    except _Invalid as exc:
        raise ProtocolError("schema", "{name}: %s" % exc) from None
"""
        + sign
        + """

def _open(signer, data, end, version, run_id):
    body = _verified_body(signer._mac, data, end)
"""
        + _BODY_CHECKS
        + """    if run_id is not None and frame_run != run_id:
        raise ProtocolError("wrong_run", frame_run[:64])
{build}
    return _new(_Envelope, (version, {kind}, sender, seq, frame_run, msg, False))


def _take(reader, data, end, peer, answer=None):
"""
        + _TAKE_BODY
        + _BODY_CHECKS
        + _RUN_CHECK
        + replay
        + """    reader._accepted += 1
    if answer is not None:  # accepted: answered before any object is built (FrameReader.answer)
        answer(peer, {values})
{build}
    return _new(_Envelope, (_VERSION, {kind}, sender, seq, frame_run, msg, newest))
"""
    )


def _generate(
    kind: int, name: str, cls: type, fields: tuple[tuple[str, str], ...]
) -> tuple[Callable[..., Any], Callable[..., Any], Callable[..., Any], Callable[..., Any], Callable[..., Any]]:
    """Build ``_enc`` (message -> validated wire values), ``_frame``, ``_frame_of``, ``_open`` and ``_take`` of one message.

    ``_frame(msg, sender, seq, run, pack, mac)``: the signed frame, ``mac`` being the keyed
    BLAKE2b state (``Signer``); ``_frame_of(sender, seqs, run, pack, mac,
    *field values)``: the same frame from the field values, numbered ``next(seqs)``, no message object
    built (a value that does not validate: ``ProtocolError``). ``_open(signer, data, end, version, run_id)``:
    for a frame of this kind whose header and length are sound (``end``: where the tag starts), the
    checks of ``DROP_REASONS`` from ``bad_tag`` on, in order, then the envelope. ``_take(reader, data, end,
    peer, answer=None)``: the same for a ``FrameReader`` on a frame whose length is exactly its header's,
    then the reader's replay check (``replayed``, ``reflected``) and its count, then ``answer(peer, *field
    values)`` if given; the envelope comes with ``newest`` set."""
    # the decoded message is built field by field (``build`` below): only right if its __init__ does no more
    if [f.name for f in dataclasses.fields(cls)] != [f for f, _ in fields] or hasattr(cls, "__post_init__"):
        raise TypeError(f"{name}: not a plain dataclass of its schema's fields")
    heads: dict[int, bytes] = {}  # body length -> the whole header (a frame's body has few sizes)

    def head_for(length: int) -> bytes:
        head = HEADER.pack(MAGIC, PROTOCOL_VERSION, kind, length)
        if length < _HEADS_CACHED:
            heads[length] = head
        return head

    env: dict[str, Any] = {
        "_Invalid": _Invalid,
        "ProtocolError": ProtocolError,
        "_Envelope": Envelope,
        "_new": tuple.__new__,
        "_blank": object.__new__,
        "_cls": cls,
        "_heads": heads,
        "_head_for": head_for,
        "_INT_MIN": _INT_MIN,
        "_INT_MAX": _INT_MAX,
        "MAX_STR": MAX_STR,
        "_STR_SURE": _STR_SURE,
        "_str_too_long": _str_too_long,
        "MAX_BIN": MAX_BIN,
        "MAX_ARRAY": MAX_ARRAY,
        "MAX_MAP": MAX_MAP,
        "MAX_SENDER": MAX_SENDER,
        "TAG_LEN": TAG_LEN,
        "_HEADER_SIZE": _HEADER_SIZE,
        "_COPY_BELOW": _COPY_BELOW,
        "_compare_digest": _compare_digest,
        "_unpackb": _unpackb,
        "_no_ext": _no_ext,
        "_verified_body": _verified_body,
        "_VERSION": PROTOCOL_VERSION,
        "_seal": _native and _native.seal,
    }
    checks = []
    for i, (field_name, wire_type) in enumerate(fields):
        if wire_type in _INLINE:
            checks.append(_INLINE[wire_type].format(v=f"v{i}", f=field_name))
        else:
            env[f"_c{i}"] = compile_type(wire_type)
            checks.append(f"v{i} = _c{i}(v{i})")
    lines = "\n".join(checks).splitlines() or ["pass"]
    code = _template(_native is not None).format(
        kind=kind,
        name=name,
        items=3 + len(fields),
        values=", ".join(f"v{i}" for i in range(len(fields))),
        loads="\n".join(f"    v{i} = msg.{f}" for i, (f, _) in enumerate(fields)),
        checks="\n".join("    " + line for line in lines),
        checks_in_try="\n".join("    " + line for line in lines).replace("\n", "\n    "),
        params="".join(f", v{i}" for i in range(len(fields))),
        build="\n".join(["    msg = _blank(_cls)"] + [f"    msg.{f} = v{i}" for i, (f, _) in enumerate(fields)]),
    )
    exec(code, env)  # noqa: S102 - code built from our own schema only
    return env["_enc"], env["_frame"], env["_frame_of"], env["_open"], env["_take"]


def _spec(kind: int, name: str, cls: type, fields: tuple[tuple[str, str], ...]) -> _Spec:
    return _Spec(kind, name, cls, *_generate(kind, name, cls, fields))


_SPECS: dict[int, _Spec] = {kind: _spec(kind, name, cls, fields) for kind, (name, cls, fields) in SCHEMA.items()}
_SPEC_BY_CLASS: dict[type, _Spec] = {spec.cls: spec for spec in _SPECS.values()}
_TAKES: dict[int, Callable[..., Envelope]] = {kind: spec.take for kind, spec in _SPECS.items()}
_FRAMES: dict[type, Callable[..., bytes]] = {spec.cls: spec.frame for spec in _SPECS.values()}

#: A field's check ``_framec.Reader.take`` does itself (its letter), by wire type; it calls the validator of any other.
_NATIVE_CODES = {"int": "i", "float": "f", "bool": "b", "str": "s"}


def _native_entry(spec: _Spec) -> tuple[Any, ...]:
    """A kind's entry in a ``_framec.Reader``'s table (what it reads a frame of it with): class, codes, field
    names, validators (None for a field of a code), answer (None: ``FrameReader.answer`` sets one)."""
    fields = SCHEMA[spec.kind][2]
    return (
        spec.cls,
        "".join(_NATIVE_CODES.get(wire_type, "*") for _, wire_type in fields),
        tuple(name for name, _ in fields),
        tuple(None if wire_type in _NATIVE_CODES else compile_type(wire_type) for _, wire_type in fields),
        None,
    )


#: Kind -> its entry: every ``_framec.Reader``'s table (a reader's ``answer`` gives it a copy of its own).
_NATIVE_TABLE: dict[int, tuple[Any, ...]] = {kind: _native_entry(spec) for kind, spec in _SPECS.items()} if _native is not None else {}
#: Class -> (kind, codes, names, validators): what a ``_framec.Writer`` writes a message of it with (the readers' entries).
_NATIVE_WRITES: dict[type, tuple[Any, ...]] = {entry[0]: (kind, *entry[1:4]) for kind, entry in _NATIVE_TABLE.items()}


def message_types() -> dict[str, type]:
    """Name → class of every message in the schema."""
    return {spec.name: spec.cls for spec in _SPECS.values()}


# ------------------------------------------------------------------ framing


class Signer:
    """The frame tag: keyed BLAKE2b (RFC 7693's MAC mode), 16 bytes, its key schedule done once.

    Protocol 8 replaced HMAC-SHA256 (two SHA-256 passes per frame, each primed
    state copied) with BLAKE2b's own keyed mode: one pass, one copy of the
    primed state per frame, and BLAKE2b is a PRF when keyed, so the tag is a
    MAC of the same strength (128-bit tag, 256-bit key). On a control frame of
    ~60 bytes it costs about a third of the HMAC, and a round trip signs and
    verifies four times (the rank's Ping, the controller's read and Pong, the
    rank's read). A secret longer than BLAKE2b's 64-byte key limit is hashed to
    32 bytes first.
    """

    __slots__ = ("_cmac", "_mac")

    def __init__(self, secret: bytes) -> None:
        key = secret if len(secret) <= 64 else hashlib.blake2b(secret, digest_size=32).digest()
        self._mac = hashlib.blake2b(key=key, digest_size=TAG_LEN)
        self._cmac = _native.Mac(key) if _native is not None else None  # the same keyed state, for the compiled codec

    def tag(self, data: bytes | memoryview) -> bytes:
        """The frame tag: keyed BLAKE2b-128 of ``data``."""
        mac = self._mac.copy()
        mac.update(data)
        tag: bytes = mac.digest()
        return tag


_signers: dict[bytes, Signer] = {}


def signer_for(secret: bytes) -> Signer:
    """A cached ``Signer`` per secret (a process holds one or two secrets)."""
    signer = _signers.get(secret)
    if signer is None:
        if len(_signers) > 64:  # tests make many secrets; keep the cache bounded
            _signers.clear()
        signer = _signers[secret] = Signer(secret)
    return signer


def sign(secret: bytes, data: bytes | memoryview) -> bytes:
    """The frame tag: keyed BLAKE2b-128 of ``data`` with ``secret`` (``Signer``)."""
    return signer_for(secret).tag(data)


def message_fields(msg: Any) -> tuple[int, list[Any]]:
    """Validate a message object and return ``(kind, wire field values)``.

    Raises:
        ProtocolError: ``schema`` if the object is not a valid message (a local bug).
    """
    spec = _SPEC_BY_CLASS.get(type(msg))
    if spec is None:
        raise ProtocolError("schema", f"{type(msg).__name__} is not a protocol message")
    try:
        return spec.kind, spec.encode(msg)
    except _Invalid as exc:
        raise ProtocolError("schema", f"{spec.name}: {exc}") from None


def pack_frame(secret: bytes | Signer, msg: Any, *, sender: str, seq: int, run_id: str, version: int = PROTOCOL_VERSION) -> bytes:
    """Encode one message into a signed frame.

    Raises:
        ProtocolError: ``schema`` if ``msg`` does not validate against the schema.
    """
    kind, fields = message_fields(msg)
    body: bytes = msgpack.packb([sender, seq, run_id, *fields], use_bin_type=True)
    unsigned = HEADER.pack(MAGIC, version, kind, len(body)) + body
    signer = secret if isinstance(secret, Signer) else signer_for(secret)
    return unsigned + signer.tag(unsigned)


def unpack_frame(
    secret: bytes | Signer,
    data: bytes,
    *,
    run_id: str | None = None,
    max_frame: int = DEFAULT_MAX_FRAME,
) -> Envelope:
    """Decode and verify one frame; checks run in the order of ``DROP_REASONS``.

    Raises:
        ProtocolError: with ``reason`` in ``DROP_REASONS`` (never ``replayed``:
            replay needs state, see ``FrameReader``).
    """
    n = len(data)
    if n > max_frame:
        raise ProtocolError("oversized", f"{n} bytes > {max_frame}")
    if n < MIN_FRAME:
        raise ProtocolError("truncated", f"{n} bytes")
    magic, version, kind, body_len = HEADER.unpack_from(data)
    if magic != MAGIC:
        raise ProtocolError("bad_magic", magic.hex())
    if version != PROTOCOL_VERSION:
        raise ProtocolError("unknown_version", str(version))
    end = HEADER.size + body_len
    if end + TAG_LEN > max_frame:
        raise ProtocolError("oversized", f"body length {body_len}")
    if n < end + TAG_LEN:
        raise ProtocolError("truncated", f"{n} bytes, header says {end + TAG_LEN}")
    return _open(secret if isinstance(secret, Signer) else signer_for(secret), data, end, kind, version, run_id)


#: The header read as (magic and version as one number, kind, body length): a sound one has the first ``_USUAL``.
_unpack_usual = struct.Struct("<IHI").unpack_from
_USUAL = int.from_bytes(MAGIC + PROTOCOL_VERSION.to_bytes(2, "little"), "little")


def _open(signer: Signer, data: bytes, end: int, kind: int, version: int, run_id: str | None) -> Envelope:
    """The checks from ``bad_tag`` on, for a frame whose header and length are sound (``end``: where the tag starts):
    a known kind's are its spec's ``open``; an unknown kind's frame is still checked in the order of ``DROP_REASONS``."""
    spec = _SPECS.get(kind)
    if spec is not None:
        return spec.open(signer, data, end, version, run_id)
    view = memoryview(data)
    if not _compare_digest(signer.tag(view[:end]), view[end : end + TAG_LEN]):
        raise ProtocolError("bad_tag")
    if len(data) > end + TAG_LEN:
        raise ProtocolError("malformed", f"{len(data) - end - TAG_LEN} bytes after the tag")
    raise ProtocolError("unknown_kind", str(kind))


# ------------------------------------------------------------ stateful ends


_WINDOW_BITS = (1 << REPLAY_WINDOW) - 1


class ReplayWindow:
    """Accepts each sequence number of one sender at most once.

    A sliding bitmap over the last ``REPLAY_WINDOW`` numbers (as in IPsec):
    frames may arrive slightly out of order (a rank's heartbeat thread and its
    training thread number frames from one counter) but never twice.

    The bitmap (``mask``, bit ``i``: number ``base - i`` seen) is kept as of
    ``base``; every number in ``(base, top]`` was seen, one after the other.
    So the usual frame, the next number in order, only moves ``top``: the
    1024-bit shift and masks that record it (three big-integer allocations,
    about a seventh of a frame's read) wait until a frame out of order comes
    (``settle``).
    """

    __slots__ = ("top", "mask", "base")

    def __init__(self) -> None:
        self.top = 0
        self.mask = 0
        self.base = 0

    def settle(self) -> None:
        """Fold the in-order run ``(base, top]`` into the bitmap."""
        run = self.top - self.base
        if run:
            self.mask = ((self.mask << run) | ((1 << run) - 1)) & _WINDOW_BITS if run < REPLAY_WINDOW else _WINDOW_BITS
            self.base = self.top

    def accept(self, seq: int) -> bool:
        """True the first time ``seq`` is seen within the window (``seq > top`` afterwards: it was the newest)."""
        if seq == self.top + 1:  # the next in order: the run grows (a reader's ``_take`` inlines this case)
            self.top = seq
            return True
        self.settle()
        if seq > self.top:
            shift = seq - self.top
            self.mask = ((self.mask << shift) | 1) & _WINDOW_BITS if shift < REPLAY_WINDOW else 1
            self.top = self.base = seq
            return True
        offset = self.top - seq
        if offset >= REPLAY_WINDOW or self.mask >> offset & 1:
            return False
        self.mask |= 1 << offset
        return True


#: A sender's replay window, as readers make them: compiled where the codec is (``_framec.Reader.take`` checks it in place).
_Window: Any = _native.Window if _native is not None else ReplayWindow


class FrameWriter:
    """Signs and numbers the frames of one sender. Thread-safe numbering.

    The same bytes as ``pack_frame``, built with fewer steps: the message's
    generated ``_frame`` validates, packs, heads (a header per body length,
    cached) and signs in one call, and each thread packs with a msgpack
    ``Packer`` of its own (``packb`` builds a new one per call).
    """

    def __init__(self, secret: bytes, run_id: str, sender: str) -> None:
        self.signer = Signer(secret)
        # the keyed state a frame's tag starts from, as the generated ``_frame`` signs: compiled or hashlib's
        self._mac = self.signer._cmac if _native is not None else self.signer._mac
        self.run_id = run_id
        self.sender = sender
        self._seq = itertools.count(1)  # next() on a count is atomic under the GIL
        self._local = threading.local()  # a Packer per thread: a rank's training and link threads share a writer
        # the compiled half, handed what it writes with (it numbers from the same count)
        self._native = _native.Writer(self._mac, sender, run_id, self._seq, _NATIVE_WRITES) if _native is not None else None

    def encode(self, msg: Any) -> bytes:
        """Validate, number, pack and sign ``msg``.

        Raises:
            ProtocolError: ``schema`` if ``msg`` does not validate against the schema (a local bug).
        """
        if self._native is not None:  # the compiled codec: checked, numbered, packed and signed in one call
            signed: bytes | None = self._native.encode(msg)
            if signed is not None:
                return signed
        seq = next(self._seq)  # here a field that does not check raises the schema error, or a class that is no message
        frame = _FRAMES.get(type(msg))
        if frame is None:
            raise ProtocolError("schema", f"{type(msg).__name__} is not a protocol message")
        pack = None  # the compiled codec's ``_frame`` packs in its call: no Packer, nor its per-thread lookup
        if _native is None:
            try:
                pack = self._local.pack
            except AttributeError:
                pack = self._local.pack = msgpack.Packer(use_bin_type=True).pack
        try:
            signed = frame(msg, self.sender, seq, self.run_id, pack, self._mac)
            return signed
        except _Invalid as exc:
            raise ProtocolError("schema", f"{type(msg).__name__}: {exc}") from None
        except BaseException:
            if pack is not None:
                del self._local.pack  # whatever it half wrote stays out of the next frame
            raise

    def encoder(self, cls: type) -> Callable[..., bytes]:
        """``encode(cls(*values))`` as a function of the values, no message built: the same bytes, numbered
        from the same count (the controller's ``Pong``, answered from a ``Ping``'s fields on the round
        trip's path). The function is for one thread: it packs with a ``Packer`` of its own (which drops
        what it half wrote when it raises), so it needs no per-thread lookup.

        Raises:
            ProtocolError: ``schema`` if ``cls`` is no message (here) or a value does not validate (from
                the function: a local bug).
        """
        spec = _SPEC_BY_CLASS.get(cls)
        if spec is None:
            raise ProtocolError("schema", f"{getattr(cls, '__name__', cls)} is not a protocol message")
        # one C-level call to the generated function per frame: no Python wrapper, no argument tuple rebuilt
        return functools.partial(spec.frame_of, self.sender, self._seq, self.run_id, msgpack.Packer(use_bin_type=True).pack, self._mac)


class FrameReader:
    """Turns received bytes into envelopes; drops, counts and logs bad frames.

    ``read`` never raises for anything a peer sends: a dropped frame returns
    ``None`` and increments ``drops[reason]``. Frames signed under the
    reader's own name (``own``, or ``own/...``) are ours reflected back by
    someone who copied them off the wire: dropped as ``reflected``. Warnings
    are rate-limited (``DropLog``): every drop is counted, few are printed.
    """

    def __init__(
        self,
        secret: bytes,
        run_id: str,
        *,
        max_frame: int = DEFAULT_MAX_FRAME,
        name: str = "",
        own: str = "",
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.signer = Signer(secret)
        self._mac = self.signer._mac  # the keyed state ``_take`` copies per frame (the Python path)
        self.run_id = run_id
        self.max_frame = max_frame
        self.name = name
        self.own = own
        self._own_sub = own + "/"  # own sub-names (controller/bulk) are own frames too
        self.drops: Counter[str] = Counter()
        self._accepted = 0  # by the Python path (``accepted``: with the compiled half's)
        self._windows: dict[str, Any] = {}  # sender -> its ``_Window`` (compiled, or ``ReplayWindow``)
        self.log = DropLog(clock=clock)
        self._takes = _TAKES  # kind -> its ``_take``; ``answer`` gives a reader a dict of its own
        # the compiled half (None without it), handed what it reads with: it shares the windows
        self._native = _native.Reader(self.signer._cmac, run_id, max_frame, self._windows, _NATIVE_TABLE) if _native is not None else None

    @property
    def accepted(self) -> int:
        """Frames accepted, by either path."""
        return self._accepted + (self._native.accepted if self._native is not None else 0)

    def answer(self, cls: type, answer: Callable[..., None]) -> None:
        """Call ``answer(peer, *field values)`` for every accepted frame of message ``cls``, as soon as it is
        accepted (authenticated, checked, fresh) and before its message and envelope are built: the
        controller's ``Pong`` leaves before anything else is done with the ``Ping``. A dropped frame is
        never answered. What ``answer`` raises leaves ``read`` (a ``ProtocolError`` would count as a drop).
        """
        spec = _SPEC_BY_CLASS[cls]
        take = spec.take
        self._takes = {**self._takes, spec.kind: lambda reader, data, end, peer: take(reader, data, end, peer, answer)}
        if self._native is not None:
            entry = self._native.table[spec.kind]
            self._native.table = {**self._native.table, spec.kind: (*entry[:4], answer)}

    def read(self, data: bytes, peer: str | bytes = "?") -> Envelope | None:
        """The envelope of an accepted frame, else None (the drop counted, perhaps logged).

        ``peer`` names the sender's connection in a drop's log line: a name, or
        the ROUTER routing id it came on (named only if a line is written: most
        frames are never dropped, and naming costs on the ingest path).
        """
        try:
            if self._native is not None:  # the compiled codec takes a sound frame whole, in one call
                taken: Envelope | None = self._native.take(data, peer)
                if taken is not None:
                    return taken
            n = len(data)
            if MIN_FRAME <= n <= self.max_frame:
                head = _unpack_usual(data)
                if head[0] == _USUAL and n == MIN_FRAME + head[2]:
                    # the usual frame: header and length sound, straight to the tag (the same checks, in the same
                    # order), in one call from there to the envelope, replay check included
                    take = self._takes.get(head[1])
                    if take is not None:
                        env: Envelope = take(self, data, n - TAG_LEN, peer)
                        return env
            # anything else is dropped here, for what the full check order says is wrong (a frame it accepted would
            # have a sound header, a known kind and its header's length: it took the path above)
            env = unpack_frame(self.signer, data, run_id=self.run_id, max_frame=self.max_frame)
            env = env._replace(newest=self._admit(env.sender, env.seq))
            self._accepted += 1
            return env
        except ProtocolError as exc:
            self._drop(exc.reason, peer, exc.detail)
            return None

    def _admit(self, sender: str, seq: int) -> bool:
        """The replay check of an authenticated frame, but for the usual case (the next number from a sender
        seen before, which ``_take`` inlines): whether ``seq`` is the newest ever accepted from ``sender``.

        Raises:
            ProtocolError: ``reflected`` (our own name, on a sender's first frame: a sender with a window
                passed this check before, and ``own`` is fixed) or ``replayed``.
        """
        window = self._windows.get(sender)
        if window is None:
            if self.own and (sender == self.own or sender.startswith(self._own_sub)):
                raise ProtocolError("reflected", f"seq {seq} signed as {sender}")
            window = self._windows[sender] = _Window()
        top: int = window.top
        if not window.accept(seq):
            raise ProtocolError("replayed", f"seq {seq} from {sender}")
        return seq > top

    def forget(self, sender: str) -> None:
        """Drop the replay state of a sender that left (bounded memory)."""
        self._windows.pop(sender, None)

    def _drop(self, reason: str, peer: str | bytes, detail: str) -> None:
        self.drops[reason] += 1
        # a peer's name is its ZeroMQ routing id, which anyone who connects chooses:
        # escaped, so no byte of it can start a line of its own in our output
        peer = _printable(peer, 80) if isinstance(peer, str) else route_name(peer)
        line = self.log.line(peer)
        if line is not None:
            log.warning("%sdropped frame from %s: %s %s%s", self.name and f"{self.name}: ", peer, reason, _printable(detail, 300), line)


def route_name(route: bytes) -> str:
    """How logs name the connection a frame came on: ``conn:<hex>`` for an id the ROUTER assigned,
    else the id its peer chose (escaped)."""
    route = bytes(route)
    if len(route) == 5 and route[0] == 0:
        return f"conn:{route[1:].hex()}"
    return _printable(route.decode("utf-8", "replace"), 80) or "?"


class DropLog:
    """Decides which dropped frames get a warning line: at most one per peer
    per ``interval_s`` and ``burst`` for all peers together per interval; a
    line says how many drops went unprinted since the last one."""

    def __init__(
        self, *, interval_s: float = DROP_LOG_INTERVAL_S, burst: int = DROP_LOG_BURST, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.interval_s = interval_s
        self.burst = burst
        self.clock = clock
        self._peers: dict[str, list[Any]] = {}  # peer -> [time of its last line, drops unprinted since]
        self._window = (0.0, 0)  # start of the current interval, lines printed in it
        self._unprinted = 0  # drops of every peer unprinted since the last line

    def line(self, peer: str) -> str | None:
        """None: count this drop only; else the suffix of the line to print (the summary of what went unprinted)."""
        now = self.clock()
        seen = self._peers.get(peer)
        start, printed = self._window
        if now - start >= self.interval_s:
            start, printed = now, 0
        if (seen is not None and now - seen[0] < self.interval_s) or printed >= self.burst:
            if seen is not None:
                seen[1] += 1
            self._unprinted += 1
            self._window = (start, printed)
            return None
        if len(self._peers) >= 10_000:  # bounded: strangers can open any number of connections
            self._peers.clear()
        quiet = seen[1] if seen is not None else 0
        others = self._unprinted - quiet
        self._peers[peer] = [now, 0]
        self._unprinted = 0
        self._window = (start, printed + 1)
        parts = [f"{quiet} more from this peer"] if quiet else []
        if others > 0:
            parts.append(f"{others} more from other peers")
        return f" ({', '.join(parts)} dropped since the last line; every drop is counted)" if parts else ""
