"""Shared benchmark plumbing: the results table and the JSON every bench writes, and a controller run.

Every benchmark prints a table and writes ``bench/results/<name>.json`` as
``{"bench", "machine", "when", "rows": [{"case", "metric", "value", "unit",
"goal", "met"}]}``; ``goal`` is the issue's target as text (null if none) and
``met`` is true/false/null.

A bench that runs the controller's CLI runs it through ``run_controller`` (to
the end: its summary) or ``start_controller`` (a handle, for a bench that acts
on the run while it trains, then ``finish``): the output goes to a log file
whose tail a ``RunFailed`` carries, every wait has a deadline, and the summary
is read from ``--summary-json``. Nothing here imports flodl.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Row:
    case: str
    metric: str
    value: float
    unit: str
    goal: str | None = None
    met: bool | None = None


def quick_flag(doc: str, help_text: str) -> bool:
    """Parse the one flag every benchmark takes; True for ``--quick``."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=help_text)
    return parser.parse_args().quick


def size_parser(doc: str, quick_help: str, smoke_help: str) -> argparse.ArgumentParser:
    """A bench's parser with its two sizes, ``--quick`` or ``--smoke`` (a toy size that only
    says the bench still runs, into ``smoke_results()``); the bench adds its own flags."""
    parser = argparse.ArgumentParser(description=doc.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--quick", action="store_true", help=quick_help)
    size.add_argument("--smoke", action="store_true", help=smoke_help + ", results in a temporary folder: does the bench still run?")
    return parser


def controller_command(task: str, **options: object) -> list[str]:
    """``python -m flodl.controller --task TASK`` with each option as its kebab-case flag
    (``summary_json=p`` -> ``--summary-json p``; ``True`` -> the bare flag, ``None``/``False`` -> left out)."""
    cmd = [sys.executable, "-m", "flodl.controller", "--task", task]
    for name, value in options.items():
        if value is None or value is False:
            continue
        cmd.append("--" + name.replace("_", "-"))
        if value is not True:
            cmd.append(str(value))
    return cmd


class RunFailed(RuntimeError):
    """A run a bench started did not end as it must (an exit code, a deadline, no summary); the message
    ends with the tail of its output, ``why`` says it in a few words."""

    def __init__(self, message: str, why: str = "") -> None:
        super().__init__(message)
        self.why = why or (message.splitlines()[0] if message else "")


def output_tail(log: Path, lines: int = 15) -> str:
    """The log's last lines, after up to 10 earlier lines that say what went wrong (torchrun's own
    summary at the end only names the signal a rank died of)."""
    try:
        text = log.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    keys = ("error", "terminate", "what()", "exception", "abort")
    causes = [ln for ln in text[:-lines] if any(k in ln.lower() for k in keys)][:10]
    return "\n".join([*causes, *(["..."] if causes else []), *text[-lines:]])


@dataclass
class ControllerRun:
    """One ``python -m flodl.controller`` a bench started (``start_controller``): its process, the log its
    output goes to, and the summary it writes there."""

    proc: subprocess.Popen
    log: Path
    summary_path: Path
    what: str  # how errors name it
    session: bool  # in a process group of its own (killed whole at a deadline)
    started: float = field(default_factory=time.time)  # Unix time, just before the process started
    ended: float | None = None  # Unix time once it was seen to exit

    @property
    def wall_s(self) -> float:
        """Seconds from the start to the exit (or to now, while it runs)."""
        return (self.ended or time.time()) - self.started

    def output(self) -> str:
        """What it printed so far (stdout and stderr together)."""
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def failed(self, why: str) -> RunFailed:
        return RunFailed(f"{self.what}: {why}; output tail:\n{output_tail(self.log)}", why)

    def wait(self, timeout_s: float) -> int:
        """Its exit code; past ``timeout_s`` it is killed and ``RunFailed`` raised."""
        try:
            code = self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.kill()
            raise self.failed(f"still running after {timeout_s:g} s (killed)") from None
        self.ended = self.ended or time.time()
        return code

    def kill(self) -> None:
        """SIGKILL it (its whole process group when it has one of its own) and reap it."""
        if self.proc.poll() is None:
            try:
                if self.session:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                else:
                    self.proc.kill()
            except ProcessLookupError:
                pass
        self.proc.wait(30)
        self.ended = self.ended or time.time()

    def summary(self) -> dict:
        """The summary it wrote; ``RunFailed`` if it wrote none."""
        if not self.summary_path.exists():
            raise self.failed(f"no summary written (exit code {self.proc.poll()})")
        summary: dict = json.loads(self.summary_path.read_text())
        return summary

    def finish(self, timeout_s: float, *, check: bool = True) -> dict:
        """Wait for the end (``wait``) and return the summary; ``check``: a non-zero exit raises ``RunFailed``."""
        code = self.wait(timeout_s)
        if check and code != 0:
            raise self.failed(f"exit code {code}")
        return self.summary()


def start_controller(
    args: Sequence[str],
    *,
    workdir: Path,
    name: str = "controller",
    env: dict[str, str] | None = None,
    prefix: Sequence[str] = (),
    session: bool = False,
    preexec_fn: Callable[[], object] | None = None,
) -> ControllerRun:
    """Start ``python -m flodl.controller ARGS --summary-json WORKDIR/NAME.json`` in the checkout, its output
    into ``WORKDIR/NAME.log``; ``prefix`` runs it through another command first (``ip netns exec NS``),
    ``session`` in a process group of its own, ``preexec_fn`` in the child before it starts (a CPU pin)."""
    workdir.mkdir(parents=True, exist_ok=True)
    log, summary = workdir / f"{name}.log", workdir / f"{name}.json"
    summary.unlink(missing_ok=True)
    cmd = [*prefix, sys.executable, "-m", "flodl.controller", *args, "--summary-json", str(summary)]
    started = time.time()
    with open(log, "w") as out:  # the child keeps its own copy of the descriptor
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=os.environ.copy() if env is None else env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=session,
            preexec_fn=preexec_fn,
        )
    shown = " ".join(args)
    what = f"the controller ({shown if len(shown) <= 200 else shown[:200] + '...'})"
    return ControllerRun(proc, log, summary, what=what, session=session, started=started)


