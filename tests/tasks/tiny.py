"""A tiny task for process tests, steered by environment variables.

FLODL_TEST_STEP_SLEEP   seconds to sleep in every training step (make runs long enough to kill)
FLODL_TEST_FIRST_STEP_SLEEP  extra seconds to sleep in a process's first step (a GPU's warm-up)
FLODL_TEST_HOLD_FILE    while this file does not exist, steps sleep FLODL_TEST_HOLD_SLEEP instead
                        (a test keeps a run long until something it waits for, e.g. a join, happened)
FLODL_TEST_FAIL_AT      raise RuntimeError at this local step (a broken user task)
FLODL_TEST_STUCK_DIR    a directory: the rank whose file rank<N> appears there blocks for good in its next
                        step (a training thread stuck in user code, its heartbeats going on; the chaos soak)
FLODL_TEST_BUILD_SLEEP  seconds the task factory takes (a task that prepares its data at start)
FLODL_TEST_BUILD_CRASH  the rank of this number crashes (exit 1) while it builds the task
FLODL_TEST_EVAL_FAIL    make eval_fn raise
FLODL_TEST_EVAL_SLEEP   seconds eval_fn takes (a real eval's time, on the eval rank only)
FLODL_TEST_SAMPLES      training samples (default 512)
FLODL_TEST_RECORD_SEEN  record_scalar("seen", samples in the batch) every step (a count to declare sum)
FLODL_TEST_EPOCH_LOG    a directory: epoch_fn appends each epoch a rank begins to rank<R>.epochs there
FLODL_TEST_SAY          at its first step, a rank prints "SAY rank R" (Python's print) and writes "RAW rank R" to its
                        stderr below Python (os.write): what a rank's log files hold (--log-dir)
FLODL_TEST_OPTIMIZER    "adam" or "momentum" (SGD with momentum 0.9) instead of plain SGD: an optimizer with state
FLODL_TEST_BIG_MODEL    add a parameter of ones, never trained, large enough that a snapshot takes two
                        8 MiB slices; the eval is then its mean (1.0 unless an average shrank it)
"""

import os
import time

import torch
import torch.nn.functional as F

from flodl import Task

_STEP = {"n": 0}


#: Elements of FLODL_TEST_BIG_MODEL's untrained parameter: more than one 8 MiB slice of float32.
BIG = (8 << 20) // 4 + 100_000


def make_model():
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
    if os.environ.get("FLODL_TEST_BIG_MODEL"):
        model.register_parameter("ballast", torch.nn.Parameter(torch.ones(BIG)))  # not in the forward: no gradient
    return model


def make_optimizer(model):
    kind = os.environ.get("FLODL_TEST_OPTIMIZER", "")
    if kind == "adam":
        return torch.optim.Adam(model.parameters(), lr=0.01)
    if kind == "momentum":
        return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return torch.optim.SGD(model.parameters(), lr=0.1)


def train_step(model, batch, device):
    _STEP["n"] += 1
    fail_at = int(os.environ.get("FLODL_TEST_FAIL_AT", "0") or 0)
    if fail_at and _STEP["n"] >= fail_at:
        raise RuntimeError(f"injected failure at step {_STEP['n']}")
    stuck = os.environ.get("FLODL_TEST_STUCK_DIR")
    if stuck and os.path.exists(os.path.join(stuck, f"rank{os.environ.get('FLODL_RANK')}")):
        while True:  # the training thread never returns; only a fence ends the process
            time.sleep(1.0)
    held = os.environ.get("FLODL_TEST_HOLD_FILE")
    if held and not os.path.exists(held):
        time.sleep(float(os.environ.get("FLODL_TEST_HOLD_SLEEP", "0.5")))
    else:
        time.sleep(float(os.environ.get("FLODL_TEST_STEP_SLEEP", "0") or 0))
    if _STEP["n"] == 1:
        time.sleep(float(os.environ.get("FLODL_TEST_FIRST_STEP_SLEEP", "0") or 0))
        if os.environ.get("FLODL_TEST_SAY"):
            print(f"SAY rank {os.environ['FLODL_RANK']}", flush=True)
            os.write(2, f"RAW rank {os.environ['FLODL_RANK']}\n".encode())
    x, y = batch
    if os.environ.get("FLODL_TEST_RECORD_SEEN"):
        from flodl import record_scalar

        record_scalar("seen", x.shape[0])
    return F.cross_entropy(model(x.to(device)), y.to(device))


