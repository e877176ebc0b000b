"""The matrix's script-mode cases (issue 18): a model of bench/matrix/tasks.py trained in the user's own loop.

    python -m flodl.controller --script bench/matrix/script.py --nproc-per-node 2 --epochs 3 -- --model mlp --epochs 3

The same model (same seed), data, optimizer, batch size and loss as the ``Task``
cases (``bench.matrix.tasks``), looped as a training script does it. Each rank
scores its replica after the last epoch's batches and ``run.report``s it under the
model's metric; the suite takes the mean over ranks as the run's eval (script mode
has no controller-driven eval: docs/script-mode.md). ``--eval-every-epoch`` (the
time-to-target bench, ``bench/matrix/target.py``): every epoch is scored, and
each rank reports the seconds its eval took as ``eval_s`` too, so that the
bench can take them out of the training time.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repo root: bench is importable

from torch.utils.data import TensorDataset

import flodl
from bench.matrix import tasks


def main() -> None:
    parser = argparse.ArgumentParser(description="a matrix model in script mode")
    parser.add_argument("--model", required=True, choices=sorted(tasks.SPECS))
    parser.add_argument("--epochs", type=int, required=True, help="the run's --epochs: the last one is scored")
    parser.add_argument("--eval-every-epoch", action="store_true", help="score every epoch, and report each eval's seconds as eval_s")
    args = parser.parse_args()
    run = flodl.init()
    spec = tasks.SPECS[args.model]
    x, y = tasks.train_data(spec)
    model = tasks.make_model(spec)
    optimizer = spec.optimizer(model)
    loss_fn = tasks.loss_fn(spec)
    model, optimizer = run.prepare(model, optimizer, TensorDataset(x, y), batch_size=spec.batch)
    for epoch in run.epochs():
        model.train()
        for xb, yb in run.batches():
            loss = loss_fn(model(xb), yb)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            run.step(loss)
        if args.eval_every_epoch:
            t0 = time.perf_counter()
            value = tasks.evaluate(spec, model, run.device)
            run.report(**{spec.metric: value, "eval_s": time.perf_counter() - t0})
        elif epoch == args.epochs - 1:  # only the last: the Task cases' evals are not in their train wall either
            run.report(**{spec.metric: tasks.evaluate(spec, model, run.device)})


if __name__ == "__main__":
    main()
