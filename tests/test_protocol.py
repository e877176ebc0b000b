"""Pure tests of the control-protocol codec: schema, golden vectors, drop reasons."""

from __future__ import annotations

import dataclasses
import json
import random
import re
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from flodl.errors import ProtocolError
from flodl.wire import messages as m
from flodl.wire.codec import (
    DROP_LOG_BURST,
    DROP_LOG_INTERVAL_S,
    DROP_REASONS,
    HEADER,
    MAGIC,
    MAX_DEPTH,
    REPLAY_WINDOW,
    FrameReader,
    FrameWriter,
    ReplayWindow,
    message_fields,
    message_types,
    pack_frame,
    sign,
    unpack_frame,
)

from .conftest import FakeClock

pytestmark = pytest.mark.timeout(30)

ROOT = Path(__file__).resolve().parent.parent
SCHEMA = json.loads((ROOT / "proto" / "schema.json").read_text())
SECRET = bytes(range(32))
RUN = "golden-run"


def from_json(value):
    if isinstance(value, dict) and set(value) == {"$bytes"}:
        return bytes.fromhex(value["$bytes"])
    if isinstance(value, list):
        return [from_json(v) for v in value]
    if isinstance(value, dict):
        return {k: from_json(v) for k, v in value.items()}
    return value


def test_generated_files_are_fresh():
    """messages.py and the README catalogue are what generate.py makes from the schema."""
    res = subprocess.run([sys.executable, str(ROOT / "proto" / "generate.py"), "--check"], capture_output=True, text=True)
    assert res.returncode == 0, res.stdout + res.stderr


def test_schema_and_python_agree_both_ways():
    """Every schema message has a class with the same fields in order, and nothing more."""
    classes = message_types()
    assert set(classes) == {msg["name"] for msg in SCHEMA["messages"]}
    for msg in SCHEMA["messages"]:
        cls = classes[msg["name"]]
        assert msg["kind"] == cls.KIND
        assert [f.name for f in dataclasses.fields(cls)] == [f["name"] for f in msg["fields"]]
    assert SCHEMA["version"] == m.PROTOCOL_VERSION


def test_protocol_readme_speaks_the_schemas_version():
    """A peer written from proto/README.md must speak the version the code and vectors use."""
    readme = (ROOT / "proto" / "README.md").read_text()
    title = re.search(r"^# flodl control protocol, version (\d+)$", readme, re.M)
    layout = re.search(r"this document describes `(\d+)`", readme)
    assert title and layout, "proto/README.md no longer states its version where this test looks"
    assert int(title.group(1)) == int(layout.group(1)) == SCHEMA["version"] == m.PROTOCOL_VERSION


def test_frames_use_the_product_cards_names():
    """The rank's timing report is TimingMsg and the saving stop is ShutdownWithSave; Shutdown no longer saves."""
    names = {msg["name"] for msg in SCHEMA["messages"]}
    assert {"TimingMsg", "ShutdownWithSave", "Shutdown"} <= names and "BatchDone" not in names
    assert not {f.name for f in dataclasses.fields(m.Shutdown)} & {"save_stem", "save_rank", "save_tag"}


def test_every_message_has_a_golden_vector():
    golden = json.loads((ROOT / "proto" / "golden" / "valid.json").read_text())
    assert {v["message"] for v in golden["vectors"]} == {msg["name"] for msg in SCHEMA["messages"]}


@pytest.mark.parametrize("vector", json.loads((ROOT / "proto/golden/valid.json").read_text())["vectors"], ids=lambda v: v["message"])
def test_golden_valid_both_ways(vector):
    frame = bytes.fromhex(vector["frame_hex"])
    want = vector["decoded"]
    env = unpack_frame(SECRET, frame, run_id=RUN)
    assert (env.version, env.kind, env.sender, env.seq, env.run_id) == (
        want["version"],
        want["kind"],
        want["sender"],
        want["seq"],
        want["run_id"],
    )
    assert dataclasses.asdict(env.msg) == from_json(want["fields"])
    # the other way: the decoded form encodes to exactly the same bytes
    cls = message_types()[vector["message"]]
    msg = cls(**from_json(want["fields"]))
    assert pack_frame(SECRET, msg, sender=want["sender"], seq=want["seq"], run_id=want["run_id"]) == frame


