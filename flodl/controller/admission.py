"""Admission: who may join the run, how ranks are numbered and welcomed, and growing.

``Admission`` owns the run's roster beyond what ``Membership`` tracks: rank
numbers (never reused), the hellos and the task they describe, and the
joiners. Workers are checked and numbered as they arrive; ranks are checked
against the first rank's task (protocol, model, data and its digest, shuffle)
and welcomed; a worker that arrives while the run trains is started at once
and its ranks are admitted at the next window boundary (``admit_joiners``).
"""

from __future__ import annotations

import time

from .. import __version__
from ..config.env import bulk_relay_setting
from ..errors import EXIT_CONFIG, EXIT_TASK_ERROR
from ..plan.cadence import CadenceLoop
from ..plan.membership import PeerState, WorkerInfo
from ..plan.schedule import digest_positions
from ..wire import messages as m
from ..wire.codec import Envelope
from ..wire.messages import PROTOCOL_VERSION
from ..wire.transport import host_name
from .context import RunContext
from .phase import Phase
from .resume import Resume
from .training import Training

#: Open files the controller keeps for itself (sockets' mailboxes, the store, logs, the dashboard).
FD_RESERVE = 128


class Admission:
    """Workers and ranks in: checks, numbering, welcomes, joiners."""

    def __init__(self, ctx: RunContext, *, training: Training, resume: Resume) -> None:
        self.ctx = ctx
        self.training = training
        self.resume = resume
        self.expected_workers = 1 if ctx.launch.embedded else ctx.launch.workers
        self.hellos: dict[int, m.RankHello] = {}
        self.task_info: m.RankHello | None = None  # the first hello's task: every later rank must match it
        self.initial_world = 0  # ranks the run started with (the LR factor every replica keeps)
        self.welcomed = False  # the first ranks were welcomed: a death from now on regroups them
        # growing: ranks of workers that arrived while training, until admitted at a window boundary
        self.joiners: dict[int, float] = {}  # rank -> deadline to be ready
        self._held: list[int] = []  # joiners that said hello before the store opened (plane.py): welcomed with the first ranks
        self.joins: list[dict] = []  # every admission: when, generation, ranks, host
        self.ready_at: dict[int, float] = {}  # a joiner -> when it said ready (seconds into the run), until admitted
        self._next_rank = 0  # rank numbers are never reused, so a late report can't be misread
        self._fd_warned = False

    def training_ranks(self) -> list[int]:
        """The ranks in the collective and the plans: live, and admitted (not joiners)."""
        return self.training.ranks(frozenset(self.joiners))

    def welcome_workers(self) -> None:
        for worker in self.ctx.members.workers.values():
            self._assign_ranks(worker)
        self.initial_world = self._next_rank
        devices = {d.split(":")[0] for w in self.ctx.members.workers.values() for d in w.devices}
        if len(devices) > 1 and self.ctx.plane.averaging is None:
            self.ctx.run.fail(
                f"ranks mix device types {sorted(devices)}: the collective backend needs one type; "
                "use a Cpu* mode (e.g. --mode cpu-cadence) to average through the controller",
                EXIT_CONFIG,
            )
            return
        for worker in self.ctx.members.workers.values():
            self._send_worker_welcome(worker)
        self.ctx.run.changed()

    def _assign_ranks(self, worker: WorkerInfo) -> None:
        """Number ``worker``'s ranks from the next unused number and expect them (silence counts from now)."""
        self.ctx.members.assign_ranks(worker, self._next_rank, self.ctx.clock())
        self._next_rank += len(worker.devices)
        # every worker and rank holds a connection here, and every rank one to the store (or the bulk plane)
        need = 2 * self._next_rank + len(self.ctx.members.workers) + FD_RESERVE
        fd_limit = self.ctx.plane.fd_limit
        if fd_limit and need > fd_limit and not self._fd_warned:
            self._fd_warned = True
            self.ctx.console.line(
                f"warning: {self._next_rank} ranks on {len(self.ctx.members.workers)} workers need about {need} open files in the "
                f"controller, its limit is {fd_limit}: peers past it cannot connect (raise the hard limit, ulimit -Hn)"
            )

    def _send_worker_welcome(self, worker: WorkerInfo) -> None:
        relay = self._relays(worker)
        averaging = self.ctx.plane.averaging
        if relay:
            assert averaging is not None  # _relays is false without the CPU backend's averaging
            averaging.admit_relay(worker.sender.encode(), worker.ranks)
        self.ctx.plane.send(
            m.WorkerWelcome(
                ranks=worker.ranks,
                world_size=self._next_rank,
                task=self.ctx.launch.spec,
                heartbeat_timeout_s=self.ctx.deadlines.heartbeat_timeout_s,
                bulk_port=averaging.port if averaging is not None else 0,
                bulk_relay=relay,
                seed=self.resume.seed(),  # the ranks' random streams: the one a resumed run started with
                deterministic=self.ctx.config.deterministic,
                log_dir=self.ctx.config.log_dir or "",  # each worker writes its ranks' logs on its host
            ),
            worker.identity,
        )

    def _relays(self, worker: WorkerInfo) -> bool:
        """Does ``worker`` pre-average its ranks (CPU backend, two ranks or more, on another host)?

        Ranks on this host reach the averager through shared memory already.
        ``FLODL_BULK_RELAY=off`` sends every rank's snapshot here, ``always``
        relays on this host too (benchmarks and tests compare).
        """
        setting = bulk_relay_setting()
        if self.ctx.plane.averaging is None or len(worker.ranks) < 2 or setting == "off":
            return False
        return setting == "always" or worker.host != host_name()

    def _check_hello(self, hello: m.RankHello) -> str | None:
        """Why ``hello`` cannot join this run, or None."""
        if hello.versions.get("protocol") != str(PROTOCOL_VERSION):
            return f"protocol {hello.versions.get('protocol')} != controller's {PROTOCOL_VERSION}"
        if hello.versions.get("flodl") != __version__:
            return f"flodl {hello.versions.get('flodl')} != controller's {__version__}"
        first = self.task_info
        if first is None:
            return None
        checks = [
            ("model signature", hello.model_signature, first.model_signature),
            ("dataset length", hello.dataset_len, first.dataset_len),
            ("shuffle signature (torch RNG differs)", hello.shuffle_signature, first.shuffle_signature),
            ("batch size", hello.batch_size, first.batch_size),
        ]
        for what, mine, theirs in checks:
            if mine != theirs:
                return f"its {what} {mine} differs from rank {first.rank}'s {theirs}"
        return None

    def _dataset_problem(self, hello: m.RankHello) -> str | None:
        """Why ``hello``'s dataset is not the first rank's though it is as long, or None. An empty
        digest (samples that cannot be hashed the same way twice) compares with nothing."""
        first = self.task_info
        if first is None or not hello.dataset_digest or not first.dataset_digest or hello.dataset_digest == first.dataset_digest:
            return None
        where = ", ".join(map(str, digest_positions(hello.dataset_len)))
        what = "shard ids" if hello.grain == "shard" else "samples"
        return (
            f"its dataset differs from rank {first.rank}'s (the {what} at positions {where} hash differently): "
            "every rank must build the same samples in the same order; seed what makes them"
        )

    def welcome_ranks(self) -> None:
        """Welcome the first ranks that said hello (one that died before is left out: the
        survivors' Regroup, sent right after, forms the first group without it)."""
        for rank in range(self.initial_world):
            if rank not in self.hellos or self.ctx.members.ranks[rank].state is PeerState.DEAD:
                continue
            self.ctx.plane.send_rank(rank, self._rank_welcome(rank, late=False))
            if self.ctx.plane.averaging is not None:
                self.ctx.plane.averaging.admit(self.ctx.members.ranks[rank].sender.encode(), rank)
        self.welcomed = True
        for rank in self._held:
            if rank in self.joiners:
                self.ctx.plane.send_rank(rank, self._rank_welcome(rank, late=True))
        self._held.clear()

    def _rank_welcome(self, rank: int, *, late: bool) -> m.RankWelcome:
        """A late rank gets the world the run started with (so its LR factor matches
        its peers'); its collective membership comes with the Regroup that admits it."""
        averaging = self.ctx.plane.averaging
        return m.RankWelcome(
            rank=rank,
            world_size=self.initial_world,
            generation=self.ctx.members.generation,
            store_host=self.ctx.launch.advertise_host,
            store_port=self.ctx.plane.store.port,
            store_prefix=f"{self.ctx.run_id}/gen{self.ctx.members.generation}",
            collective_timeout_s=self.ctx.deadlines.collective_timeout_s,
            config=self.ctx.config.to_dict(),
            seed=self.resume.seed(),  # a resumed run keeps the bundle's shuffle on every rank
            bulk_port=averaging.port if averaging is not None else 0,
            late=late,
            shm_probe=averaging.probe_path if averaging is not None else "",
            shm_nonce=averaging.probe_nonce if averaging is not None else "",
            # every rank enters every epoch in order (docs/script-mode.md): from the run's first, or a
            # joiner from its first batch's, to the run's last
            first_epoch=-1 if late else self.resume.first_epoch(),
            epochs=self.ctx.launch.epochs * self.ctx.config.epoch_splits,
        )

    def on_worker_hello(self, identity: bytes, env: Envelope, msg: m.WorkerHello) -> None:
        if self.ctx.run.ended or self.ctx.run.failure is not None:
            # the run is over (Ctrl-C before the local worker said hello): not a refusal, an end
            why = str(self.ctx.run.failure) if self.ctx.run.failure is not None else "the run has ended"
            self.ctx.plane.send(m.Shutdown(reason=why[:500], abort=True), identity)
            return
        problem = self.worker_problem(env.sender, msg)
        if problem:
            self.ctx.plane.send(m.Reject(reason=problem), identity)
            if self.ctx.run.admitting:
                self.ctx.console.line(f"refused a worker on host {msg.host} (pid {msg.pid}): {problem}")
            return
        worker = WorkerInfo(env.sender, identity, msg.host, msg.pid, list(msg.devices))
        self.ctx.members.add_worker(worker, self.ctx.clock())
        if self.ctx.run.admitting:
            self._grow(worker)
        else:
            self.ctx.startup.worker_up(len(self.ctx.members.workers), self.expected_workers)
        self.ctx.run.changed()

    def worker_problem(self, sender: str, msg: m.WorkerHello) -> str | None:
        """Why a worker cannot join now, or None (during gathering, or to grow a training run)."""
        if sender in self.ctx.members.workers:
            return "this worker already joined"
        if msg.versions.get("protocol") != str(PROTOCOL_VERSION):
            return f"protocol {msg.versions.get('protocol')} != {PROTOCOL_VERSION}"
        if not msg.devices:
            return "no devices"
        if self.ctx.run.phase in (Phase.STARTING, Phase.GATHERING):
            return None
        problem = self.grow_problem()
        if problem is not None:
            return problem
        kinds = {d.split(":")[0] for d in msg.devices} | {r.device.split(":")[0] for r in self.ctx.members.live_ranks()}
        if len(kinds) > 1 and self.ctx.plane.averaging is None:
            return f"its devices {list(msg.devices)} mix device types with the run's; the collective backend needs one type"
        return None

    def grow_problem(self) -> str | None:
        """Why the run cannot take new ranks now (a worker's, or a restart's), or None."""
        if not self.ctx.run.admitting or self.ctx.run.failure is not None:
            return f"the run is {self.ctx.run.phase}; a worker can join while it starts or trains"
        if self.ctx.config.elche.partition_ratios is not None:
            return "partition_ratios fixes the world size; this run cannot grow"
        if self.ctx.plane.averaging is not None and self.initial_world < 2:
            return "a one-rank Cpu* run does not average, so it cannot take a joiner; start it with two ranks to let it grow"
        loop = self.training.cadence
        if loop is not None and loop.dispatcher.finished:
            return "the run has planned its last window"
        return None

    def _grow(self, worker: WorkerInfo) -> None:
        """A worker arrived while training: number its ranks above every rank so far
        and start them; they join at a window boundary once ready (``admit_joiners``)."""
        self._assign_ranks(worker)
        deadline = self.ctx.clock() + self.ctx.launch.join_timeout_secs
        for rank in worker.ranks:
            self.joiners[rank] = deadline
        self.ctx.console.line(f"worker on host {worker.host} joins: starting rank(s) {worker.ranks} on {', '.join(worker.devices)}")
        self._send_worker_welcome(worker)

    def on_rank_hello(self, identity: bytes, env: Envelope, msg: m.RankHello) -> None:
        info = self.ctx.members.ranks[msg.rank]
        if info.sender:
            return  # said hello already (a later connection of its own moved its route in _on_message), or a second process claiming the rank
        problem, code = self._check_hello(msg), EXIT_TASK_ERROR
        if problem is None:
            problem, code = self._dataset_problem(msg), EXIT_CONFIG  # the user's task or script, as written
        if problem:
            self.ctx.plane.send(m.Reject(reason=problem), identity)
            if msg.rank in self.joiners:
                self.drop_joiner(msg.rank, problem)  # a bad latecomer never stops a training run
            else:
                self.ctx.run.fail(f"rank {msg.rank} on host {msg.host} (pid {msg.pid}) cannot join: {problem}", code)
            return
        self.ctx.members.rank_said_hello(msg.rank, identity, env.sender, msg.host, msg.pid, msg.device)
        self.hellos[msg.rank] = msg
        if self.task_info is None:
            self.task_info = msg
        if msg.rank in self.joiners and self.ctx.plane.store is None:
            self._held.append(msg.rank)  # its welcome names the store: it goes out with the first ranks'
        elif msg.rank in self.joiners:
            self.ctx.plane.send_rank(msg.rank, self._rank_welcome(msg.rank, late=True))
        elif not self.welcomed:
            self.ctx.startup.rank_built(len(self.hellos), self.initial_world)
        self.ctx.run.changed()

    def on_rank_ready(self, identity: bytes, env: Envelope, msg: m.RankReady) -> None:
        self.ctx.members.rank_ready(msg.rank)
        if msg.rank in self.joiners:
            self.ready_at[msg.rank] = self.ctx.clock() - self.ctx.run.started_at  # for its join's record
            self.training.hurry()  # admitted at the next batch boundary, not at the end of a long window
        self.ctx.run.changed()

    def admit_joiners(self, loop: CadenceLoop, in_flight: list[int]) -> bool:
        """Growing, at a window boundary: admit the joiners that are ready.

        Returns True when ready joiners wait for the windows in flight to drain
        (the caller then plans nothing ahead until they are in).

        Collective backend: only between windows (no rank inside an average);
        a Regroup names the grown world and the lowest surviving rank, whose
        parameters (the consensus) every member takes after rebuilding the
        group. CPU backend: the joiners are expected from the next window's
        first averaging round, whose average they take whole before training,
        and the lowest member not behind a relay hands them its state with its
        snapshot of that round (the Regroup goes to it too).
        Either way ElChe plans them from the next window on.
        """
        t0 = time.perf_counter()
        now = self.ctx.clock()
        for rank, deadline in list(self.joiners.items()):
            if now > deadline and self.ctx.members.ranks[rank].state is not PeerState.READY:
                self.drop_joiner(rank, f"not ready within join_timeout_secs ({self.ctx.launch.join_timeout_secs:g} s)")
        # joiners join in rank order (the plans only grow at the end): a ready rank waits
        # while a lower-numbered joiner is not ready yet (or until that one is dropped)
        waiting_below = min((r for r in self.joiners if self.ctx.members.ranks[r].state is not PeerState.READY), default=None)
        ready = sorted(
            r for r in self.joiners if self.ctx.members.ranks[r].state is PeerState.READY and (waiting_below is None or r < waiting_below)
        )
        averaging = self.ctx.plane.averaging
        if averaging is not None:
            # a relaying host joins whole: its relay sends one snapshot for all its ranks, from one first round
            waiting = {
                averaging.relayed[r]
                for r in self.joiners
                if r in averaging.relayed and self.ctx.members.ranks[r].state is not PeerState.READY
            }
            ready = [r for r in ready if averaging.relayed.get(r) not in waiting]
        if not ready or loop.dispatcher.finished:
            return False
        if averaging is None and in_flight:
            return True  # the group is rebuilt with nothing queued on any rank
        old = list(loop.ranks)
        loop.add_ranks(ready)
        for rank in ready:
            del self.joiners[rank]
        hosts = sorted({self.ctx.members.ranks[r].host for r in ready})
        reason = f"rank(s) {', '.join(map(str, ready))} on {', '.join(hosts)} joined"
        generation, members = self.ctx.members.new_generation(reason), list(loop.ranks)
        if averaging is None:
            msg = m.Regroup(
                generation=generation,
                members=members,
                store_prefix=f"{self.ctx.run_id}/gen{generation}",
                reason=reason,
                sync_from=old[0],
                first_round=-1,
            )
            targets = members
        else:
            for rank in ready:
                averaging.admit(self.ctx.members.ranks[rank].sender.encode(), rank, from_round=loop.round_base)
            # the donor hands its optimizer state to the joiners with its snapshot of their first round,
            # through the bulk plane (a rank behind a host relay neither gives nor takes one)
            donor = averaging.hand_over(loop.round_base, old, ready)
            self.training.hurry_adoption(loop.window)  # the window they adopt ends a batch in
            msg = m.Regroup(
                generation=generation, members=members, store_prefix="", reason=reason, sync_from=donor, first_round=loop.round_base
            )
            targets = [*ready, *([donor] if donor >= 0 else [])]  # the others' CPU rounds simply start expecting the joiners
        self.ctx.plane.send_ranks(targets, msg)
        self.joins.append(
            {
                "at_s": now - self.ctx.run.started_at,
                "unix_time": time.time(),
                "generation": generation,
                "ranks": ready,
                "hosts": hosts,
                "world": len(members),
                # when each said ready (built, welcomed): from there to ``at_s`` it waited for a window boundary
                "ready_at_s": [self.ready_at.pop(r, None) for r in ready],
            }
        )
        if self.training.goodput is not None:  # a restart fills its slot again; any other joiner grows the world
            self.training.goodput.admitted(ready, now)
        self.ctx.monitor.ranks_joined({r: (self.ctx.members.ranks[r].host, self.ctx.members.ranks[r].device) for r in ready}, now_s=now)
        self.ctx.console.line(f"{reason}; training with {len(members)} rank(s) (generation {generation})")
        self.ctx.hooks.joiners_admitted(ready, time.perf_counter() - t0)
        return False

    def drop_joiner(self, rank: int, why: str) -> None:
        """A joiner that cannot join leaves the run's books; its process is fenced."""
        self.joiners.pop(rank, None)
        self.hellos.pop(rank, None)
        if self.training.goodput is not None:  # a restart that never came: its slot waits for no one
            self.training.goodput.never_joined(rank)
        info = self.ctx.members.forget_rank(rank)
        if info is None:
            return
        self.ctx.console.line(f"{info.where()} could not join the run: {why}")
        if info.exit_code is None:
            for worker in self.ctx.members.workers.values():
                if rank in worker.ranks and not worker.exited:
                    self.ctx.plane.send(m.Fence(rank=rank, reason=why[:500]), worker.identity)

    def drop_all_joiners(self, why: str) -> None:
        for rank in list(self.joiners):
            self.drop_joiner(rank, why)

    def restart(self, worker: WorkerInfo, device: str, delay_s: float, now: float) -> int:
        """Number a rank that ``worker`` starts in place of a dead one after ``delay_s`` and
        expect it as a joiner; returns its number."""
        new = self._next_rank
        self._next_rank += 1
        self.ctx.members.expect_restart(worker, new, device, now)
        self.joiners[new] = now + delay_s + self.ctx.launch.join_timeout_secs
        return new
