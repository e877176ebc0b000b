"""Wire messages of the flodl control protocol.

GENERATED from proto/schema.json by proto/generate.py: do not edit by hand.
Each message is a slotted dataclass (treat it as immutable: not frozen only
because frozen construction costs 4x on the controller's hot path);
``SCHEMA`` maps a kind to its name,
class and ``(field, wire type)`` pairs, from which ``codec.py`` builds its
bounded validators. Field order is wire order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

PROTOCOL_VERSION = 16


@dataclass(slots=True)
class WorkerHello:
    """A worker announces its host, process and the devices it will run one rank on each. (worker -> controller)"""

    KIND: ClassVar[int] = 1
    host: str
    """host name the worker runs on"""
    pid: int
    """the worker's process id"""
    devices: list[str]
    """one torch device string per rank to spawn, e.g. cuda:0 or cpu"""
    versions: dict[str, str]
    """flodl, protocol, python and torch versions"""


@dataclass(slots=True)
class WorkerWelcome:
    """The controller admits a worker and assigns a global rank to each of its devices. (controller -> worker)"""

    KIND: ClassVar[int] = 2
    ranks: list[int]
    """global rank of each device, in the order of WorkerHello.devices"""
    world_size: int
    """number of ranks in the run"""
    task: str
    """what the ranks run: a task factory spec they import (module:function or file.py:function), or script: and a JSON list [path, *args], a script the worker runs as python path args (script mode)"""
    heartbeat_timeout_s: float
    """seconds of controller silence after which the worker stops its ranks and exits"""
    bulk_port: int
    """port of the controller's bulk-plane socket (CPU averaging backend), 0 when unused"""
    bulk_relay: bool
    """run a host relay: this host's ranks send their snapshots to the worker, which pre-averages them (weighted) and sends one snapshot upstream per round, so the controller's ingress grows with hosts, not ranks"""
    seed: int
    """the run seed (--seed; a resumed run's, its bundle's): the ranks seed every RNG from it before building the task, the same on every rank, and again from (seed, rank) before training, each rank its own stream"""
    deterministic: bool
    """the run's deterministic option: the ranks turn on torch's deterministic algorithms before building the task"""
    log_dir: str
    """the run's log_dir (--log-dir, as the worker's working directory resolves it), or empty: the worker also writes each of its ranks' stdout and stderr to <log_dir>/<run id>/rank<N>/stdout.log and stderr.log"""


@dataclass(slots=True)
class Reject:
    """The controller refuses a peer's hello; the peer exits printing the reason. (controller -> worker|rank)"""

    KIND: ClassVar[int] = 3
    reason: str
    """why the peer was refused, for the user"""


@dataclass(slots=True)
class RankExited:
    """A rank process ended; sent by its worker the moment it is reaped. (worker -> controller)"""

    KIND: ClassVar[int] = 4
    rank: int
    """global rank of the process"""
    pid: int
    """its process id"""
    code: int
    """exit status; negative means killed by that signal number"""


@dataclass(slots=True)
class RankHello:
    """A rank has built its task and asks to join, describing itself and its model. (rank -> controller)"""

    KIND: ClassVar[int] = 5
    rank: int
    """the global rank its worker assigned"""
    host: str
    """host name"""
    pid: int
    """process id"""
    device: str
    """torch device the rank trains on"""
    versions: dict[str, str]
    """flodl, protocol, python and torch versions"""
    model_signature: str
    """hash of parameter and buffer names, shapes and dtypes; must agree across ranks"""
    param_count: int
    """number of scalar parameters in the model"""
    shuffle_signature: str
    """hash of a reference permutation, proving every rank derives the same epoch shuffles"""
    dataset_len: int
    """number of samples in the task's dataset; must agree across ranks"""
    dataset_digest: str
    """hash of the dataset's samples at a few fixed positions (plan/schedule.py digest_positions; for a flodl.Shards, of its shard ids there); must agree across ranks; empty when the samples cannot be hashed the same way twice"""
    has_eval: bool
    """whether the task defines an eval function"""
    eval_metric: str
    """name of the eval function's metric"""
    batch_size: int
    """the task's batch size"""
    grain: str
    """what one dataset position is: "sample" (a map-style dataset) or "shard" (a flodl.Shards: grants, coverage and window quotas count shards; dataset_len is the shard count)"""
    accumulate_grad_batches: int
    """batches per optimizer step (the task's accumulate_grad_batches, or a script's prepare()): Sync averages every this many batches (the largest of the starting ranks')"""
    cores: str
    """the CPU cores the rank is pinned to, as taskset writes them ("2-7"), or empty when it shares the host's cores unpinned"""