@pytest.mark.parametrize("vector", json.loads((ROOT / "proto/golden/invalid.json").read_text())["vectors"], ids=lambda v: v["note"])
def test_golden_invalid_reasons(vector):
    with pytest.raises(ProtocolError) as err:
        unpack_frame(SECRET, bytes.fromhex(vector["frame_hex"]), run_id=RUN)
    assert err.value.reason == vector["reason"]


def test_invalid_vectors_cover_every_stateless_reason():
    golden = json.loads((ROOT / "proto" / "golden" / "invalid.json").read_text())
    assert {v["reason"] for v in golden["vectors"]} == set(DROP_REASONS) - {"replayed", "reflected"}  # both need a reader's state


def test_round_trip_every_message_random_values():
    """Random values of the right types survive encode/decode for every message."""
    rng = random.Random(1)

    def value_for(t):
        if t == "int":
            return rng.randint(-(2**40), 2**40)
        if t == "float":
            return rng.uniform(-1e6, 1e6)
        if t == "bool":
            return rng.random() < 0.5
        if t == "str":
            return "".join(rng.choice("abcé漢 ") for _ in range(rng.randint(0, 20)))
        if t == "bytes":
            return rng.randbytes(rng.randint(0, 40))
        if t == "value":
            return {"a": [1, 2.5, None, "x"], "b": {"c": True}}
        if t.startswith("opt<"):
            return None if rng.random() < 0.3 else value_for(t[4:-1])
        if t.startswith("list<"):
            return [value_for(t[5:-1]) for _ in range(rng.randint(0, 4))]
        if t.startswith("map<str,"):
            return {f"k{i}": value_for(t[8:-1]) for i in range(rng.randint(0, 4))}
        raise AssertionError(t)

    for msg in SCHEMA["messages"]:
        cls = message_types()[msg["name"]]
        for _ in range(20):
            obj = cls(**{f["name"]: value_for(f["type"]) for f in msg["fields"]})
            env = unpack_frame(SECRET, pack_frame(SECRET, obj, sender="s", seq=5, run_id=RUN), run_id=RUN)
            assert env.msg == obj


def test_int_accepted_for_float_on_decode():
    body = msgpack.packb(["rank0.1", 1, RUN, 3, 7, "", 0, 0.0, -1])  # Heartbeat.sent_at (and busy_s) written as ints
    unsigned = HEADER.pack(MAGIC, m.PROTOCOL_VERSION, m.Heartbeat.KIND, len(body)) + body
    env = unpack_frame(SECRET, unsigned + sign(SECRET, unsigned), run_id=RUN)
    assert env.msg.sent_at == 7.0 and type(env.msg.sent_at) is float


def test_encoder_refuses_invalid_message():
    with pytest.raises(ProtocolError) as err:
        pack_frame(
            SECRET, m.Heartbeat(step="one", sent_at=1.0, busy="", busy_s=0.0, step_ms=0.0, averaged=-1), sender="s", seq=1, run_id=RUN
        )
    assert err.value.reason == "schema"
    with pytest.raises(ProtocolError):
        message_fields(object())


def _signed(body_obj, kind=m.RankWelcome.KIND):
    body = msgpack.packb(body_obj)
    unsigned = HEADER.pack(MAGIC, m.PROTOCOL_VERSION, kind, len(body)) + body
    return unsigned + sign(SECRET, unsigned)


