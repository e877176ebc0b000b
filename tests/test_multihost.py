"""The ssh launcher across real separate hosts, made with network namespaces.

Three tiers: pure tests of the hostfile and the ssh command lines; a loopback
test of the worker's ``--secret-from-stdin`` (its stdin's end-of-file stops it);
and ``python -m flodl.launcher`` driving three hosts, each a network namespace
with its own address, hostname (a UTS namespace) and sshd, joined by a bridge
in the root namespace. The namespace tests need root, ``ip netns`` and
``/usr/sbin/sshd``; without them they skip, saying why. The namespaces share
the filesystem, so remote workers run this interpreter from this checkout.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from bench.netns import NsHost
from bench.netns import cmdline as _cmdline
from bench.netns import must as _must
from bench.netns import run as _run
from flodl.errors import ConfigError
from flodl.host.hostfile import Host, load_hostfile, parse_host_flag, ssh_argv, with_defaults
from flodl.launcher import check_controller_args, split_argv
from flodl.worker import read_stdin_credentials

from .conftest import PY, task_spec
from .helpers.history import epoch_samples
from .helpers.hosts import assert_no_flodl_left, launch_on_hosts, parent_pid, wait_until
from .helpers.procs import Proc, is_rank, served
from .netns import Unavailable, ssh_cluster

pytestmark = pytest.mark.timeout(180)

SECRET = "ab" * 32


# ====================================================================== pure


def _hostfile(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "hosts.toml"
    path.write_text(text)
    return path


def test_hostfile_reads_every_key(tmp_path):
    path = _hostfile(
        tmp_path,
        """
[[hosts]]
host = "gpu-a"
devices = "cuda:0,cuda:1"
python = "/opt/venv/bin/python"
workdir = "/srv/train"
env = { OMP_NUM_THREADS = "4" }
ssh_user = "trainer"
ssh_port = 2222
identity_file = "~/.ssh/id_ed25519"
ssh_options = ["StrictHostKeyChecking=accept-new"]
nccl_socket_ifname = "ib0"
gloo_socket_ifname = "eth1"