def evaluate(model, device):
    if os.environ.get("FLODL_TEST_EVAL_FAIL"):
        raise ValueError("injected eval failure")
    time.sleep(float(os.environ.get("FLODL_TEST_EVAL_SLEEP", "0") or 0))
    ballast = getattr(model, "ballast", None)
    if ballast is not None:
        return ballast.detach().double().mean().item()
    x, y = _data(256, 1)
    return (model(x).argmax(1) == y).float().mean().item()


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, (x.sum(1) > 0).long()


def task():
    time.sleep(float(os.environ.get("FLODL_TEST_BUILD_SLEEP", "0") or 0))
    crash = os.environ.get("FLODL_TEST_BUILD_CRASH")
    if crash is not None and crash == os.environ.get("FLODL_RANK"):
        os._exit(1)
    x, y = _data(int(os.environ.get("FLODL_TEST_SAMPLES", "512") or 512), 0)
    return Task(
        model=make_model,
        optimizer=make_optimizer,
        dataset=torch.utils.data.TensorDataset(x, y),
        batch_size=16,
        train_step=train_step,
        eval_fn=evaluate,
        eval_metric="accuracy",
    )


def log_epoch(epoch, worker):
    """epoch_fn: append the epoch this rank begins to FLODL_TEST_EPOCH_LOG/rank<R>.epochs."""
    with open(os.path.join(os.environ["FLODL_TEST_EPOCH_LOG"], f"rank{worker.rank}.epochs"), "a") as f:
        f.write(f"{epoch}\n")


def epoch_logging_task():
    """The tiny task, with an epoch_fn that logs every epoch each rank begins."""
    t = task()
    t.epoch_fn = log_epoch
    return t


def empty_task():
    """No samples at all: refused at start as the user's error (exit 2)."""
    t = task()
    t.dataset = torch.utils.data.TensorDataset(torch.zeros(0, 8), torch.zeros(0, dtype=torch.long))
    return t


def three_samples_task():
    """3 samples: a world of 4 ranks would leave one with nothing to train (refused, exit 2)."""
    t = task()
    x, y = _data(3, 0)
    t.dataset = torch.utils.data.TensorDataset(x, y)
    return t


def other_model_task():
    """Same data, different model: must be refused at join."""
    t = task()
    t.model = lambda: torch.nn.Linear(8, 2)
    return t


