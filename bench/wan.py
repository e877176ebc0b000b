"""Training across slow links: how much of its rate and its time to quality a run keeps on WAN links.

    python -m bench.wan [--quick | --smoke] [--models M,..] [--modes M,..] [--links L,..]
                        [--compressions C,..] [--fragments 1,2,4] [--results DIR]

Three network namespaces on one bridge stand in for three sites: the
controller's (``flodl-wan-c``) and two hosts (``flodl-wan-h1``, ``-h2``), each
host's worker with one CPU rank, started as ``bench/network.py`` starts them
(``ip netns exec``, no ssh; a host name and ``/dev/shm`` of its own). Every
node's link is shaped alike (``bench/netns.py``'s ``Shaper``): what a node sends
is capped at the link's rate and delayed by its one-way delay, what it receives
is capped at the rate, so a message between two sites crosses the sender's
delay and both ends' caps. Links (``LINKS``):

* ``unshaped``: the ideal, through the same path (the userspace relay, where
  the kernel has no netem, copies every frame with no delay or cap);
* ``1gbit-1ms``, ``100mbit-50ms``, ``20mbit-100ms``: rate and one-way delay.

Each link is measured before its runs (``link_probe``: the fastest TCP round
trip between the hosts and a bulk transfer's rate) and the JSON keeps it.

The grid: the matrix's GPT-nano and ResNet-20 (``bench.matrix.tasks``, seed
0), in ``nccl-cadence`` (gloo between the hosts' ranks) and ``cpu-cadence``
(the controller averages), each ``--sync-compression none`` and ``int8``
(docs/compression.md), each ``--sync-fragments F`` for F in ``--fragments``
(only passed when F > 1; where this flodl's controller has no such option,
those cells are skipped and the note says so). Per cell:

* *throughput*: training samples/s (the summary's ``train_samples_per_s``,
  evals out) and its *fraction of ideal*: of the same model, mode,
  compression and fragments on the unshaped link;
* *bytes per average*: the summary's ``sync_bytes.per_average`` (what every
  rank sends for one average, summed over the ranks), and for int8 how many
  times fewer than none's on the same link;
* *time to target* (the time-to-target protocol, ``bench/matrix/reach.py``):
  the target is the unshaped ``none`` run's final eval and training loss (per
  model, mode and fragments); a run has reached it at the first history row with
  eval >= target - 0.005 and loss <= 1.05 x target; training seconds to that
  row (evals out), and the ratio to the unshaped none run's own time to it.
  Every run but the target's trains up to ``CAP`` x the budget's epochs and is
  stopped (SIGINT) once its record log shows a row that met the target.

Goals (issue 51): at 100 Mbit/50 ms GPT-nano keeps >= 0.95 of its unshaped
training rate and reaches the unshaped target within 1.1x its time; int8 sends
>= 3.5x fewer bytes per average than none.

``--quick``: GPT-nano, unshaped and 100 Mbit/50 ms, none and int8,
``nccl-cadence``, fewer samples and epochs (under two minutes, results in
``wan_quick.json``). ``--smoke``: GPT-nano, 512 samples, one epoch, unshaped
and 100 Mbit/50 ms, none only, into a temporary folder.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.common import Row, RunFailed, report, size_parser, smoke_results, start_controller, write_results  # noqa: E402
from bench.matrix import Budget  # noqa: E402
from bench.matrix.reach import Goal, Reach, RecordWatch, first_reach  # noqa: E402
from bench.matrix.tasks import SAMPLES_ENV, SEED_ENV, SPECS  # noqa: E402
from bench.netns import Netem, NsHost, Shaper, link_probe, make_hosts, netem_in_kernel, teardown_hosts, unusable_reason  # noqa: E402
from bench.network import with_workers  # noqa: E402
from bench.pace_probe import probe_ms  # noqa: E402
from flodl.config.env import SUMMARY_HISTORY_BYTES  # noqa: E402
from flodl.errors import EXIT_INTERRUPTED  # noqa: E402

BRIDGE = "flodl-wanbr0"
CONTROLLER = NsHost("flodl-wan-c", "10.81.0.10", "flodl-wanv0")
HOSTS = [NsHost(f"flodl-wan-h{i}", f"10.81.0.1{i}", f"flodl-wanv{i}") for i in (1, 2)]
FIRST_PORT = 29600
RUN_TIMEOUT_S = 900.0
STOP_POLL_S = 0.2
CAP = 1.5  # every run but the target's trains at most this many times the budget's epochs (stopped at the target)
GOAL_OF_IDEAL, GOAL_TIME, GOAL_FEWER = 0.95, 1.1, 3.5
GOAL_LINK, GOAL_MODEL = "100mbit-50ms", "gpt_nano"
GOAL_TEXT = f">= {GOAL_OF_IDEAL} of the unshaped rate and the unshaped target within {GOAL_TIME}x its time"


@dataclass(frozen=True)
class Link:
    """One kind of WAN link: every node's rate cap (0: none) and one-way delay."""

    name: str
    rate_mbit: float
    delay_ms: float

    @property
    def label(self) -> str:
        if not self.rate_mbit:
            return "unshaped"
        rate = f"{self.rate_mbit / 1000:g} Gbit" if self.rate_mbit >= 1000 else f"{self.rate_mbit:g} Mbit"
        return f"{rate}/{self.delay_ms:g} ms"

    def shaper(self, nodes: list[NsHost]) -> Shaper:
        egress, ingress = Netem(delay_ms=self.delay_ms, rate_mbit=self.rate_mbit), Netem(rate_mbit=self.rate_mbit)
        return Shaper(nodes, BRIDGE, egress=egress, ingress=ingress, seed=int(self.delay_ms))

    def probe_bytes(self) -> int:
        """About a second's worth at the rate (2 to 32 MB): long enough past TCP's slow start."""
        return int(min(32 << 20, max(2 << 20, self.rate_mbit * 1e6 / 8))) if self.rate_mbit else 32 << 20


