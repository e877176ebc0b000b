"""Model x mode matrix: six model families under every flodl mode, next to torchrun.

    python -m bench.matrix [--quick] [--seeds N] [--lr-scaling linear|none] [--base-ms MS] [--results DIR]
                                          # run the suite, write bench/results/matrix/ and bench/results/matrix.json
    python -m bench.matrix.report         # tables into docs/benchmarks.md, plots into docs/img/ (needs matplotlib)

Models (``bench/matrix/tasks.py``; data in ``bench/matrix/data.py``, nothing
downloaded): logistic regression and an MLP on scikit-learn's digits, LeNet-5
and ResNet-20 on generated 32x32 images, a char-RNN (GRU and LSTM) and GPT-nano
on the source text of standard-library modules.

Cases per model, each one real run per seed (``--seeds``, default 3; 1 with
``--quick``), timed twice: *train wall* (from the first dispatched batch to the
final eval, evals taken out: start-up not counted) and *command* (the whole
command, process start to exit):

* ``solo``: flodl on one rank (also the calibration of the 4:1 cases: their
  base step time, and the solo rate of their ideal);
* ``nccl-sync``, ``nccl-cadence``, ``nccl-async`` (gloo on CPU ranks) and
  ``cpu-sync``, ``cpu-cadence``, ``cpu-async``: flodl on 2 equal ranks;
* ``torchrun-ddp`` and ``torchrun-postlocal``: the same model, data, budget and
  batch per rank under ``torchrun`` (gloo) with DistributedDataParallel, and with
  PyTorch's post-local SGD (``bench/matrix/ddp.py``), with the linear LR scaling
  rule for the all-reduced steps (``--lr-scaling``);
* ``...-4to1``: 2 ranks with rank 1 paced to four times the solo step time
  (flodl's ``FLODL_SIMULATE_SLOWDOWN=1:4`` with ``FLODL_SIMULATE_BASE_MS``; the
  same rule in the DDP script, ``--slowdown 1:4 --base-ms``), the measured
  ratio reported, for ``nccl-cadence``, ``nccl-async``, ``cpu-cadence``,
  ``cpu-async`` and both torchrun variants;
* ``script-nccl-cadence-4to1`` (the full plans' MLP and ResNet-20): the same 4:1
  run in script mode, the same training in the user's own loop
  (``bench/matrix/script.py``), its eval the ranks' mean of their replicas'
  after the last epoch's batches.

Every rank runs one intra-op thread (``OMP_NUM_THREADS=1``); sample budgets are
fixed (``PLANS``), seeds are 0..N-1. Each run's summary (flodl's
``--summary-json``, or the DDP script's summary in the same shape) is kept as
``bench/results/matrix/<model>__<case>__seed<k>.json`` with a ``matrix`` key
added (model, case, seed, budget, ``train_s``, ``command_s``,
``measured_ratio``, ``base_ms``, ``of_ideal``, the LR rule, loss-vs-time curve,
the command); the directory is cleared when a suite starts, so it always holds
one suite's runs. The protocol: docs/benchmarks.md, "Protocol of the
unequal-rank benchmarks".
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "benchmarks.md"
IMG_DIR = ROOT / "docs" / "img"


@dataclass(frozen=True)
class Target:
    """Where a suite runs its ranks, and where its results and report go."""

    device: str  # "cpu": CPU ranks, gloo; "cuda": one GPU per rank, NCCL
    name: str  # results directory, common-format JSON (bench/results/<name>.json), doc markers, plot prefix

    @property
    def results_dir(self) -> Path:
        return ROOT / "bench" / "results" / self.name

    def devices(self, nproc: int) -> str | None:
        """flodl's ``--devices`` for ``nproc`` ranks (None: the embedded worker's default, CPU ranks here)."""
        return ",".join(f"cuda:{i}" for i in range(nproc)) if self.device == "cuda" else None


TARGETS = {"cpu": Target("cpu", "matrix"), "cuda": Target("cuda", "matrix_gpu")}
RATIO = 4  # the unequal case: rank 1 this many times slower


@dataclass(frozen=True)
class Case:
    """One cell of the matrix for a model."""

    id: str  # file name part, e.g. "nccl-cadence-4to1"
    label: str  # table label
    kind: str  # "flodl" | "torchrun"
    mode: str  # flodl --mode, or the DDP script's --algo
    nproc: int = 2
    ratio: int = 1  # rank 1 is this many times slower
    script: bool = False  # flodl in script mode (bench/matrix/script.py: the user's own loop), not a Task


FLODL_MODES = ("nccl-sync", "nccl-cadence", "nccl-async", "cpu-sync", "cpu-cadence", "cpu-async")
_LABELS = {
    "nccl-sync": "NcclSync",
    "nccl-cadence": "NcclCadence",
    "nccl-async": "NcclAsync",
    "cpu-sync": "CpuSync",
    "cpu-cadence": "CpuCadence",
    "cpu-async": "CpuAsync",
    "ddp": "torchrun DDP",
    "postlocal": "torchrun post-local SGD",
}


def _flodl(mode: str, ratio: int = 1) -> Case:
    suffix = f"-{ratio}to1" if ratio > 1 else ""
    return Case(mode + suffix, _LABELS[mode] + (f" {ratio}:1" if ratio > 1 else ""), "flodl", mode, ratio=ratio)


def _torchrun(algo: str, ratio: int = 1) -> Case:
    suffix = f"-{ratio}to1" if ratio > 1 else ""
    return Case(f"torchrun-{algo}{suffix}", _LABELS[algo] + (f" {ratio}:1" if ratio > 1 else ""), "torchrun", algo, ratio=ratio)


def system_case(system: str, ratio: int = 1) -> Case:
    """The case of one system with rank 1 ``ratio`` times slower: a flodl mode (``nccl-cadence``, ...),
    ``script-<mode>`` (that mode in script mode: ``bench/matrix/script.py``), ``torchrun-ddp`` or
    ``torchrun-postlocal``. ValueError names the systems there are."""
    if system.startswith("torchrun-") and system[len("torchrun-") :] in ("ddp", "postlocal"):
        return _torchrun(system[len("torchrun-") :], ratio)
    mode = system[len("script-") :] if system.startswith("script-") else system
    if mode not in FLODL_MODES:
        raise ValueError(f"unknown system {system!r}; known: {', '.join(SYSTEMS)}")
    if mode == system:
        return _flodl(mode, ratio)
    base = _flodl(mode, ratio)
    return Case(f"script-{base.id}", f"{base.label}, script mode", "flodl", mode, ratio=ratio, script=True)


#: what system_case takes (script mode: any flodl mode after ``script-``)
SYSTEMS = (*FLODL_MODES, *(f"script-{m}" for m in FLODL_MODES), "torchrun-ddp", "torchrun-postlocal")

SOLO = Case("solo", "solo (1 rank)", "flodl", "nccl-cadence", nproc=1)  # the default mode: the best flodl solo is the ideal
EQUAL = (SOLO, *(_flodl(m) for m in FLODL_MODES), _torchrun("ddp"), _torchrun("postlocal"))
#: the ideal of the 4:1 cases in their own run conditions: two solo runs started together, one of
#: them paced 4:1, so each rank has the other's process beside it as in a pair, with no averaging
#: and no waiting for each other; the ideal is the sum of their training rates
SIDE_BY_SIDE = Case(
    f"side-by-side-{RATIO}to1", f"2 solo runs side by side {RATIO}:1 (ideal)", "side-by-side", "nccl-cadence", nproc=1, ratio=RATIO
)
#: the default mode in script mode (issue 18): the same training in the user's own loop
SCRIPT_4TO1 = system_case("script-nccl-cadence", RATIO)
UNEQUAL = (
    SIDE_BY_SIDE,
    *(_flodl(m, RATIO) for m in ("nccl-cadence", "nccl-async", "cpu-cadence", "cpu-async")),
    SCRIPT_4TO1,
    _torchrun("ddp", RATIO),
    _torchrun("postlocal", RATIO),
)
ALL_CASES = EQUAL + UNEQUAL
CASES = {c.id: c for c in ALL_CASES}
#: the torchrun baseline each flodl case is compared with
BASELINE = {1: "torchrun-ddp", RATIO: f"torchrun-ddp-{RATIO}to1"}
BASELINE_POSTLOCAL = {1: "torchrun-postlocal", RATIO: f"torchrun-postlocal-{RATIO}to1"}
GOAL_SPEEDUP = 1.8  # issue 9: Cadence/Async beat torchrun DDP on unequal ranks by >= 1.8x at 4:1 (train time) ...
GOAL_EVAL_POINTS = 1.0  # ... with eval within 1 point
#: every case but script mode's, which the full plan runs on the MLP and ResNet-20 only (issue 18)
TASK_CASES = tuple(c.id for c in ALL_CASES if not c.script)
GOAL_OF_IDEAL = 0.90  # issue 22: Cadence/Async >= 0.90 of ideal at 4:1 (ideal: the side-by-side case's two rates)


@dataclass(frozen=True)
class Budget:
    samples: int  # training samples (the first N of the model's training set)
    epochs: int


MODEL_ORDER = ("logreg", "mlp", "lenet", "char_gru", "char_lstm", "gpt_nano", "resnet20")

#: budget name -> model -> (budget, case ids)
PLANS: dict[str, dict[str, tuple[Budget, tuple[str, ...]]]] = {
    "full": {
        # sub-ms steps: ~5 s of training each. At 160 epochs (~1.7 s) logreg's 4:1 cells read
        # 0.82-0.97 of ideal from one run to the next on this VM (a 100 ms hiccup is 6% of
        # such a run); at 40, 0.5 s. The MLP's 40 epochs were ~1.7 s too.
        "logreg": (Budget(1500, 480), TASK_CASES),
        "mlp": (Budget(1500, 120), tuple(CASES)),
        "lenet": (Budget(8192, 4), TASK_CASES),
        "char_gru": (Budget(4096, 3), TASK_CASES),
        "char_lstm": (Budget(4096, 3), TASK_CASES),
        "gpt_nano": (Budget(4096, 3), TASK_CASES),
        "resnet20": (Budget(4096, 3), tuple(CASES)),
    },
    "quick": {
        # the main cell: every mode, both torchrun variants, and the 4:1 case with its goal
        "lenet": (Budget(8192, 3), TASK_CASES),
        # one small model of each other family: solo, the default mode, and torchrun DDP
        "mlp": (Budget(1500, 40), ("solo", "nccl-cadence", "torchrun-ddp")),
        "char_gru": (Budget(1024, 2), ("solo", "nccl-cadence", "torchrun-ddp")),
        "gpt_nano": (Budget(1024, 2), ("solo", "nccl-cadence", "torchrun-ddp")),
    },
    # --device cuda: 2 GPUs (NCCL refuses two ranks on one GPU); the models that give a GPU some work
    "gpu": {
        "lenet": (Budget(16384, 4), TASK_CASES),
        "gpt_nano": (Budget(8192, 3), TASK_CASES),
        "resnet20": (Budget(8192, 3), tuple(CASES)),
    },
    "gpu-quick": {
        "lenet": (Budget(8192, 3), TASK_CASES),
        "resnet20": (
            Budget(4096, 2),
            ("torchrun-ddp", "nccl-cadence-4to1", "nccl-async-4to1", "cpu-cadence-4to1", "cpu-async-4to1", "torchrun-ddp-4to1"),
        ),
    },
}
