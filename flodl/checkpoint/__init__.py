"""Checkpoints: bundles of the consensus model, an optimizer state, and the run's trajectory.

* ``bundle``          save and load the data files (torch); the names users call, re-exported here
* ``files``           where a bundle's files live, and how a save replaces a bundle without tearing it
* ``meta``            the sidecar ``<stem>.meta.json``: commit it, read it back, check its files
* ``safetensors_io``  tensors to and from safetensors files, no pickle
* ``atomic_file``     atomic, durable file writes

Only ``bundle`` imports torch. The controller uses ``files`` and ``meta`` and must start without
torch, so ``from flodl.checkpoint import load_model`` imports ``bundle`` on first use.
"""

_BUNDLE = ("load_model", "load_optimizer", "read_meta", "save_model", "save_optimizer")


def __getattr__(name: str):
    if name in _BUNDLE:
        from . import bundle

        return getattr(bundle, name)
    raise AttributeError(f"module 'flodl.checkpoint' has no attribute {name!r}")


__all__ = list(_BUNDLE)