#: in the order a model's cells run them: the goal's link right after the ideal it is measured against
LINKS = {k.name: k for k in (Link("unshaped", 0, 0), Link(GOAL_LINK, 100, 50), Link("1gbit-1ms", 1000, 1), Link("20mbit-100ms", 20, 100))}
IDEAL = "unshaped"
MODES = ("nccl-cadence", "cpu-cadence")
#: the full run's modes per model, as fit this 2-core VM in about 30 minutes (``--modes`` sets every model's)
FULL_MODES = {"gpt_nano": MODES, "resnet20": ("nccl-cadence",)}
COMPRESSIONS = ("none", "int8")
#: size -> model -> budget (the matrix's full budgets for the full run)
BUDGETS = {
    "full": {"gpt_nano": Budget(4096, 8), "resnet20": Budget(4096, 2)},
    "quick": {"gpt_nano": Budget(1024, 2)},
    "smoke": {"gpt_nano": Budget(512, 1)},
}


@dataclass(frozen=True)
class Cell:
    """One cell of the grid: a model in a mode on a link, with a compression and a fragment count."""

    model: str
    mode: str
    link: str
    compression: str
    fragments: int = 1

    @property
    def case(self) -> str:
        frag = f" F={self.fragments}" if self.fragments > 1 else ""
        return f"{self.model} {self.mode} {LINKS[self.link].label} {self.compression}{frag}"

    @property
    def slug(self) -> str:
        return f"{self.model}__{self.mode}__{self.link}__{self.compression}__f{self.fragments}"

    def like(self, **change: object) -> Cell:
        return Cell(**{**asdict(self), **change})


def fragments_supported() -> bool:
    """Whether this checkout's controller takes ``--sync-fragments`` (issue 51's streamed fragments)."""
    res = subprocess.run(
        [sys.executable, "-m", "flodl.controller", "--help"], capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=120
    )
    return "--sync-fragments" in res.stdout


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLODL_")}
    env.update(PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **extra)
    return env


