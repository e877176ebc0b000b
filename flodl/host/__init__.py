"""What a host gives the run: its processes, devices, hosts file and resource gauges.

* ``proc``        process hygiene: no orphan survives its parent, no child outlives a teardown
* ``devices``     which devices a worker runs ranks on
* ``hostfile``    the hosts of a multi-host run and each host's ssh command
* ``gauges``      CPU, memory and GPU gauges sampled on a thread (the rank and the monitor read them)

This package re-exports nothing; import modules by name.
"""