def halve_every_64_steps(global_step):
    """An LR schedule on the global step: x0.5 every 64 batches of all ranks."""
    return 0.5 ** (global_step // 64)


def record_lr(epoch, worker):
    """epoch_fn: record the LR each rank starts the epoch with; from epoch 2 on, scale it down."""
    from flodl import record_scalar

    record_scalar("lr_at_epoch_start", worker.current_lr)
    record_scalar("world", worker.world_size)
    if epoch == 2:
        worker.set_scheduler(None)
        worker.set_lr(0.001)


def scheduled_task():
    t = task()
    t.lr_schedule = halve_every_64_steps
    t.epoch_fn = record_lr
    return t


def note_checkpoint(version, worker):
    """checkpoint_fn: leave a file per call in FLODL_TEST_CKPT_DIR; version 2 fails on purpose."""
    out = os.environ["FLODL_TEST_CKPT_DIR"]
    with open(os.path.join(out, f"v{version}.rank{worker.rank}"), "w") as f:
        f.write(str(sum(float(p.sum()) for p in worker.model.parameters())))
    if version == 2:
        raise OSError("injected checkpoint_fn failure")


def checkpointing_task():
    t = task()
    t.checkpoint_fn = note_checkpoint
    return t


def momentum_task():
    """SGD with momentum: the optimizer has state tensors (a .optim with something in it)."""
    t = task()
    t.optimizer = lambda model: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return t


def big_data_task():
    """4x the samples: several windows per epoch, so a checkpoint can fall mid-epoch."""
    x, y = _data(2048, 0)
    t = task()
    t.dataset = torch.utils.data.TensorDataset(x, y)
    return t


def jitter(rows, keys):
    """A delivery transform: per-pick Gaussian jitter, seeded by the pick (same on every rank and run)."""
    x, y = rows
    noise = torch.stack([torch.randn(x.shape[1:], generator=torch.Generator().manual_seed(k.seed())) for k in keys])
    return x + 0.01 * noise, y


class SlowDataset(torch.utils.data.Dataset):
    """The tiny task's data behind a ``__getitem__`` that costs FLODL_TEST_ITEM_MS (a file read, a decode)."""

    def __init__(self, n: int = 512, raise_at: int | None = None):
        self.x, self.y = _data(n, 0)
        self.raise_at = raise_at
        self.delay = float(os.environ.get("FLODL_TEST_ITEM_MS", "0.5") or 0) / 1000.0

    def __len__(self):
        return len(self.y)

    def __getitem__(self, i):
        if i == self.raise_at:
            raise OSError(f"corrupt record {i}")
        time.sleep(self.delay)
        return self.x[i], self.y[i]


def slow_data_task():
    """The tiny task whose samples cost time to read: the staging tiers' case."""
    t = task()
    t.dataset = SlowDataset()
    return t


def broken_data_task():
    """Sample 77 cannot be read."""
    t = task()
    t.dataset = SlowDataset(raise_at=77)
    return t


def _bn_model():
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _bn_batches_seen(model, device):
    """eval_fn: how many batches the BatchNorm layer's statistics come from (a re-estimate resets the count)."""
    return float(model[1].num_batches_tracked)


def batchnorm_task():
    """A BatchNorm model on the loss_fn path; its 'eval' reports the statistics' batch count.
    FLODL_TEST_BN_BATCHES sets Task.bn_recalibration_batches."""
    x, y = _data(int(os.environ.get("FLODL_TEST_SAMPLES", "512") or 512), 0)
    return Task(
        model=_bn_model,
        optimizer=make_optimizer,
        dataset=torch.utils.data.TensorDataset(x, y),
        batch_size=16,
        loss_fn=F.cross_entropy,
        eval_fn=_bn_batches_seen,
        eval_metric="bn_batches",
        bn_recalibration_batches=int(os.environ.get("FLODL_TEST_BN_BATCHES", "16")),
    )


def _noisy_model():
    return torch.nn.Sequential(
        torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Dropout(0.2), torch.nn.Linear(16, 2)
    )


def _noisy_eval(model, device):
    """eval_fn that draws from the global RNG (a random subset), as user evals do."""
    x, y = _data(256, 1)
    keep = torch.rand(256) < 0.9
    return (model(x[keep]).argmax(1) == y[keep]).float().mean().item()


def noisy_task():
    """Everything that draws random numbers: data and initial weights from the global RNG (equal on
    every rank and from run to run: every run seeds it from --seed before the build), dropout,
    BatchNorm re-estimated before each eval, an eval that draws too."""
    x = torch.randn(512, 8)
    return Task(
        model=_noisy_model,
        optimizer=lambda model: torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
        dataset=torch.utils.data.TensorDataset(x, (x.sum(1) > 0).long()),
        batch_size=16,
        loss_fn=F.cross_entropy,
        eval_fn=_noisy_eval,
        eval_metric="accuracy",
    )