[[hosts]]
host = "gpu-b"
""",
    )
    a, b = load_hostfile(path)
    assert a == Host(
        host="gpu-a",
        devices="cuda:0,cuda:1",
        python="/opt/venv/bin/python",
        workdir="/srv/train",
        env={"OMP_NUM_THREADS": "4"},
        ssh_user="trainer",
        ssh_port=2222,
        identity_file="~/.ssh/id_ed25519",
        ssh_options=("StrictHostKeyChecking=accept-new",),
        nccl_socket_ifname="ib0",
        gloo_socket_ifname="eth1",
    )
    b = with_defaults(b, python="python3.11", workdir="/here", nccl=None, gloo="eth0")
    assert (b.python, b.workdir, b.gloo_socket_ifname, b.devices) == ("python3.11", "/here", "eth0", None)


@pytest.mark.parametrize(
    ("body", "needle"),
    [
        ('[[hosts]]\nhost = "a"\n\n[[hosts]]\nhost = "b"\nsshport = 22\n', "line 4 (hosts[1]).sshport: unknown key"),
        ('[[hosts]]\ndevices = "cpu"\n', "line 1 (hosts[0]).host: missing"),
        ('[[hosts]]\nhost = "a"\nssh_port = "22"\n', "hosts[0]).ssh_port: must be a TCP port"),
        ('[[hosts]]\nhost = "a"\nenv = { FLODL_RUN_SECRET = "00" }\n', "env.FLODL_RUN_SECRET: the run's credentials"),
        ('[[hosts]]\nhost = "a"\nenv = { N = 4 }\n', "env.N: must be a string"),
        ('[[hosts]]\nhost = "a"\nssh_options = ["BatchMode=no"]\n', "set by the launcher"),
        ('[[hosts]]\nhost = "a"\nssh_options = ["-v"]\n', "Key=Value"),
        ('[[host]]\nhost = "a"\n', "unknown top-level key(s) ['host']"),
        ('[[hosts]\nhost = "a"\n', "line 1"),  # TOML syntax: tomllib's own position
    ],
)
def test_hostfile_errors_name_the_line_and_key(tmp_path, body, needle):
    with pytest.raises(ConfigError) as info:
        load_hostfile(_hostfile(tmp_path, body))
    assert needle in str(info.value)


def test_ssh_command_keeps_launcher_options_first_and_holds_no_secret():
    host = with_defaults(
        Host(
            host="10.0.0.2",
            devices="cpu,cpu",
            ssh_user="root",
            ssh_port=2200,
            identity_file="/k",
            ssh_options=("ConnectTimeout=3",),
            env={"A": "x y"},
        ),
        python="/py",
        workdir="/w d",
        nccl="ib0",
        gloo=None,
    )
    argv = ssh_argv(host, "tcp://10.0.0.1:5000", extra_options=("LogLevel=ERROR",))
    assert argv[:4] == ["ssh", "-T", "-o", "BatchMode=yes"]
    opts = [argv[i + 1] for i, a in enumerate(argv) if a == "-o"]
    assert opts == ["BatchMode=yes", "ConnectTimeout=3", "LogLevel=ERROR", "ConnectTimeout=10"]  # ssh keeps the first
    assert argv[-3:-1] == ["--", "10.0.0.2"] and argv[argv.index("-p") : argv.index("-p") + 2] == ["-p", "2200"]
    command = argv[-1]
    assert command.startswith("cd '/w d' && exec env PYTHONUNBUFFERED=1 NCCL_SOCKET_IFNAME=ib0 'A=x y' /py -m flodl.worker")
    assert "--secret-from-stdin" in command and "--devices cpu,cpu" in command and "FLODL_RUN" not in command


def test_host_flag_and_controller_args():
    assert parse_host_flag("root@gpu:cuda:0,cuda:1") == Host(host="root@gpu", devices="cuda:0,cuda:1")
    assert parse_host_flag("gpu") == Host(host="gpu")
    with pytest.raises(ConfigError, match="--host"):
        parse_host_flag("gpu:")
    assert split_argv(["--host", "a", "--", "--task", "t.py:task", "--", "x"]) == (["--host", "a"], ["--task", "t.py:task", "--", "x"])
    with pytest.raises(ConfigError, match="--workers: is set by the launcher"):
        check_controller_args(["--task", "t.py:task", "--workers=2"])
    with pytest.raises(ConfigError, match="nothing to run"):
        check_controller_args([])
    check_controller_args(["--script", "train.py", "--", "--port", "5"])  # after the second --: the script's own


def test_stdin_credentials_line():
    r, w = os.pipe()
    try:
        os.write(w, f"{SECRET} run-1\nleft for the EOF watch".encode())
        assert read_stdin_credentials(r, 1.0) == (bytes.fromhex(SECRET), "run-1")
        assert os.read(r, 100) == b"left for the EOF watch"  # nothing past the newline was consumed
        with pytest.raises(ConfigError, match=r"within 0\.2 s"):
            read_stdin_credentials(r, 0.2)
        os.write(w, b"not-hex run-1 extra\n")
        with pytest.raises(ConfigError, match="got 3 field") as info:
            read_stdin_credentials(r, 1.0)
        assert "not-hex" not in str(info.value)  # a malformed line is never echoed: it may hold the secret
        os.write(w, b"zz run\n")
        with pytest.raises(ValueError, match="must be hex"):
            read_stdin_credentials(r, 1.0)
        os.write(w, b"abcd")
        os.close(w)
        w = -1
        with pytest.raises(ConfigError, match="stdin closed"):
            read_stdin_credentials(r, 1.0)
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


# ================================================================== processes


def test_worker_reads_its_secret_from_stdin_and_stops_on_eof(proc_env):
    """Loopback: a --secret-from-stdin worker trains, and closing its stdin stops it and its ranks."""
    from .helpers.procs import PICK_PORT

    env = {**proc_env, "FLODL_RUN_SECRET": SECRET, "FLODL_RUN_ID": "stdin-run", "FLODL_TEST_STEP_SLEEP": "0.02"}
    ctl = Proc(
        [
            PY,
            "-m",
            "flodl.controller",
            "--task",
            task_spec("tiny.py"),
            "--workers",
            "1",
            *PICK_PORT,
            "--epochs",
            "200",
            "--dashboard-port",
            "-1",
        ],
        env,
    )
    worker_env = {k: v for k, v in proc_env.items() if not k.startswith("FLODL_RUN")}
    try:
        port = ctl.control_port()
    except BaseException:
        ctl.kill()
        raise
    worker = Proc(
        [PY, "-m", "flodl.worker", "--controller", f"tcp://127.0.0.1:{port}", "--devices", "cpu,cpu", "--secret-from-stdin"],
        {**worker_env, "FLODL_TEST_STEP_SLEEP": "0.02"},
        stdin=subprocess.PIPE,
    )
    try:
        worker.proc.stdin.write(f"{SECRET} stdin-run\n")
        worker.proc.stdin.flush()
        ctl.wait_for_line("epoch 1/200")
        tree = psutil.Process(worker.proc.pid).children(recursive=True)
        ranks = [p for p in tree + served(tree, {"stdin-run"}) if is_rank(p)]  # forked by its zygote (or the suite's server)
        assert len(ranks) == 2
        worker.proc.stdin.close()
        assert worker.wait(20) == 130, worker.output
        assert "stdin closed" in worker.output
        wait_until(lambda: not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks), 10, "the ranks to exit")
    finally:
        worker.kill()
        ctl.kill()


# ========================================================== namespace hosts

BRIDGE = "flodl-br0"
GATEWAY = "10.77.0.1"
HOSTS = [NsHost(f"flodl-h{i}", f"10.77.0.1{i}", f"flodl-v{i}") for i in (1, 2, 3)]


@pytest.fixture(scope="session")
def cluster(tmp_path_factory):
    """Three namespace hosts with sshd, torn down at the end even on failure; skips when unusable."""
    try:  # ssh_cluster checks for root, the tools and sshd first (Unavailable says which is missing)
        with ssh_cluster(tmp_path_factory.mktemp("netns"), HOSTS, BRIDGE, GATEWAY) as built:
            yield built
    except Unavailable as exc:
        pytest.skip(f"namespace hosts unavailable: {exc}")


def _net_ns(pid: int) -> int:
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino
    except OSError:
        return -1


@pytest.fixture(scope="module")
def three_host_run(cluster, tmp_path_factory):
    """One run across the three hosts, every process's command line sampled while it runs."""
    tmp = tmp_path_factory.mktemp("three")
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # the global flag instead of the per-host key: GLOO_SOCKET_IFNAME must reach every rank either way
    run = launch_on_hosts(
        cluster, tmp, env, step_sleep="0.01", epochs=3, per_host_ifname=False, launcher_extra=["--gloo-socket-ifname", "eth0"]
    )
    seen: set[str] = set()
    secrets: set[str] = set()  # from this run's controller and ranks only (other test runs may be going on)
    namespaces = {os.stat(f"/run/netns/{h.name}").st_ino for h in cluster.hosts}
    while run.proc.poll() is None:
        for p in psutil.process_iter():
            line = _cmdline(p)
            seen.add(line)
            ours = ("flodl.controller" in line and parent_pid(p) == run.proc.pid) or ("flodl.rank" in line and _net_ns(p.pid) in namespaces)
            if ours:
                try:
                    secrets.add(p.environ().get("FLODL_RUN_SECRET", ""))
                except psutil.Error:
                    pass
        time.sleep(0.05)
    code = run.wait(10)
    summary_path = tmp / "summary.json"
    summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
    return code, summary, run, seen, secrets - {""}


