"""A passive sniffer of the control plane: copies flodl frames off the wire.

Frames are authenticated, not encrypted, so anyone who sees the traffic (a
mirror port, a compromised switch, root on a host of the same bridge) can
copy them; ``tests/test_network.py`` uses the copies to try replays. A
``Sniffer`` reads every IPv4/TCP packet on one interface with an
``AF_PACKET`` socket (root only) and picks out ZeroMQ (ZMTP 3) data frames
sent to one TCP port whose body is a flodl frame: magic, version, kind and a
body length that agrees with the ZMTP frame size. A frame split across two
TCP segments is missed; control frames are small, so few are.
"""

from __future__ import annotations

import socket
import threading

import msgpack

from flodl.wire.codec import HEADER, MAGIC, MIN_FRAME, TAG_LEN

_ETH_P_IP = 0x0800


def zmtp_frames(payload: bytes) -> list[bytes]:
    """Every whole flodl frame carried as a single-part ZMTP message in ``payload`` (one TCP segment)."""
    found = []
    i, n = 0, len(payload)
    while i + 4 <= n:
        flags = payload[i]
        if flags == 0x00 and payload[i + 2 : i + 4] == MAGIC:  # short frame: flags, 1-byte size
            start, size = i + 2, payload[i + 1]
        elif flags == 0x02 and i + 11 <= n and payload[i + 9 : i + 11] == MAGIC:  # long frame: flags, 8-byte size
            start, size = i + 9, int.from_bytes(payload[i + 1 : i + 9], "big")
        else:
            i += 1
            continue
        frame = payload[start : start + size]
        if len(frame) == size >= MIN_FRAME and HEADER.size + HEADER.unpack_from(frame)[3] + TAG_LEN == size:
            found.append(bytes(frame))
            i = start + size
        else:
            i += 1
    return found


def sender_seq(frame: bytes) -> tuple[str, int, str, int]:
    """(sender, seq, run id, kind) of a frame, read without the secret (nothing is encrypted)."""
    kind = HEADER.unpack_from(frame)[2]
    body = msgpack.unpackb(frame[HEADER.size : -TAG_LEN], raw=False)
    return body[0], body[1], body[2], kind


class Sniffer(threading.Thread):
    """Collects the flodl frames sent to TCP port ``port`` seen on ``ifname``, in order, once each."""

    def __init__(self, ifname: str, port: int) -> None:
        super().__init__(daemon=True, name=f"sniff-{ifname}")
        self.port = port
        self.sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_IP))
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 16 << 20)
        self.sock.bind((ifname, _ETH_P_IP))
        self.sock.settimeout(0.2)
        self.frames: list[bytes] = []
        self._seen: set[bytes] = set()  # TCP retransmissions carry the same frame again
        self._halt = threading.Event()
        self.lock = threading.Lock()

    def run(self) -> None:
        while not self._halt.is_set():
            try:
                data = self.sock.recv(1 << 18)
            except TimeoutError:
                continue
            except OSError:
                return
            for frame in self._parse(data):
                with self.lock:
                    if frame not in self._seen:
                        self._seen.add(frame)
                        self.frames.append(frame)

    def _parse(self, data: bytes) -> list[bytes]:
        if len(data) < 34 or data[12:14] != b"\x08\x00" or data[23] != 6:  # IPv4, TCP
            return []
        ihl = (data[14] & 0x0F) * 4
        tcp = 14 + ihl
        if len(data) < tcp + 20 or int.from_bytes(data[tcp + 2 : tcp + 4], "big") != self.port:
            return []
        total = int.from_bytes(data[16:18], "big") or len(data) - 14  # 0 in a TSO super-frame
        payload = data[tcp + (data[tcp + 12] >> 4) * 4 : 14 + total]
        return zmtp_frames(payload) if payload else []

    def snapshot(self) -> list[bytes]:
        with self.lock:
            return list(self.frames)

    def stop(self) -> None:
        self._halt.set()
        self.join(2)
        self.sock.close()