@dataclass(slots=True)
class RankWelcome:
    """The controller admits a rank and tells it how to join the collective for this membership generation. (controller -> rank)"""

    KIND: ClassVar[int] = 6
    rank: int
    """global rank, echoed"""
    world_size: int
    """number of ranks in this generation"""
    generation: int
    """membership generation; bumps on every change of the world"""
    store_host: str
    """address of the controller's TCPStore"""
    store_port: int
    """port of the controller's TCPStore"""
    store_prefix: str
    """key prefix of this generation's rendezvous in the store"""
    collective_timeout_s: float
    """timeout of every collective operation"""
    config: dict[str, Any]
    """the run options (DdpRunConfig.to_dict())"""
    seed: int
    """shuffle seed of the run; epoch e's permutation is seeded seed + e"""
    bulk_port: int
    """port of the controller's bulk-plane socket (CPU averaging backend), 0 when unused"""
    late: bool
    """the rank joins a run already training: it waits for a Regroup that names it, then takes the consensus parameters instead of training from its own"""
    shm_probe: str
    """path of the controller's shared-memory probe (CPU averaging backend), empty when the same-host lane is off"""
    shm_nonce: str
    """what the probe holds: a rank that reads exactly this from it shares the controller's host and user and may use the same-host lane"""
    first_epoch: int
    """the epoch the run trains first (0, or a resumed run's first open epoch): a rank enters every epoch from there in order, an epoch it trains no batch of included; -1: from the epoch of its first batch (a rank joining a running job)"""
    epochs: int
    """epochs the run trains in all (--epochs x epoch_splits): a completed run ends every rank's last epoch, the run's last one"""


@dataclass(slots=True)
class RankReady:
    """A rank has joined the collective and holds the same initial parameters as rank 0. (rank -> controller)"""

    KIND: ClassVar[int] = 7
    rank: int
    """global rank"""
    generation: int
    """generation whose process group it joined"""
    init_ms: float
    """milliseconds spent building the group and syncing parameters"""


@dataclass(slots=True)
class TimingMsg:
    """A rank's timing report for its latest optimizer steps (one or more, all of one epoch; sent about every 50 ms, each step when probing, and after each round's average): timing and loss for the cadence, the monitor and liveness. (rank -> controller)"""

    KIND: ClassVar[int] = 9
    rank: int
    """global rank"""
    epoch: int
    """epoch of the steps"""
    step: int
    """the rank's local step count after the last of them"""
    samples: int
    """samples in the steps, added up"""
    loss: float
    """the steps' mean loss"""
    batch_ms: float
    """compute milliseconds of the steps, added up (forward, backward, optimizer)"""
    data_ms: float
    """milliseconds waiting for the steps' data, added up"""
    sync_ms: float
    """milliseconds spent averaging after the last of them (0 if none)"""
    batches: int
    """optimizer steps (batches) this report covers, at least 1"""