def one_run(cell: Cell, budget: Budget, epochs: int, port: int, workdir: Path, stop_at: Goal | None) -> dict:
    """One run of ``cell``: the controller in its namespace, a worker with one CPU rank on each host; its summary
    (``stopped``: it was stopped at ``stop_at``, by SIGINT once its record log showed a row that met it)."""
    out = workdir / cell.slug
    secret, run_id = secrets.token_hex(32), f"wan-{secrets.token_hex(4)}"
    env = _env(
        FLODL_RUN_SECRET=secret, FLODL_RUN_ID=run_id, **{SAMPLES_ENV: str(budget.samples), SEED_ENV: "0", SUMMARY_HISTORY_BYTES: "0"}
    )
    args = ["--task", f"bench.matrix.tasks:{cell.model}", "--workers", str(len(HOSTS)), "--bind", CONTROLLER.addr, "--port", str(port)]
    args += ["--epochs", str(epochs), "--mode", cell.mode, "--seed", "0", "--sync-compression", cell.compression]
    args += ["--dashboard-port", "-1", "--no-progress", "--record-log-dir", str(out / "logs")]
    args += ["--sync-fragments", str(cell.fragments)] if cell.fragments > 1 else []
    ctl = start_controller(args, workdir=out, name="controller", env=env, prefix=CONTROLLER.netns_exec())
    watch = RecordWatch(out / "logs", stop_at) if stop_at else None
    stopped = False

    def finish() -> dict:
        nonlocal stopped
        deadline = time.monotonic() + RUN_TIMEOUT_S
        while ctl.proc.poll() is None and time.monotonic() < deadline:
            if watch is not None and not stopped and watch():
                ctl.proc.send_signal(signal.SIGINT)  # the controller stops its ranks and writes its summary
                stopped = True
            time.sleep(STOP_POLL_S)
        code = ctl.wait(max(1.0, deadline - time.monotonic()))
        # stopped at the target: it exits interrupted, or, when the SIGINT came as a run that ended anyway
        # was exiting (the target met at its last row), killed by it once its summary was written
        if code != 0 and not (stopped and code in (EXIT_INTERRUPTED, -signal.SIGINT) and ctl.summary_path.exists()):
            raise ctl.failed(f"exit code {code}")
        try:
            return ctl.summary()
        except ValueError:  # half written when the signal came
            raise ctl.failed(f"exit code {code}, its summary unreadable") from None

    summary = with_workers(ctl, HOSTS, "cpu", {**env, "GLOO_SOCKET_IFNAME": "eth0"}, out / "workers.log", cell.case, finish)
    summary["wan"] = {"stopped": stopped, "epochs_cap": epochs}
    return summary


@dataclass
class Outcome:
    """What one cell's run gave, in the figures the rows report."""

    cell: Cell
    samples_per_s: float
    bytes_per_average: float | None
    averages: int
    final_eval: float | None  # its last scored row's (a run stopped at the target has no final eval)
    final_loss: float | None
    reach: Reach
    stopped: bool
    epochs: int
    pace_probe_ms: list[float]  # bench.pace_probe before and after the run (a healthy core: ~0.3 ms)
    peak_bytes_per_average: float | None = None  # the most one average sent (summaries that count it: fragments)
    anchors: list[int] = field(default_factory=list)  # ElChe's anchor as it changed (the last 50): windows a slow link grew

    def to_dict(self) -> dict:
        return {**asdict(self), "cell": asdict(self.cell), "case": self.cell.case, "reach": self.reach.to_dict()}


def outcome(cell: Cell, summary: dict, goal: Goal) -> Outcome:
    return Outcome(
        cell,
        summary["train_samples_per_s"],
        (summary.get("sync_bytes") or {}).get("per_average"),
        summary.get("syncs", 0),
        next((h["eval"] for h in reversed(summary.get("history") or []) if h.get("eval") is not None), None),
        summary.get("final_loss"),
        first_reach(summary, goal, summary.get("startup_s")),
        summary["wan"]["stopped"],
        summary.get("epochs_completed", 0),
        summary["wan"].get("pace_probe_ms", []),
        (summary.get("sync_bytes") or {}).get("peak_per_average"),
        list((summary.get("cadence") or {}).get("anchor_history") or []),
    )


