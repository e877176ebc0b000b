"""The controller's composition: each part owns what it writes, is built from one frozen context,
the phase's one way to move, and the hooks benches time it with."""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import logging
from pathlib import Path

import pytest

from flodl.config import DdpRunConfig
from flodl.controller import Controller, ControllerHooks, LaunchOptions, Phase
from flodl.controller.context import RunContext
from flodl.controller.phase import RunState
from flodl.plan.decisions import MAX_COLLECTIVE_RETRIES
from flodl.plan.membership import Membership
from flodl.testing.sim import SimRankSpec, SimWorker
from flodl.wire import messages as m

pytestmark = pytest.mark.timeout(60)

SECRET = b"s" * 32
RUN = "parts-run"
PARTS = Path(__file__).resolve().parent.parent / "flodl" / "controller"

#: The most parameters a part's constructor takes: the context, and by name the parts it uses.
MOST_PARAMETERS = 4


#: The names the controller holds its parts by (``self.training``, ``ctx.plane``, ``self.ctx``...).
HELD_AS = {"ctx", "run", "state", "plane", "training", "resume", "admission", "saving", "liveness", "teardown"}
HELD_AS |= {"console", "startup", "checkpoints", "before_init", "resender", "epoch_ends"}


def _held_as(node: ast.expr) -> str | None:
    """The name ``node`` holds its object by: ``self.ctx.plane`` -> plane, ``training`` -> training."""
    return node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None


def _stores(tree: ast.AST):
    """Every attribute assignment in ``tree``: (line, the name its object is held by, the attribute)."""
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AugAssign | ast.AnnAssign) else []
        for target in targets:
            for part in ast.walk(target):
                if isinstance(part, ast.Attribute) and isinstance(part.ctx, ast.Store):
                    yield node.lineno, _held_as(part.value), part.attr


def foreign_writes(sources: dict[str, str]) -> list[str]:
    """Attributes of a part (``self.x = ...`` in its file) that another file assigns, or any
    assignment through the context."""
    trees = {name: ast.parse(text) for name, text in sources.items()}
    owned = {name: {attr for _, held, attr in _stores(tree) if held == "self"} for name, tree in trees.items()}
    found = []
    for name, tree in trees.items():
        for line, held, attr in _stores(tree):
            owners = [other for other, attrs in owned.items() if other != name and attr in attrs]
            if held == "ctx" or (held in HELD_AS and owners):
                found.append(f"{name}:{line} writes {held}.{attr} (owned by {', '.join(owners) or 'nobody: the context is frozen'})")
    return found


def test_no_part_writes_another_parts_attributes():
    """Each part's state has one writer, its own file; the context hands out the shared services
    to read and call, never to assign (a write through ``self.ctx.plane.port`` is caught too)."""
    sources = {path.name: path.read_text() for path in sorted(PARTS.glob("*.py"))}
    assert foreign_writes(sources) == []
    # the rule bites: the same check on a part that assigns the plane's port through the context
    bad = {"plane.py": "class P:\n def __init__(self):\n  self.port = 0\n", "x.py": "def f(self):\n self.ctx.plane.port = 1\n"}
    assert foreign_writes(bad) == ["x.py:2 writes plane.port (owned by plane.py)"]


