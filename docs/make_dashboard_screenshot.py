"""Render docs/dashboard.png: the dashboard archive of a realistic synthetic run, in headless Chromium.

The run: 4 unlike GPUs, 10 epochs of 8 sub-epoch reports, cadence mode; the
slowest rank is lost in epoch 6 and the survivors take its share. Records
follow the monitor stream of the reference (section 12.1), published into a
`Feed` and archived with `write_archive`, exactly as the controller will.

    python docs/make_dashboard_screenshot.py                 # docs/dashboard.png
    python docs/make_dashboard_screenshot.py --theme dark --out /tmp/dark.png --keep-html /tmp/dash.html
"""

from __future__ import annotations

import argparse
import math
import random
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from flodl.monitor.archive import write_archive
from flodl.monitor.feed import Feed

HERE = Path(__file__).resolve().parent
GIB = 2**30
EPOCHS, REPORTS, DATASET, BATCH = 10, 8, 1_281_167, 256
LOST_RANK, LOST_EPOCH, LOST_TICK = 3, 6, 3
# (device, samples/s, VRAM total GiB): unlike GPUs on one host
GPUS = [(0, 2950.0, 80), (1, 2800.0, 80), (2, 1750.0, 40), (3, 1250.0, 24)]


class SyntheticRun:
    """Publishes the run into a feed, one sub-epoch window at a time."""

    def __init__(self, feed: Feed, seed: int = 7) -> None:
        self.feed, self.rng = feed, random.Random(seed)
        self.ts = 1_735_000_000_000
        self.anchor = 4
        self.alive = [True] * len(GPUS)

    def publish_all(self) -> None:
        self.feed.publish({"v": 1, "ts": self.ts, "kind": "meta", "reductions": {"anchor": "last", "lr": "last"},
                           "run": {"run_id": "resnet50-2024-12-24-a7f3", "mode": "cadence", "task": "train_resnet.py:task",
                                   "world_size": len(GPUS), "epochs": EPOCHS, "dataset_len": DATASET,
                                   "batch_size": BATCH, "eval_metric": "top1", "reports_per_epoch": REPORTS}})
        for epoch in range(EPOCHS):
            for tick in range(1, REPORTS + 1):
                self.window(epoch, tick)
            self.epoch_end(epoch)

    def noise(self, scale: float) -> float:
        return self.rng.gauss(0.0, scale)

    def loss_at(self, x: float) -> float:
        return 0.55 + 6.4 * math.exp(-0.42 * x) + abs(self.noise(0.04))

    def shares(self) -> list[float]:
        speed = [g[1] if up else 0.0 for g, up in zip(GPUS, self.alive)]
        return [s / sum(speed) for s in speed]

    def window(self, epoch: int, tick: int) -> None:
        if (epoch, tick) == (LOST_EPOCH, LOST_TICK):
            self.lose_rank()
        x = epoch + tick / REPORTS
        shares = self.shares()
        total = sum(g[1] for g, up in zip(GPUS, self.alive) if up)
        self.ts += int(DATASET / REPORTS / total * 1000)
        ranks = [self.rank_record(r, epoch, tick, x, shares[r]) for r in range(len(GPUS))]
        for rec in ranks:
            self.feed.publish(rec)
        live = [r for r in ranks if r["alive"]]
        self.maybe_grow_anchor(epoch, tick)
        self.node("root", epoch, tick, children=len(GPUS), metrics={
            "loss": sum(r["metrics"]["loss"] * r["metrics"]["batch_share"] for r in live) / sum(shares),
            "throughput": sum(r["metrics"]["throughput"] for r in live), "batch_share": 1.0,
            "data_starve": max(r["metrics"]["data_starve"] for r in live)})

    def rank_record(self, r: int, epoch: int, tick: int, x: float, share: float) -> dict:
        device, speed, vram = GPUS[r]
        path = f"root/rank{r}"
        if not self.alive[r]:  # dead ranks stay in the tree, alive:false, metrics absent
            return self.node(path, epoch, tick, device=device, alive=False, metrics={}, publish=False)
        starve = max(0.0, (0.07 if tick == 1 else 0.004) * (1 + r) + self.noise(0.003))
        metrics = {"loss": self.loss_at(x) + self.noise(0.03), "throughput": speed * (1 - starve) + self.noise(speed * 0.02),
                   "batch_share": share, "data_starve": starve, "compute_only_ms": BATCH / speed * 1000}
        res = {"gpu_util": min(99.0, 93 - 40 * starve + self.noise(2)), "gpu_util_max": 100.0,
               "vram_alloc": (0.55 * vram + 1.5 + self.noise(0.2)) * GIB, "vram_total": vram * GIB,
               "cpu_util": 28 + 6 * r + self.noise(2.5), "rss_bytes": (7.5 + 0.4 * r + 0.02 * x) * GIB}
        return self.node(path, epoch, tick, device=device, metrics=metrics, res=res, publish=False)

    def node(self, path: str, epoch: int, tick: int | None, *, metrics: dict, publish: bool = True, **extra) -> dict:
        rec = {"v": 1, "ts": self.ts, "sev": "info", "path": path, "kind": "node", "epoch": epoch,
               "metrics": metrics, "work": 1.0, "alive": True, **extra}
        if tick is not None:
            rec["tick"] = tick
        if publish:
            self.feed.publish(rec)
        return rec

    def event(self, cls: str, path: str, detail: str, sev: str = "info") -> None:
        self.feed.publish({"v": 1, "ts": self.ts, "sev": sev, "path": path, "kind": "event", "class": cls,
                           "detail": detail, "count": 1})

    def maybe_grow_anchor(self, epoch: int, tick: int) -> None:
        target = 8 if not self.alive[LOST_RANK] else min(32, 4 * 2 ** (epoch // 2))
        if target != self.anchor and tick == REPORTS // 2:
            self.event("anchor", "root", f"anchor {self.anchor} \u2192 {target} steps between syncs")
            self.anchor = target
        if (epoch, tick) == (3, 5):
            self.event("drift", "root", "guard corrected the anchor: rank2 drifted 18% past the cadence", "warn")

    def lose_rank(self) -> None:
        self.alive[LOST_RANK] = False
        path = f"root/rank{LOST_RANK}"
        self.event("rank_lost", path, "no heartbeat for 30 s; its samples go to the survivors", "critical")

    def epoch_end(self, epoch: int) -> None:
        self.ts += 2500  # eval pass
        live = [r for r in range(len(GPUS)) if self.alive[r]]
        steps = DATASET / BATCH / len(live)  # per rank; as the hub does, anchor and syncs ride on epoch rows
        self.node("root", epoch, None, children=len(GPUS), epoch_complete=True, metrics={
            "loss": self.loss_at(epoch + 0.5), "eval": 0.93 - 0.55 * math.exp(-0.38 * (epoch + 1)) + self.noise(0.004),
            "throughput": sum(GPUS[r][1] for r in live) * 0.97, "anchor": float(self.anchor),
            "syncs": round(steps / self.anchor)})
        if epoch % 2 == 1:
            self.event("checkpoint", "root", f"saved checkpoints/epoch{epoch + 1}.fdl (97.8 MiB)")


def screenshot(html: Path, png: Path, width: int, height: int) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("chromium not found: apt-get install chromium")
    with tempfile.TemporaryDirectory() as profile:
        subprocess.run([chromium, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                        f"--user-data-dir={profile}", f"--screenshot={png}", f"--window-size={width},{height}",
                        html.as_uri()], check=True, timeout=60, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=HERE / "dashboard.png", help="PNG to write")
    ap.add_argument("--theme", choices=["light", "dark", "auto"], default="light", help="pinned archive theme")
    ap.add_argument("--size", default="1400,1000", help="window size WIDTH,HEIGHT in CSS pixels")
    ap.add_argument("--keep-html", type=Path, default=None, help="also keep the archive HTML here")
    args = ap.parse_args()
    feed = Feed()
    SyntheticRun(feed).publish_all()
    width, height = (int(v) for v in args.size.split(","))
    with tempfile.TemporaryDirectory() as tmp:
        html = write_archive(args.keep_html or Path(tmp) / "dashboard.html", feed, theme=args.theme)
        screenshot(html, args.out.resolve(), width, height)
    print(f"wrote {args.out} ({len(feed.snapshot())} records)")


if __name__ == "__main__":
    main()
