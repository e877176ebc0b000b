"""The compiled codec (``flodl/wire/_framec.c``) against the pure-Python one it stands in for.

Both halves must write the same bytes and accept exactly the same frames with the same values: the
compiled one only ever takes a subset (anything it does not take goes the Python way, which accepts
it or names the drop). Checked here on every message kind with random values, on mutated, re-signed
and hand-made bodies (ext types, deep nesting, bytes keys, bad UTF-8, out-of-range numbers), on the
replay window, and on the keyed BLAKE2b tag against hashlib's. The whole protocol suite also runs
once with ``FLODL_PURE_CODEC=1``, the path of a machine where flodl was installed without a compiler.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
import types
from pathlib import Path

import msgpack
import pytest

from flodl import wire
from flodl.config.env import pure_codec_requested
from flodl.errors import ProtocolError
from flodl.wire import codec
from flodl.wire import messages as m
from flodl.wire.codec import HEADER, MAGIC, FrameReader, FrameWriter, ReplayWindow, message_types, pack_frame, sign

from .helpers.codec_fuzz import pure_reader, same_outcome, value_for
from .test_protocol import SCHEMA

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parent.parent
SECRET = bytes(range(32))
RUN = "native-run"
native = pytest.mark.skipif(not codec.NATIVE, reason="flodl.wire._framec is not built here")


def test_the_compiled_codec_is_built_where_a_compiler_is():
    """setup.py builds it as optional: on a machine with a C compiler (CI's) a failed build must not pass unseen."""
    if shutil.which("cc") is None and shutil.which("gcc") is None:
        pytest.skip("no C compiler here: the pure-Python codec is the one in use")
    if pure_codec_requested():
        pytest.skip("FLODL_PURE_CODEC asks for the pure-Python codec")
    assert codec.NATIVE, "flodl.wire._framec did not build or load: pip install -e . and read its compiler output"


def _pure_reader() -> FrameReader:
    """A reader on the Python path only (as where the extension is not built)."""
    reader: FrameReader = pure_reader(SECRET, RUN)
    return reader


@native
def test_every_message_is_written_and_read_as_the_python_codec_does():
    """Same bytes as ``pack_frame`` (pure msgpack + hashlib), for every kind and awkward sizes of every
    type (each msgpack width); the compiled read gives the Python read's envelope."""
    rng = random.Random(3)
    for spec in SCHEMA["messages"]:
        cls = message_types()[spec["name"]]
        writer = FrameWriter(SECRET, RUN, "rank0.1")
        native_reader, pure_reader = FrameReader(SECRET, RUN), _pure_reader()
        seq = 1  # the writer's next number
        for _ in range(25):
            msg = cls(**{f["name"]: value_for(rng, f["type"]) for f in spec["fields"]})
            try:
                want = pack_frame(SECRET, msg, sender="rank0.1", seq=seq, run_id=RUN)
            except ProtocolError:  # a value over the schema's bounds: the writer refuses it too
                with pytest.raises(ProtocolError):
                    writer.encode(msg)
                seq += 1  # the compiled half took no number, the Python path that raised took one
                continue
            frame = writer.encode(msg)
            seq += 1
            assert frame == want, (spec["name"], msg)
            got, ref = native_reader.read(frame), pure_reader.read(frame)
            assert got is not None and got == ref and got.msg == ref.msg


@native
def test_an_int_for_a_float_is_widened_on_both_paths():
    writer = FrameWriter(SECRET, RUN, "rank0.1")
    frame = writer.encode(m.Ping(nonce=1, sent_at=3))  # type: ignore[arg-type]
    env = FrameReader(SECRET, RUN).read(frame)
    assert env is not None and type(env.msg.sent_at) is float and env.msg.sent_at == 3.0
    assert frame == pack_frame(SECRET, m.Ping(nonce=1, sent_at=3.0), sender="rank0.1", seq=1, run_id=RUN)


@native
@pytest.mark.parametrize("value", [True, 1.5, "1", 2**64, -(2**63) - 1, None])
def test_a_bad_int_is_refused_by_the_writer_without_taking_a_number(value):
    writer = FrameWriter(SECRET, RUN, "rank0.1")
    with pytest.raises(ProtocolError) as err:
        writer.encode(m.Ping(nonce=value, sent_at=0.0))
    assert err.value.reason == "schema"
    # the pure path took one number (as it always did); the compiled one takes none before a message checks
    frame = writer.encode(m.Ping(nonce=1, sent_at=0.0))
    assert FrameReader(SECRET, RUN).read(frame) is not None


_EDGE = codec.MAX_STR  # the one string limit: UTF-8 bytes, for writer and reader


@pytest.mark.parametrize(
    ("text", "fits"),
    [
        ("a" * _EDGE, True),
        ("a" * (_EDGE + 1), False),
        ("é" * (_EDGE // 2), True),  # 65,536 bytes in 32,768 characters
        ("é" * (_EDGE // 2 + 1), False),
        ("é" * _EDGE, False),  # 65,536 characters, 131,072 bytes: written before, then dropped by every reader
        ("漢" * (_EDGE // 3) + "a", True),
        ("𝄞" * (_EDGE // 4 + 1), False),
    ],
    ids=["ascii-edge", "ascii-over", "e-acute-edge", "e-acute-over", "e-acute-65536-chars", "han-edge", "four-byte-over"],
)
@pytest.mark.parametrize("where", ["str", "list<str>", "map key", "value"])
def test_a_string_is_bounded_by_its_bytes_alike_in_writer_and_reader(text, fits, where):
    """The writer allowed MAX_STR characters, the reader MAX_STR bytes: a string of 65,536 "é" was
    written and then dropped as malformed. One rule now (bytes), in both codecs' writers: what
    one writes, both readers read; what no reader would take is refused at the writer."""
    msg = {
        "str": lambda: m.Reject(reason=text),
        "list<str>": lambda: m.WorkerHello(host="h", pid=1, devices=[text], versions={}),
        "map key": lambda: m.WorkerHello(host="h", pid=1, devices=[], versions={text: "1"}),
        "value": lambda: _welcome_with(text),
    }[where]()
    writers = [("python", lambda: pack_frame(SECRET, msg, sender="rank0.1", seq=1, run_id=RUN))]
    if codec.NATIVE:
        writers.append(("compiled", lambda: FrameWriter(SECRET, RUN, "rank0.1").encode(msg)))
    for name, write in writers:
        if not fits:
            with pytest.raises(ProtocolError) as err:
                write()
            assert err.value.reason == "schema" and "bytes" in str(err.value), (name, err.value)
            continue
        frame = write()
        readers = [_pure_reader()] + ([FrameReader(SECRET, RUN)] if codec.NATIVE else [])
        for reader in readers:
            env = reader.read(frame)
            assert env is not None and env.msg == msg, (name, where, reader.drops)


def _welcome_with(text: str) -> m.RankWelcome:
    """A message with a ``map<str,value>`` field holding ``text`` as a free value."""
    return m.RankWelcome(
        rank=0, world_size=1, generation=0, store_host="h", store_port=1, store_prefix="p", collective_timeout_s=1.0,
        config={"x": text}, seed=1, bulk_port=0, late=False, shm_probe="", shm_nonce="", first_epoch=0, epochs=1,
    )  # fmt: skip


def _body_samples(rng: random.Random) -> list[object]:
    """Bodies a peer with the secret could sign: good ones, and every shape the compiled reader must leave alone."""
    good = ["rank0.1", 1, RUN, 7, 0.5]
    deep: object = 1
    for _ in range(20):
        deep = [deep]
    return [
        good,
        ["rank0.1", 1, RUN, 7, 1],  # int for the float
        ["rank0.1", 1, RUN, 7.0, 0.5],  # float for the int
        ["rank0.1", 1, RUN, True, 0.5],
        ["rank0.1", 0, RUN, 7, 0.5],  # seq 0
        ["rank0.1", -1, RUN, 7, 0.5],
        ["", 1, RUN, 7, 0.5],
        ["s" * 257, 1, RUN, 7, 0.5],
        ["s" * 256, 1, RUN, 7, 0.5],
        [b"rank0.1", 1, RUN, 7, 0.5],
        ["rank0.1", 1, "other", 7, 0.5],
        ["rank0.1", 1, RUN, 7],
        ["rank0.1", 1, RUN, 7, 0.5, 9],
        ["rank0.1", 1, RUN, deep, 0.5],
        ["rank0.1", 1, RUN, {"a": 1}, 0.5],
        ["rank0.1", 1, RUN, msgpack.ExtType(3, b"x"), 0.5],
        {"sender": "rank0.1"},
        "not a list",
        ["rank0.1", 2**64 - 1, RUN, 2**64 - 1, -0.0],
        ["rank0.1", 1, RUN, -(2**63), float("nan")],
    ] + [["rank0.1", rng.randint(1, 5), RUN, rng.randint(-(2**63), 2**64 - 1), rng.random()] for _ in range(20)]


def _signed_raw(body: bytes, kind: int = m.Ping.KIND) -> bytes:
    unsigned = HEADER.pack(MAGIC, m.PROTOCOL_VERSION, kind, len(body)) + body
    return unsigned + sign(SECRET, unsigned)


def _same_outcome(frame: bytes, context: object) -> None:
    """The compiled reader and the Python one agree: the same envelope, or the same drop."""
    _, why = same_outcome(FrameReader(SECRET, RUN), _pure_reader(), frame)
    assert why is None, (context, why)


@native
def test_signed_bodies_of_every_shape_are_read_alike():
    rng = random.Random(5)
    for body in _body_samples(rng):
        _same_outcome(_signed_raw(msgpack.packb(body, use_bin_type=True)), body)
        _same_outcome(_signed_raw(msgpack.packb(body, use_bin_type=True, use_single_float=True)), ("float32", body))


@native
def test_hand_made_msgpack_is_read_alike():
    """Bytes no packer writes: bad UTF-8, bytes map keys, the unused 0xc1, lengths past the end, trailing bytes,
    msgpack's timestamp ext, and random bytes after a good array head."""
    rng = random.Random(7)
    head = msgpack.packb(["rank0.1", 1, RUN], use_bin_type=True)[1:]  # the envelope's items, no array header
    raw = [
        b"\x95" + head + b"\x07" + b"\xa2\xff\xfe",  # str of invalid UTF-8 for the float
        b"\x95" + head + b"\x07" + b"\x81\xc4\x01k\x01",  # map with a bytes key
        b"\x95" + head + b"\x07" + b"\xc1",
        b"\x95" + head + b"\x07" + b"\xcb\x00\x00",  # float64 cut short
        b"\x95" + head + b"\x07" + b"\xdb\xff\xff\xff\xff",  # str32 longer than the frame
        b"\x95" + head + b"\x07" + b"\xcb" + bytes(8) + b"\x00",  # a byte after the array
        b"\x95" + head + b"\x07" + b"\xd6\xff" + bytes(4),  # timestamp ext
        b"\xdc\x00\x05" + head + b"\x07\xcb" + bytes(8),  # array16 header for five items
        b"\xdd\x00\x00\x00\x05" + head + b"\x07\xcb" + bytes(8),
        b"\x95" + head + b"\x07" + b"\xca\x3f\xc0\x00\x00",  # float32 1.5
    ]
    raw += [b"\x95" + head + rng.randbytes(rng.randint(0, 12)) for _ in range(3000)]
    for body in raw:
        _same_outcome(_signed_raw(body), body)
        _same_outcome(_signed_raw(body, m.Heartbeat.KIND), ("heartbeat", body))


@native
def test_mutated_frames_are_read_alike():
    rng = random.Random(9)
    writer = FrameWriter(SECRET, RUN, "rank0.1")
    samples = [m.TimingMsg(0, 0, 1, 32, 0.5, 1.0, 0.0, 0.0, 1), m.Ping(nonce=3, sent_at=2.0), m.Reject(reason="x" * 300)]
    for i in range(3000):
        frame = bytearray(writer.encode(rng.choice(samples)))
        if i % 3 == 0:
            frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
        elif i % 3 == 1:
            body = bytearray(frame[HEADER.size : -16])
            body[rng.randrange(len(body))] = rng.randrange(256)
            frame = bytearray(_signed_raw(bytes(body), int.from_bytes(frame[4:6], "little")))
        _same_outcome(bytes(frame), i)


@native
def test_replay_is_decided_alike_from_one_counter_shared_by_many_peers():
    """Numbers that skip (one controller counter for every rank), repeat, come late or fall out of the window:
    the compiled window decides each as ``ReplayWindow``, through the readers and directly."""
    rng = random.Random(13)
    writer = FrameWriter(SECRET, RUN, "controller")
    frames = [writer.encode(m.Ping(nonce=i, sent_at=0.0)) for i in range(1, 20_000)]
    native_reader, pure_reader = FrameReader(SECRET, RUN), _pure_reader()
    pure_reader._admit = lambda sender, seq, r=pure_reader: _python_window_admit(r, sender, seq)  # type: ignore[method-assign]
    window, model = codec._native.Window(), ReplayWindow()
    position = 0
    for _ in range(6000):
        position = max(0, min(len(frames) - 1, position + rng.choice([1] * 30 + [2, 5, 40, 300, 1500, -1, -3, -700, -1100])))
        frame = frames[position]
        got, want = native_reader.read(frame), pure_reader.read(frame)
        assert got == want and native_reader.drops == pure_reader.drops
        assert window.accept(position + 1) == model.accept(position + 1)
        assert window.top == model.top
    assert native_reader.drops["replayed"] > 100 and native_reader.accepted > 300


def _python_window_admit(reader: FrameReader, sender: str, seq: int) -> bool:
    """``FrameReader._admit`` with the Python ``ReplayWindow`` (the pure reader's own windows)."""
    window = reader._windows.setdefault(sender, ReplayWindow())
    top = window.top
    if not window.accept(seq):
        raise ProtocolError("replayed", f"seq {seq} from {sender}")
    return seq > top


@native
def test_the_tag_is_keyed_blake2b_128():
    rng = random.Random(17)
    for key_len in (1, 16, 32, 63, 64):
        key = rng.randbytes(key_len)
        mac = codec._native.Mac(key)
        for n in (1, 2, 63, 127, 128, 129, 255, 256, 257, 1000, 70_000):
            data = rng.randbytes(n)
            assert codec._native.tag(mac, data) == hashlib.blake2b(data, key=key, digest_size=16).digest(), (key_len, n)
    with pytest.raises(ValueError):
        codec._native.Mac(b"k" * 65)
    with pytest.raises(ValueError):
        codec._native.tag(codec._native.Mac(b"k"), b"")


@native
def test_a_reader_answers_from_the_compiled_path_before_building_the_message():
    reader = FrameReader(SECRET, RUN)
    heard: list[tuple] = []
    reader.answer(m.Ping, lambda peer, *values: heard.append((peer, *values)))
    frame = FrameWriter(SECRET, RUN, "rank0.1").encode(m.Ping(nonce=9, sent_at=1.25))
    env = reader.read(frame, b"route")
    assert env is not None and heard == [(b"route", 9, 1.25)]
    assert reader.read(frame, b"route") is None and reader.drops == {"replayed": 1} and len(heard) == 1  # a replay is never answered


def test_a_stale_build_is_refused_with_a_warning(monkeypatch, caplog):
    """An extension built from other sources (an old .so next to new code: its calls differ) is not used,
    nor one that cannot serve the protocol it is handed."""
    stale = types.ModuleType("flodl.wire._framec")
    stale.PROTOCOL_VERSION = m.PROTOCOL_VERSION  # type: ignore[attr-defined]  # how builds before the ABI said what they were
    monkeypatch.setitem(sys.modules, "flodl.wire._framec", stale)
    monkeypatch.setattr(wire, "_framec", stale, raising=False)
    monkeypatch.delenv("FLODL_PURE_CODEC", raising=False)
    assert codec._load_native() is None
    assert "built from other sources (interface None" in caplog.text

    def refuse(**protocol):
        raise ValueError("this build writes a 10-byte header")

    stale.ABI, stale.configure = codec._FRAMEC_ABI, refuse  # type: ignore[attr-defined]
    assert codec._load_native() is None
    assert f"cannot serve protocol {m.PROTOCOL_VERSION} (this build writes" in caplog.text
    monkeypatch.setenv("FLODL_PURE_CODEC", "1")
    assert codec._load_native() is None


@native
@pytest.mark.parametrize(
    ("change", "why"),
    [
        ({"tag_len": 32}, "16-byte BLAKE2b tag"),
        ({"header_len": 12}, "10-byte header"),
        ({"magic": b"\xf1"}, "magic"),
        ({"version": 1 << 16}, "version"),
        ({"replay_window": 1000}, "replay_window"),
        ({"envelope": dict}, "envelope"),
    ],
)
def test_the_compiled_codec_refuses_a_protocol_it_cannot_serve_and_keeps_its_own(change, why):
    with pytest.raises(ValueError, match=why):
        codec._native.configure(**{**codec._protocol(), **change})
    frame = FrameWriter(SECRET, RUN, "rank0.1").encode(m.Ping(nonce=1, sent_at=0.0))  # still the protocol it was handed
    assert frame[2:4] == m.PROTOCOL_VERSION.to_bytes(2, "little") and FrameReader(SECRET, RUN).read(frame) is not None


#: Run in a fresh process: protocol 4242 (messages.py's number, nothing else edited) with a tighter MAX_STR,
#: then what the compiled codec wrote and read.
_BUMPED = """
import json
from flodl.wire import messages as m

m.PROTOCOL_VERSION = 4242
from flodl.wire import codec

codec.MAX_STR = 100
codec._native.configure(**codec._protocol())  # as the import did, with the bound a bump would change there
writer, reader = codec.FrameWriter(b"s" * 32, "run", "rank0.1"), codec.FrameReader(b"s" * 32, "run")
frames = [writer.encode(m.Ping(nonce=i, sent_at=0.5)) for i in range(1, 5)]
envs = [reader.read(f) for f in frames]
old = codec.pack_frame(b"s" * 32, m.Ping(nonce=9, sent_at=0.5), sender="rank0.1", seq=9, run_id="run", version=13)
long_reason = codec.pack_frame(b"s" * 32, m.Reject(reason="x" * 101), sender="rank0.1", seq=10, run_id="run", version=4242)
print(json.dumps({
    "native": codec.NATIVE,
    "versions": [int.from_bytes(f[2:4], "little") for f in frames],
    "read": [e.version for e in envs],
    "by_the_compiled_half": reader._native.accepted,
    "old": reader.read(old) is None and dict(reader.drops),
    "over_the_bound": [reader._native.take(long_reason, "?"), reader._native.accepted],
}))
"""


@native
def test_a_protocol_bump_keeps_the_compiled_codec_without_a_c_edit():
    """The same build, handed another version and bound at import, writes and reads that protocol itself."""
    res = subprocess.run([sys.executable, "-c", _BUMPED], cwd=ROOT, capture_output=True, text=True, timeout=60, env=_env_native())
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert out["native"] is True and "pure-Python" not in res.stderr
    assert out["versions"] == [4242] * 4 and out["read"] == [4242] * 4
    assert out["by_the_compiled_half"] == 3  # all but the sender's first frame (its window is made on the Python path)
    assert out["old"] == {"unknown_version": 1}  # the old protocol's frame is no longer read
    assert out["over_the_bound"] == [None, 3]  # a str past the handed MAX_STR is left to the Python path


def test_the_c_source_holds_no_protocol_and_reads_no_attribute_by_name():
    """What a protocol bump edits lives in Python: no version or bound is defined in the C, and it looks up
    no attribute of a writer or reader by name (each hands its state to its compiled half)."""
    source = (ROOT / "flodl" / "wire" / "_framec.c").read_text()
    for word in ("#define PROTOCOL_VERSION", "#define MAX_", "#define WINDOW_BITS", "InternFromString", "GetAttrString", "CallMethod"):
        assert word not in source, word
    assert not [name for name in ("_seq", "_admit", "_native_table", "_windows", "_cmac", "_mac") if f'"{name}"' in source]


def _env_native() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "FLODL_PURE_CODEC"}
    env["PYTHONPATH"] = str(ROOT) + os.pathsep + env.get("PYTHONPATH", "")
    return env


def test_the_protocol_suite_passes_on_the_pure_python_codec():
    """A machine without a compiler runs the Python path: the same suite, and this file's checks that need none."""
    env = {**os.environ, "FLODL_PURE_CODEC": "1"}
    res = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-n",
            "0",
            "-p",
            "no:cacheprovider",
            "tests/test_protocol.py",
            "tests/test_native_codec.py",
            "-k",
            "not pure_python",
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=100,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    probe = subprocess.run(
        [sys.executable, "-c", "import flodl.wire.codec as c; print(c.NATIVE)"], env=env, capture_output=True, text=True, timeout=60
    )
    assert probe.stdout.strip() == "False", probe.stderr
