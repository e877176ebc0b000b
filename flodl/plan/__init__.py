"""The run's decisions as pure logic: no sockets, no event loop, no clock (time is passed in).

The controller feeds them what it hears and carries out what they answer; tests step them
directly with golden values.

* ``cadence``     one averaging window at a time: ties dispatch, ElChe and the guard together
* ``dispatch``    what each rank trains in the next window
* ``pool``        one epoch's samples handed out, trained, or given back: the coverage ledger
* ``schedule``    epoch permutations every rank derives on its own
* ``elche``       the cadence balancer: each rank's share of a window
* ``guard``       divergence guard and LR-aware meta-controller
* ``signals``     the phase and the verdict ElChe and the guard exchange
* ``metrics``     per-epoch counters and folding the ranks' reports into one row
* ``membership``  who is in the run, who is alive
* ``progress``    liveness as progress
* ``decisions``   what a fault leads to

This package re-exports nothing; import modules by name.
"""
