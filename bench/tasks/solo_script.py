"""The overhead bench's script-mode side (``bench/overhead.py --script``): bench/tasks/solo.py's
training (same data, model, optimizer, batch size) in the user's own loop, run by
``python -m flodl.controller --script``. The plain side of the bench is unchanged.

Eager only: ``FLODL_BENCH_COMPILE`` is refused by the bench for script mode, and a
task with a ``train_step`` instead of a ``loss_fn`` cannot be looped here.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench is importable

import flodl
from bench.tasks import solo


def main() -> None:
    run = flodl.init()
    task = solo.task()
    if task.loss_fn is None:
        raise SystemExit(f"bench/tasks/solo_script.py: model {solo.model_name()!r} has no loss_fn to loop over")
    model = task.model()
    optimizer = task.optimizer(model)
    model, optimizer = run.prepare(model, optimizer, task.dataset, batch_size=task.batch_size, collate_fn=task.collate_fn)
    for _ in run.epochs():
        for x, y in run.batches():
            loss = task.loss_fn(model(x), y)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            run.step(loss)


if __name__ == "__main__":
    main()