@dataclass(slots=True)
class Heartbeat:
    """A sign of life, sent every second in both directions; any frame also counts as one. A rank's also says what its training thread is doing and for how long it has made no progress, so a thread stuck in user code is told from a busy one. (any -> any)"""

    KIND: ClassVar[int] = 11
    step: int
    """the sender's step count (controller: global step)"""
    sent_at: float
    """sender's wall clock, seconds since the epoch"""
    busy: str
    """what the sender's training thread is doing: build, step, average, eval, callback, save, idle (empty from controllers and workers)"""
    busy_s: float
    """seconds since that thread last made progress (finished a step, an average, an eval) in this activity; while idle, how long it has waited for a command"""
    step_ms: float
    """the rank's recent slowest step in milliseconds (0 before its first step); sets its step deadline"""
    averaged: int
    """the membership generation of the rank's last completed average (-1: none yet)"""


@dataclass(slots=True)
class RunEval:
    """Score the averaged model with the task's eval function, between batches (the rank does not wait for its window to end). (controller -> rank)"""

    KIND: ClassVar[int] = 12
    epoch: int
    """the epoch the score is reported for (number of epochs for the final eval)"""
    final: bool
    """whether this is the run's final eval"""
    window: int
    """the window whose average closed the epoch: the rank scores exactly that average, even if it has trained on since (-1: the model as it is once its last average landed)"""


@dataclass(slots=True)
class EvalResult:
    """The eval function's value, or the error it raised. (rank -> controller)"""

    KIND: ClassVar[int] = 13
    rank: int
    """global rank that ran it"""
    epoch: int
    """echo of RunEval.epoch"""
    final: bool
    """echo of RunEval.final"""
    value: float | None
    """the metric, nil on error"""
    elapsed_ms: float
    """milliseconds the eval took"""
    error: str | None
    """the exception text if eval failed"""


@dataclass(slots=True)
class Shutdown:
    """Stop: after a completed run, or abort a failed one without saving; peers exit and leave no process behind. (controller -> worker|rank)"""

    KIND: ClassVar[int] = 14
    reason: str
    """why, for logs"""
    abort: bool
    """true when the run failed and ranks should not wait on peers"""


@dataclass(slots=True)
class Exiting:
    """A peer is leaving on purpose; a clean exit is not a death. (worker|rank -> controller)"""

    KIND: ClassVar[int] = 15
    rank: int
    """global rank, or -1 for a worker"""
    reason: str
    """why it leaves"""
    digest: str
    """sha256 of the rank's final parameters and buffers on a clean exit (replicas that agree have equal digests); empty otherwise"""


@dataclass(slots=True)
class RankError:
    """A rank's task or collective raised; the controller reports it once, with rank and host, and stops the run. (rank -> controller)"""

    KIND: ClassVar[int] = 16
    rank: int
    """global rank"""
    stage: str
    """where it failed: build, collective, train or eval"""
    error: str
    """exception type and message"""
    detail: str
    """the traceback, truncated"""
    generation: int
    """the membership generation the rank was in when it failed (a collective failure from an older generation is already explained)"""


@dataclass(slots=True)
class Ping:
    """Round-trip probe; the controller answers with a Pong carrying the same nonce. (any -> controller)"""

    KIND: ClassVar[int] = 17
    nonce: int
    """echoed back"""
    sent_at: float
    """sender's monotonic clock, echoed back"""


@dataclass(slots=True)
class Pong:
    """Answer to a Ping. (controller -> any)"""

    KIND: ClassVar[int] = 18
    nonce: int
    """the Ping's nonce"""
    sent_at: float
    """the Ping's sent_at"""


@dataclass(slots=True)
class Window:
    """Train the granted positions until a quota is reached, then average through the collective (progressive dispatch). (controller -> rank)"""

    KIND: ClassVar[int] = 19
    window: int
    """window number, from 0; echoed in WindowDone"""
    global_step: int
    """batches trained by all ranks before this window (drives LR schedules)"""
    grants: list[list[int]]
    """[epoch, start, size] ranges of epoch permutations, trained in this order"""
    quota_batches: int
    """stop after this many batches (0: no batch limit)"""
    quota_ms: float
    """stop at the first batch boundary after this many milliseconds of training (0: no time limit)"""
    sync_every: int
    """also average after every this many batches (0: only at the end)"""
    rounds: int
    """collective averaging rounds in this window, equal on every rank"""
    measure_divergence: bool
    """report the replica's drift from the average (costs one parameter copy)"""
    after: int
    """the window sent to this rank before this one (-1: its first); a rank runs its windows in that order, holding one that overtook the one it names, and answers a window it already reported with that report again (the controller re-sends a window whose report is overdue from an idle rank)"""