def test_value_depth_is_bounded():
    nested = "leaf"
    for _ in range(MAX_DEPTH + 2):
        nested = [nested]
    frame = _signed(["rank0.1", 1, RUN, 0, 1, 0, "h", 1, "p", 1.0, {"deep": nested}])
    with pytest.raises(ProtocolError) as err:
        unpack_frame(SECRET, frame, run_id=RUN)
    assert err.value.reason == "schema"


def test_long_strings_and_big_maps_are_malformed():
    frame = _signed(["rank0.1", 1, RUN, "x" * (70 * 1024)], kind=m.Reject.KIND)
    with pytest.raises(ProtocolError) as err:
        unpack_frame(SECRET, frame, run_id=RUN)
    assert err.value.reason == "malformed"
    big = {f"k{i}": i for i in range(5000)}
    frame = _signed(["rank0.1", 1, RUN, 0, 1, 0, "h", 1, "p", 1.0, big])
    with pytest.raises(ProtocolError) as err:
        unpack_frame(SECRET, frame, run_id=RUN)
    assert err.value.reason == "malformed"


def test_wrong_secret_is_bad_tag():
    frame = pack_frame(
        b"another secret", m.Heartbeat(step=1, sent_at=1.0, busy="", busy_s=0.0, step_ms=0.0, averaged=-1), sender="s", seq=1, run_id=RUN
    )
    with pytest.raises(ProtocolError) as err:
        unpack_frame(SECRET, frame, run_id=RUN)
    assert err.value.reason == "bad_tag"


def test_replay_window():
    w = ReplayWindow()
    assert w.accept(1) and w.accept(3) and w.accept(2)
    assert not w.accept(2) and not w.accept(3)
    assert w.accept(2000)
    assert not w.accept(3) and not w.accept(2000 - 1024)
    assert w.accept(2000 - 1023)


def _replay_model(seqs: list[int]) -> list[bool]:
    """What a replay window must answer: a number is accepted once, unless 1024 or more below the highest accepted."""
    seen: set[int] = set()
    top = 0
    out = []
    for seq in seqs:
        ok = seq not in seen and seq > top - REPLAY_WINDOW
        if ok:
            seen.add(seq)
            top = max(top, seq)
        out.append(ok)
    return out


@pytest.mark.parametrize("seed", range(6))
def test_replay_window_in_order_runs_answer_as_the_bitmap(seed):
    """In-order numbers only move ``top`` (the bitmap is folded in later): runs short and long
    (past the window's width), gaps, late and repeated numbers all answer as the model, through
    ``ReplayWindow.accept`` and through ``FrameReader.read``'s inline path (with ``newest``)."""
    rng = random.Random(seed)
    seqs: list[int] = []
    nxt = rng.randint(1, 5)
    while len(seqs) < 3000:
        pick = rng.random()
        if pick < 0.6:  # a run in order, sometimes longer than the window
            run = rng.choice([1, 3, 50, REPLAY_WINDOW - 1, REPLAY_WINDOW, REPLAY_WINDOW + 7])
            seqs += range(nxt, nxt + run)
            nxt += run
        elif pick < 0.75:  # a gap
            nxt += rng.choice([1, 2, 500, REPLAY_WINDOW, 3 * REPLAY_WINDOW])
        else:  # late or repeated: anywhere from just below the top to past the window's edge
            seqs.append(max(1, nxt - rng.randint(1, REPLAY_WINDOW + 50)))
    want = _replay_model(seqs)
    w = ReplayWindow()
    assert [w.accept(seq) for seq in seqs] == want
    frames = {seq: pack_frame(SECRET, m.Ping(nonce=seq, sent_at=1.0), sender="rank0.1", seq=seq, run_id=RUN) for seq in set(seqs)}
    reader = FrameReader(SECRET, RUN)
    top = 0
    for seq, ok in zip(seqs, want, strict=True):
        env = reader.read(frames[seq], "peer")
        assert (env is not None) == ok, seq
        if env is not None:
            assert env.newest == (seq > top), seq
            top = max(top, seq)
    assert reader.drops["replayed"] == want.count(False)