def rows_for(o: Outcome, done: dict[Cell, Outcome]) -> list[Row]:
    """One cell's rows: its rate (and of ideal), its bytes (and fewer than none), its time to target."""
    c, rows = o.cell, []
    ideal = done.get(c.like(link=IDEAL))
    target = done.get(c.like(link=IDEAL, compression="none"))
    none = done.get(c.like(compression="none"))
    goal_cell = c.model == GOAL_MODEL and c.link == GOAL_LINK and c.fragments == 1
    rows.append(Row(c.case, "throughput", o.samples_per_s, "samples/s"))
    if ideal is not None and c.link != IDEAL:
        of = o.samples_per_s / ideal.samples_per_s
        rows.append(
            Row(
                c.case,
                "of ideal",
                of,
                "fraction",
                f">= {GOAL_OF_IDEAL} of unshaped" if goal_cell else None,
                of >= GOAL_OF_IDEAL if goal_cell else None,
            )
        )
    if o.bytes_per_average is not None:
        rows.append(Row(c.case, "bytes per average", o.bytes_per_average, "B"))
        if c.compression != "none" and none is not None and none.bytes_per_average and o.bytes_per_average:
            fewer = none.bytes_per_average / o.bytes_per_average
            int8 = c.compression == "int8"
            rows.append(
                Row(
                    c.case,
                    "fewer bytes than none",
                    fewer,
                    "x",
                    f">= {GOAL_FEWER}x" if int8 else None,
                    fewer >= GOAL_FEWER if int8 else None,
                )
            )
    if o.peak_bytes_per_average:  # with --sync-fragments F an average sends one fragment: about 1/F of F=1's
        rows.append(Row(c.case, "peak bytes per average", o.peak_bytes_per_average, "B"))
        whole = done.get(c.like(fragments=1))
        if c.fragments > 1 and whole is not None and whole.peak_bytes_per_average:
            rows.append(Row(c.case, "peak bytes, F=1 / this", whole.peak_bytes_per_average / o.peak_bytes_per_average, "x"))
    rows.append(Row(c.case, "averages", o.averages, "rounds"))
    if o.pace_probe_ms:  # how loaded the shared machine was: a slow probe marks a slowed run
        rows.append(Row(c.case, "pace probe, slower of before/after", max(o.pace_probe_ms), "ms"))
    rows.append(Row(c.case, "reached target", float(o.reach.reached), "1 = yes"))
    rows.append(Row(c.case, "train s to target", o.reach.train_s, "s" if o.reach.reached else "s (not reached: the whole run)"))
    ratio = o.reach.train_s / target.reach.train_s if target is not None and target.reach.reached and target.reach.train_s > 0 else None
    if ratio is not None:
        in_time = o.reach.reached and ratio <= GOAL_TIME
        goal = f"reached within {GOAL_TIME}x" if goal_cell else None
        rows.append(Row(c.case, "to target / unshaped none's", ratio, "x", goal, in_time if goal_cell else None))
    if goal_cell and ideal is not None and ratio is not None and c.link != IDEAL:
        met = o.samples_per_s / ideal.samples_per_s >= GOAL_OF_IDEAL and o.reach.reached and ratio <= GOAL_TIME
        rows.append(Row(c.case, "issue 51 goal", float(met), "1 = met", GOAL_TEXT, met))
    return rows


def rebuild(path: Path) -> None:
    """``--report FILE``: the rows of a finished (or cut short) run's JSON built again from its cells, with
    today's row rules; its measurements and its ``when`` are kept."""
    data = json.loads(path.read_text())
    done: dict[Cell, Outcome] = {}
    rows: list[Row] = []
    names = {f.name for f in fields(Outcome)} - {"cell", "reach"}
    for d in data["cells"]:
        o = Outcome(cell=Cell(**d["cell"]), reach=Reach(**d["reach"]), **{k: d[k] for k in names if k in d})
        done[o.cell] = o
        rows += rows_for(o, done)
    kept = {k: data[k] for k in ("links", "targets", "cells", "skipped", "when")}
    written = report(
        data["bench"],
        link_rows(data["links"]) + rows,
        note=data.get("note", ""),
        results=path.parent,
        extra={**kept, "rebuilt": time.strftime("%Y-%m-%dT%H:%M:%S%z")},
    )
    if written.resolve() != path.resolve():  # report names the file after the bench: put it back where it was read
        os.replace(written, path)
        print(f"moved to {path}")


def link_rows(probes: dict[str, dict]) -> list[Row]:
    rows = []
    for name, p in probes.items():
        rows.append(Row(f"link {LINKS[name].label}", "measured round trip", p["rtt_ms"], "ms"))
        rows.append(Row(f"link {LINKS[name].label}", "measured bulk rate", p["mbit"], "Mbit/s"))
    return rows


