"""BatchNorm statistics after averaging: as averaged, or re-estimated (flodl/rank/norms.py).

    python bench/bn_recal.py [--quick | --smoke]

Two ResNet-20 replicas (``bench.matrix.tasks``: the matrix's model, data,
optimizer and initial weights) train Local SGD the way unequal ranks do under
Cadence: per round the fast one takes ``4x`` the batches of the slow one, then
both take the average (parameters weighted by batches, BatchNorm statistics
averaged plainly, as flodl averages buffers). After every average the held-out
accuracy is measured twice: the averaged model as it is, and a copy whose
BatchNorm statistics ``flodl.rank.norms.recalibrate`` re-estimated from 16
training batches (what a flodl eval rank does before scoring). Single process,
CPU, fixed seeds: the difference is the statistics, nothing else.

``--smoke``: one round of 4+1 batches on 256 training and 250 held-out images,
2 batches to re-estimate, results in a temporary folder (does the bench still run?).
"""

from __future__ import annotations

import copy
import dataclasses
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import Row, report, size_parser, smoke_results  # noqa: E402
from bench.matrix import tasks  # noqa: E402
from flodl.rank.norms import norm_layers, recalibrate  # noqa: E402

RECAL_BATCHES = 16


def averaged_state(models: list[torch.nn.Module], weights: list[float]) -> dict[str, torch.Tensor]:
    """Parameters weighted by batches; floating buffers (BatchNorm statistics) plainly averaged; the rest from the first."""
    states = [m.state_dict() for m in models]
    buffers = {name for name, _ in models[0].named_buffers()}
    out = {}
    for key, first in states[0].items():
        if not first.dtype.is_floating_point:
            out[key] = first
        elif key in buffers:
            out[key] = sum(s[key] for s in states) / len(states)
        else:
            out[key] = sum(w * s[key] for w, s in zip(weights, states, strict=False)) / sum(weights)
    return out


def main() -> None:
    args = size_parser(__doc__, "5 rounds of 32+8 batches instead of 8 of 48+12", "1 round of 4+1 batches on 256 images").parse_args()
    rounds, fast, slow = (1, 4, 1) if args.smoke else (5, 32, 8) if args.quick else (8, 48, 12)
    recal_batches = 2 if args.smoke else RECAL_BATCHES
    torch.manual_seed(0)
    torch.set_num_threads(max(1, min(4, torch.get_num_threads())))
    spec = tasks.SPECS["resnet20"]
    if args.smoke:  # toy data: the numbers mean nothing, the path is the bench's own
        spec = dataclasses.replace(spec, samples=256, eval_samples=250)
    x, y = tasks.train_data(spec, spec.samples)
    loss_fn = tasks.loss_fn(spec)
    replicas = [tasks.make_model(spec), tasks.make_model(spec)]
    optimizers = [spec.optimizer(m) for m in replicas]
    order = torch.randperm(len(x), generator=torch.Generator().manual_seed(0))
    cursor = [0]

    def batch() -> tuple[torch.Tensor, torch.Tensor]:
        if cursor[0] + spec.batch > len(x):
            cursor[0] = 0
        idx = order[cursor[0] : cursor[0] + spec.batch]
        cursor[0] += spec.batch
        return x[idx], y[idx]

    rows: list[Row] = []
    start = time.perf_counter()
    cpu = torch.device("cpu")
    for r in range(rounds):
        for model, opt, n in zip(replicas, optimizers, (fast, slow), strict=False):
            model.train()
            for _ in range(n):
                xb, yb = batch()
                loss = loss_fn(model(xb), yb)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
        state = averaged_state(replicas, [fast, slow])
        for model in replicas:
            model.load_state_dict(state)
        as_averaged = tasks.evaluate(spec, replicas[0], cpu)
        fresh = copy.deepcopy(replicas[0])
        recalibrate(fresh, norm_layers(fresh), (batch()[0] for _ in range(recal_batches)))
        re_estimated = tasks.evaluate(spec, fresh, cpu)
        print(
            f"round {r + 1}/{rounds} ({time.perf_counter() - start:.0f} s): eval {as_averaged * 100:.1f}% as averaged, "
            f"{re_estimated * 100:.1f}% re-estimated",
            flush=True,
        )
        case = f"after average {r + 1} of {rounds}"
        rows += [
            Row(case, "eval, statistics as averaged", as_averaged * 100, "%"),
            Row(case, "eval, statistics re-estimated", re_estimated * 100, "%"),
            Row(case, "gain", (re_estimated - as_averaged) * 100, "points"),
        ]
    report(
        "bn_recal",
        rows,
        note=f"ResNet-20, 2 replicas, {fast}+{slow} batches of {spec.batch} per round (4:1), "
        f"{recal_batches} batches to re-estimate; CPU, fixed seeds" + ("; smoke: 256 training images" if args.smoke else ""),
        results=smoke_results() if args.smoke else None,
    )


if __name__ == "__main__":
    main()