@dataclass(slots=True)
class WindowDone:
    """A rank finished a window and its averaging; what it trained, how long it took, how far it had drifted. (rank -> controller)"""

    KIND: ClassVar[int] = 20
    rank: int
    """global rank"""
    window: int
    """echo of Window.window"""
    batches: int
    """optimizer steps taken"""
    consumed: int
    """samples trained: the first this many positions of the grants, in order"""
    loss_sum: float
    """sum of batch losses"""
    compute_ms: float
    """milliseconds of forward, backward and optimizer"""
    data_ms: float
    """milliseconds waiting for data"""
    sync_ms: float
    """milliseconds inside averaging rounds, waiting for peers included"""
    wall_ms: float
    """the window's wall time on the rank, first batch to its last average's launch, less its pauses (the evals it scored, its wait for a late peer's previous average; sync_ms and the per-batch bookkeeping included): ElChe sizes windows from wall_ms - sync_ms per batch, so a rank's own overheads count in its pace and a once-an-epoch eval does not"""
    divergence: float | None
    """‖pre − post‖ / ‖post‖ over all parameters at the window's last average"""
    pre_norm: float | None
    """‖pre‖, the replica's parameter norm before that average"""
    post_norm: float | None
    """‖post‖, the averaged parameters' norm"""
    lr: float | None
    """the optimizer's learning rate at the end of the window (first parameter group)"""
    epochs: list[list[float]]
    """per epoch touched: [epoch, batches, samples, loss_sum, compute_ms, data_ms]"""
    scalars: dict[str, list[float]]
    """user scalars recorded during the window, name to [sum, count]"""
    regrouped_at: int
    """the window's averaging round that was redone in a new generation because a peer died (-1: none); the dead rank's batches before it are in the consensus"""
    dropped: int
    """a window whose end-of-window background average this rank gave up while training this one, because a peer died mid-average (-1: none); when every survivor gave it up, the dead rank's work of that window is in no replica and its samples are granted again"""
    res: dict[str, Any]
    """the rank's machine gauges over the window (gpu_util, gpu_util_max, vram_alloc, vram_alloc_max, vram_total, cpu_util, rss_bytes; present ones only), and what its averages put on the network so far (sync_sent_bytes, sync_recv_bytes, sync_averages, sync_broadcast_bytes: running totals, once it averaged)"""
    data: dict[str, Any]
    """the rank's data plane over the window: hits per staging tier (vram_hits, ram_hits, disk_hits), source_fetches, bytes held per tier (vram_bytes, ram_bytes, disk_bytes); empty for in-memory datasets"""


@dataclass(slots=True)
class EndWindow:
    """Finish the current batch, then end the window and average (ends an open-ended calibration window; since version 15 also any window ended early for a joining rank, and a window not started yet when this arrives ends after its first batch; since version 16 on the CPU backend with no batch, its round averaged with weight 0, unless the rank hands joiners its state with that round's snapshot). (controller -> rank)"""

    KIND: ClassVar[int] = 21
    window: int
    """the window to end"""


