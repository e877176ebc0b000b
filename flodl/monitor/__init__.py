"""The monitor: record stream, dashboard, timeline, resources.

Everything a run tells the outside about itself while it trains and after it
ends lives here: the path-keyed record stream (``records``) and its bounded
on-disk ring (``record_log``) with a reader tool (``reader``), the live and
archived dashboard, the timeline export and the resource sampler. Modules are
imported by name; this package re-exports nothing.
"""
