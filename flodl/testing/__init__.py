"""Test fakes and fault injection, kept out of the product namespace (like ``trio.testing``).

* ``sim``     simulated workers and ranks that speak the real protocol, on one event loop
* ``faults``  a rank kills or stops itself at a chosen point (``FLODL_INJECT_FAULT``); inert
  unless the variable is set, so ranks import it unconditionally

This package re-exports nothing: importing it costs nothing.
"""