def test_a_run_across_three_hosts_trains_and_finishes(cluster, three_host_run):
    code, summary, run, _, _ = three_host_run
    assert code == 0, run.output
    assert summary["exit_reason"] == "completed" and summary["world_size"] == 3
    assert sorted(r["host"] for r in summary["per_rank"]) == ["flodl-h1", "flodl-h2", "flodl-h3"]
    assert epoch_samples(summary["history"]) == [512] * 3  # exact coverage, every epoch
    # the last epoch's line: its own, or a row of the epochs one average closed ("epochs 1-3/3"; no eval asked by number)
    assert re.search(r"^\[controller\] epochs? (\d+-)?3/3 ", run.output, re.M), run.output
    for prefix in (
        "[10.77.0.11]",
        "[launcher] stopping: the controller exited with code 0",
        "frames are authenticated, not encrypted",
    ):  # served beyond loopback: it says so
        assert prefix in run.output, run.output
    assert_no_flodl_left(cluster, 5)


def test_the_secret_is_never_on_a_command_line(three_host_run):
    code, summary, run, seen, secrets = three_host_run
    assert code == 0, run.output
    assert len(secrets) == 1, "the controller and the ranks hold one secret, in their environment"
    secret = secrets.pop()
    assert any("flodl.worker" in c and "--secret-from-stdin" in c for c in seen), "the sampler saw the remote workers"
    assert any("flodl.rank" in c for c in seen)
    assert not [c for c in seen if secret in c]
    assert secret not in run.output and secret not in json.dumps(summary)