@dataclass(slots=True)
class Snapshot:
    """One slice of a parameter snapshot for a CPU averaging round; its raw bytes follow as one frame. A snapshot is sent as slices of at most 8 MiB, so no end holds more than a few slices of it in flight. (rank -> controller (bulk plane))"""

    KIND: ClassVar[int] = 22
    rank: int
    """global rank"""
    round: int
    """averaging round the snapshot belongs to"""
    weight: float
    """batches trained since the last snapshot; parameters are averaged in proportion (0: take the average, add nothing)"""
    groups: list[str]
    """per flat tensor of the model: p (parameters, weighted) or b (floating buffers, equal weight among ranks that trained)"""
    dtypes: list[str]
    """per flat tensor of the model: torch dtype name, e.g. float32, bfloat16"""
    numels: list[int]
    """per flat tensor of the model: element count; the frame holds exactly numel x itemsize bytes"""
    bucket: int
    """which flat tensor this message carries a slice of (-1: none, e.g. an aborted round)"""
    start: int
    """first element of the slice within that tensor"""
    count: int
    """elements in the slice; the single frame holds exactly count x itemsize bytes"""
    shm: str
    """empty: the slice is the frame that follows; else the path of the rank's shared-memory segment that holds it, and no frame follows"""
    shm_offset: int
    """byte offset of the slice in that segment (0 when shm is empty)"""
    ranks: int
    """how many ranks' snapshots this one averages: 1 from a rank; from a host relay, its ranks that trained (floating buffers are weighted by it)"""
    folded: list[int]
    """from a host relay: its ranks whose snapshot slice this one folds (a rank that died halfway through its snapshot is in some slices only); empty from a rank. The controller's ledger counts a relayed rank's window as averaged only if it is in every slice of its round"""


@dataclass(slots=True)
class Update:
    """One slice of the averaged model for a CPU averaging round (or the round's abort, with no frame); its raw bytes follow as one frame. (controller (bulk plane) -> rank)"""

    KIND: ClassVar[int] = 23
    round: int
    """the round averaged"""
    aborted: bool
    """the round timed out: no frames follow, keep training on local parameters"""
    ranks: int
    """how many snapshots the average holds"""
    groups: list[str]
    """per frame, as in Snapshot"""
    dtypes: list[str]
    """per frame, as in Snapshot"""
    numels: list[int]
    """per frame, as in Snapshot"""
    bucket: int
    """which flat tensor this message carries a slice of (-1: none, e.g. an aborted round)"""
    start: int
    """first element of the slice within that tensor"""
    count: int
    """elements in the slice; the single frame holds exactly count x itemsize bytes"""
    shm: str
    """empty: the slice is the frame that follows; else the path of the controller's update segment that holds it as float32, and no frame follows"""
    shm_offset: int
    """byte offset of the slice in that segment; the segment's round stamp (int64 at byte 8) must equal round before and after reading"""


@dataclass(slots=True)
class Regroup:
    """The world changed: rebuild the collective among these ranks under a fresh store prefix, then carry on with the current window. (controller -> rank)"""

    KIND: ClassVar[int] = 24
    generation: int
    """the new membership generation"""
    members: list[int]
    """global ranks of the new world, in collective order (a rank's index here is its collective rank)"""
    store_prefix: str
    """key prefix of this generation's rendezvous in the controller's TCPStore"""
    reason: str
    """why, for logs (e.g. rank 2 on host h (pid 9) was killed by SIGKILL)"""
    sync_from: int
    """growing: the member that holds the consensus and hands its state to the joiners (-1 when nobody joined). Collective backend: every member takes its parameters after rebuilding the group, and each joiner its optimizer state; CPU backend (since version 15): sent to it and to the joiners, it hands its optimizer state to the joiners with its snapshot of first_round (StateSlice)"""
    first_round: int
    """CPU backend, growing: the averaging round a joining rank's first snapshot belongs to (it takes that round's average as its parameters); -1 otherwise"""


@dataclass(slots=True)
class Fence:
    """A rank of this worker was declared dead while its process may still live (silent, hung, stopped): kill it now, so it can never rejoin a world that went on without it. (controller -> worker)"""

    KIND: ClassVar[int] = 25
    rank: int
    """global rank to kill"""
    reason: str
    """why, for logs"""


