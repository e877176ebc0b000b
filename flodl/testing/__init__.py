"""Test fakes and fault injection, kept out of the product namespace (like ``trio.testing``).

* ``sim``     simulated workers and ranks that speak the real protocol, on one event loop
* ``faults``  a rank kills or stops itself at a chosen point (``FLODL_INJECT_FAULT``)
* ``pace_board`` the live step time simulated slow ranks pace against (``FLODL_SIMULATE_PACE_FILE``)
* ``probes``  both, as the probes product code calls (``flodl/probes.py``): an entry point
  installs them when one of those variables is set; no other product module imports this package

This package re-exports nothing: importing it costs nothing.
"""
