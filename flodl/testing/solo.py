"""A rank's parts in process, joined as the only rank of a run (tests and benchmarks).

``RankRunner.join`` takes a welcome; ``solo_welcome`` is the one a controller
would send a run of one rank. A test or a bench sets the runner's task and
model (what the build makes), joins, and then drives the parts directly: a
``Steps.step``, a ``Windows.run_rounds``, with no controller and no link thread.
"""

from __future__ import annotations

from ..config import DdpRunConfig
from ..wire import messages as m


def solo_welcome(
    config: DdpRunConfig | None = None, *, seed: int = 1, epochs: int = 1, collective_timeout_s: float = 30.0
) -> m.RankWelcome:
    """The welcome of rank 0 in a run of one (no process group, no bulk plane)."""
    return m.RankWelcome(
        rank=0,
        world_size=1,
        generation=0,
        store_host="127.0.0.1",
        store_port=0,
        store_prefix="solo/gen0",
        collective_timeout_s=collective_timeout_s,
        config=(config or DdpRunConfig()).to_dict(),
        seed=seed,
        bulk_port=0,
        late=False,
        shm_probe="",
        shm_nonce="",
        first_epoch=0,
        epochs=epochs,
    )