@dataclass(slots=True)
class SaveCheckpoint:
    """Between windows, the elected rank writes the consensus bundle's model and optimizer files and/or calls the task's checkpoint_fn; the controller commits the sidecar naming those files when CheckpointDone says they are in. (controller -> rank)"""

    KIND: ClassVar[int] = 26
    version: int
    """checkpoint number in this run (1, 2, ...)"""
    stem: str
    """bundle stem; empty: write no files"""
    tag: str
    """name part of this save's data files, chosen by the controller: the rank writes <stem>.<tag>.fdl and <stem>.<tag>.optim, never over a file the committed sidecar names"""
    reason: str
    """checkpoint or final"""
    epoch: int
    """the epoch the checkpoint belongs to (passed to checkpoint_fn)"""
    call_fn: bool
    """also call the task's checkpoint_fn(version, worker)"""


@dataclass(slots=True)
class CheckpointDone:
    """The rank's part of a checkpoint is written (or failed): the answer to SaveCheckpoint, and to a ShutdownWithSave. (rank -> controller)"""

    KIND: ClassVar[int] = 27
    rank: int
    """the writing rank"""
    version: int
    """the SaveCheckpoint's version; -1 for a ShutdownWithSave"""
    model_sha256: str
    """sha256 of the <stem>.<tag>.fdl written (empty if none: nothing to commit)"""
    optim_sha256: str
    """sha256 of the <stem>.<tag>.optim written (empty if none)"""
    elapsed_ms: float
    """time spent writing and in checkpoint_fn"""
    error: str | None
    """what failed (the files, or checkpoint_fn), or null"""


@dataclass(slots=True)
class Respawn:
    """Healing: start a new rank process in place of one of this worker's ranks that died; it joins the running world at a window boundary like any joiner. (controller -> worker)"""

    KIND: ClassVar[int] = 28
    rank: int
    """the new rank's global number (numbers are never reused)"""
    device: str
    """the device it trains on (the dead rank's)"""
    replaces: int
    """the dead rank it stands in for (its process is reaped, or killed, first)"""
    attempt: int
    """restarts of this slot so far, this one included (1-based)"""
    delay_s: float
    """back-off: seconds to wait before starting it"""


@dataclass(slots=True)
class ShutdownWithSave:
    """Stop a failed run, but first have one survivor save the consensus bundle (save_rank writes its files, the controller commits the sidecar); otherwise as Shutdown. (controller -> worker|rank)"""

    KIND: ClassVar[int] = 29
    reason: str
    """why, for logs"""
    abort: bool
    """true: the run failed; after saving, ranks do not wait on peers"""
    save_stem: str
    """the bundle stem save_rank writes before exiting"""
    save_rank: int
    """the rank that writes the bundle's data files"""
    save_tag: str
    """name part of that save's data files: save_rank writes <save_stem>.<save_tag>.fdl and .optim, new names, so the committed bundle stays whole until the controller's sidecar names the new files"""


@dataclass(slots=True)
class EpochEnd:
    """Script mode: the script's end-of-epoch code (after its loop over the epoch's batches) has run on this rank; what it reported, for that epoch's row (the controller prints and records a closed epoch once every live rank that trained in it has sent this). (rank -> controller)"""

    KIND: ClassVar[int] = 30
    rank: int
    """global rank"""
    epoch: int
    """the epoch that ended"""
    scalars: dict[str, list[float]]
    """user scalars recorded since the rank's last report and up to the end of that epoch's code, name to [sum, count]"""


