"""The overhead bench's task: one model trained the same way by flodl and by a plain loop.

FLODL_BENCH_MODEL    ``mlp`` (bench/tasks/mlp.py, its step time set by its width) or a
                     matrix model (``resnet20``, ``gpt_nano``, ...: bench/matrix/tasks.py)
FLODL_BENCH_COMPILE  a ``torch.compile`` mode applied on both sides (``Task.compile`` for
                     flodl, ``model.compile`` in the plain loop); unset: eager

The matrix models' evals are left out: the plain loop has none, and an eval is
not the runtime's overhead.
"""

from __future__ import annotations

import dataclasses
import os

from flodl import Task


def model_name() -> str:
    return os.environ.get("FLODL_BENCH_MODEL", "mlp")


def compile_mode() -> str | None:
    return os.environ.get("FLODL_BENCH_COMPILE") or None


def task() -> Task:
    name = model_name()
    if name == "mlp":
        from bench.tasks import mlp

        base = mlp.task()
    else:
        from bench.matrix import tasks

        base = tasks.task(name)
    return dataclasses.replace(base, eval_fn=None, compile=compile_mode() or False)
