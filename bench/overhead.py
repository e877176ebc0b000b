"""Runtime overhead: one rank under flodl vs the same training in a plain PyTorch loop.

    python bench/overhead.py [--quick | --smoke] [--device cuda] [--steps-ms 1,5] [--pairs N]
                             [--models resnet20,gpt_nano] [--compile reduce-overhead] [--script]
                             [--cpus 2-5] [--width W] [--concurrent] [--null]

Same model, data, batch size, optimizer, shuffle and thread count; the plain
loop is written as one would write it by hand: it indexes the same in-memory
tensors and reads the loss back every ``LOSS_EVERY`` steps, not every step.

Both sides are timed over their whole training, first batch to last, warm-up
included on both: flodl's is the run summary's training wall (first window
sent to last report, so its planning, window turnarounds and reports all
count), the plain loop's is its epochs' wall. Per-epoch rates are not used:
flodl's windows straddle epochs, so an epoch's wall as the controller stamps it
(from the planning of the window holding its first grant) overlaps its
neighbours'. Process start-up (imports, spawning) is not counted on either side.
Each side trains in a fresh process, the plain loop too: on a small VM the
same loop runs up to ±9% apart from one process to the next.

Cases are sized by the plain loop's steady-state step: the first width whose
step takes at least ``target`` ms, so every case is at or above 4 ms. On a GPU a
1 ms step is the host's pace at any width from 256 to ~2048 (launches, not
kernels, set it), and which width sizing lands on moves with the GPU's clock
ramp: ``--width`` gives the width instead (256: the host-bound case, where every
microsecond flodl adds to a step shows; 2048: the GPU has the host's pace). Each
repetition is a pair run back to back, who goes first alternating (drift hits
both), and the ratio is taken per pair; the table gives the median over the pairs (9; 11 with
``--quick``), the spread (lowest and highest pair) and every pair's ratio.
``--epochs N`` runs every MLP case N epochs long instead of the plan's (a run's
fixed costs, its first window and last report, weigh less against more steps). ``--quick`` runs the
~5 ms case only (the hardest for the goal), under two minutes.

Goal (issues 2, 22): ≥ 97% of plain throughput at a step of 4 ms or more on
a CPU, repeatably (median of ≥ 5). On a GPU (``--device cuda``, issue 17) the
cases are ~1, 2, 5 and 20 ms steps (``--quick``: 1 and 5, 3 pairs): ≥ 97% at
1 ms, ≥ 99% from 5 ms, against the loop a good engineer writes for a GPU: the
data resident on the device, no host sync per step, the loss read every 100
steps (the loop reading it every step is reported too, from one run). flodl keeps a tensor
dataset that fits in the VRAM budget on the device as well (``vram_pool``).
A GPU case's dataset is sized to ~2.5 s epochs. ``--models`` adds matrix models
(bench/matrix/tasks.py, evals left out) as cases, solo; the full GPU plan has
ResNet-20 and GPT-nano. ``--compile MODE`` compiles both sides the same way
(flodl: ``Task.compile``; the plain loop: ``model.compile(mode=MODE)``, marking
each step for CUDA graphs); goal with ``reduce-overhead``: ≥ 95% at 1 ms. Cases
are named by their eager step time.

``--script`` runs flodl's side in script mode (issue 18): the same training as
the user's own loop, ``bench/tasks/solo_script.py`` under ``python -m
flodl.controller --script``, its rate from the run summary's training wall as
for a ``Task``; the plain side is unchanged. Results in ``overhead_script.json``
(``overhead_gpu_script.json`` with ``--device cuda``); eager only (no ``--compile``).

``--concurrent`` (CPU, two cores) runs each pair's two sides at the same time
instead of back to back: flodl's whole run (controller, worker, rank) pinned to
one core, the plain loop streaming on the other from before flodl's training
starts until after it ends, its rate taken over exactly flodl's training span
(the summary's ``trained_unix``); the cores swap every pair. On a VM whose
speed wanders by ±20% within seconds (this one's, with nothing else running),
back-to-back pairs measure the wander as much as flodl; side by side, both
sides live through the same seconds. It is the stricter test: flodl's
controller and worker share the rank's core instead of idling on the other.
Results in ``overhead[_script]_concurrent.json``.

``--null`` is an A/A run: flodl's side is replaced by a second plain loop (a
fresh process, pinned like flodl's with ``--concurrent``), so the ratios show
how far the design alone moves a pair; no goal. Results in
``overhead_null[_concurrent].json``.

``--smoke`` runs one small pair without sizing (seconds) and writes its JSON
under ``$FLODL_BENCH_RESULTS`` or a temporary folder, never ``bench/results``.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench.common import Row, report, run_controller, size_parser, smoke_results, write_results  # noqa: E402
from bench.tasks import solo  # noqa: E402
from flodl import Trainer  # noqa: E402
from flodl.task import COMPILE_MODES  # noqa: E402

TASK = f"{ROOT / 'bench' / 'tasks' / 'solo.py'}:task"
#: ``--script``: the same training as ``TASK``, in the user's own loop (script mode).
SCRIPT = ROOT / "bench" / "tasks" / "solo_script.py"
#: The plain loop reads its loss back every this many steps (a log line's worth), as one would by hand.
LOSS_EVERY = 50
#: Each case's plain step is at least this long (the goal is stated at ≥ 4 ms steps).
MIN_STEP_MS = 4.0

DEVICE = "cpu"
#: ``--script``: flodl's side runs ``SCRIPT`` in script mode instead of ``TASK``.
SCRIPT_MODE = False
#: ``--null``: flodl's side replaced by a second plain loop (an A/A run: the design's own noise).
NULL = False
#: ``--concurrent``: the two cores (flodl's, the plain loop's) of a pair's first order; empty: pairs run back to back.
CONCURRENT: tuple[int, ...] = ()


def plain_loop(epochs: int, *, steady: bool = False, sync_every_step: bool = False, span: list[float] | None = None) -> tuple[float, float]:
    """(samples/s, mean step ms) of the plain loop over all its epochs (``steady``: after its first).

    On a GPU it is the loop a good engineer writes: the data sits on the device, the
    shuffle goes up once per epoch, and the loss is read back every ``loss_every()``
    steps, so the host launches ahead of the kernels (``sync_every_step``: every step,
    the variant that waits for the device each time). ``span``, if given, receives the
    timed stretch's first and last moment in Unix time (``--null``'s stand-in for flodl's
    ``trained_unix``)."""
    n, bs, step = _plain_parts()
    steps = 0
    losses = []
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    for epoch in range(epochs):
        if steady and epoch == 1:  # sizing: warm-up (first kernels, allocator) is not the step's cost
            steps, start = 0, time.perf_counter()
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(42 + epoch)).to(DEVICE)
        for i in range(0, n, bs):
            loss = step(perm[i : i + bs])
            steps += 1
            if sync_every_step or steps % loss_every() == 0:
                losses.append(loss.item())
    losses.append(loss.item())  # the last one, as a training script prints it (and the device is done)
    wall = time.perf_counter() - start
    if span is not None:
        end = time.time()
        span[:] = [end - wall, end]
    counted = epochs - 1 if steady and epochs > 1 else epochs
    return n * counted / wall, wall / steps * 1000


def _plain_parts() -> tuple[int, int, Callable[[torch.Tensor], torch.Tensor]]:
    """The plain loop's dataset length, batch size, and one training step on a batch's indices
    (the data, model and optimizer built once, on the device), returning the step's loss."""
    task = solo.task()
    x_all, y_all = (t.to(DEVICE) for t in task.dataset.tensors)
    model = task.model().to(DEVICE)
    opt = task.optimizer(model)
    mode = solo.compile_mode()
    if mode:  # as flodl does it (Task.compile): the module's forward, the loss outside
        model.compile(mode=mode)
    graphed = mode in ("reduce-overhead", "max-autotune") and DEVICE == "cuda"

    def step(idx: torch.Tensor) -> torch.Tensor:
        if graphed:
            torch.compiler.cudagraph_mark_step_begin()
        loss = task.loss_fn(model(x_all[idx]), y_all[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss

    return len(x_all), task.batch_size, step


def plain_stream(core: int) -> list[tuple[float, int]]:
    """``--concurrent``'s plain side: the plain loop (CPU) on ``core``, epoch after epoch until
    SIGTERM, with (Unix time, samples trained so far) after every step. Says ``ready`` once built."""
    os.sched_setaffinity(0, {core})
    stop: list[int] = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    n, bs, step = _plain_parts()
    print("ready", flush=True)
    stamps, samples, steps, epoch = [(time.time(), 0)], 0, 0, 0
    while not stop:
        perm = torch.randperm(n, generator=torch.Generator().manual_seed(42 + epoch))
        for i in range(0, n, bs):
            idx = perm[i : i + bs]
            loss = step(idx)
            steps += 1
            samples += len(idx)
            if steps % loss_every() == 0:
                loss.item()
            stamps.append((time.time(), samples))
            if stop:
                break
        epoch += 1
    return stamps


def rate_between(stamps: list[tuple[float, int]], start: float, end: float) -> float:
    """Samples/s the stream trained from ``start`` to ``end`` (Unix times), interpolated between steps.

    Raises:
        ValueError: the stream did not run over the whole span.
    """
    times = [t for t, _ in stamps]
    if not times[0] <= start < end <= times[-1]:
        raise ValueError(f"the plain loop ran {times[0]:.2f}-{times[-1]:.2f}, not over flodl's training {start:.2f}-{end:.2f}")

    def at(t: float) -> float:
        k = max(1, bisect.bisect_left(times, t))
        (t0, s0), (t1, s1) = stamps[k - 1], stamps[k]
        return s0 + (s1 - s0) * (t - t0) / (t1 - t0) if t1 > t0 else s1

    return (at(end) - at(start)) / (end - start)


def concurrent_pair(epochs: int, cores: tuple[int, int]) -> tuple[float, float]:
    """(plain, flodl) samples/s trained side by side over the same seconds: flodl's run (controller,
    worker and rank) pinned to ``cores[0]``, the plain loop streaming on ``cores[1]`` from before
    flodl's training starts until after it ends; the plain rate is taken over exactly flodl's
    training span (the summary's ``trained_unix``). Whatever the host does to the machine's speed
    in those seconds, it does to both sides."""
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1]); import bench.overhead as o; print(json.dumps(o.plain_stream(int(sys.argv[2]))))"
    )
    plain = subprocess.Popen([sys.executable, "-c", code, str(ROOT), str(cores[1])], stdout=subprocess.PIPE, text=True)
    try:
        assert plain.stdout is not None and plain.stdout.readline().strip() == "ready", "the plain loop did not start"
        summary = plain_span(epochs, cores[0]) if NULL else flodl_cli_run(epochs, core=cores[0])
    finally:
        plain.send_signal(signal.SIGTERM)
        out, _ = plain.communicate(timeout=60)
    start, end = summary["trained_unix"]
    return rate_between(json.loads(out.strip().splitlines()[-1]), start, end), summary["samples"] / summary["wall_s"]