def test_reader_counts_every_drop_and_logs_a_peer_at_most_once_per_interval(caplog):
    clock = FakeClock()
    writer = FrameWriter(SECRET, RUN, "rank0.1")
    reader = FrameReader(SECRET, RUN, clock=clock)
    frame = writer.encode(m.Ping(nonce=1, sent_at=1.0))
    assert reader.read(frame, "peerA") is not None
    with caplog.at_level("WARNING"):
        for _ in range(5):
            assert reader.read(frame, "peerA") is None  # replayed
        assert reader.read(b"junk", "peerA") is None
        assert reader.read(b"junk", "peerB") is None
        clock.advance(DROP_LOG_INTERVAL_S)
        assert reader.read(b"junk", "peerA") is None
    assert reader.drops == {"replayed": 5, "truncated": 3}
    assert reader.accepted == 1
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 3, lines  # peerA, peerB, then peerA again once the interval is over
    assert "replayed" in lines[0] and "peerB" in lines[1]
    assert "5 more from this peer" in lines[2], lines[2]


def test_a_thousand_strangers_write_a_few_lines_not_a_thousand(caplog):
    clock = FakeClock()
    reader = FrameReader(SECRET, RUN, clock=clock)
    with caplog.at_level("WARNING"):
        for i in range(1000):
            reader.read(b"junk", f"conn:{i:08x}")
        clock.advance(DROP_LOG_INTERVAL_S)
        reader.read(b"junk", "conn:last")
    lines = [r.getMessage() for r in caplog.records]
    assert reader.drops == {"truncated": 1001}
    assert len(lines) == DROP_LOG_BURST + 1, len(lines)
    assert f"{1000 - DROP_LOG_BURST} more from other peers" in lines[-1], lines[-1]


def test_own_frames_reflected_back_are_dropped():
    """A frame signed under the reader's own name (or a sub-name such as controller/bulk) was ours: someone copied it back."""
    reader = FrameReader(SECRET, RUN, own="controller")
    for sender in ("controller", "controller/bulk"):
        frame = FrameWriter(SECRET, RUN, sender).encode(m.Ping(nonce=1, sent_at=1.0))
        assert reader.read(frame, "x") is None
    assert reader.drops == {"reflected": 2} and reader.accepted == 0
    assert reader.read(FrameWriter(SECRET, RUN, "controllerish").encode(m.Ping(nonce=1, sent_at=1.0)), "x") is not None


def test_reader_survives_random_garbage():
    """Fuzz: random and mutated frames never raise and never get accepted."""
    rng = random.Random(7)
    writer = FrameWriter(SECRET, RUN, "rank0.1")
    reader = FrameReader(SECRET, RUN)
    good = [writer.encode(m.TimingMsg(0, 0, i, 32, 0.5, 1.0, 0.0, 0.0, 1)) for i in range(1, 50)]
    for i in range(5000):
        base = bytearray(rng.choice(good))
        mode = i % 4
        if mode == 0:
            data = rng.randbytes(rng.randint(0, 200))
        elif mode == 1:
            base[rng.randrange(len(base))] ^= 1 << rng.randrange(8)
            data = bytes(base)
        elif mode == 2:
            data = bytes(base[: rng.randrange(len(base))])
        else:
            data = bytes(base) + rng.randbytes(rng.randint(1, 10))
        assert reader.read(data, "fuzz") is None
    assert reader.accepted == 0
    assert sum(reader.drops.values()) == 5000
    assert set(reader.drops) <= set(DROP_REASONS)


