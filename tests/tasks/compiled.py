"""A task whose model is compiled (``Task.compile``), for the compile tests.

FLODL_TEST_COMPILE  JSON of Task.compile on a GPU rank (default, and always on a CPU rank:
                    {"backend": "aot_eager"}: dynamo and autograd tracing without a C++ or
                    Triton build, seconds on a CPU)
FLODL_TEST_PRECISION  Task.precision (default "32"), e.g. bf16-mixed: autocast under the compiled forward
FLODL_TEST_TRACES   a folder: each eval writes how often the model's forward ran eagerly in this
                    process (compiled: never, dynamo's trace folds the count away; eager: every step)
"""

import json
import os

import torch
import torch.nn.functional as F

from flodl import Task

_EAGER = {"n": 0}


class Net(torch.nn.Sequential):
    def forward(self, x):
        if not torch.compiler.is_compiling():  # constant while dynamo traces: the compiled code has no count
            _EAGER["n"] += 1
        return super().forward(x)


def make_model():
    return Net(torch.nn.Linear(8, 32), torch.nn.ReLU(), torch.nn.Linear(32, 2))


def make_optimizer(model):
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def _data(n, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 8, generator=g)
    return x, (x.sum(1) > 0).long()


def evaluate(model, device):
    x, y = _data(512, 1)
    folder = os.environ.get("FLODL_TEST_TRACES")
    if folder:
        with open(os.path.join(folder, f"{os.getpid()}.txt"), "w") as f:
            f.write(str(_EAGER["n"]))
    with torch.no_grad():
        return (model(x.to(device)).argmax(1).cpu() == y).float().mean().item()


AOT_EAGER = '{"backend": "aot_eager"}'


def _on_gpu():
    """This rank trains on a GPU (a CPU rank beside it keeps aot_eager: an inductor C++ build takes minutes)."""
    return os.environ.get("FLODL_DEVICE", "cpu").startswith("cuda")


def task():
    return Task(
        model=make_model,
        optimizer=make_optimizer,
        dataset=torch.utils.data.TensorDataset(*_data(1024, 0)),
        batch_size=32,
        loss_fn=F.cross_entropy,
        eval_fn=evaluate,
        eval_metric="accuracy",
        compile=json.loads(os.environ.get("FLODL_TEST_COMPILE", AOT_EAGER) if _on_gpu() else AOT_EAGER),
        precision=os.environ.get("FLODL_TEST_PRECISION", "32"),
    )