def test_each_part_takes_the_context_and_only_its_own_collaborators():
    """No constructor of a part lists the run's shared things one by one (the controller's
    entry point aside, whose arguments are the run's)."""
    wide = []
    for path in sorted(PARTS.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.name != "Controller":
                for fn in node.body:
                    if isinstance(fn, ast.FunctionDef) and fn.name == "__init__":
                        count = len(fn.args.args) - 1 + len(fn.args.kwonlyargs)
                        if count > MOST_PARAMETERS:
                            wide.append(f"{path.name} {node.name}: {count}")
    assert wide == []


async def test_the_context_is_frozen_and_every_part_shares_one(quiet_console):
    ctl = Controller(LaunchOptions(task="sim:task", progress=False), DdpRunConfig(), secret=SECRET, run_id=RUN, console=quiet_console)
    ctx = ctl.ctx
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.plane = None  # type: ignore[misc]
    parts = (ctl.training, ctl.resume, ctl.admission, ctl.saving, ctl.liveness, ctl.teardown)
    assert all(part.ctx is ctx for part in parts) and ctl.plane.ctx.members is ctx.members
    assert isinstance(ctx, RunContext) and (ctx.run_id, ctx.secret, ctx.console) == (RUN, SECRET, quiet_console)


def test_the_phase_moves_forward_and_logs_each_move(clock, caplog):
    state = RunState(Membership(5.0), clock)
    assert state.phase is Phase.STARTING and not state.admitting and not state.ended
    with caplog.at_level(logging.INFO, logger="flodl.controller"):
        for phase in (Phase.GATHERING, Phase.JOINING, Phase.TRAINING):
            state.to(phase)
    assert state.admitting and "phase: joining -> training" in caplog.text
    state.to(Phase.SHUTTING_DOWN)
    assert state.ended and not state.admitting
    state.to(Phase.DONE)


@pytest.mark.parametrize(
    "path",
    [
        (Phase.TRAINING,),  # skipping the gathering and the joining
        (Phase.GATHERING, Phase.GATHERING),  # standing still is no move
        (Phase.ABORTING, Phase.DONE, Phase.ABORTING),  # done is done
        (Phase.GATHERING, Phase.SHUTTING_DOWN),  # a clean end only after training
    ],
)
def test_a_move_the_run_cannot_make_is_refused(clock, path):
    state = RunState(Membership(5.0), clock)
    *before, illegal = path
    for phase in before:
        state.to(phase)
    with pytest.raises(RuntimeError, match="cannot move"):
        state.to(illegal)


def test_the_first_failure_wins(clock):
    state = RunState(Membership(5.0), clock)
    state.fail("first", 3)
    state.fail("second", 4)
    assert str(state.failure) == "first" and state.failure.exit_code == 3


class Recorder(ControllerHooks):
    def __init__(self) -> None:
        self.calls: dict[str, list] = {}

    def _note(self, name: str, *args) -> None:
        self.calls.setdefault(name, []).append(args)

    def opened(self, endpoint) -> None:
        self._note("opened", endpoint)

    def handled(self, msg) -> None:
        self._note("handled", type(msg))

    def planned(self, window, ranks, seconds) -> None:
        self._note("planned", window, ranks, seconds)

    def settled(self, window, seconds) -> None:
        self._note("settled", window, seconds)

    def deaths_handled(self, dead, seconds) -> None:
        self._note("deaths_handled", dead, seconds)

    def joiners_admitted(self, ranks, seconds) -> None:
        self._note("joiners_admitted", ranks, seconds)


async def test_the_hooks_see_a_run_with_a_death(quiet_console):
    """What a bench times: every window planned and settled, every message handled, a death."""
    hooks = Recorder()
    config = DdpRunConfig().with_mode("nccl-sync")
    launch = LaunchOptions(task="sim:task", epochs=2, workers=1, progress=False, join_timeout_secs=20.0)
    ctl = Controller(launch, config, secret=SECRET, run_id=RUN, console=quiet_console, hooks=hooks)
    run = asyncio.create_task(ctl.run())
    await ctl.ready.wait()
    sim = SimWorker(
        f"tcp://127.0.0.1:{ctl.port}", SECRET, RUN, [SimRankSpec(), SimRankSpec(die_at_batch=5)], dataset_len=400, batch_size=10
    )
    worker = asyncio.create_task(sim.run())
    summary = await run
    await asyncio.wait_for(worker, 10)
    assert summary["exit_reason"] == "completed" and [d["rank"] for d in summary["deaths"]] == [1]
    calls = hooks.calls
    assert calls["opened"] == [(ctl.endpoint,)]
    windows = [w for w, _, _ in calls["planned"]]
    assert windows == sorted(set(windows)) and [w for w, _ in calls["settled"]] == windows
    assert calls["deaths_handled"][0][0] == {1}
    handled = set(calls["handled"])
    assert {(m.WorkerHello,), (m.RankHello,), (m.RankReady,), (m.TimingMsg,), (m.WindowDone,), (m.EvalResult,)} <= handled
    assert "joiners_admitted" not in calls


async def test_the_hosted_stores_port_is_read_once_whole_and_a_silent_worker_falls_back(tmp_path):
    """plane.py reads the port the embedded worker's store process writes (host/store_server.py);
    0 (it could not open) and no file within the deadline both mean: open the store here."""
    from flodl.controller.plane import ControlPlane
    from flodl.host.store_server import write_port

    path = tmp_path / "port"
    later = asyncio.get_running_loop().call_later(0.05, write_port, str(path), 41234)
    assert await ControlPlane._hosted_store_port(path, 30.0) == 41234
    later.cancel()
    write_port(str(path), 0)
    assert await ControlPlane._hosted_store_port(path, 30.0) == 0
    assert await ControlPlane._hosted_store_port(tmp_path / "never", 0.1) == 0
    assert [p.name for p in tmp_path.iterdir()] == ["port"]  # no temporary file left beside it


async def test_collective_rebuilds_are_counted_in_a_row_not_over_the_run(clock, quiet_console):
    """A collective that fails with no death to explain it is rebuilt in place, at most
    MAX_COLLECTIVE_RETRIES times in a row. The count never started again, so a long run stopped at
    its 4th such failure however far apart (the chaos soak: three lost hosts, each found by silence
    after the survivors' collective had failed, then a 4th: "saw its collective fail 4 times")."""
    launch = LaunchOptions(task="sim:task", epochs=2, workers=1, progress=False)
    ctl = Controller(launch, DdpRunConfig().with_mode("nccl-cadence"), secret=SECRET, run_id=RUN, console=quiet_console, clock=clock)
    ctl.plane.open(lambda identity, env: None)  # a real socket: the Regroups go out to peers that are not there
    members = ctl.ctx.members
    for rank in (0, 1):
        members.expect_rank(rank, "h", "cpu", clock())
        members.rank_said_hello(rank, f"r{rank}".encode(), f"rank-{rank}", "h", 100 + rank, "cpu")
        members.rank_ready(rank)

    def fail_once() -> None:
        error = m.RankError(rank=0, stage="collective", error="Connection closed by peer", detail="", generation=members.generation)
        ctl.liveness.on_rank_error(b"r0", None, error)
        clock.advance(1.5)  # past the grace a death report would have come in
        for rank in (0, 1):
            members.seen_rank(rank, clock())
        ctl.liveness.judge()

    try:
        for _ in range(MAX_COLLECTIVE_RETRIES + 2):  # each rebuilt, and the survivors average again in it
            fail_once()
            assert ctl.state.failure is None
            for rank in (0, 1):
                beat = m.Heartbeat(step=1, sent_at=0.0, busy="step", busy_s=0.0, step_ms=1.0, averaged=members.generation)
                ctl.liveness.on_heartbeat(f"r{rank}".encode(), None, beat)
            assert ctl.liveness.recoveries[-1]["training_again_s"] is not None
        for _ in range(MAX_COLLECTIVE_RETRIES + 1):  # with no average in between, the row reaches the limit
            fail_once()
        assert ctl.state.failure is not None and f"saw its collective fail {MAX_COLLECTIVE_RETRIES + 1} times" in str(ctl.state.failure)
    finally:
        ctl.plane.close()
