"""Tasks for the training features of update.py: accumulation, schedulers, mixed precision,
several optimizers. The data is small and the accumulation spans a whole epoch, so one
optimizer step is full-batch gradient descent: a hand loop gets the same parameters
whatever order flodl visits the samples in (tests/test_update.py)."""

import torch
import torch.nn.functional as F

from flodl import Task

SAMPLES, FEATURES, BATCH, ACCUMULATE = 64, 8, 16, 4  # one optimizer step per epoch


def data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(SAMPLES, FEATURES, generator=g)
    return x, x @ torch.linspace(-1.0, 1.0, FEATURES).unsqueeze(1) + 0.5


def make_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(FEATURES, 4), torch.nn.Tanh(), torch.nn.Linear(4, 1))


def sgd(model):
    return torch.optim.SGD(model.parameters(), lr=0.1)


def adam(model):
    return torch.optim.Adam(model.parameters(), lr=0.05)


def two_optimizers(model):
    """Adam on the first layer, SGD with momentum on the last: each steps, each is saved."""
    return [torch.optim.Adam(model[0].parameters(), lr=0.05), torch.optim.SGD(model[2].parameters(), lr=0.1, momentum=0.9)]


def step_lr(optimizer):
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=2, gamma=0.5)


def base(**fields):
    x, y = data()
    fields = {"accumulate_grad_batches": ACCUMULATE, **fields}
    return Task(
        model=make_model,
        optimizer=sgd,
        dataset=torch.utils.data.TensorDataset(x, y),
        batch_size=BATCH,
        loss_fn=F.mse_loss,
        bn_recalibration_batches=0,
        **fields,
    )


def accumulate_task():
    return base()


def scheduled_task():
    """Adam, a StepLR halving every 2 optimizer steps (= epochs here): its state must survive a resume."""
    t = base(scheduler=step_lr)
    t.optimizer = adam
    return t


def two_optimizers_task():
    t = base(scheduler=step_lr)
    t.optimizer = two_optimizers
    return t


def bf16_task():
    return base(precision="bf16-mixed")


def fp16_task():
    return base(precision="fp16-mixed")


def loud_loss(output, target):
    """A loss whose gradient at the output is in the hundreds: scaled by the GradScaler's 65536 it
    overflows float16, so the first steps are skipped while the loss itself stays finite."""
    return F.mse_loss(output * 300.0, target * 300.0) / 1000.0


def overflowing_fp16_task():
    t = base(precision="fp16-mixed")
    t.loss_fn = loud_loss
    return t


def unplain_task():
    """Two ranks, cadence: a scheduler stepped on the global step, accumulation 2 (not a whole
    epoch), two optimizers."""
    x, y = data()
    return Task(
        model=make_model,
        optimizer=two_optimizers,
        dataset=torch.utils.data.TensorDataset(x.repeat(8, 1), y.repeat(8, 1)),
        batch_size=8,
        loss_fn=F.mse_loss,
        accumulate_grad_batches=2,
        scheduler=step_lr,
        bn_recalibration_batches=0,
    )
