"""The run's rendezvous store, hosted beside the ranks: ``python -m flodl.host.store_server PORT_FILE BIND``.

torch.distributed's groups meet at a ``TCPStore``. The controller used to open it itself,
which made it import torch (about 2 s of CPU at every start, beside the zygote's own import
of it). With an embedded worker, that worker asks its zygote to fork this module instead:
torch is imported there already, so the fork opens the store at once. It writes the port to
``PORT_FILE`` (written whole, by rename; ``0`` when the store could not open), then serves
until its zygote goes (PDEATHSIG) or it is terminated. The store outlives any rank: ranks
are the zygote's other children.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path
from typing import Any

from ..config import env as flodl_env
from .proc import die_with_parent


def open_store(bind: str) -> Any:
    """The ranks' rendezvous, a torch ``TCPStore`` on ``bind`` (a free port); it survives
    membership generations (each gets a key prefix). The controller's fallback opens it the
    same way (``controller/plane.py``)."""
    import torch.distributed as dist

    return dist.TCPStore(bind, 0, is_master=True, wait_for_workers=False)


def write_port(path: str, port: int) -> None:
    """``port`` into ``path`` in one step: the controller never reads half of it."""
    tmp = Path(f"{path}.tmp{os.getpid()}")
    tmp.write_text(str(port))
    os.replace(tmp, path)


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 2:
        print("usage: python -m flodl.host.store_server PORT_FILE BIND", file=sys.stderr)
        return 2
    path, bind = args
    die_with_parent(flodl_env.parent_pid())
    try:
        store = open_store(bind)
    except Exception as exc:  # noqa: BLE001 - the controller opens its own store then
        print(f"flodl: the worker could not open the run's store on {bind}: {exc}", file=sys.stderr)
        write_port(path, 0)
        return 1
    write_port(path, store.port)
    while True:  # SIGTERM (the worker's stop) or PDEATHSIG ends it: the store holds nothing to save
        signal.pause()


if __name__ == "__main__":
    sys.exit(main())