def plain_span(epochs: int, core: int) -> dict:
    """``--null``'s stand-in for flodl's side: the plain loop in a fresh process on ``core``, its
    rate and its span as a run summary gives them (``samples``, ``wall_s``, ``trained_unix``)."""
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1]); import os; os.sched_setaffinity(0, {int(sys.argv[3])}); "
        "import torch; torch.set_num_threads(1); import bench.overhead as o; "
        "span = []; rate, _ = o.plain_loop(int(sys.argv[2]), span=span); print(json.dumps([rate, *span]))"
    )
    out = subprocess.run([sys.executable, "-c", code, str(ROOT), str(epochs), str(core)], capture_output=True, text=True, check=True)
    rate, start, end = json.loads(out.stdout.strip().splitlines()[-1])
    return {"samples": rate * (end - start), "wall_s": end - start, "trained_unix": [start, end]}


def loss_every() -> int:
    """How often the plain loop reads its loss: a log line's worth of steps (more on a GPU, whose steps are short)."""
    return 100 if DEVICE == "cuda" else LOSS_EVERY


def plain_run(epochs: int, *, sync_every_step: bool = False) -> float:
    """Samples/s of the plain loop in a fresh process, as flodl's rank is one: on this kind of VM the
    same loop runs up to ±9% apart from one process to the next (placement, memory layout), so a
    plain rate taken once in the long-lived bench process would bias every pair the same way."""
    code = (
        "import sys, json; sys.path.insert(0, sys.argv[1]); import torch; torch.set_num_threads(1); "
        "import bench.overhead as o; o.DEVICE = sys.argv[3]; "
        "print(json.dumps(o.plain_loop(int(sys.argv[2]), sync_every_step=sys.argv[4] == '1')[0]))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(ROOT), str(epochs), DEVICE, "1" if sync_every_step else "0"],
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def flodl_run(epochs: int) -> float:
    """Samples/s of one flodl run over its training wall (the run summary's)."""
    if SCRIPT_MODE:
        return script_run(epochs)
    builder = Trainer.builder(TASK).epochs(epochs).progress(False)
    builder = builder.devices("cuda:0") if DEVICE == "cuda" else builder.nproc_per_node(1)
    summary = builder.run()
    assert summary["exit_reason"] == "completed", summary["exit_reason"]
    return summary["samples"] / summary["wall_s"]


def script_run(epochs: int) -> float:
    """Samples/s of one script-mode run (``SCRIPT`` through the controller's CLI) over its training wall."""
    summary = flodl_cli_run(epochs)
    return summary["samples"] / summary["wall_s"]


def flodl_cli_run(epochs: int, core: int | None = None) -> dict:
    """The summary of one run through the controller's CLI (``SCRIPT`` in script mode, else ``TASK``),
    every process of it on ``core`` if given (children inherit the mask)."""
    where = ["--devices", "cuda:0"] if DEVICE == "cuda" else ["--nproc-per-node", "1"]
    what = ["--script", str(SCRIPT)] if SCRIPT_MODE else ["--task", TASK]
    pin = None if core is None else (lambda: os.sched_setaffinity(0, {core}))
    summary = run_controller([*what, *where, "--epochs", str(epochs), "--no-progress"], preexec_fn=pin)
    assert summary["exit_reason"] == "completed", summary["exit_reason"]
    return summary


def step_width(target_ms: float, given: int | None = None) -> tuple[int, float]:
    """The first hidden width whose steady plain step takes at least ``target_ms``, and that step's ms
    (eager: a case is named by its eager step, whether or not both sides then compile); ``given``
    (``--width``): that width and its step, not sized."""
    with eager():
        return _step_width(target_ms, given)


@contextlib.contextmanager
def eager() -> Iterator[None]:
    """Within: the plain loop runs uncompiled in this process (sizing a case)."""
    mode = os.environ.pop("FLODL_BENCH_COMPILE", None)
    try:
        yield
    finally:
        if mode is not None:
            os.environ["FLODL_BENCH_COMPILE"] = mode


def _step_width(target_ms: float, given: int | None) -> tuple[int, float]:
    os.environ["FLODL_BENCH_SAMPLES"] = "2048"
    os.environ["FLODL_BENCH_WIDTH"] = "256"
    plain_loop(1)  # warm-up (CUDA context, kernels, allocator): else the first width looks slow and wins
    widths: tuple[int, ...] = (256, 384, 512, 640, 768, 896, 1024, 1280, 1536, 1792, 2048, 2560, 3072)
    if DEVICE == "cuda":
        widths = (256, 512, 1024, 1536, 2048, 3072, 4096, 6144, 8192, 10240, 12288, 16384, 20480, 24576)
    if given is not None:
        widths = (given,)
    for w in widths:
        os.environ["FLODL_BENCH_WIDTH"] = str(w)
        _, ms = plain_loop(2, steady=True)  # the second epoch's steps
        if ms >= target_ms:
            break
    return w, ms


#: GPU cases: a case's epoch takes about this long (steps per epoch = this / the step), so
#: a 20 ms case does not take 20x the device time of a 1 ms one ...
GPU_EPOCH_MS = 2500.0
#: ... within these bounds of steps per epoch.
GPU_STEPS = (128, 2048)
#: Matrix models on the GPU: training samples (images are generated to size; text is what it is) and epochs.
MODEL_SAMPLES, MODEL_EPOCHS = 16384, 4


def gpu_samples(step_ms: float, batch: int) -> int:
    """Samples of a GPU case's dataset: about ``GPU_EPOCH_MS`` of steps per epoch."""
    steps = min(max(round(GPU_EPOCH_MS / max(step_ms, 0.05)), GPU_STEPS[0]), GPU_STEPS[1])
    return steps * batch


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = size_parser(__doc__, "the ~5 ms case only, 11 pairs (under two minutes)", "one tiny pair")
    parser.add_argument(
        "--device", choices=("cpu", "cuda"), default="cpu", help="where both sides train (cuda: results in overhead_gpu.json)"
    )
    parser.add_argument(
        "--steps-ms",
        default=None,
        help="comma-separated step times (ms) to size the cases by, instead of the plan's (e.g. 1 or 1,5; 0: none, with --models)",
    )
    parser.add_argument(
        "--width",
        type=int,
        default=None,
        help="the MLP's hidden width for every --steps-ms case, instead of sizing it (a case is then named by its measured step)",
    )
    parser.add_argument("--pairs", type=int, default=None, help="plain/flodl pairs per case, instead of the plan's")
    parser.add_argument(
        "--models",
        default=None,
        help="comma-separated matrix models to run as cases too (e.g. resnet20,gpt_nano; --device cuda's full plan has both)",
    )
    parser.add_argument(
        "--compile",
        choices=COMPILE_MODES,
        default=None,
        help="torch.compile mode on both sides (Task.compile / model.compile); results in <name>_compiled[_mode].json",
    )
    parser.add_argument(
        "--script", action="store_true", help="flodl's side in script mode (bench/tasks/solo_script.py); results in <name>_script.json"
    )
    parser.add_argument(
        "--epochs",
        type=int,
        default=None,
        help="epochs of every MLP case instead of the plan's (more epochs: a run's fixed costs weigh less against its steps)",
    )
    parser.add_argument("--name", default=None, help="results file name (default: overhead, overhead_gpu, + the compile mode)")
    parser.add_argument(
        "--concurrent",
        action="store_true",
        help="CPU: run each pair's two sides at the same time on two cores (swapped every pair), the plain rate taken over "
        "flodl's training span, instead of back to back; results in <name>_concurrent.json",
    )
    parser.add_argument(
        "--null",
        action="store_true",
        help="an A/A run: flodl's side is a second plain loop, so the ratios show the design's own noise "
        "(no goal); results in overhead_null[_concurrent].json",
    )
    parser.add_argument(
        "--cpus",
        default=None,
        help="pin the bench and every process it starts (both sides) to these cores, e.g. 2-5 or 2,3 "
        "(on a many-core host, which cores a process lands on moves a host-bound loop by ±20%%)",
    )
    return parser.parse_args(argv)


def parse_cpus(spec: str) -> set[int]:
    """``2-5,8`` as a set of core numbers; a clear error on anything else."""
    cores: set[int] = set()
    try:
        for part in spec.split(","):
            low, _, high = part.partition("-")
            cores.update(range(int(low), int(high or low) + 1))
    except ValueError:
        raise SystemExit(f"overhead.py: --cpus {spec!r} is not a core list like 2-5 or 2,3") from None
    if not cores or not cores <= os.sched_getaffinity(0):
        raise SystemExit(f"overhead.py: --cpus {spec!r} names cores outside this process's {sorted(os.sched_getaffinity(0))}")
    return cores


def plan(args: argparse.Namespace) -> tuple[list[tuple[str, float | None, str]], int, int, int]:
    """(cases as (label, target step ms or None, model), pairs, samples, epochs) for these flags."""
    if args.smoke:
        return [("smoke", None, "mlp")], 1, 1024, 1
    if DEVICE == "cuda":  # issue 17: 1 to 20 ms steps, where a GPU loop's host work shows
        targets = (1.0, 5.0) if args.quick else (1.0, 2.0, 5.0, 20.0)
        models = () if args.quick else ("resnet20", "gpt_nano")
        reps, samples, epochs = (3 if args.quick else 5), 0, 3  # samples: sized per case
    elif args.quick:
        targets, models, reps, samples, epochs = (5.0,), (), 11, 12288, 2
    else:
        targets, models, reps, samples, epochs = (5.0, 20.0), (), 9, 16384, 4
    if args.steps_ms:
        targets = tuple(float(t) for t in args.steps_ms.split(",") if t and float(t) > 0)  # 0: no MLP case
    if args.steps_ms and args.models is None:  # cases named: only those
        models = ()
    if args.models is not None:
        models = tuple(m for m in args.models.split(",") if m)
    if args.epochs is not None:
        if args.epochs < 1:
            raise SystemExit(f"overhead.py: --epochs {args.epochs} must be at least 1")
        epochs = args.epochs
    cases = [(f"~{t:g} ms step", t, "mlp") for t in targets] + [(name, None, name) for name in models]
    return cases, args.pairs or reps, samples, epochs


def run_case(
    label: str,
    target: float | None,
    model: str,
    reps: int,
    samples: int,
    epochs: int,
    loads: list[float],
    width: int | None = None,
    after_pair: Callable[[dict, int], None] | None = None,
) -> dict:
    """One case's pairs: the plain and flodl rates, their ratios, and the every-step-sync loop's rate.
    ``width``: the MLP's, as given (its step measured), instead of sized to ``target``."""
    os.environ["FLODL_BENCH_MODEL"] = model
    if model == "mlp":
        width, step_ms = step_width(target, width) if target else (256, 0.0)
        os.environ["FLODL_BENCH_WIDTH"] = str(width)
        if DEVICE == "cuda":
            samples = gpu_samples(step_ms, mlp_batch())
        os.environ["FLODL_BENCH_SAMPLES"] = str(samples)
        name = f"{label} (width {width}, {step_ms:.1f} ms)"
    else:
        os.environ["FLODL_MATRIX_SAMPLES"] = str(MODEL_SAMPLES)
        epochs = MODEL_EPOCHS
        with eager():
            _, step_ms = plain_loop(2, steady=True)
        name = f"{label} ({step_ms:.1f} ms)"
    plain, flo, ratios, synced = [], [], [], []
    for i in range(reps):  # pairs back to back (who goes first alternates), so drift in the machine hits both sides
        if CONCURRENT:  # side by side instead, the two cores swapped from one pair to the next
            rate, f = concurrent_pair(epochs, CONCURRENT if i % 2 == 0 else CONCURRENT[::-1])
        elif i % 2:
            f = plain_run(epochs) if NULL else flodl_run(epochs)
            rate = plain_run(epochs)
        else:
            rate = plain_run(epochs)
            f = plain_run(epochs) if NULL else flodl_run(epochs)
        plain.append(rate)
        flo.append(f)
        ratios.append(f / rate)
        if DEVICE == "cuda" and i == 0:  # the loop that reads its loss every step, for reference (once: device time)
            synced.append(plain_run(epochs, sync_every_step=True))
        loads.append(os.getloadavg()[0])
        print(f"{label} pair {i + 1}/{reps}: plain {rate:,.0f}, flodl {f:,.0f} samples/s, {f / rate:.1%} (load {loads[-1]:.2f})")
        if after_pair is not None and i + 1 < reps:  # a run cut short (a device lease's limit) keeps its pairs
            after_pair(_case(name, step_ms, plain, flo, ratios, synced, model), i + 1)
    return _case(name, step_ms, plain, flo, ratios, synced, model)


def _case(name: str, step_ms: float, plain: list, flo: list, ratios: list, synced: list, model: str) -> dict:
    batch = mlp_batch() if model == "mlp" else solo.task().batch_size
    return {"name": name, "step_ms": step_ms, "plain": plain, "flodl": flo, "ratios": ratios, "synced": synced, "batch": batch}


def case_rows(args: argparse.Namespace, target: float | None, res: dict, reps: int) -> list[Row]:
    case, ratios = res["name"], res["ratios"]
    ratio = statistics.median(ratios)
    rows = [
        Row(case, "plain samples/s", statistics.median(res["plain"]), "samples/s"),
        Row(case, "flodl samples/s", statistics.median(res["flodl"]), "samples/s"),
    ]
    if res["synced"]:
        rows.append(
            Row(case, "plain, loss read every step / plain (one run)", res["synced"][0] / statistics.median(res["plain"]) * 100, "%")
        )
    label = f"flodl / plain (median of {reps})"
    if args.smoke:  # a step far under 4 ms and one pair: the path ran, nothing is measured
        rows.append(Row(case, label, ratio * 100, "%"))
    elif DEVICE == "cuda":
        step = target if target is not None else res["step_ms"]
        goal = (0.95 if step < 5.0 else 0.99) if args.compile == "reduce-overhead" else (0.97 if step < 5.0 else 0.99)
        text = f"≥ {goal:.0%} (median of ≥ 3)"
        rows.append(Row(case, label, ratio * 100, "%", text, ratio >= goal and reps >= 3))
    elif NULL:  # plain against plain: the design's resolution, not a result of flodl's
        rows.append(Row(case, label, ratio * 100, "%"))
    else:
        met = ratio >= 0.97 and reps >= 5 and res["step_ms"] >= MIN_STEP_MS
        rows.append(Row(case, label, ratio * 100, "%", "≥ 97% (median of ≥ 5, ≥ 4 ms)", met))
    rows.append(Row(case, "flodl / plain (lowest pair)", min(ratios) * 100, "%"))
    rows.append(Row(case, "flodl / plain (highest pair)", max(ratios) * 100, "%"))
    for k, r in enumerate(ratios, 1):  # every pair, so a reader sees the spread the median hides
        order = f"flodl on core {CONCURRENT[(k - 1) % 2]}" if CONCURRENT else f"{'flodl' if k % 2 == 0 else 'plain'} first"
        rows.append(Row(case, f"flodl / plain, pair {k} ({order})", r * 100, "%"))
    rows.append(Row(case, "flodl's cost per step, whole run (median of pairs)", step_cost_us(res), "µs"))
    return rows


def step_cost_us(res: dict) -> float:
    """What flodl adds to each step, amortised over its whole run (median over the pairs): a step's
    time under flodl less the plain loop's, from each pair's rates. It holds the run's fixed costs
    too (first window, probe, window turnarounds), so it bounds the per-step work from above;
    at the smallest steps it is most of what the ratio loses."""
    batch = res["batch"]
    return statistics.median(batch * (1.0 / f - 1.0 / p) * 1e6 for f, p in zip(res["flodl"], res["plain"], strict=True))


def mlp_batch() -> int:
    from bench.tasks import mlp

    return mlp.BATCH


def main(argv: list[str] | None = None) -> Path:
    global DEVICE, SCRIPT_MODE, CONCURRENT, NULL
    args = parse_args(argv)
    DEVICE, SCRIPT_MODE, NULL = args.device, args.script, args.null
    if args.null and (args.device == "cuda" or args.script or args.compile):
        raise SystemExit("overhead.py: --null compares the CPU plain loop with itself (no --device cuda, --script or --compile)")
    if args.script and args.compile:
        raise SystemExit("overhead.py: --script runs eager (the script does not compile); drop --compile")
    # one intra-op thread on both sides: on a small shared machine a second
    # thread makes every step hostage to whatever else runs, drowning the signal
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    if args.compile:
        os.environ["FLODL_BENCH_COMPILE"] = args.compile
    if args.cpus:
        # children inherit the mask: the plain loop's process and flodl's controller, worker and rank alike
        os.sched_setaffinity(0, parse_cpus(args.cpus))
    if args.concurrent:
        if DEVICE == "cuda":
            raise SystemExit("overhead.py: --concurrent runs the two sides on two CPU cores (no --device cuda)")
        cores = sorted(os.sched_getaffinity(0))
        if len(cores) < 2:
            raise SystemExit(f"overhead.py: --concurrent needs two cores, this process may use {cores}")
        CONCURRENT = (cores[0], cores[1])
    cases, reps, samples, epochs = plan(args)
    rows: list[Row] = []
    sys.stdout = io.TextIOWrapper(sys.stdout.buffer, line_buffering=True)
    loads = [os.getloadavg()[0]]
    name = results_name(args)
    where = smoke_results() if args.smoke else None
    for done, (label, target, model) in enumerate(cases, 1):

        def partial(res: dict, pairs: int, done: int = done, target: float | None = target) -> None:
            note = run_note(args, reps, samples, epochs, loads) + f"; PARTIAL: case {done} of {len(cases)} after {pairs} of {reps} pairs"
            write_results(name, [*rows, *case_rows(args, target, res, pairs)], note=note, results=where)

        res = run_case(label, target, model, reps, samples, epochs, loads, width=args.width, after_pair=partial)
        rows.extend(case_rows(args, target, res, reps))
        if done < len(cases):  # a run cut short keeps the cases it finished
            write_results(
                name, rows, note=run_note(args, reps, samples, epochs, loads) + f"; PARTIAL: {done} of {len(cases)} cases", results=where
            )
    return report(name, rows, note=run_note(args, reps, samples, epochs, loads), results=where)


def results_name(args: argparse.Namespace) -> str:
    """The results file's name: ``--name``, or overhead[_gpu] + the compile mode + _script."""
    if args.name:
        return args.name
    name = "overhead_gpu" if DEVICE == "cuda" else "overhead_null" if args.null else "overhead"
    if args.compile:
        name += "_compiled" + ("" if args.compile == "default" else "_" + args.compile.replace("-", "_"))
    return name + ("_script" if args.script else "") + ("_concurrent" if args.concurrent else "")


def run_note(args: argparse.Namespace, reps: int, samples: int, epochs: int, loads: list[float]) -> str:
    """The conditions of the run, for the results file and the table's foot."""
    how = (
        f"side by side on cores {CONCURRENT[0]} and {CONCURRENT[1]} (swapped every pair), the plain rate over flodl's training span"
        if CONCURRENT
        else "whole training timed on both sides"
    )
    note = (
        f"{reps} plain/flodl pairs per case, {how}; "
        f"plain reads its loss every {loss_every()} steps; load average {min(loads):.2f}-{max(loads):.2f} during the run"
    )
    if DEVICE == "cuda":
        note += (
            f"; 1 CUDA rank vs a plain loop on the same GPU, the data on the device for both, ~{GPU_EPOCH_MS / 1000:g} s epochs x {epochs}"
        )
        note += f" (matrix models: {MODEL_SAMPLES} samples x {MODEL_EPOCHS} epochs)"
    else:
        note += f"; {samples} samples x {epochs} epoch(s); 1 CPU rank, 1 intra-op thread on both sides (OMP_NUM_THREADS=1)"
    if args.script:
        note += "; flodl's side in script mode (bench/tasks/solo_script.py: the user's own loop, flodl.init/prepare/batches/step)"
    if args.compile:
        note += f"; torch.compile(mode={args.compile!r}) on both sides"
    if args.width:
        note += f"; MLP width {args.width} as given (not sized)"
    if args.epochs:
        note += f"; {args.epochs} epochs per MLP run as given"
    if args.cpus:
        note += f"; every process pinned to cores {args.cpus}"
    if args.null:
        note += "; A/A: the 'flodl' side is a second plain loop in a fresh process (the design's own noise, no goal)"
    return note


if __name__ == "__main__":
    main()
