"""Optional ZeroMQ CURVE encryption of the control and bulk planes.

Frames are always authenticated (a keyed BLAKE2b tag with the run secret); on a network
that is not trusted, ``--encrypt`` (``FLODL_ENCRYPT=1`` in the environment of
every process of the run) also encrypts them. There is no key to hand out:
the controller's CURVE key pair is derived from the run secret, so exactly the
processes holding the secret know the server's public key and can complete
the handshake; each client uses a fresh key pair per socket. A peer without
the secret cannot even connect, let alone send a frame the tag check would then
refuse.

What CURVE does not cover: torch's TCPStore rendezvous and the NCCL/gloo
collectives (``nccl-*`` modes) travel as torch sends them. On an untrusted
network use a ``cpu-*`` mode, whose parameters go through the bulk plane,
and keep the store's port closed to strangers (``docs/multihost.md``).

Each process turns it on once, at start (``enable``), before it makes a
socket; every socket factory of flodl then calls ``server`` or ``client``.
"""

from __future__ import annotations

import hashlib
import hmac
from typing import Any

import zmq
from zmq.utils import z85

from ..config.env import encryption_requested

_server_secret: bytes | None = None  # z85 secret key of the run's server side
_server_public: bytes | None = None


def requested() -> bool:
    """``FLODL_ENCRYPT`` asks for encryption in this process's environment."""
    return encryption_requested()


def available() -> bool:
    """This libzmq was built with CURVE (pyzmq's wheels are)."""
    return bool(zmq.has("curve"))


def enable(secret: bytes) -> None:
    """Encrypt every socket this process makes from now on, keys derived from ``secret``.

    Raises:
        RuntimeError: libzmq has no CURVE support.
    """
    global _server_secret, _server_public
    if not available():
        raise RuntimeError("encryption asked for, but this libzmq has no CURVE support (install pyzmq's wheel)")
    seed = hmac.new(secret, b"flodl curve server key v1", hashlib.sha256).digest()
    _server_secret = z85.encode(seed)
    _server_public = zmq.curve_public(_server_secret)


def disable() -> None:
    global _server_secret, _server_public
    _server_secret = _server_public = None


def enabled() -> bool:
    return _server_secret is not None


def server(sock: zmq.Socket[Any]) -> None:
    """Make a bound socket a CURVE server (before ``bind``); no-op when off."""
    if _server_secret is None:
        return
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, _server_secret)


def client(sock: zmq.Socket[Any]) -> None:
    """Make a connecting socket a CURVE client of the run's servers (before ``connect``); no-op when off."""
    if _server_secret is None:
        return
    assert _server_public is not None  # set with the secret
    public, secret = zmq.curve_keypair()
    sock.setsockopt(zmq.CURVE_SERVERKEY, _server_public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
