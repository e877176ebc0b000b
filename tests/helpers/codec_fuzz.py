"""Differential fuzzing of the frame codec: the compiled reader (``flodl/wire/_framec.c``) against the Python one.

A case is a frame a peer holding the secret could send: a valid signed frame of a random message kind
(random field values of every wire type), then mutated and signed again, so the tag verifies and the
mutated bytes reach both parsers. The mutations are byte-level (a bit flipped, a byte set to a msgpack
type marker, bytes inserted, deleted, duplicated, spliced from another frame, the body cut short) and
structural (a field replaced by a value of another type or past a bound, an item dropped or added,
nesting past the limit, the header's kind, version or length changed); a few keep the old tag (the
bytes no longer match it). Both readers must agree on every case: the same envelope with values of the
same types, or the same drop; the same counters after it. Half the cases go to one pair of readers
that lives through the whole run (their replay windows fill alike), the rest to a fresh pair.

Seeded and deterministic: ``run(seed, cases)`` gives the same cases for the same seed. Also run as a
module, in a process whose ``flodl.wire._framec`` is a sanitizer build (``--framec PATH``, loaded in
its place before flodl imports it: ``tests/test_codec_fuzz.py``):

    python -m tests.helpers.codec_fuzz --framec /tmp/x/_framec.cpython-311-x86_64-linux-gnu.so --seed 1 --cases 20000
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import logging
import random
import sys
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

SECRET = bytes(range(32))
RUN = "native-run"
SENDER = "rank0.1"

#: bytes a mutation writes over one of the body's: msgpack's type markers (nil, the unused 0xc1, bools,
#: bin/ext/float/int/str/array/map of every width, fixext), fix-type heads and the ends of the ranges
MARKERS = bytes([0x00, 0x7F, 0x80, 0x8F, 0x90, 0x9F, 0xA0, 0xBF, 0xE0, 0xFF, *range(0xC0, 0xE0)])

#: the fuzz's strings and bytes: short, at msgpack's width edges (fixstr 31, str8 255)
SMALL_SIZES = ((0, 1, 5, 31, 32, 255, 256), (0, 1, 3, 255, 256))


def load_framec(path: str) -> None:
    """Make the extension at ``path`` (a sanitizer build) this process's ``flodl.wire._framec``: called
    before flodl is imported, so the codec's ``from . import _framec`` finds it already loaded."""
    if "flodl.wire.codec" in sys.modules:
        raise RuntimeError("load_framec must run before flodl.wire.codec is imported")
    spec = importlib.util.spec_from_file_location("flodl.wire._framec", path)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"{path}: not a loadable extension")
    module = importlib.util.module_from_spec(spec)
    sys.modules["flodl.wire._framec"] = module
    spec.loader.exec_module(module)


#: sizes of strings and bytes ``value_for`` draws by default: each msgpack width, and past 64 KiB of bytes
BIG_SIZES = ((0, 5, 31, 32, 255, 256, 70_000 // 3), (0, 3, 255, 256, 70_000))


def value_for(rng: random.Random, t: str, sizes: tuple[tuple[int, ...], tuple[int, ...]] = BIG_SIZES) -> Any:
    """A random value of wire type ``t``: ints at every msgpack width and both ends of the range, strings
    and bytes of the lengths ``sizes`` names (strings' characters, bytes')."""
    if t == "int":
        return rng.choice(
            [0, 1, 127, 128, 255, 256, -1, -32, -33, -128, -129, 2**16, -(2**15) - 1, 2**32, -(2**31) - 1, 2**63, 2**64 - 1, -(2**63)]
        )
    if t == "float":
        return rng.choice([0.0, -0.0, 1.5, -1e300, float("inf"), rng.uniform(-1e6, 1e6)])
    if t == "bool":
        return rng.random() < 0.5
    if t == "str":
        return "".join(rng.choice("abcé漢 \n") for _ in range(rng.choice(sizes[0])))
    if t == "bytes":
        return rng.randbytes(rng.choice(sizes[1]))
    if t == "value":
        return rng.choice([None, 1, -5, 2.5, "x", b"y", [1, [2, [3]]], {"b": {"a": True}, "a": [None]}])
    if t.startswith("opt<"):
        return None if rng.random() < 0.3 else value_for(rng, t[4:-1], sizes)
    if t.startswith("list<"):
        return [value_for(rng, t[5:-1], sizes) for _ in range(rng.choice([0, 1, 15, 16, 17]))]
    if t.startswith("map<str,"):
        return {f"k{rng.randrange(99)}": value_for(rng, t[8:-1], sizes) for _ in range(rng.choice([0, 1, 15, 16, 17]))}
    raise AssertionError(t)


def _awkward(rng: random.Random) -> Any:
    """A value to put where a field's is: of another type, at a bound, or past one."""
    import msgpack

    deep: Any = 1
    for _ in range(rng.choice([7, 8, 9, 17])):
        deep = [deep] if rng.random() < 0.5 else {"k": deep}
    return rng.choice(
        [
            None, True, False, 0, -1, 2**63, 2**64 - 1, -(2**63), 0.5, float("nan"), float("-inf"), "", "x", "é" * 40,
            "a" * 65_537, b"", b"\x00" * 3, [], [1, "a"], {}, {"a": 1}, {1: 2}, {b"k": 1}, deep, msgpack.ExtType(5, b"ab"),
            msgpack.ExtType(-1, bytes(4)), SENDER, RUN, "other-run",
        ]
    )  # fmt: skip


def _paths(value: Any, at: tuple = ()) -> Iterator[tuple]:
    """Every place inside a decoded body (list indexes, map keys), the body itself first."""
    yield at
    if isinstance(value, list):
        for i, item in enumerate(value):
            yield from _paths(item, (*at, i))
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*at, key))


