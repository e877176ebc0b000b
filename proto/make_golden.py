"""Write the golden vectors in proto/golden/ (run once per schema change).

``valid.json``: one frame per message kind, with its decoded form.
``invalid.json``: one frame per drop reason, with the reason it must produce.
The test suite checks the codec against both files in both directions, so a
vector that changes is a protocol change and needs a version bump.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import msgpack

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from flodl.wire import messages as m  # noqa: E402
from flodl.wire.codec import HEADER, MAGIC, message_fields, pack_frame, sign  # noqa: E402
from flodl.wire.messages import PROTOCOL_VERSION  # noqa: E402

SECRET = bytes(range(32))
RUN_ID = "golden-run"
GOLDEN = ROOT / "proto" / "golden"

SAMPLES = [
    m.WorkerHello(host="node-a", pid=4242, devices=["cuda:0", "cpu"], versions={"flodl": "0.1.0", "protocol": str(PROTOCOL_VERSION)}),
    m.WorkerWelcome(
        ranks=[0, 1],
        world_size=2,
        task="examples/digits.py:task",
        heartbeat_timeout_s=30.0,
        bulk_port=0,
        bulk_relay=False,
        seed=42,
        deterministic=False,
        log_dir="run/logs",
    ),
    m.Reject(reason="model signature differs from rank 0"),
    m.RankExited(rank=1, pid=4300, code=-9),
    m.RankHello(
        rank=0,
        host="node-a",
        pid=4301,
        device="cpu",
        versions={"flodl": "0.1.0"},
        model_signature="ab12",
        param_count=1000,
        shuffle_signature="cd34",
        dataset_len=1500,
        dataset_digest="9f86d081884c7d65",
        has_eval=True,
        eval_metric="accuracy",
        batch_size=32,
        grain="sample",
        accumulate_grad_batches=2,
        cores="2-7",
    ),
    m.RankWelcome(
        rank=0,
        world_size=2,
        generation=0,
        store_host="127.0.0.1",
        store_port=29500,
        store_prefix="run/gen0",
        collective_timeout_s=30.0,
        config={"mode": "nccl-sync", "max_grad_norm": None, "lr_scale_ratio": 1.0},
        seed=42,
        bulk_port=0,
        late=False,
        shm_probe="",
        shm_nonce="",
        first_epoch=0,
        epochs=5,
    ),
    m.RankReady(rank=1, generation=0, init_ms=12.5),
    m.TimingMsg(rank=1, epoch=3, step=97, samples=96, loss=0.25, batch_ms=16.5, data_ms=0.375, sync_ms=0.75, batches=3),
    m.Respawn(rank=3, device="cuda:1", replaces=1, attempt=1, delay_s=1.0),
    m.ShutdownWithSave(reason="rank 1 lost", abort=True, save_stem="/shared/run", save_rank=0, save_tag="f00d"),
    m.EpochEnd(rank=1, epoch=2, scalars={"accuracy": [0.93, 1.0]}),
    m.Heartbeat(step=1234, sent_at=1700000000.5, busy="step", busy_s=0.25, step_ms=12.5, averaged=3),
    m.RunEval(epoch=5, final=True, window=17),
    m.EvalResult(rank=0, epoch=5, final=True, value=0.96875, elapsed_ms=3.5, error=None),
    m.Shutdown(reason="run complete", abort=False),
    m.Exiting(rank=-1, reason="shutdown", digest=""),
    m.RankError(rank=1, stage="train", error="RuntimeError: boom", detail="Traceback ...", generation=0),
    m.Ping(nonce=7, sent_at=12.25),
    m.Pong(nonce=7, sent_at=12.25),
    m.EvalResult(rank=2, epoch=1, final=False, value=None, elapsed_ms=0.0, error="ValueError: bad eval"),
    m.Window(
        window=7,
        global_step=640,
        grants=[[2, 128, 64], [3, 0, 32]],
        quota_batches=0,
        quota_ms=812.5,
        sync_every=0,
        rounds=1,
        measure_divergence=True,
        after=6,
    ),
    m.EndWindow(window=7),
    m.Snapshot(
        rank=1,
        round=12,
        weight=7.0,
        groups=["p", "b"],
        dtypes=["float32", "float32"],
        numels=[1000, 20],
        bucket=0,
        start=0,
        count=1000,
        shm="",
        shm_offset=0,
        ranks=1,
        folded=[],
    ),
    m.Update(
        round=12,
        aborted=False,
        ranks=2,
        groups=["p", "b"],
        dtypes=["float32", "float32"],
        numels=[1000, 20],
        bucket=1,
        start=0,
        count=20,
        shm="/dev/shm/flodl-run-7-update",
        shm_offset=4096,
    ),
    m.WindowDone(
        rank=1,
        window=7,
        batches=3,
        consumed=96,
        loss_sum=1.5,
        compute_ms=30.0,
        data_ms=1.0,
        sync_ms=2.0,
        wall_ms=36.5,
        divergence=0.03125,
        pre_norm=12.0,
        post_norm=11.5,
        lr=0.01,
        epochs=[[2.0, 2.0, 64.0, 1.0, 20.0, 0.5], [3.0, 1.0, 32.0, 0.5, 10.0, 0.5]],
        scalars={},
        regrouped_at=-1,
        dropped=-1,
        res={"gpu_util": 87.5, "vram_alloc": 1 << 30, "cpu_util": 12.0},
        data={"ram_hits": 90, "source_fetches": 6, "ram_bytes": 1 << 20},
    ),
    m.Regroup(
        generation=2,
        members=[0, 2],
        store_prefix="golden-run/gen2",
        reason="rank 1 on host node-b (pid 4300) was killed by SIGKILL",
        sync_from=-1,
        first_round=-1,
    ),
    m.Regroup(
        generation=3, members=[0, 2, 3], store_prefix="golden-run/gen3", reason="rank 3 on host node-c joined", sync_from=0, first_round=-1
    ),
    m.Regroup(generation=4, members=[0, 2, 3, 4], store_prefix="", reason="rank 4 on host node-d joined", sync_from=0, first_round=17),
    m.StateSlice(rank=0, round=17, total=20_971_520, start=8_388_608, count=8_388_608, shm=""),
    m.StateSlice(rank=0, round=18, total=-1, start=0, count=0, shm=""),
    m.StateSlice(rank=0, round=19, total=20_971_520, start=0, count=20_971_520, shm="/dev/shm/flodl-0a1b2c3d-4242.3-state"),
    m.SaveCheckpoint(version=2, stem="/shared/run/ckpt", tag="0a1b2c3d4e5f", reason="checkpoint", epoch=4, call_fn=True),
    m.CheckpointDone(rank=0, version=2, model_sha256="ab" * 32, optim_sha256="cd" * 32, elapsed_ms=41.5, error=None),
    m.Fence(rank=3, reason="sent nothing for 10.2 s (heartbeat timeout 10 s)"),
]


def to_json(value):
    """Plain JSON form of a decoded field value (bytes as {"$bytes": hex})."""
    if isinstance(value, bytes):
        return {"$bytes": value.hex()}
    if isinstance(value, list):
        return [to_json(v) for v in value]
    if isinstance(value, dict):
        return {k: to_json(v) for k, v in value.items()}
    return value


def valid_vectors() -> list[dict]:
    out = []
    for seq, msg in enumerate(SAMPLES, start=1):
        kind, fields = message_fields(msg)
        frame = pack_frame(SECRET, msg, sender="rank0.4301", seq=seq, run_id=RUN_ID)
        names = [f.name for f in dataclasses.fields(msg)]
        out.append(
            {
                "message": type(msg).__name__,
                "frame_hex": frame.hex(),
                "decoded": {
                    "version": PROTOCOL_VERSION,
                    "kind": kind,
                    "sender": "rank0.4301",
                    "seq": seq,
                    "run_id": RUN_ID,
                    "fields": {name: to_json(v) for name, v in zip(names, fields, strict=False)},
                },
            }
        )
    return out


def _resign(unsigned: bytes) -> bytes:
    return unsigned + sign(SECRET, unsigned)


def invalid_vectors() -> list[dict]:
    good = pack_frame(
        SECRET, m.Heartbeat(step=1, sent_at=2.0, busy="", busy_s=0.0, step_ms=0.0, averaged=-1), sender="rank0.1", seq=1, run_id=RUN_ID
    )
    body = good[HEADER.size : -16]

    def frame(kind: int = 11, version: int = PROTOCOL_VERSION, payload: bytes = body, magic: bytes = MAGIC) -> bytes:
        return _resign(HEADER.pack(magic, version, kind, len(payload)) + payload)

    cases = [
        ("truncated", good[:20], "shorter than a header and tag"),
        ("truncated", good[:-3], "body length says more than arrived"),
        ("oversized", HEADER.pack(MAGIC, PROTOCOL_VERSION, 11, 1 << 21) + b"\0" * 16, "body length over the 1 MiB limit"),
        ("bad_magic", frame(magic=b"\xde\xad"), "wrong magic"),
        ("unknown_version", frame(version=PROTOCOL_VERSION + 1), f"version {PROTOCOL_VERSION + 1}"),
        ("bad_tag", good[:-1] + bytes([good[-1] ^ 1]), "one bit of the tag flipped"),
        ("bad_tag", good[:12] + bytes([good[12] ^ 1]) + good[13:], "one bit of the body flipped"),
        ("unknown_kind", frame(kind=999), "kind 999"),
        ("malformed", frame(payload=b"\xc1"), "0xc1 is never valid msgpack"),
        ("malformed", frame(payload=body + b"\x00"), "a second msgpack value after the body"),
        ("malformed", frame(payload=msgpack.packb(msgpack.ExtType(1, b"x"))), "ext types are refused"),
        ("schema", frame(payload=msgpack.packb(["rank0.1", 1, RUN_ID, 1])), "one field missing"),
        ("schema", frame(payload=msgpack.packb(["rank0.1", 1, RUN_ID, "1", 2.0])), "str where int is due"),
        ("schema", frame(payload=msgpack.packb(["rank0.1", 1, RUN_ID, True, 2.0])), "bool is not int"),
        ("schema", frame(payload=msgpack.packb(["rank0.1", 0, RUN_ID, 1, 2.0])), "seq must be >= 1"),
        ("wrong_run", frame(payload=msgpack.packb(["rank0.1", 1, "other-run", 1, 2.0, "", 0.0, 0.0, -1])), "another run's frame"),
    ]
    return [{"reason": r, "frame_hex": f.hex(), "note": note} for r, f, note in cases]


def main() -> None:
    GOLDEN.mkdir(parents=True, exist_ok=True)
    header = {"secret_hex": SECRET.hex(), "run_id": RUN_ID}
    (GOLDEN / "valid.json").write_text(json.dumps({**header, "vectors": valid_vectors()}, indent=1) + "\n")
    (GOLDEN / "invalid.json").write_text(json.dumps({**header, "vectors": invalid_vectors()}, indent=1) + "\n")
    print(f"wrote {GOLDEN}/valid.json and invalid.json")


if __name__ == "__main__":
    main()