def run_controller(
    args: Sequence[str],
    *,
    timeout_s: float = 600.0,
    workdir: Path | None = None,
    name: str = "controller",
    env: dict[str, str] | None = None,
    check: bool = True,
    prefix: Sequence[str] = (),
    preexec_fn: Callable[[], object] | None = None,
) -> dict:
    """Run the controller to the end and return its summary (the arguments as ``start_controller``'s;
    without ``workdir``, its log and summary go to a temporary folder, deleted after).

    Raises:
        RunFailed: it ran past ``timeout_s`` (then killed), exited non-zero (``check``) or wrote no summary;
            the message ends with its output's tail.
    """
    if workdir is None:
        with tempfile.TemporaryDirectory(prefix="flodl-bench-") as tmp:
            return run_controller(
                args, timeout_s=timeout_s, workdir=Path(tmp), name=name, env=env, check=check, prefix=prefix, preexec_fn=preexec_fn
            )
    run = start_controller(args, workdir=workdir, name=name, env=env, prefix=prefix, preexec_fn=preexec_fn)
    return run.finish(timeout_s, check=check)


def cuda_or_stop(bench: str, *, smoke: bool) -> bool:
    """True where a CUDA device is there; else say so and return False (``--smoke``: exit non-zero,
    since a smoke test that measured nothing must not pass)."""
    import torch

    if torch.cuda.is_available():
        return True
    if smoke:
        sys.exit(f"{bench} --smoke: needs a CUDA device (torch.cuda.is_available() is False here); nothing measured")
    print(f"{bench} needs a CUDA device; none here, nothing measured")
    return False


def machine() -> str:
    """One line describing where the numbers came from."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f", GPU {torch.cuda.get_device_name(0)}"
    except Exception:
        pass
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{os.cpu_count()} x {cpu}, {mem:.0f} GiB RAM{gpu}, Python {platform.python_version()}"


def smoke_results() -> Path:
    """Where a ``--smoke`` run writes: ``$FLODL_BENCH_RESULTS``, else a fresh temporary
    folder; never ``bench/results``, whose files are the committed numbers."""
    where = os.environ.get("FLODL_BENCH_RESULTS")
    return Path(where) if where else Path(tempfile.mkdtemp(prefix="flodl-bench-smoke-"))


def report(bench: str, rows: list[Row], *, note: str = "", results: Path | None = None, extra: dict | None = None) -> Path:
    """Print the table and write the JSON (into ``results``, default ``bench/results``; ``extra``: more keys
    for it, e.g. a soak's table of faults); returns its path."""
    width = max(len(r.case) for r in rows) + 2
    print(f"\n{bench} on {machine()}")
    print(f"{'case':<{width}}{'metric':<22}{'value':>14}  {'unit':<10}{'goal':<26}met")
    for r in rows:
        met = "-" if r.met is None else ("yes" if r.met else "NO")
        print(f"{r.case:<{width}}{r.metric:<22}{r.value:>14,.2f}  {r.unit:<10}{(r.goal or '-'):<26}{met}")
    if note:
        print(note)
    path = write_results(bench, rows, note=note, results=results, extra=extra)
    print(f"wrote {path}")
    return path


def write_results(bench: str, rows: list[Row], *, note: str = "", results: Path | None = None, extra: dict | None = None) -> Path:
    """Write the JSON alone (no table): a long bench calls it after each case, so a run cut short
    (a time limit, a lost machine) keeps the cases it finished, its note saying how far it got."""
    folder = RESULTS if results is None else results
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{bench}.json"
    payload = {"bench": bench, "machine": machine(), "when": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": [asdict(r) for r in rows]}
    if note:
        payload["note"] = note
    payload.update(extra or {})
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path