def _replace(value: Any, path: tuple, new: Callable[[Any], Any]) -> Any:
    if not path:
        return new(value)
    head, rest = path[0], path[1:]
    if isinstance(value, list):
        return [_replace(v, rest, new) if i == head else v for i, v in enumerate(value)]
    return {k: (_replace(v, rest, new) if k == head else v) for k, v in value.items()}


def _structural(rng: random.Random, body: bytes) -> bytes:
    """The body decoded, one place in it changed (another value, an item more or less), encoded again."""
    import msgpack

    try:
        decoded = msgpack.unpackb(body, raw=False, strict_map_key=False)
    except Exception:  # noqa: BLE001 - a body a byte mutation already broke: left as it is
        return body
    path = rng.choice(list(_paths(decoded)))

    def change(old: Any) -> Any:
        if isinstance(old, list) and old and rng.random() < 0.5:
            items = list(old)
            if rng.random() < 0.5:
                items.pop(rng.randrange(len(items)))
            else:
                items.insert(rng.randrange(len(items) + 1), _awkward(rng))
            return items
        return _awkward(rng)

    try:
        return msgpack.packb(_replace(decoded, path, change), use_bin_type=True, use_single_float=rng.random() < 0.2)
    except (OverflowError, ValueError, TypeError):  # nothing msgpack can write (an int past 64 bits)
        return body


def _bytewise(rng: random.Random, body: bytes, other: bytes) -> bytes:
    """One byte-level change of the body (``other``: another case's body, for a splice)."""
    b = bytearray(body)
    pos = rng.randrange(len(b) + 1)
    how = rng.randrange(7)
    if how == 0 and b:
        b[min(pos, len(b) - 1)] ^= 1 << rng.randrange(8)
    elif how == 1 and b:
        b[min(pos, len(b) - 1)] = rng.choice(MARKERS)
    elif how == 2:
        b[pos:pos] = rng.randbytes(rng.randint(1, 8))
    elif how == 3:
        del b[pos : pos + rng.randint(1, 8)]
    elif how == 4:
        del b[pos:]
    elif how == 5:
        end = min(len(b), pos + rng.randint(1, 16))
        b[end:end] = b[pos:end]
    else:
        cut = rng.randrange(len(other) + 1)
        b[pos:] = other[cut:]
    return bytes(b)


@dataclass
class Outcome:
    """What one run of cases found: how many, how each pair of readers ended, and any disagreement."""

    cases: int = 0
    accepted: int = 0
    compiled: int = 0  # of those accepted, how many the compiled half took whole (the rest: the Python path)
    drops: Counter = field(default_factory=Counter)
    mutations: Counter = field(default_factory=Counter)
    disagreements: list[str] = field(default_factory=list)

    def as_json(self) -> str:
        return json.dumps(
            {
                "cases": self.cases,
                "accepted": self.accepted,
                "compiled": self.compiled,
                "drops": dict(sorted(self.drops.items())),
                "mutations": dict(sorted(self.mutations.items())),
                "disagreements": self.disagreements[:5],
                "disagreement_count": len(self.disagreements),
            },
            sort_keys=True,
        )


def same_outcome(native_reader: Any, pure_reader: Any, frame: bytes) -> tuple[Any, str | None]:
    """Both readers read ``frame``: (the Python reader's envelope or None, why they disagree or None).
    They agree on the same envelope (compared by ``repr``: a NaN equals itself only there) whose values
    have the same types, or on the same drop; and on their counters after it."""
    got, want = native_reader.read(frame), pure_reader.read(frame)
    if repr(got) != repr(want):
        return want, f"compiled {got!r:.300} / python {want!r:.300}"
    if want is not None and [type(getattr(got.msg, n)) for n in want.msg.__slots__] != [
        type(getattr(want.msg, n)) for n in want.msg.__slots__
    ]:
        return want, f"value types differ in {type(want.msg).__name__}"
    if native_reader.drops != pure_reader.drops or native_reader.accepted != pure_reader.accepted:
        return (
            want,
            f"counters: compiled {dict(native_reader.drops)} {native_reader.accepted} / python {dict(pure_reader.drops)} {pure_reader.accepted}",
        )
    return want, None


def pure_reader(secret: bytes = SECRET, run_id: str = RUN) -> Any:
    """A reader on the Python path only (as where the extension is not built)."""
    from flodl.wire.codec import FrameReader

    reader = FrameReader(secret, run_id)
    reader._native = None
    return reader


