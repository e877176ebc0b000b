"""An intruder on the control network, for ``tests/test_network.py``.

    python tests/intruder.py --controller tcp://ADDR:PORT --captured FILE --out FILE

It runs on a host of the run's network that is no part of the run (a fourth
namespace), knows the protocol (it is open source) but not the run secret,
and holds frames a sniffer captured off the wire (frames are authenticated,
not encrypted, so anyone on the path can copy them). It tries, in order:

1. raw TCP that is not ZeroMQ 3 at all (an HTTP request, 4 KB of fixed
   random bytes, a ZMTP greeting with an unknown security mechanism);
2. forged frames: real message types with plausible fields (a worker's hello,
   a rank's exit, a rank's error, a ping the controller would answer), signed
   with a secret of its own, plus one captured frame with a byte flipped;
3. malformed messages: empty, shorter than a header, wrong magic, an unknown
   protocol version, a header announcing a body over the size limit, a
   three-part message, and a 2 MB message (on its own connection, which
   libzmq closes at the size header: it never reaches the codec);
4. replays: every captured frame, sent again unchanged from its own
   connection. Each was already accepted from its real sender, so the
   controller's per-sender replay window must drop it (``replayed``), whatever
   the connection it arrives on.

A last connection gives itself a routing id holding a line break and a
terminal escape: the id shows up in the controller's warning about the
dropped frame, and must not become a log line of its own.

It then listens for two seconds: a controller that acted on anything would
answer (a ``Pong``, a ``Reject``, a ``WorkerWelcome``). With ``--phases``
including ``hijack`` it finally connects again and again with a real rank's
ZeroMQ routing id (its sender name, which every frame carries in clear) for
``--hold-secs``, counting the frames meant for that rank that reach it.
``--out`` gets the drop count the controller should show for each reason (if
the frames reach its codec at all: under ``--encrypt`` none should), and what
came back.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import random
import secrets
import socket
import sys
import time
from pathlib import Path
from typing import Any

import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from flodl.wire import messages as m
from flodl.wire.codec import HEADER, MAGIC, TAG_LEN, pack_frame
from flodl.wire.messages import PROTOCOL_VERSION, SCHEMA

FORGED_LINE = "[controller] epoch 99/99 FORGED BY THE INTRUDER"

#: A routing id holding a line break and a terminal escape, then a line the controller never wrote.
LIAR_ID = b"x\n" + FORGED_LINE.encode() + b"\x1b[1A"

_DEFAULTS = {"int": 0, "float": 0.0, "str": "", "bool": False, "bytes": b"", "value": None}


def _blank(wire_type: str) -> Any:
    if wire_type in _DEFAULTS:
        return _DEFAULTS[wire_type]
    if wire_type.startswith("opt<"):
        return None
    return [] if wire_type.startswith("list<") else {}


def forge(cls: type, **fields: Any) -> Any:
    """A message of ``cls`` with ``fields`` and every other field blank (robust to schema additions)."""
    _, _, spec = next(v for v in SCHEMA.values() if v[1] is cls)
    return cls(**{name: fields.get(name, _blank(t)) for name, t in spec})


#: ZMTP 3.0 greeting (signature, version 3.0) naming a security mechanism no ZeroMQ peer knows.
BAD_GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"FLODL-NOPE".ljust(20, b"\x00") + b"\x00" * 32
#: Bytes no ZeroMQ peer would send, the same on every run: libzmq takes a peer
#: whose first byte is not 0xff for a ZMTP 1.0 one and cuts the rest into
#: messages, which reach the controller's codec (and are counted there).
GARBAGE = random.Random(20240611).randbytes(4096)


def raw_tcp(host: str, port: int) -> dict:
    """Connections that do not speak ZMTP 3: the controller must shrug them off."""
    seen = {}
    for name, payload in (("http", b"GET / HTTP/1.1\r\nHost: flodl\r\n\r\n"), ("garbage", GARBAGE), ("bad mechanism", BAD_GREETING)):
        with socket.create_connection((host, port), timeout=5) as s:
            try:
                s.sendall(payload)
                s.settimeout(1.5)
                got = s.recv(4096)  # ZeroMQ sends its greeting first
                while got:
                    got = s.recv(4096)
                seen[name] = "closed by the controller"
            except TimeoutError:
                seen[name] = "left open"
            except OSError as exc:
                seen[name] = type(exc).__name__
    return seen


def hijack(ctx: zmq.Context, addr: str, identity: bytes, hold_s: float) -> int:
    """Connect again and again with a peer's routing id for ``hold_s``; how many frames meant for it arrived here."""
    got = 0
    end = time.monotonic() + hold_s
    while time.monotonic() < end:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.ROUTING_ID, identity)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(addr)
        until = min(end, time.monotonic() + 0.5)
        while time.monotonic() < until:
            if sock.poll(50):
                sock.recv_multipart()
                got += 1
        sock.close()
    return got


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--controller", required=True)
    p.add_argument(
        "--captured", required=True, help="JSON: run_id, worker_sender, rank_sender (names of real peers) and frames (hex, may be empty)"
    )
    p.add_argument("--out", required=True)
    p.add_argument("--phases", default="wire,forged,malformed,liar,replay", help="comma-separated, in this order; also: hijack")
    p.add_argument("--hijack-id", default="", help="routing id to take over (hijack phase): a rank's sender name")
    p.add_argument("--hold-secs", type=float, default=8.0, help="how long the hijack phase keeps taking the route")
    args = p.parse_args()
    faulthandler.dump_traceback_later(60, exit=True)  # a stuck intruder says where, and never hangs the test
    phases = set(args.phases.split(","))
    captured = json.loads(Path(args.captured).read_text())
    frames = [bytes.fromhex(h) for h in captured["frames"]]
    run_id = captured["run_id"]
    worker, rank = captured["worker_sender"], captured["rank_sender"]
    host, port = args.controller.removeprefix("tcp://").rsplit(":", 1)
    expected: dict[str, int] = {}  # what the controller's codec should count, if the frames reach it

    def expect(reason: str, n: int = 1) -> None:
        expected[reason] = expected.get(reason, 0) + n

    unsent = [0]

    def send(s: zmq.Socket, data: bytes | list[bytes], reason: str) -> None:
        """Hand a frame to ZeroMQ and expect the controller to count it; under --encrypt the
        handshake never completes, so a DEALER may have no peer and the send times out (counted)."""
        try:
            s.send_multipart(data) if isinstance(data, list) else s.send(data)
        except zmq.Again:
            unsent[0] += 1
            return
        expect(reason)

    report: dict[str, Any] = {"raw_tcp": raw_tcp(host, int(port)) if "wire" in phases else {}}

    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.ROUTING_ID, b"intruder-" + secrets.token_hex(4).encode())  # a new identity: no route to steal
    sock.setsockopt(zmq.LINGER, 1000)
    sock.setsockopt(zmq.SNDTIMEO, 3000)
    sock.connect(args.controller)

    if "forged" in phases:  # the right run id and real senders, a wrong secret
        wrong = secrets.token_bytes(32)
        versions = {"protocol": str(PROTOCOL_VERSION), "flodl": "0"}
        forged = [
            (forge(m.Ping, nonce=7, sent_at=time.time()), worker),
            (forge(m.WorkerHello, host="flodl-n4", pid=4242, devices=["cpu", "cpu"], versions=versions), "worker.flodl-n4.4242"),
            (forge(m.RankExited, rank=0, pid=1, code=-9), worker),
            (forge(m.RankError, rank=1, stage="train", error="forged failure", detail="", generation=0), rank),
            (forge(m.Exiting, rank=2, reason="forged", digest=""), rank),
        ]
        for i, (msg, sender) in enumerate(forged):
            send(sock, pack_frame(wrong, msg, sender=sender, seq=1_000_000 + i, run_id=run_id), "bad_tag")
        if frames:
            tampered = bytearray(frames[0])
            tampered[HEADER.size] ^= 0x01  # one bit of the body; the tag no longer matches
            send(sock, bytes(tampered), "bad_tag")

    if "malformed" in phases:
        send(sock, b"", "truncated")
        send(sock, b"\x00" * 10, "truncated")
        send(sock, b"GARBAGE!" + secrets.token_bytes(56), "bad_magic")
        send(sock, HEADER.pack(MAGIC, 99, 11, 8) + b"\x00" * (8 + TAG_LEN), "unknown_version")
        send(sock, HEADER.pack(MAGIC, PROTOCOL_VERSION, 11, 0xFFFFFFFF) + b"\x00" * (TAG_LEN + 4), "oversized")  # 4 GiB announced
        # 2 MB: over every control socket's ZMQ_MAXMSGSIZE, so libzmq closes the connection at the
        # size header and the codec never sees it (not counted); on a socket of its own, since the
        # connection it rides on is closed, with whatever follows it
        big = ctx.socket(zmq.DEALER)
        big.setsockopt(zmq.LINGER, 1000)
        big.connect(args.controller)
        try:
            big.send(MAGIC + secrets.token_bytes(2 << 20), zmq.NOBLOCK)
        except zmq.Again:
            unsent[0] += 1
        big.close()
        send(sock, [b"two", b"parts"], "malformed")

    liar = None
    if "liar" in phases:  # a routing id is chosen by the peer and shows up in the controller's warnings
        liar = ctx.socket(zmq.DEALER)
        liar.setsockopt(zmq.ROUTING_ID, LIAR_ID)
        liar.setsockopt(zmq.LINGER, 1000)
        liar.setsockopt(zmq.SNDTIMEO, 3000)
        liar.connect(args.controller)
        send(liar, b"GARBAGE!" + b"\x00" * 56, "bad_magic")

    if "replay" in phases:  # genuine frames again, from a connection of our own
        for frame in frames:
            send(sock, frame, "replayed")

    replies = []
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        if sock.poll(100):
            replies.append(sock.recv_multipart())
    report["hijacked_frames"] = hijack(ctx, args.controller, args.hijack_id.encode(), args.hold_secs) if "hijack" in phases else 0
    sock.close()  # lingers (bounded) until everything queued is handed to the kernel
    if liar is not None:
        liar.close()
    ctx.term()
    report |= {"expected": expected, "unsent": unsent[0], "replies": len(replies), "reply_sizes": [sum(map(len, r)) for r in replies]}
    Path(args.out).write_text(json.dumps(report, indent=1) + "\n")
    print(json.dumps(report), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
