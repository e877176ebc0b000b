"""Stateful healing with real processes: a rank that joins takes its donor's state, not a fresh one.

A healed rank (``--max-restarts``) takes the survivors' parameters and, with them, its donor's
optimizer state (flodl/rank/handoff.py) over the lane the parameters take: the process group on
the collective backend, the controller's bulk plane on the CPU backend. The ranks write the state
they handed and took at their probes (``FLODL_PROBE_DIR``), and the tests compare them bit for bit.
The outer optimizer's state reaches a joiner too, and is kept in bundles for a resumed run.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from flodl.checkpoint.bundle import SavedOptimizer

from .conftest import task_spec
from .helpers.history import epoch_samples
from .helpers.observed import assert_same_state, observed, train_state
from .helpers.procs import Run

pytestmark = pytest.mark.timeout(180)

#: an outer Nesterov step on equal-weight averages, local steps at the optimizer's own rate
NESTEROV = ("--outer-optimizer", "nesterov", "--average-weights", "equal", "--lr-scale-ratio", "0")


def healed_run(proc_env, tmp_path, mode, *, optimizer, epochs=8, extra=()):
    """Three ranks; rank 1 dies at its 30th batch and is restarted (as rank 3). The steps are slow
    until the restart has joined (a loaded machine's start-up cannot outlast the run), then short."""
    hold, probes, path = tmp_path / "joined", tmp_path / "probes", tmp_path / "s.json"
    probes.mkdir()
    env = {
        **proc_env,
        "FLODL_TEST_OPTIMIZER": optimizer,
        "FLODL_PROBE_DIR": str(probes),
        "FLODL_INJECT_FAULT": "1:batch:30",
        "FLODL_TEST_STEP_SLEEP": "0.01",
        "FLODL_TEST_HOLD_FILE": str(hold),
        "FLODL_TEST_HOLD_SLEEP": "0.1",
    }
    args = ["--task", task_spec("tiny.py"), "--nproc-per-node", "3", "--epochs", str(epochs), "--mode", mode]
    run = Run([*args, "--heartbeat-timeout-secs", "4", "--max-restarts", "1", "--summary-json", str(path), *extra], env)
    run.wait_for_line("training with 3 rank(s)", timeout=120)
    hold.touch()
    assert run.wait(120) == 0, run.output
    summary = json.loads(path.read_text())
    assert epoch_samples(summary["history"]) == [512] * epochs  # every sample once through the death and the join
    assert [(r["rank"], r["replaces"]) for r in summary["restarts"]] == [(3, 1)]
    return summary, probes


@pytest.mark.parametrize("compression", ["none", "int8"])
@pytest.mark.parametrize("mode", ["nccl-cadence", "cpu-cadence"])
def test_a_healed_rank_takes_its_donors_optimizer_state_bit_for_bit(proc_env, tmp_path, mode, compression):
    """Adam's moments and step counts: the restarted rank holds, right after it joined, exactly
    the state its donor (rank 0, the lowest survivor) handed it; before, it started from zero.
    Compressed averages (int8 deltas from an anchor) change nothing of it: the state goes whole."""
    summary, probes = healed_run(proc_env, tmp_path, mode, optimizer="adam", extra=("--sync-compression", compression))
    sent, taken = observed(probes, "handoff.sent"), observed(probes, "handoff.taken")
    assert set(sent) == {0} and set(taken) == {3}, (sent.keys(), taken.keys())
    assert_same_state(taken[3][0], sent[0][0])
    if mode == "cpu-cadence" and compression == "none":  # one host: the state through shared memory, no byte of it through a socket
        # (compressed, a CPU rank's payloads all take the socket, its state too: it still arrives whole)
        averaging = summary["averaging"]
        assert averaging["state_lane_bytes"] > 0 and averaging["state_wire_bytes"] == 0, averaging
    state = sent[0][0]
    assert {"state.0.exp_avg", "state.0.exp_avg_sq", "state.0.step"} <= set(state)
    assert float(state["state.0.step"]) >= 30 and state["state.0.exp_avg"].abs().sum() > 0  # a trained state, not a fresh one
    assert train_state(taken[3][0]) == train_state(state)


def test_a_healed_rank_takes_the_outer_optimizers_state_on_the_cpu_backend(proc_env, tmp_path):
    """cpu-sync with an outer Nesterov step: every average lands whole on every rank, so all end on
    one consensus only if the restarted rank steps as its peers do. It adopts the round's average
    and takes the outer optimizer's anchor and momentum with its donor's state, then steps that
    average as they did. (Before, it took the plain average and a zero momentum: its replica
    stayed apart from the others' to the end.)"""
    summary, probes = healed_run(proc_env, tmp_path, "cpu-sync", optimizer="momentum", extra=NESTEROV)
    taken = observed(probes, "handoff.taken")[3][0]
    assert any(name.startswith("outer.momentum.") for name in taken)
    assert_same_state(taken, observed(probes, "handoff.sent")[0][0])
    digests = summary["final_digests"]
    assert set(digests) == {"0", "2", "3"} and len(set(digests.values())) == 1, digests


def test_a_resumed_run_steps_on_from_the_bundles_outer_momentum(proc_env, tmp_path):
    """The bundle keeps the outer optimizer's anchor and momentum beside the optimizer's state; a
    resumed run takes them on every rank (before, its momentum started again from zero)."""
    stem, probes = tmp_path / "ck", tmp_path / "probes"
    probes.mkdir()
    env = {**proc_env, "FLODL_TEST_OPTIMIZER": "momentum"}
    args = ["--task", task_spec("tiny.py"), "--nproc-per-node", "2", "--mode", "nccl-cadence", *NESTEROV]
    first = Run([*args, "--epochs", "3", "--save-path", str(stem)], env)
    assert first.wait(120) == 0, first.output
    saved = SavedOptimizer.read(stem)
    momentum = {name: t for name, t in saved.outer.items() if name.startswith("outer.momentum.")}
    assert momentum and all(t.abs().sum() > 0 for t in momentum.values())
    assert saved.train_state["outer_steps"] > 0
    resumed = Run([*args, "--epochs", "5", "--resume-from", str(stem)], {**env, "FLODL_PROBE_DIR": str(probes)})
    assert resumed.wait(120) == 0, resumed.output
    states = observed(probes, "resumed")
    assert set(states) == {0, 1}
    for rank_states in states.values():
        assert_same_state(rank_states[0], saved.outer)
    assert "holds no outer optimizer state" not in resumed.output


def test_a_bundle_without_the_outer_state_resumes_with_a_fresh_momentum_and_says_so(proc_env, tmp_path):
    """A bundle of a run without an outer optimizer resumed with one: it starts afresh, saying so."""
    stem = tmp_path / "ck"
    env = {**proc_env, "FLODL_TEST_OPTIMIZER": "momentum"}
    args = ["--task", task_spec("tiny.py"), "--nproc-per-node", "2", "--mode", "nccl-cadence"]
    first = Run([*args, "--epochs", "2", "--save-path", str(stem)], env)
    assert first.wait(120) == 0, first.output
    assert SavedOptimizer.read(stem).outer == {}
    resumed = Run([*args, *NESTEROV, "--epochs", "3", "--resume-from", str(stem)], env)
    assert resumed.wait(120) == 0, resumed.output
    assert "the bundle holds no outer optimizer state: its momentum starts from zero" in resumed.output


def test_a_donors_state_roundtrips_through_bytes_as_an_optim_file_holds_it():
    """The handed state is an .optim file's bytes: every tensor and the JSON beside it come back."""
    from flodl.checkpoint import safetensors_io
    from flodl.checkpoint.bundle import optimizer_payload

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    model(torch.randn(5, 4)).sum().backward()
    opt.step()
    outer = {"outer.anchor.0": torch.randn(7), "outer.momentum.0": torch.randn(7)}
    tensors, metadata = optimizer_payload(opt, {"lr_base": [0.01]}, outer)
    back = SavedOptimizer(*safetensors_io.loads(safetensors_io.dumps(tensors, metadata)), origin="test")
    assert sorted(back.outer) == sorted(outer) and all(torch.equal(back.outer[k], v) for k, v in outer.items())
    fresh_model = torch.nn.Linear(4, 3)
    fresh = torch.optim.Adam(fresh_model.parameters(), lr=0.5)
    assert back.load_into(fresh) == {"lr_base": [0.01]}
    mine, theirs = fresh.state_dict(), opt.state_dict()
    assert mine["param_groups"] == theirs["param_groups"]
    for pid, values in theirs["state"].items():
        assert all(torch.equal(mine["state"][pid][key], value) for key, value in values.items())
    with pytest.raises(ValueError, match=r"the donor's state: .*too short"):
        safetensors_io.loads(bytearray(b"\x01\x02"), "the donor's state")


# ------------------------------------------------------------------ the CPU lane's parts


def test_the_cpu_donor_is_the_lowest_member_not_behind_a_relay():
    """A relay passes no state on: the donor is the lowest member that sends its own snapshots,
    and joiners behind a relay await none (-1 when every joiner is)."""
    from flodl.averaging.server import CpuAveraging

    actor = CpuAveraging(secret=b"k" * 32, run_id="r", bind="127.0.0.1", timeout_s=5.0)
    try:
        actor.admit_relay(b"worker.a", [0, 1])
        actor.admit(b"rank2.b", 2)
        actor.admit_relay(b"worker.c", [4, 5])
        actor.admit(b"rank3.d", 3, from_round=7)
        assert actor.hand_over(7, [0, 1, 2], [3]) == 2
        assert actor.handoffs == {3: (7, 2)}
        assert actor.hand_over(9, [0, 1, 2, 3], [4, 5]) == -1 and set(actor.handoffs) == {3}
    finally:
        actor.close()


def test_a_joiner_gathers_its_donors_state_slice_by_slice():
    """Slices in any order make the state; a "none" or a state of another round leaves nothing
    awaited; a slice whose frame disagrees with its header is refused, naming why."""
    from flodl.errors import ProtocolError
    from flodl.rank.state_lane import StateIn
    from flodl.wire import messages as m

    state = bytes(range(256)) * 3
    lane = StateIn()
    lane.expect(5)
    for start in (512, 0, 256):
        assert not lane.ended
        lane.take(m.StateSlice(rank=0, round=5, total=len(state), start=start, count=256, shm=""), [state[start : start + 256]])
    assert lane.ended and lane.wait(lambda ms: None, 1.0, lambda: False) == bytearray(state)
    assert not lane.awaited
    lane.expect(6)
    lane.take(m.StateSlice(rank=0, round=5, total=4, start=0, count=4, shm=""), [b"abcd"])  # another round's: stale
    assert not lane.ended
    lane.take(m.StateSlice(rank=0, round=6, total=-1, start=0, count=0, shm=""), [])
    assert lane.ended and lane.wait(lambda ms: None, 1.0, lambda: False) is None
    with pytest.raises(ProtocolError, match="state slice of 3 bytes, header says 4"):
        lane.take(m.StateSlice(rank=0, round=6, total=8, start=0, count=4, shm=""), [b"abc"])
    with pytest.raises(ProtocolError, match="outside a state of 8 bytes"):
        lane.take(m.StateSlice(rank=0, round=6, total=8, start=6, count=4, shm=""), [b"abcd"])


def test_a_joiner_maps_its_donors_state_from_the_segment_the_controller_names(tmp_path):
    """On the controller's host the donor writes its state into a segment and the controller names a
    link of its own to it to each joiner there: the joiner maps it copy-on-write (its optimizer's
    steps never write the segment) and unlinks it; a header that names part of a state, carries a
    frame or names a foreign file is refused, naming why."""
    from flodl.errors import ProtocolError
    from flodl.rank.state_lane import StateIn
    from flodl.wire import messages as m
    from flodl.wire import shm

    run_id = "test-state-segment"
    state = bytes(range(256)) * 4
    donor = shm.write_state(run_id, state)
    link = shm.path_for(run_id, shm.STATE_ROLE)  # the controller's link for this joiner
    os.link(donor, link)
    try:
        lane = StateIn(run_id)
        lane.expect(7)
        lane.take(m.StateSlice(rank=0, round=7, total=len(state), start=0, count=len(state), shm=str(link)), [])
        assert lane.ended and not link.exists()  # mapped, and the name is gone
        got = lane.wait(lambda ms: None, 1.0, lambda: False)
        assert got is not None and bytes(got) == state
        got[0] = 255  # writable (an optimizer's state lives in it), and private: the donor's bytes stay
        assert donor.read_bytes() == state
        header = dict(rank=0, round=8, total=len(state), start=0, count=len(state))
        lane.expect(8)
        with pytest.raises(ProtocolError, match="names the whole state"):
            lane.take(m.StateSlice(**{**header, "count": 8}, shm=str(donor)), [])
        with pytest.raises(ProtocolError, match="carries no frame"):
            lane.take(m.StateSlice(**header, shm=str(donor)), [b"x"])
        with pytest.raises(ProtocolError, match="not a state segment of this run"):
            lane.take(m.StateSlice(**header, shm=str(tmp_path / "elsewhere")), [])
        with pytest.raises(ProtocolError, match="not a state segment of this run"):
            lane.take(m.StateSlice(**header, shm=str(shm.path_for("another-run", shm.STATE_ROLE))), [])
    finally:
        shm.unlink(donor)
        shm.unlink(link)


def test_a_window_ended_before_its_first_batch_ends_empty_unless_it_carries_the_state_for_joiners():
    """CPU backend: a window the controller ended for a joiner before the rank began it (sent ahead)
    ends with no batch (its round goes with weight 0) instead of one: a batch less between the
    joiner's ready and its state. The donor's window whose snapshot carries the state trains its
    batch (the average the joiners adopt is its values); the collective backend's windows too."""
    from types import SimpleNamespace

    from flodl.rank.cpu_average import BulkLink, CpuAverager
    from flodl.rank.flat import FlatModel
    from flodl.rank.windows import Windows

    bulk = BulkLink("tcp://127.0.0.1:9", rank=0, secret=b"s" * 32, run_id="ends-empty", sender="rank0.t/bulk")  # never reached
    try:
        averager = CpuAverager(FlatModel(torch.nn.Linear(2, 2)), bulk, rank=0, timeout_s=1.0, must_stop=lambda: False)
        averager.start_at_round(7)
        assert Windows._ends_empty(SimpleNamespace(averager=averager))
        averager.hand_state_at(7)  # the Regroup named it the donor of the joiners of round 7
        assert not Windows._ends_empty(SimpleNamespace(averager=averager))
        averager.start_at_round(8)
        assert Windows._ends_empty(SimpleNamespace(averager=averager))
        assert not Windows._ends_empty(SimpleNamespace(averager=object()))  # a collective averager
    finally:
        bulk.close()