def test_writer_makes_the_bytes_pack_frame_makes():
    """FrameWriter's fast path (spec header, generated body list, a Packer per thread) is byte-exact."""
    golden = json.loads((ROOT / "proto" / "golden" / "valid.json").read_text())
    writer = FrameWriter(SECRET, RUN, "rank0.4301")
    for seq, vector in enumerate(golden["vectors"], start=1):
        msg = message_types()[vector["message"]](**from_json(vector["decoded"]["fields"]))
        assert writer.encode(msg) == pack_frame(SECRET, msg, sender="rank0.4301", seq=seq, run_id=RUN), vector["message"]
    with pytest.raises(ProtocolError) as err:
        writer.encode(m.Heartbeat(step="one", sent_at=1.0, busy="", busy_s=0.0, step_ms=0.0, averaged=-1))
    assert err.value.reason == "schema"
    with pytest.raises(ProtocolError):
        writer.encode(object())
    with pytest.raises(UnicodeEncodeError):  # a string msgpack cannot write: nothing of it leaks into the next frame
        writer.encode(m.Reject(reason="\ud800"))
    after = writer.encode(m.Ping(nonce=1, sent_at=1.0))
    assert unpack_frame(SECRET, after, run_id=RUN).msg == m.Ping(nonce=1, sent_at=1.0)


def test_encoder_makes_the_bytes_encode_makes():
    """FrameWriter.encoder (the controller's Pong from a Ping's fields) numbers from the writer's count, byte-exact."""
    writer = FrameWriter(SECRET, RUN, "controller")
    pong = writer.encoder(m.Pong)
    frames = [writer.encode(m.Pong(nonce=1, sent_at=0.5)), pong(2, 1.5), writer.encode(m.Ping(nonce=3, sent_at=2.5)), pong(4, 3)]
    want = [m.Pong(1, 0.5), m.Pong(2, 1.5), m.Ping(3, 2.5), m.Pong(4, 3.0)]  # an int for a float is widened, as encode does
    for seq, (frame, msg) in enumerate(zip(frames, want, strict=True), start=1):
        assert frame == pack_frame(SECRET, msg, sender="controller", seq=seq, run_id=RUN)
    with pytest.raises(ProtocolError) as err:
        pong("one", 1.0)
    assert err.value.reason == "schema"
    assert unpack_frame(SECRET, pong(6, 1.0), run_id=RUN).seq == 6  # the refused value took number 5, as encode's would
    with pytest.raises(ProtocolError):
        writer.encoder(object)


def test_reader_answers_an_accepted_frame_before_building_it():
    """FrameReader.answer: called with the peer and the field values of every accepted frame of its message, never
    for a dropped one (the controller answers a Ping with its Pong before anything else)."""
    reader = FrameReader(SECRET, RUN)
    calls = []
    reader.answer(m.Ping, lambda peer, *values: calls.append((peer, *values)))
    writer = FrameWriter(SECRET, RUN, "worker.a")
    ping = writer.encode(m.Ping(nonce=7, sent_at=1.5))
    env = reader.read(ping, b"route")
    assert env is not None and env.msg == m.Ping(nonce=7, sent_at=1.5) and env.newest
    assert calls == [(b"route", 7, 1.5)]
    assert reader.read(ping, b"route") is None and reader.drops == {"replayed": 1}
    assert reader.read(FrameWriter(b"x" * 32, RUN, "worker.a").encode(m.Ping(nonce=8, sent_at=1.5)), b"route") is None
    assert reader.read(writer.encode(m.Pong(nonce=9, sent_at=1.5)), b"route") is not None  # another message: not answered
    assert calls == [(b"route", 7, 1.5)] and reader.drops == {"replayed": 1, "bad_tag": 1}
    assert FrameReader(SECRET, RUN).read(ping) is not None  # other readers answer nothing