@dataclass(slots=True)
class StateSlice:
    """CPU backend, growing (since version 15): one slice of a donor's optimizer state for the ranks that join at an averaging round, its raw bytes following as one frame; the controller passes each slice on to those joiners as it comes. The state is the bytes of a bundle's .optim file (safetensors: the optimizer's state tensors, its parameter groups and what a bundle keeps beside them as JSON metadata, and the outer optimizer's anchor and momentum), sent as slices of at most 8 MiB; since version 16, from a donor on the controller's host, as one shared-memory segment instead (shm), which the controller names to each joiner on that host (its own link to it, which the joiner maps and unlinks) and sends as slices to the others. (rank|controller (bulk plane) -> controller (bulk plane)|rank)"""

    KIND: ClassVar[int] = 31
    rank: int
    """the donor's global rank (Regroup.sync_from)"""
    round: int
    """the averaging round the state goes with: the joiners' first (Regroup.first_round); the state is the donor's as it sent its snapshot of that round"""
    total: int
    """the state's size in bytes; -1: no state comes (the donor has none to give, or died), the joiners start with a fresh optimizer"""
    start: int
    """byte offset of this slice in the state"""
    count: int
    """bytes in this slice; the single frame holds exactly that many (0 and no frame when total is -1; total and no frame when shm names a segment)"""
    shm: str
    """since version 16: the path of a shared-memory segment of this run holding the whole state (start 0, count total, no frame): the donor's to the controller, the joiner's own link to it from the controller; empty: the bytes follow as a frame"""


