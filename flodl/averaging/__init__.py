"""CPU averaging's rounds: snapshot slices in, weighted averages out (``CpuSync``, ``CpuCadence``, ``CpuAsync``).

- ``rounds.py``: the round core: bookkeeping, folding, timeouts; no sockets.
- ``server.py``: the bulk socket and same-host lane sources send slices to,
  driving the core; the controller's averager.
- ``relay.py``: a worker's host relay: the same server for its local ranks,
  whose averages go upstream instead of back.

Nothing here imports ``flodl.controller``, so a relaying worker loads this
package alone; and this file imports nothing, so importing one module does
not load the others. The rank's side is ``flodl/rank/cpu_average.py``.
"""