def frames(seed: int, cases: int) -> Iterator[tuple[str, bytes]]:
    """``cases`` mutated frames, each with the name of its mutation; the same for the same seed."""
    from flodl.wire import messages as m
    from flodl.wire.codec import HEADER, MAGIC, TAG_LEN, FrameWriter, sign

    rng = random.Random(seed)
    kinds = sorted(m.SCHEMA)
    writers = {kind: FrameWriter(SECRET, RUN, SENDER) for kind in kinds}
    for writer in writers.values():
        writer.encode(m.Ping(nonce=0, sent_at=0.0))  # number 1 is the priming frame's (``_fresh_pair``)
    from flodl.errors import ProtocolError

    previous = b""
    for _ in range(cases):
        kind = rng.choice(kinds)
        _, cls, fields = m.SCHEMA[kind]
        while True:
            msg = cls(**{name: value_for(rng, t, SMALL_SIZES) for name, t in fields})
            try:
                frame = writers[kind].encode(msg)
                break
            except ProtocolError:  # a value past the schema's bounds (an int too big for its field): draw again
                continue
        version, length = m.PROTOCOL_VERSION, None
        body = frame[HEADER.size : -TAG_LEN]
        roll = rng.random()
        if roll < 0.4:
            what, body = "bytes", _bytewise(rng, body, previous or body)
            if rng.random() < 0.3:
                body = _bytewise(rng, body, previous or body)
        elif roll < 0.8:
            what, body = "structure", _structural(rng, body)
        elif roll < 0.88:
            what, kind = "kind", rng.choice([*kinds, 0, max(kinds) + 1, 0xFFFF])  # one kind's body read as another's
        elif roll < 0.93:
            what, length = "length", max(0, len(body) + rng.choice([-2, -1, 1, 2, 1 << 20]))
        elif roll < 0.96:
            what, version = "version", rng.choice([0, m.PROTOCOL_VERSION - 1, m.PROTOCOL_VERSION + 1, 0xFFFF])
        else:
            what = "tag"  # the bytes changed after signing: no longer theirs
        previous = body
        head = HEADER.pack(MAGIC, version, kind, len(body) if length is None else length)
        if what == "tag":
            damaged = bytearray(frame)
            damaged[rng.randrange(len(damaged))] ^= 1 << rng.randrange(8)
            yield what, bytes(damaged)
        else:
            yield what, head + body + sign(SECRET, head + body)


def run(seed: int, cases: int) -> Outcome:
    """Read every case with the compiled and the Python reader; what they found (``disagreements``
    must stay empty). Needs the compiled codec (``flodl.wire.codec.NATIVE``)."""
    from flodl.wire.codec import NATIVE

    if not NATIVE:
        raise RuntimeError("flodl.wire._framec is not loaded: nothing to compare the Python codec with")
    quiet = logging.getLogger("flodl.wire.codec")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # a line per dropped frame: thousands, and all expected
    try:
        return _compare(seed, cases)
    finally:
        quiet.setLevel(level)


def _fresh_pair() -> tuple[Any, Any]:
    """A compiled and a Python reader that have each accepted one frame of the sender (number 1): the first
    frame of a sender always takes the Python path (its replay window is made there), the next ones the
    compiled path where it can."""
    from flodl.wire import messages as m
    from flodl.wire.codec import FrameReader, pack_frame

    pair = (FrameReader(SECRET, RUN), pure_reader())
    prime = pack_frame(SECRET, m.Ping(nonce=0, sent_at=0.0), sender=SENDER, seq=1, run_id=RUN)
    for reader in pair:
        reader.read(prime)
    return pair


def _compare(seed: int, cases: int) -> Outcome:
    from flodl.wire.codec import FrameReader

    out = Outcome()
    shared = (FrameReader(SECRET, RUN), pure_reader())  # lives through every case: replay windows fill alike
    rng = random.Random(seed + 1)
    for i, (what, frame) in enumerate(frames(seed, cases)):
        native_reader, python_reader = shared if rng.random() < 0.5 else _fresh_pair()
        before, taken = Counter(python_reader.drops), native_reader._native.accepted
        env, why = same_outcome(native_reader, python_reader, frame)
        out.cases += 1
        out.mutations[what] += 1
        if env is not None:
            out.accepted += 1
            out.compiled += native_reader._native.accepted - taken
        out.drops.update(python_reader.drops - before)
        if why is not None:
            out.disagreements.append(f"case {i} ({what}, seed {seed}): {why}; frame {frame[:200].hex()}")
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--framec", default=None, help="the extension to load as flodl.wire._framec (a sanitizer build)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--cases", type=int, default=5000)
    a = parser.parse_args()
    if a.framec:
        load_framec(a.framec)
    from flodl.wire import codec

    if a.framec and getattr(codec._native, "__file__", None) != a.framec:
        sys.exit(f"flodl.wire._framec is {getattr(codec._native, '__file__', None)}, not {a.framec}")
    out = run(a.seed, a.cases)
    print(out.as_json(), flush=True)
    sys.exit(1 if out.disagreements else 0)


if __name__ == "__main__":
    main()
