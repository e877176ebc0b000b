"""A task whose dataset is read by loader workers (``Task.num_workers``), for tests/test_loader.py,
steered by environment variables:

FLODL_TEST_NUM_WORKERS  Task.num_workers (default 0)
FLODL_TEST_LOG_DIR      a directory: every process that runs ``dataset[i]`` appends ``i`` to
                        reads.<pid> there, and every trained batch's indices go to trained.<pid>
FLODL_TEST_GETITEM_MS   milliseconds of CPU-bound Python (holding the GIL) in every ``dataset[i]``
FLODL_TEST_STEP_SLEEP   seconds to sleep in every training step (a run long enough to kill)
FLODL_TEST_SAMPLES      dataset size (default 512)
FLODL_TEST_PIN_MEMORY   "1": Task.pin_memory; a GPU rank then logs "pinned" for each batch that came pinned
"""

import os
import time

import torch
import torch.nn.functional as F

from flodl import Task

_FILES: dict[str, object] = {}


def log_line(kind: str, text: str) -> None:
    """Append ``text`` to ``<kind>.<pid>`` in FLODL_TEST_LOG_DIR (one file per process: no locking)."""
    where = os.environ.get("FLODL_TEST_LOG_DIR")
    if not where:
        return
    key = f"{kind}.{os.getpid()}"
    f = _FILES.get(key)
    if f is None:
        f = _FILES[key] = open(os.path.join(where, key), "a", buffering=1)  # open for the process's life
    f.write(text + "\n")


def _spin(ms: float) -> None:
    end = time.perf_counter() + ms / 1000.0
    while time.perf_counter() < end:
        pass


class LoggedDataset(torch.utils.data.Dataset):
    """``(x, y, i)`` samples; each read is logged by the process that made it."""

    def __init__(self, n: int) -> None:
        g = torch.Generator().manual_seed(0)
        self.x = torch.randn(n, 8, generator=g)
        self.y = (self.x.sum(1) > 0).long()
        self.cost_ms = float(os.environ.get("FLODL_TEST_GETITEM_MS", "0") or 0)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int):
        log_line("reads", str(i))
        _spin(self.cost_ms)
        return self.x[i].clone(), self.y[i], i


def make_model():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def train_step(model, batch, device):
    x, y, idx = batch
    log_line("trained", " ".join(map(str, idx.tolist())))
    if device.type == "cuda" and x.is_pinned():
        log_line("pinned", str(len(idx)))
    time.sleep(float(os.environ.get("FLODL_TEST_STEP_SLEEP", "0") or 0))
    return F.cross_entropy(model(x.to(device)), y.to(device))


def evaluate(model, device):
    g = torch.Generator().manual_seed(1)
    x = torch.randn(256, 8, generator=g)
    return (model(x.to(device)).argmax(1).cpu() == (x.sum(1) > 0).long()).float().mean().item()


def task():
    return Task(
        model=make_model,
        optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.1),
        dataset=LoggedDataset(int(os.environ.get("FLODL_TEST_SAMPLES", "512"))),
        batch_size=16,
        train_step=train_step,
        eval_fn=evaluate,
        eval_metric="accuracy",
        num_workers=int(os.environ.get("FLODL_TEST_NUM_WORKERS", "0")),
        pin_memory=os.environ.get("FLODL_TEST_PIN_MEMORY") == "1",
    )
