"""A BatchNorm model in script mode (tests/test_norms.py): after each epoch's batches, each rank
reports the model's held-out accuracy (an eval-mode forward: flodl re-estimates the statistics
before it) and writes what its model's BatchNorm statistics were for that eval; ``task()`` is the same training as a ``Task``.

FLODL_TEST_OUT         a directory: each rank appends one JSON line per epoch end to rank<R>.jsonl
                       ("epoch", "batches": the layer's batch count, "gap": the largest distance
                       between its running mean and the mean over the whole dataset of its input
                       under the model's weights now, "mean": the running mean)
FLODL_TEST_BN_BATCHES  run.prepare(..., bn_recalibration_batches=N) (default 32: the whole epoch
                       of 32 batches of 16, so re-estimated means are the dataset's mean exactly)
FLODL_TEST_DICT_BATCHES  the samples are dicts ({"x": ..., "y": ...}): flodl cannot tell the model's input
"""

import json
import os

import torch
import torch.nn.functional as F

import flodl


def model() -> torch.nn.Module:
    """The same initial weights in a script and in a Task, whatever their RNGs' state."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def data() -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(0))
    return x, (x.sum(1) > 0).long()


class Dicts(torch.utils.data.Dataset):
    """The samples as dicts, as many a Hugging Face style dataset gives them."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor) -> None:
        self.x, self.y = x, y

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict:
        return {"x": self.x[i], "y": self.y[i]}


def accuracy(net: torch.nn.Module, device: torch.device) -> float:
    """Held-out accuracy, in eval mode (the running statistics)."""
    x = torch.randn(256, 8, generator=torch.Generator().manual_seed(1))
    was_training = net.training
    net.eval()
    with torch.no_grad():
        right = (net(x.to(device)).argmax(1).cpu() == (x.sum(1) > 0).long()).float().mean().item()
    net.train(was_training)
    return right


def optimizer(net: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)


def task() -> flodl.Task:
    x, y = data()
    return flodl.Task(
        model=model,
        optimizer=optimizer,
        dataset=torch.utils.data.TensorDataset(x, y),
        batch_size=16,
        loss_fn=F.cross_entropy,
        eval_fn=accuracy,
        eval_metric="accuracy",
        bn_recalibration_batches=int(os.environ.get("FLODL_TEST_BN_BATCHES", "32")),
    )


def main() -> None:
    run = flodl.init()
    net = model()
    opt = optimizer(net)
    x, y = data()
    batches = int(os.environ.get("FLODL_TEST_BN_BATCHES", "32"))
    dicts = bool(os.environ.get("FLODL_TEST_DICT_BATCHES"))
    dataset = Dicts(x, y) if dicts else torch.utils.data.TensorDataset(x, y)
    net, opt = run.prepare(net, opt, dataset, batch_size=16, bn_recalibration_batches=batches)
    out = os.environ.get("FLODL_TEST_OUT")
    for epoch in run.epochs():
        net.train()
        for batch in run.batches():
            xb, yb = (batch["x"], batch["y"]) if dicts else batch
            loss = F.cross_entropy(net(xb), yb)
            opt.zero_grad()
            loss.backward()
            opt.step()
            run.step(loss)
        run.report(accuracy=accuracy(net, run.device))  # the script scores its model: flodl re-estimates first
        bn = net[1]  # what that eval found
        with torch.no_grad():
            gap = float((bn.running_mean - net[0](x).mean(0)).abs().max())
        if out:
            line = {"epoch": epoch, "batches": int(bn.num_batches_tracked), "gap": gap, "mean": bn.running_mean.tolist()}
            with open(os.path.join(out, f"rank{run.rank}.jsonl"), "a") as f:
                f.write(json.dumps(line) + "\n")


if __name__ == "__main__":
    main()
