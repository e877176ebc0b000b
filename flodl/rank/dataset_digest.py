"""The dataset digest: a cheap hash that shows every rank built the same dataset.

The ranks train positions of one global permutation (plan/schedule.py): rank
1's sample 37 must be rank 0's, or the run trains a mix of datasets and
nothing says so. Their lengths alone miss a dataset drawn without a seed
(every rank its own samples, as many of them). The hello carries this digest:
a hash of the samples at ``digest_positions`` (a few, first to last: cheap
whatever the dataset's size), read as training reads them (``dataset[i]``) and
encoded bit-exact as the disk tier encodes them (sample_codec.py: tensors,
arrays, numbers, strings and containers of them); for a ``flodl.Shards``, its
shard ids at those positions (opening a shard may mean reading a file).

What cannot be hashed the same way twice is not hashed: the reads draw from
host RNGs seeded alike on every rank (a transform that draws from the global
generators gives every rank the same sample) and put back afterwards; every
position is read twice, and samples that differ between the two reads
(augmentation from a generator of the dataset's own, a clock) leave the
digest empty, as does a sample of another kind (an image object) or a read
that raises. The controller then compares the lengths only: the digest is a
check, never a reason for a build to fail.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Any

from ..plan.schedule import digest_positions
from ..shards import Shards
from .determinism import kept_rngs, seed_host
from .sample_codec import SampleCodec

log = logging.getLogger(__name__)

#: The host RNGs' seed while the digest reads (any value, the same on every rank).
READ_SEED = 0


def dataset_digest(dataset: Any) -> str:
    """The digest of ``dataset`` (hex), or "" when its samples cannot be hashed the same way twice."""
    positions = digest_positions(len(dataset))
    try:
        with kept_rngs():
            first, again = _hash(dataset, positions), _hash(dataset, positions)
    except Exception as exc:  # the user's dataset: any read may raise (and training will say so), or hold objects
        log.debug("no dataset digest: %s: %s", type(exc).__name__, exc)
        return ""
    if first != again:
        log.debug("no dataset digest: the samples at positions %s differ between two reads", positions)
        return ""
    return first


def _hash(dataset: Any, positions: list[int]) -> str:
    seed_host(READ_SEED)
    codec, h = SampleCodec(), hashlib.blake2b(digest_size=16)
    for i in positions:
        sample = _shard_id(dataset.shard_ids[i]) if isinstance(dataset, Shards) else dataset[i]
        frame = codec.encode(sample)
        h.update(len(frame).to_bytes(8, "little"))
        h.update(frame)
    return h.hexdigest()


def _shard_id(shard: Any) -> Any:
    """A shard id as plain data: a path as its text."""
    return os.fspath(shard) if isinstance(shard, os.PathLike) else shard
