"""A rank's random streams (every run), and reproducible ranks (the ``deterministic`` option).

Every run: a rank seeds every RNG a task or script may draw from (Python's
``random``, NumPy's global generator when NumPy is installed, torch's CPU and
CUDA generators) twice, from the run seed (``--seed``; a resumed run keeps
its bundle's). First for the *build phase*, before the task or the script
builds its model and data: the same on every rank, so an unseeded synthetic
dataset comes out equal everywhere (the controller compares a digest of it,
dataset_digest.py) and so do the initial weights (rank 0's are broadcast
anyway). Then for the *training phase*, as the rank joins (before its first
batch; in script mode before ``run.prepare()`` returns): from (seed, rank),
each rank its own stream, so replicas draw their own dropout masks and
augmentation noise, as torchrun's ranks do. A restarted rank has a new rank
number, hence a stream of its own too. Forked from one zygote, ranks would
otherwise all continue its one state.

``deterministic`` adds the rest of reproducibility: torch is asked for its
deterministic algorithms, and an eval, which the controller's ``RunEval``
places between two batches at a moment the clock decides, leaves no trace:
the RNG states and the model's buffers (BatchNorm statistics it re-estimates)
are put back afterwards. (The controller fixes *what* a rank trains and
*when* it averages by batch counts: plan/dispatch.py, ``fixed``.)
"""

from __future__ import annotations

import contextlib
import random
from collections.abc import Iterator
from typing import Any

import torch

from ..config.env import RankEnv, fixed_cublas_workspace


def use_deterministic_algorithms() -> None:
    """Ask torch for deterministic kernels (before any CUDA work). An op without one warns
    rather than stops the run: the docs say which guarantee then no longer holds."""
    fixed_cublas_workspace()
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.backends.cudnn.benchmark = False  # autotuning picks kernels by timing
    torch.backends.cudnn.deterministic = True


_built: list[bool] = [False]  # this process entered its build phase (a script rank: at its first line)


def enter_build_phase(env: RankEnv) -> None:
    """Before the task or script builds anything: the run's settings, and every RNG seeded from
    the run seed, the same on every rank (before CUDA work: the seed of a device not yet
    initialised is applied when it is). Once per process: a script rank enters it before the
    script's first line (script_start.py) and again, as a no-op, at ``flodl.init()``."""
    if _built[0]:
        return
    _built[0] = True
    if env.deterministic:
        use_deterministic_algorithms()
    seed_everything(env.seed)


def enter_training_phase(seed: int, rank: int) -> None:
    """Before the rank's first batch: every RNG seeded from (``seed``, ``rank``), its own stream."""
    seed_everything(seed, stream=rank + 1)


def seed_everything(seed: int, stream: int = 0) -> None:
    """Seed Python's, NumPy's (when installed) and torch's generators (CUDA included) with
    ``seed``, or with a value derived from it for ``stream`` > 0 (one stream per rank)."""
    value = seed if stream == 0 else (seed * 1_000_003 + stream) % 2**63
    seed_host(value)
    torch.manual_seed(value)  # seeds every CUDA device too


def seed_host(value: int) -> None:
    """Seed Python's, NumPy's (when installed) and torch's CPU generator, not the CUDA devices'."""
    random.seed(value)
    torch.random.default_generator.manual_seed(value)
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
def kept_rngs() -> Iterator[None]:
    """Whatever runs inside leaves the RNGs (CUDA's too, once initialised) as they were."""
    state = random.getstate()
    numpy = _numpy()
    numpy_state = numpy.random.get_state() if numpy is not None else None
    cpu = torch.random.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        random.setstate(state)
        if numpy is not None:
            numpy.random.set_state(numpy_state)
        torch.random.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@contextlib.contextmanager
def traceless(model: torch.nn.Module, seed: int | None = None, stream: int = 0) -> Iterator[None]:
    """Whatever runs inside (an eval) leaves the RNGs and the model's buffers as they were; with
    ``seed`` it also draws from generators seeded for it (``stream``), not from wherever training
    left them, so the same model scores the same."""
    buffers = [b.detach().clone() for b in model.buffers()]
    with kept_rngs():
        if seed is not None:
            seed_everything(seed, stream)
        try:
            yield
        finally:
            with torch.no_grad():
                for live, kept in zip(model.buffers(), buffers, strict=True):
                    live.copy_(kept)
