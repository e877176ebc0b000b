"""Healing: the time from a rank's death to the world back at full size with the dead rank's
replacement holding its donor's optimizer state, for a model of about 100 MB.

    python bench/heal.py [--quick | --smoke] [--runs N] [--width W]

Two CPU ranks train an MLP of 25.2 M parameters (100.7 MB; Adam, whose state is
twice that: ``bench/tasks/heal.py``) with ``--max-restarts 1``. Rank 1 kills
itself at its 6th batch (``FLODL_INJECT_FAULT``); its worker starts a new rank
in its place at once (a first fault has no back-off), which builds the task, says it is ready,
is admitted at the next window boundary and takes the survivor's parameters
and optimizer state (docs/fault-tolerance.md, *A joiner takes its donor's
state*): through the process group in ``nccl-cadence`` (gloo here), through
shared memory in ``cpu-cadence`` (one host: the donor's segment, linked to the
joiner by the controller; the summary's ``averaging.state_lane_bytes``, the
"state through shared memory" row). The ranks write the state they handed and
took at their probes (``FLODL_PROBE_DIR``, with the moment each was reached),
so each run also checks the two are bit-identical.

From the summary and the probes, in seconds after the controller handled the death:

* **spawn**: the new rank said it was ready (back-off, process start, torch
  and the task built, welcomed): what no state transfer can shorten;
* **admitted**: the controller admitted it (it waited for a window boundary);
* **back at full size**: it holds its donor's state, loaded, in the full
  world (the collective backend: right after the admitting broadcast and the
  state; the CPU backend: once it adopted its first round's average, at the
  end of that window, and loaded the state that came with it). The donor's
  probe writes the state to disk before it sends it: that write's own time is
  taken out.

Goal (issue 50): back at full size within spawn + 2 s for a 100 MB model, the
donor's optimizer state bit-identical.

``--quick``: one run per backend (the committed results: about 2 minutes here).
``--smoke``: width 256 (a 2 MB model), nccl-cadence only, results in a temporary folder.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import Row, RunFailed, report, size_parser, smoke_results, start_controller  # noqa: E402

TASK = f"{ROOT / 'bench' / 'tasks' / 'heal.py'}:task"
MODES = ("nccl-cadence", "cpu-cadence")
GOAL = "spawn time + 2 s for a 100 MB model, donor's optimizer state bit-identical"


def heal_once(mode: str, width: int, tmp: Path) -> dict:
    """One run: the death, the restart, the state handed over; the times and the check."""
    probes, release = tmp / "probes", tmp / "released"
    probes.mkdir(parents=True)
    env = dict(os.environ)
    env.update(
        PYTHONPATH=str(ROOT) + os.pathsep + env.get("PYTHONPATH", ""),
        PYTHONUNBUFFERED="1",
        FLODL_PROBE_DIR=str(probes),
        FLODL_INJECT_FAULT="1:batch:6",
        FLODL_BENCH_HEAL_WIDTH=str(width),
        FLODL_BENCH_HEAL_RELEASE=str(release),
    )
    args = ["--task", TASK, "--nproc-per-node", "2", "--epochs", "3", "--mode", mode, "--max-restarts", "1"]
    # a step of this model can take a second on a loaded 2-core machine: generous deadlines, so none
    # of them decides the run (an averaging round given up is no part of what is measured)
    deadlines = ["--heartbeat-timeout-secs", "30", "--snapshot-timeout-secs", "120"]
    run = start_controller([*args, *deadlines], workdir=tmp, env=env)
    deadline = time.monotonic() + 300
    try:
        while not list(probes.glob("handoff.taken.*.safetensors.t1")):
            if run.proc.poll() is not None or time.monotonic() > deadline:
                raise run.failed("the restarted rank never took a state")
            time.sleep(0.1)
    finally:
        release.touch()  # the rest of the run is cheap steps
    summary = run.finish(300)
    return measured(summary, probes)


def measured(summary: dict, probes: Path) -> dict:
    """Seconds after the death's handling, from the summary (its run-relative clock) and the probes (Unix time)."""
    import torch

    from flodl.checkpoint import safetensors_io

    death, restart, join = summary["recoveries"][0], summary["restarts"][0], summary["joins"][0]
    started_unix = death["unix_time"] - death["at_s"]  # the run's start, on the Unix clock

    def probe(point: str) -> tuple[dict, float, float]:
        path = next(probes.glob(f"{point}.rank*.0.safetensors"))
        tensors, meta = safetensors_io.load(path)
        t1 = float(Path(f"{path}.t1").read_text())
        return tensors, float(meta["t0"]), t1

    sent, sent_t0, sent_t1 = probe("handoff.sent")
    taken, taken_t0, _ = probe("handoff.taken")
    identical = sorted(taken) == sorted(sent) and all(
        taken[k].dtype == t.dtype
        and taken[k].shape == t.shape
        and torch.equal(taken[k].reshape(-1).view(torch.uint8), t.reshape(-1).view(torch.uint8))
        for k, t in sent.items()
    )
    back = taken_t0 - started_unix - death["at_s"] - (sent_t1 - sent_t0)  # less the donor's probe write
    return {
        "spawn_s": join["ready_at_s"][0] - death["at_s"],
        "admitted_s": join["at_s"] - death["at_s"],
        "back_s": back,
        "backoff_s": restart["delay_s"],
        "state_mb": sum(t.numel() * t.element_size() for name, t in sent.items() if name != "train_state") / 1e6,
        "identical": identical,
        "world": join["world"],
        "lane_mb": ((summary.get("averaging") or {}).get("state_lane_bytes") or 0) / 1e6,  # the CPU backend's shared-memory hand-over
    }


