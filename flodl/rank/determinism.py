"""Reproducible ranks (the ``deterministic`` option): seeded RNGs, deterministic kernels, traceless evals.

The controller fixes *what* a rank trains and *when* it averages by batch
counts (plan/dispatch.py, ``fixed``); this module makes the rank's own
computation repeat: every RNG a task may draw from is seeded from the run
seed before the task is built (the same on every rank, so a task that makes
its data or model with them makes the same ones) and again per rank before
training (so ranks do not share dropout masks), torch is asked for its
deterministic algorithms, and an eval, which the controller's ``RunEval``
places between two batches at a moment the clock decides, leaves no trace:
the RNG states and the model's buffers (BatchNorm statistics it re-estimates)
are put back afterwards.
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import torch

from ..config.env import fixed_cublas_workspace


def use_deterministic_algorithms() -> None:
    """Ask torch for deterministic kernels (before any CUDA work). An op without one warns
    rather than stops the run: the docs say which guarantee then no longer holds."""
    fixed_cublas_workspace()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False  # autotuning picks kernels by timing
    torch.backends.cudnn.deterministic = True


def seed_everything(seed: int, stream: int = 0) -> None:
    """Seed Python's, NumPy's (when installed) and torch's generators (CUDA included) with
    ``seed``, or with a value derived from it for ``stream`` > 0 (one stream per rank)."""
    value = seed if stream == 0 else (seed * 1_000_003 + stream) % 2**63
    random.seed(value)
    torch.manual_seed(value)  # seeds every CUDA device too
    numpy = _numpy()
    if numpy is not None:
        numpy.random.seed(value % 2**32)


def _numpy() -> Any:
    """NumPy's module, or None: NumPy is optional."""
    try:
        import numpy
    except ImportError:
        return None
    return numpy


@contextlib.contextmanager
def traceless(model: torch.nn.Module, seed: int | None = None, stream: int = 0) -> Iterator[None]:
    """Whatever runs inside (an eval) leaves the RNGs and the model's buffers as they were; with
    ``seed`` it also draws from generators seeded for it (``stream``), not from wherever training
    left them, so the same model scores the same."""
    state = random.getstate()
    numpy = _numpy()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    cpu = torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    buffers = [b.detach().clone() for b in model.buffers()]
    if seed is not None:
        seed_everything(seed, stream)
    try:
        yield
    finally:
        with torch.no_grad():
            for live, kept in zip(model.buffers(), buffers, strict=True):
                live.copy_(kept)
        random.setstate(state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
