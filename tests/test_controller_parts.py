"""The controller's composition: the phase's one way to move, and the hooks benches time it with."""

from __future__ import annotations

import asyncio
import logging

import pytest

from flodl.config import DdpRunConfig
from flodl.controller import Controller, ControllerHooks, LaunchOptions, Phase
from flodl.controller.phase import RunState
from flodl.plan.membership import Membership
from flodl.testing.sim import SimRankSpec, SimWorker
from flodl.wire import messages as m

pytestmark = pytest.mark.timeout(60)

SECRET = b"s" * 32
RUN = "parts-run"


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