def main() -> None:
    parser = size_parser(__doc__, "one run per backend", "a 2 MB model, nccl-cadence only")
    parser.add_argument("--runs", type=int, default=None, help="runs per backend (default 3; quick 1)")
    parser.add_argument("--width", type=int, default=None, help="hidden width (default 4096: 100.7 MB of parameters)")
    parser.add_argument("--modes", default=",".join(MODES), help=f"modes, comma-separated (default {','.join(MODES)})")
    a = parser.parse_args()
    runs = a.runs or (1 if a.quick or a.smoke else 3)
    width = a.width or (256 if a.smoke else 4096)
    modes = MODES[:1] if a.smoke else tuple(a.modes.split(","))
    params = 2048 * width + width + width * width + width + width * 2 + 2
    rows: list[Row] = []
    started, load = time.monotonic(), os.getloadavg()[0]
    for mode in modes:
        got = []
        for i in range(runs):
            with tempfile.TemporaryDirectory(prefix="flodl-heal-") as tmp:
                try:
                    got.append(heal_once(mode, width, Path(tmp)))
                except RunFailed as exc:
                    print(f"{mode} run {i}: {exc}", flush=True)
                    raise
            print(f"{mode} run {i}: {got[-1]}", flush=True)
        spawn = statistics.median(g["spawn_s"] for g in got)
        back = statistics.median(g["back_s"] for g in got)
        beyond = max(g["back_s"] - g["spawn_s"] for g in got)
        identical = all(g["identical"] for g in got)
        rows += [
            Row(mode, "runs", len(got), "runs"),
            Row(mode, "model", params * 4 / 1e6, "MB"),
            Row(mode, "state handed", statistics.median(g["state_mb"] for g in got), "MB"),
            Row(mode, "state through shared memory", statistics.median(g["lane_mb"] for g in got), "MB"),
            Row(mode, "spawn (ready) p50", spawn, "s after death"),
            Row(mode, "admitted p50", statistics.median(g["admitted_s"] for g in got), "s after death"),
            Row(mode, "back at full size p50", back, "s after death"),
            Row(mode, "back - spawn, max", beyond, "s", GOAL, beyond <= 2.0 and identical),
            Row(mode, "state bit-identical", sum(g["identical"] for g in got), "runs", "every run", identical),
        ]
    size = "smoke" if a.smoke else "quick" if a.quick else "full"
    report("heal", rows, note=_note(size, width, params, load, started), results=smoke_results() if a.smoke else None)


def _note(size: str, width: int, params: int, load: float, started: float) -> str:
    """What the results were measured on, and how loaded the machine was."""
    return (
        f"{size}: 2 CPU ranks, MLP 2048-{width}-{width}-2 ({params / 1e6:.1f} M parameters), Adam, batch 8, rank 1 killed "
        f"at its 6th batch, --max-restarts 1 (no back-off), heartbeat 30 s, snapshot timeout 120 s; load average "
        f"{load:.1f} -> {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores (other work on the machine slows every step); "
        f"{time.monotonic() - started:.0f} s"
    )


if __name__ == "__main__":
    main()