def test_writer_threads_each_pack_their_own_frames():
    """A rank's training and link threads share one writer: every frame stays whole and numbered once."""
    import threading

    writer = FrameWriter(SECRET, RUN, "rank0.1")
    frames: list[bytes] = []

    def work(base: int) -> None:
        for i in range(2000):
            frames.append(writer.encode(m.TimingMsg(base, 0, i + 1, 32, 0.5, 1.0, 0.0, 0.0, 1)))

    threads = [threading.Thread(target=work, args=(b,)) for b in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    envs = [unpack_frame(SECRET, f, run_id=RUN) for f in frames]  # stateless: the threads' frames interleave beyond a replay window
    assert sorted(e.seq for e in envs) == list(range(1, 8001))
    assert sorted((e.msg.rank, e.msg.step) for e in envs) == [(b, i + 1) for b in range(4) for i in range(2000)]


@pytest.mark.parametrize(
    "ext", [msgpack.Timestamp(1, 0), msgpack.ExtType(5, b"abc"), msgpack.ExtType(5, b"")], ids=["timestamp", "ext", "empty"]
)
def test_msgpack_ext_values_are_malformed_read_or_unpacked(ext):
    """An ext value in an authenticated frame (msgpack's own timestamp too, which no ext hook sees) is
    malformed on the reader's fast path, whose small bodies skip most of msgpack's bounds, as in unpack_frame."""
    frame = _signed(["rank0.1", 1, RUN, 0, 1, 0, "h", 1, "p", 1.0, {"t": ext}])
    with pytest.raises(ProtocolError) as err:
        unpack_frame(SECRET, frame, run_id=RUN)
    assert err.value.reason == "malformed"
    reader = FrameReader(SECRET, RUN)
    assert reader.read(frame) is None and reader.drops == {"malformed": 1}


def test_reader_fast_path_drops_for_the_reasons_unpack_frame_gives():
    """FrameReader.read goes straight to the tag for a sound header; any frame it drops is
    dropped for the reason the full check order (``unpack_frame``) gives, and good ones pass."""
    rng = random.Random(11)
    writer = FrameWriter(SECRET, RUN, "rank0.1")
    samples = [m.TimingMsg(0, 0, 1, 32, 0.5, 1.0, 0.0, 0.0, 1), m.Ping(nonce=3, sent_at=2.0), m.Reject(reason="x" * 300)]
    for i in range(3000):
        frame = bytearray(writer.encode(rng.choice(samples)))
        mode = i % 6
        if mode == 1:
            frame[rng.randrange(len(frame))] ^= 1 << rng.randrange(8)
        elif mode == 2:
            frame = frame[: rng.randrange(len(frame))]
        elif mode == 3:
            frame += rng.randbytes(rng.randint(1, 5))
        elif mode == 4:  # a valid tag over a body that lies about its kind or its length
            body = bytes(frame[HEADER.size : -16])
            kind = rng.choice([m.Ping.KIND, m.TimingMsg.KIND, 999])
            unsigned = HEADER.pack(MAGIC, m.PROTOCOL_VERSION, kind, len(body) + rng.choice([0, 0, 1, -1])) + body
            frame = bytearray(unsigned + sign(SECRET, unsigned))
        elif mode == 5:  # someone else's run
            unsigned = bytes(frame[:-16]).replace(RUN.encode(), b"other-run".ljust(len(RUN), b"-"))
            frame = bytearray(unsigned + sign(SECRET, unsigned))
        data = bytes(frame)
        try:
            unpack_frame(SECRET, data, run_id=RUN)
            want = None
        except ProtocolError as exc:
            want = exc.reason
        reader = FrameReader(SECRET, RUN)
        env = reader.read(data, b"\x00\x01\x02\x03\x04")
        if want is None:
            assert env is not None and not reader.drops
        else:
            assert env is None and reader.drops == {want: 1}, (mode, want, reader.drops)


def test_a_route_names_its_connection_only_in_a_drop_line(caplog):
    reader = FrameReader(SECRET, RUN)
    with caplog.at_level("WARNING"):
        assert reader.read(b"junk", b"\x00\x80\x00\x00\x2a") is None
        assert reader.read(b"junk", b"evil\nline") is None
    lines = [r.getMessage() for r in caplog.records]
    assert "conn:8000002a" in lines[0] and "evil\\nline" in lines[1]
