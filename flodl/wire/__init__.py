"""How processes talk: the control protocol, its sockets, and the bulk plane.

* ``messages``    the wire message types, generated from ``proto/schema.json`` (do not edit)
* ``codec``       envelopes and frames
* ``transport``   ZeroMQ sockets on the asyncio loop: the control plane's plumbing
* ``curve``       optional ZeroMQ CURVE encryption of both planes
* ``bulk``        the bulk plane's message shape: a signed header frame plus raw tensor frames
* ``shm``         shared-memory segments, the bulk plane's same-host lane (torch)
* ``shm_sweep``   sweeping stale segments without torch (the worker sweeps too)

This package re-exports nothing; import modules by name.
"""