SCHEMA: dict[int, tuple[str, type, tuple[tuple[str, str], ...]]] = {
    1: ('WorkerHello', WorkerHello, (('host', 'str'), ('pid', 'int'), ('devices', 'list<str>'), ('versions', 'map<str,str>'),)),
    2: ('WorkerWelcome', WorkerWelcome, (('ranks', 'list<int>'), ('world_size', 'int'), ('task', 'str'), ('heartbeat_timeout_s', 'float'), ('bulk_port', 'int'), ('bulk_relay', 'bool'), ('seed', 'int'), ('deterministic', 'bool'), ('log_dir', 'str'),)),
    3: ('Reject', Reject, (('reason', 'str'),)),
    4: ('RankExited', RankExited, (('rank', 'int'), ('pid', 'int'), ('code', 'int'),)),
    5: ('RankHello', RankHello, (('rank', 'int'), ('host', 'str'), ('pid', 'int'), ('device', 'str'), ('versions', 'map<str,str>'), ('model_signature', 'str'), ('param_count', 'int'), ('shuffle_signature', 'str'), ('dataset_len', 'int'), ('dataset_digest', 'str'), ('has_eval', 'bool'), ('eval_metric', 'str'), ('batch_size', 'int'), ('grain', 'str'), ('accumulate_grad_batches', 'int'), ('cores', 'str'),)),
    6: ('RankWelcome', RankWelcome, (('rank', 'int'), ('world_size', 'int'), ('generation', 'int'), ('store_host', 'str'), ('store_port', 'int'), ('store_prefix', 'str'), ('collective_timeout_s', 'float'), ('config', 'map<str,value>'), ('seed', 'int'), ('bulk_port', 'int'), ('late', 'bool'), ('shm_probe', 'str'), ('shm_nonce', 'str'), ('first_epoch', 'int'), ('epochs', 'int'),)),
    7: ('RankReady', RankReady, (('rank', 'int'), ('generation', 'int'), ('init_ms', 'float'),)),
    9: ('TimingMsg', TimingMsg, (('rank', 'int'), ('epoch', 'int'), ('step', 'int'), ('samples', 'int'), ('loss', 'float'), ('batch_ms', 'float'), ('data_ms', 'float'), ('sync_ms', 'float'), ('batches', 'int'),)),
    11: ('Heartbeat', Heartbeat, (('step', 'int'), ('sent_at', 'float'), ('busy', 'str'), ('busy_s', 'float'), ('step_ms', 'float'), ('averaged', 'int'),)),
    12: ('RunEval', RunEval, (('epoch', 'int'), ('final', 'bool'), ('window', 'int'),)),
    13: ('EvalResult', EvalResult, (('rank', 'int'), ('epoch', 'int'), ('final', 'bool'), ('value', 'opt<float>'), ('elapsed_ms', 'float'), ('error', 'opt<str>'),)),
    14: ('Shutdown', Shutdown, (('reason', 'str'), ('abort', 'bool'),)),
    15: ('Exiting', Exiting, (('rank', 'int'), ('reason', 'str'), ('digest', 'str'),)),
    16: ('RankError', RankError, (('rank', 'int'), ('stage', 'str'), ('error', 'str'), ('detail', 'str'), ('generation', 'int'),)),
    17: ('Ping', Ping, (('nonce', 'int'), ('sent_at', 'float'),)),
    18: ('Pong', Pong, (('nonce', 'int'), ('sent_at', 'float'),)),
    19: ('Window', Window, (('window', 'int'), ('global_step', 'int'), ('grants', 'list<list<int>>'), ('quota_batches', 'int'), ('quota_ms', 'float'), ('sync_every', 'int'), ('rounds', 'int'), ('measure_divergence', 'bool'), ('after', 'int'),)),
    20: ('WindowDone', WindowDone, (('rank', 'int'), ('window', 'int'), ('batches', 'int'), ('consumed', 'int'), ('loss_sum', 'float'), ('compute_ms', 'float'), ('data_ms', 'float'), ('sync_ms', 'float'), ('wall_ms', 'float'), ('divergence', 'opt<float>'), ('pre_norm', 'opt<float>'), ('post_norm', 'opt<float>'), ('lr', 'opt<float>'), ('epochs', 'list<list<float>>'), ('scalars', 'map<str,list<float>>'), ('regrouped_at', 'int'), ('dropped', 'int'), ('res', 'map<str,value>'), ('data', 'map<str,value>'),)),
    21: ('EndWindow', EndWindow, (('window', 'int'),)),
    22: ('Snapshot', Snapshot, (('rank', 'int'), ('round', 'int'), ('weight', 'float'), ('groups', 'list<str>'), ('dtypes', 'list<str>'), ('numels', 'list<int>'), ('bucket', 'int'), ('start', 'int'), ('count', 'int'), ('shm', 'str'), ('shm_offset', 'int'), ('ranks', 'int'), ('folded', 'list<int>'),)),
    23: ('Update', Update, (('round', 'int'), ('aborted', 'bool'), ('ranks', 'int'), ('groups', 'list<str>'), ('dtypes', 'list<str>'), ('numels', 'list<int>'), ('bucket', 'int'), ('start', 'int'), ('count', 'int'), ('shm', 'str'), ('shm_offset', 'int'),)),
    24: ('Regroup', Regroup, (('generation', 'int'), ('members', 'list<int>'), ('store_prefix', 'str'), ('reason', 'str'), ('sync_from', 'int'), ('first_round', 'int'),)),
    25: ('Fence', Fence, (('rank', 'int'), ('reason', 'str'),)),
    26: ('SaveCheckpoint', SaveCheckpoint, (('version', 'int'), ('stem', 'str'), ('tag', 'str'), ('reason', 'str'), ('epoch', 'int'), ('call_fn', 'bool'),)),
    27: ('CheckpointDone', CheckpointDone, (('rank', 'int'), ('version', 'int'), ('model_sha256', 'str'), ('optim_sha256', 'str'), ('elapsed_ms', 'float'), ('error', 'opt<str>'),)),
    28: ('Respawn', Respawn, (('rank', 'int'), ('device', 'str'), ('replaces', 'int'), ('attempt', 'int'), ('delay_s', 'float'),)),
    29: ('ShutdownWithSave', ShutdownWithSave, (('reason', 'str'), ('abort', 'bool'), ('save_stem', 'str'), ('save_rank', 'int'), ('save_tag', 'str'),)),
    30: ('EpochEnd', EpochEnd, (('rank', 'int'), ('epoch', 'int'), ('scalars', 'map<str,list<float>>'),)),
    31: ('StateSlice', StateSlice, (('rank', 'int'), ('round', 'int'), ('total', 'int'), ('start', 'int'), ('count', 'int'), ('shm', 'str'),)),
}