def test_ctrl_c_tears_down_every_host(cluster, tmp_path, proc_env):
    run = launch_on_hosts(cluster, tmp_path, proc_env, step_sleep="0.05", epochs=200)
    try:
        run.wait_for_line("epoch 1/200")
        local = psutil.Process(run.proc.pid).children(recursive=True)
        assert all(h.flodl_procs() for h in cluster.hosts)
        stopped_at = time.monotonic()
        run.proc.send_signal(signal.SIGINT)
        assert run.wait(30) == 130, run.output
        assert time.monotonic() - stopped_at < 15, run.output
        assert_no_flodl_left(cluster, 5)
        assert not [p for p in local if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        assert "[launcher] stopping: received SIGINT" in run.output
    finally:
        run.kill()


def test_a_host_that_cannot_be_reached_stops_the_launch(cluster, tmp_path, proc_env):
    """sshd does not listen on port 2200: every ssh fails at once, and the launcher exits 7 leaving nothing."""
    run = launch_on_hosts(cluster, tmp_path, proc_env, step_sleep="0", epochs=1, ssh_port=2200)
    try:
        assert run.wait(60) == 7, run.output
        assert "failed at start (ssh could not connect or log in, exit code 255)" in run.output
        assert_no_flodl_left(cluster, 5)
    finally:
        run.kill()


def test_a_cut_link_is_a_dead_rank_and_the_survivors_finish(cluster, tmp_path, proc_env):
    cut = cluster.hosts[2]
    # 10 epochs: the survivors cannot settle a window without the cut rank's report until it is declared
    # dead (4 s), so the death is found however short the rest of the run; the epochs after it are
    # what shows the survivors finish (20 used to spend 19 s more on them; 50 ms steps 4 s more than 20 ms)
    run = launch_on_hosts(cluster, tmp_path, proc_env, step_sleep="0.02", epochs=10, extra=["--heartbeat-timeout-secs", "4"])
    try:
        run.wait_for_line("epoch 1/10")
        _must("ip", "link", "set", cut.veth, "down")
        assert run.wait(150) == 0, run.output
        summary = json.loads((tmp_path / "summary.json").read_text())
        assert [d["host"] for d in summary["deaths"]] == [cut.name], summary["deaths"]
        assert summary["exit_reason"] == "completed"
        assert epoch_samples(summary["history"]) == [512] * 10  # the dead rank's samples went to the survivors
        # cut off, the host's worker hears nothing from the controller and stops its ranks on its own
        assert_no_flodl_left(cluster, 40)
    finally:
        _run("ip", "link", "set", cut.veth, "up")
        run.kill()