def main() -> None:
    parser = size_parser(
        __doc__, "GPT-nano, unshaped and 100 Mbit/50 ms, none and int8, nccl-cadence (under two minutes)", "GPT-nano, 512 samples"
    )
    parser.add_argument("--models", default="", help=f"comma-separated (default: {', '.join(BUDGETS['full'])})")
    parser.add_argument("--modes", default="", help=f"comma-separated (default: {', '.join(MODES)}; nccl-cadence with --quick)")
    parser.add_argument("--links", default="", help=f"comma-separated, of {', '.join(LINKS)} (the unshaped ideal always runs)")
    parser.add_argument("--compressions", default="", help="comma-separated (default: none,int8; none with --smoke)")
    parser.add_argument("--fragments", default="", help="comma-separated F of --sync-fragments F (default 1,2,4; 1 with --quick)")
    parser.add_argument("--results", type=Path, default=None, help="folder for the JSON (default bench/results)")
    parser.add_argument("--report", type=Path, default=None, metavar="FILE", help="run nothing: rebuild FILE's rows from its cells")
    args = parser.parse_args()
    if args.report:
        return rebuild(args.report)
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    small = size != "full"
    models = _pick(parser, "--models", args.models, tuple(BUDGETS[size]), tuple(SPECS))
    modes = _pick(parser, "--modes", args.modes, ("nccl-cadence",) if small else MODES, MODES)
    modes_of = {m: modes if args.modes or small else FULL_MODES.get(m, modes) for m in models}
    links = _pick(parser, "--links", args.links, (IDEAL, GOAL_LINK) if small else tuple(LINKS), tuple(LINKS))
    links = (IDEAL, *(k for k in links if k != IDEAL))
    compressions = _pick(parser, "--compressions", args.compressions, ("none",) if args.smoke else COMPRESSIONS, ("none", "bf16", "int8"))
    compressions = ("none", *(c for c in compressions if c != "none"))  # none's ideal run sets the target
    try:
        fragments = tuple(int(f) for f in (args.fragments or ("1" if small else "1,2,4")).split(","))
    except ValueError:
        parser.error(f"--fragments must be whole numbers like 1,2,4, not {args.fragments!r}")
    if any(f < 1 for f in fragments):
        parser.error(f"--fragments: each must be at least 1, not {args.fragments!r}")
    reason = unusable_reason(sshd=False)
    if reason:
        sys.exit(f"bench/wan.py: namespace hosts unavailable: {reason}")
    skipped: list[str] = []
    if any(f > 1 for f in fragments) and not fragments_supported():
        skipped.append(
            f"F={','.join(str(f) for f in fragments if f > 1)}: this flodl's controller has no --sync-fragments (not merged yet)"
        )
        print(f"bench/wan.py: skipping {skipped[-1]}", flush=True)
        fragments = tuple(f for f in fragments if f == 1) or (1,)
    name = {"smoke": "wan", "quick": "wan_quick", "full": "wan"}[size]
    results = smoke_results() if args.smoke else args.results
    backend = "tc netem" if netem_in_kernel() else "the userspace relay of bench/netns.py, rate caps by tc tbf (no netem in this kernel)"
    ran = (
        f"models {','.join(models)}; modes {'; '.join(f'{m}: ' + ','.join(modes_of[m]) for m in models)}; links {','.join(links)}; compressions {','.join(compressions)}; "
        f"fragments {','.join(map(str, fragments))}; budgets "
        + ", ".join(
            f"{m} {BUDGETS[size].get(m, BUDGETS['full'].get(m, Budget(4096, 3))).samples} samples x {_budget(size, m).epochs} epochs"
            for m in models
        )
    )
    note = (
        f"{len(HOSTS)} hosts x 1 CPU rank + the controller, each in a network namespace, every node's link shaped alike via {backend}; "
        f"one-way delay on what a node sends, its rate cap both ways. Ran: {ran}; seed 0, one run per cell (this 2-core VM is shared: "
        f"runs of one cell swing by ~15%). Target per model, mode and F: the unshaped none run's final eval and loss; every other run "
        f"trains up to {CAP}x the epochs and stops at the target."
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up below on SIGTERM too, as on Ctrl-C
    # a link's cells one after another (the ideal first, which sets the target): the machine's load drifts
    # less between a cell and its ideal than across a whole grid
    cells = [Cell(m, mode, k, c, f) for m in models for mode in modes_of[m] for f in fragments for c in compressions for k in links]
    grid = Grid(name, results, note, skipped, len(cells))
    nodes = [CONTROLLER, *HOSTS]
    teardown_hosts(nodes, BRIDGE)  # what a killed earlier run may have left
    try:
        make_hosts(nodes, BRIDGE, None)
        with tempfile.TemporaryDirectory(prefix="flodl-wan-") as td:
            for cell in cells:
                grid.run(cell, _budget(size, cell.model), Path(td))
    finally:
        teardown_hosts(nodes, BRIDGE)
    if not grid.rows:
        sys.exit("bench/wan.py: no cell ran:\n" + "\n".join(skipped))
    report(name, grid.all_rows(), note=grid.note, results=results, extra=grid.extra())


class Grid:
    """The cells run so far, their targets and links; each cell's rows go to the JSON as soon as it ends,
    so a run cut short keeps what it finished."""

    def __init__(self, name: str, results: Path | None, note: str, skipped: list[str], planned: int) -> None:
        self.name, self.results, self.skipped, self.planned = name, results, skipped, planned
        self.grid_note = note
        self.done: dict[Cell, Outcome] = {}
        self.targets: dict[tuple[str, str, int], Goal] = {}
        self.probes: dict[str, dict] = {}
        self.rows: list[Row] = []
        self.port = FIRST_PORT

    def run(self, cell: Cell, budget: Budget, workdir: Path) -> None:
        link, key = LINKS[cell.link], (cell.model, cell.mode, cell.fragments)
        sets_target = cell.link == IDEAL and cell.compression == "none"
        if not sets_target and key not in self.targets:
            self.skipped.append(f"{cell.case}: no target (its unshaped none run failed)")
            return
        epochs = budget.epochs if sets_target else math.ceil(CAP * budget.epochs)
        self.port += 1
        with link.shaper([CONTROLLER, *HOSTS]) as shaper:
            if cell.link not in self.probes:
                probe = link_probe(HOSTS[0], HOSTS[1], link.probe_bytes())
                self.probes[cell.link] = {"rtt_ms": probe.rtt_ms, "mbit": probe.mbit, "shaper": str(shaper)}
                print(f"{link.label}: {shaper}; measured {probe}", flush=True)
            try:
                pace = probe_ms()  # the machine's pace around the run: a shared VM's load drifts
                summary = one_run(cell, budget, epochs, self.port, workdir, None if sets_target else self.targets[key])
                summary["wan"]["pace_probe_ms"] = [pace, probe_ms()]
            except RunFailed as exc:
                self.skipped.append(f"{cell.case}: failed ({exc.why})")
                print(f"{cell.case}: FAILED\n{exc}", flush=True)
                return
        if sets_target:
            self.targets[key] = Goal.of(summary)
        o = self.done[cell] = outcome(cell, summary, self.targets[key])
        self.rows += rows_for(o, self.done)
        print(
            f"{cell.case}: {o.samples_per_s:.0f} samples/s, {o.averages} averages, {(o.bytes_per_average or 0) / 1e3:.0f} kB/average, "
            f"target {'reached' if o.reach.reached else 'NOT reached'} at {o.reach.train_s:.1f} s train; "
            f"pace probe {o.pace_probe_ms[0]:.2f}/{o.pace_probe_ms[1]:.2f} ms; anchor {' '.join(map(str, o.anchors[-8:])) or '-'}",
            flush=True,
        )
        write_results(self.name, self.all_rows(), note=self.note, results=self.results, extra=self.extra())

    @property
    def note(self) -> str:
        """The grid's note, with how far it got (a run cut short says so)."""
        return f"{self.grid_note} {len(self.done)} of {self.planned} cells finished."

    def all_rows(self) -> list[Row]:
        return link_rows(self.probes) + self.rows

    def extra(self) -> dict:
        return {
            "links": self.probes,
            "targets": {f"{m} {mode} F={f}": g.to_dict() for (m, mode, f), g in self.targets.items()},
            "cells": [o.to_dict() for o in self.done.values()],
            "skipped": self.skipped,
        }


def _budget(size: str, model: str) -> Budget:
    return BUDGETS[size].get(model) or BUDGETS["full"].get(model) or Budget(SPECS[model].samples, 3)


def _pick(parser, flag: str, given: str, default: tuple[str, ...], known: tuple[str, ...]) -> tuple[str, ...]:
    chosen = tuple(given.split(",")) if given else default
    unknown = [c for c in chosen if c not in known]
    if unknown:
        parser.error(f"{flag}: unknown {', '.join(unknown)}; known: {', '.join(known)}")
    return chosen


if __name__ == "__main__":
    main()
