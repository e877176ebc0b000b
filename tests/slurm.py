"""A throwaway one-node Slurm cluster for tests: munged, slurmctld and slurmd started here.

Everything lives in one fresh directory under /tmp (munge key and socket, slurm.conf, state
and spool dirs, logs), removed by ``stop()``: munged wants every directory above its socket
searchable by all, which pytest's private tmp_path is not. The daemons run in the foreground as children of this process, so ``stop()`` ends
exactly them. Client commands find the cluster through ``SLURM_CONF`` in ``env()``.
The node is this host (``hostname -s``, as slurmd registers), its CPUs counted here;
jobs run as root (``SlurmUser=root``), with ``proctrack/linuxproc``: no cgroups needed.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import psutil

from .helpers.procs import reserved_port

BINARIES = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scontrol", "scancel")
FINAL_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED", "BOOT_FAIL", "DEADLINE"}


class Unavailable(Exception):
    """Slurm cannot run here (binaries missing, not root): the reason a test skips with."""


def missing() -> str | None:
    """Why a cluster cannot start here, or None."""
    if os.geteuid() != 0:
        return "needs root (SlurmUser=root, munged's key and socket)"
    absent = [b for b in BINARIES if shutil.which(b) is None and not Path("/usr/sbin", b).exists()]
    if absent:
        return f"Slurm/munge binaries missing: {', '.join(absent)} (apt-get install slurmctld slurmd slurm-client munge)"
    if (os.cpu_count() or 1) < 2:
        return "needs 2 CPUs (a job of two tasks on the one node)"
    node = socket.gethostname().split(".")[0]
    try:
        socket.gethostbyname(node)  # the recipe finds the controller's address with getent hosts
    except OSError:
        return f"this host's name {node!r} does not resolve"
    return None


def _exe(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


CONF = """\
ClusterName=flodltest
SlurmctldHost={node}
SlurmUser=root
SlurmdUser=root
SlurmctldPort={ctld_port}
SlurmdPort={d_port}
AuthType=auth/munge
AuthInfo=socket={dir}/munge.sock
CredType=cred/munge
StateSaveLocation={dir}/state
SlurmdSpoolDir={dir}/spool
SlurmctldPidFile={dir}/slurmctld.pid
SlurmdPidFile={dir}/slurmd.pid
SlurmctldLogFile={dir}/slurmctld.log
SlurmdLogFile={dir}/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
MpiDefault=none
SwitchType=switch/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
KillWait={kill_wait}
NodeName={node} CPUs={cpus} State=UNKNOWN
PartitionName=flodl Nodes={node} Default=YES MaxTime=INFINITE State=UP
"""


class SlurmCluster:
    """munged + slurmctld + slurmd in ``root``; ``start()`` waits until the node is idle."""

    def __init__(self, kill_wait: int = 5):
        self.root = Path(tempfile.mkdtemp(prefix="flodl-slurm-"))
        self.node = socket.gethostname().split(".")[0]
        self.kill_wait = kill_wait
        self.procs: list[subprocess.Popen] = []

    def env(self, base: dict | None = None) -> dict:
        """``base`` (default: this process's environment) pointed at this cluster."""
        return {**(os.environ if base is None else base), "SLURM_CONF": str(self.root / "slurm.conf")}

    def _daemon(self, name: str, *args: str) -> None:
        with open(self.root / f"{name}.out", "wb") as log:  # the child keeps its own copy of the descriptor
            self.procs.append(subprocess.Popen([_exe(name), *args], stdout=log, stderr=subprocess.STDOUT, env=self.env()))

    def start(self, timeout: float = 30) -> None:
        reason = missing()
        if reason:
            raise Unavailable(reason)
        # munged wants its socket's directory searchable by all and its key private
        self.root.chmod(0o755)
        for sub in ("state", "spool"):
            (self.root / sub).mkdir(exist_ok=True)
        key = self.root / "munge.key"
        subprocess.run([_exe("mungekey"), "--create", f"--keyfile={key}"], check=True, capture_output=True)
        key.chmod(0o600)
        conf = CONF.format(
            node=self.node,
            dir=self.root,
            ctld_port=reserved_port(),  # the daemons bind them themselves: held in TIME_WAIT till then
            d_port=reserved_port(),
            cpus=os.cpu_count(),
            kill_wait=self.kill_wait,
        )
        (self.root / "slurm.conf").write_text(conf)
        r = self.root
        self._daemon(
            "munged", "-F", f"--socket={r}/munge.sock", f"--key-file={key}", f"--pid-file={r}/munged.pid",
            f"--seed-file={r}/munged.seed", f"--log-file={r}/munged.log",
        )  # fmt: skip
        self._wait(lambda: (r / "munge.sock").exists(), timeout, "munged's socket")
        self._daemon("slurmctld", "-D", "-c", "-f", str(r / "slurm.conf"))
        self._daemon("slurmd", "-D", "-f", str(r / "slurm.conf"))
        self._wait(self._node_idle, timeout, f"node {self.node} to be idle")

    def _node_idle(self) -> bool:
        out = self.scontrol("show", "node", self.node, check=False)
        return bool(re.search(r"State=IDLE\b", out))

    def _wait(self, condition, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not condition():
            dead = [p.args[0] for p in self.procs if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead} exited while waiting for {what}:\n{self.logs()}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {timeout} s waiting for {what}:\n{self.logs()}")
            time.sleep(0.1)

    def logs(self) -> str:
        parts = []
        for name in ("munged.out", "slurmctld.out", "slurmd.out", "slurmctld.log", "slurmd.log"):
            path = self.root / name
            if path.exists():
                parts.append(f"--- {name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-15:]))
        return "\n".join(parts)

    def stop(self) -> None:
        """End everything this cluster started, daemons and jobs alike; remove the directory.

        slurmstepd (one per job step) outlives slurmd by design, so its jobs are cancelled
        first, and whatever step is still there after the daemons stopped is killed, with its
        processes: a step belongs to this cluster when its environment names our slurm.conf."""
        if self.procs and all(p.poll() is None for p in self.procs):
            subprocess.run([_exe("scancel"), "--user=root"], env=self.env(), capture_output=True, timeout=30)
            deadline = time.monotonic() + self.kill_wait + 10
            while self.stepds() and time.monotonic() < deadline:
                time.sleep(0.1)
        for p in reversed(self.procs):
            if p.poll() is None:
                p.terminate()
        for p in reversed(self.procs):
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(5)
        self.procs.clear()
        for stepd in self.stepds():
            for q in [*stepd.children(recursive=True), stepd]:
                with contextlib.suppress(psutil.Error):
                    q.kill()
        shutil.rmtree(self.root, ignore_errors=True)

    def stepds(self) -> list[psutil.Process]:
        """This cluster's live slurmstepd processes: those holding our slurmd.log open (a step
        overwrites its argv, and with it the environment /proc shows)."""
        found = []
        log = str(self.root / "slurmd.log")
        for p in psutil.process_iter(["name"]):
            try:
                live = p.info["name"] == "slurmstepd" and p.status() != psutil.STATUS_ZOMBIE
                if live and any(f.path.startswith(log) for f in p.open_files()):
                    found.append(p)
            except psutil.Error:
                pass
        return found

    # ------------------------------------------------------------------ client

    def scontrol(self, *args: str, check: bool = True) -> str:
        r = subprocess.run([_exe("scontrol"), *args], env=self.env(), capture_output=True, text=True, timeout=30)
        if check and r.returncode != 0:
            raise RuntimeError(f"scontrol {' '.join(args)}: {r.stderr}")
        return r.stdout

    def sbatch(self, script: Path, *args: str, env: dict, cwd: Path) -> int:
        """Submit ``script`` with ``args`` (before the script, as sbatch options); the job id."""
        r = subprocess.run(
            [_exe("sbatch"), "--parsable", *args, str(script)], env=self.env(env), cwd=cwd, capture_output=True, text=True, timeout=30
        )
        if r.returncode != 0:
            raise RuntimeError(f"sbatch failed ({r.returncode}): {r.stderr}")
        return int(r.stdout.strip().split(";")[0])

    def scancel(self, job: int) -> None:
        subprocess.run([_exe("scancel"), str(job)], env=self.env(), check=True, timeout=30)

    def job(self, job: int) -> dict[str, str]:
        """``scontrol show job`` as a dict (the controller keeps finished jobs for MinJobAge, 300 s)."""
        out = self.scontrol("show", "job", "--oneliner", str(job))
        return dict(f.split("=", 1) for f in out.split() if "=" in f)

    def wait_job(self, job: int, timeout: float) -> dict[str, str]:
        """The job's record once it reached a final state."""
        info: dict[str, str] = {}
        self._wait(lambda: info.update(self.job(job)) or info.get("JobState") in FINAL_STATES, timeout, f"job {job} to end")
        return info
