"""Render docs/dashboard.png: the dashboard archive of a real run, in headless Chromium.

The run: digits on 3 CPU ranks for 10 epochs, 5 sub-epoch reports per epoch;
rank 2 kills itself as it enters epoch 6 (fault injection) and the survivors
finish without it. Its archive (``--dashboard-html``) is opened offline in
Debian's ``chromium`` and screenshotted.

    python docs/make_dashboard_screenshot.py                     # docs/dashboard.png
    python docs/make_dashboard_screenshot.py --theme dark --out /tmp/dark.png
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def run_archive(html: Path, theme: str | None) -> None:
    cmd = [
        sys.executable,
        "-m",
        "flodl.controller",
        "--task",
        "examples/digits.py:task",
        "--nproc-per-node",
        "3",
        "--epochs",
        "10",
        "--reports-per-epoch",
        "5",
        "--heartbeat-timeout-secs",
        "5",
        "--dashboard-port",
        "-1",
        "--dashboard-html",
        str(html),
    ]
    if theme:
        cmd += ["--dashboard-theme", theme]
    env = dict(os.environ, FLODL_INJECT_FAULT="2:epoch:5", FLODL_TEST_STEP_SLEEP="0.002")
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, timeout=300)


def screenshot(html: Path, out: Path, size: str) -> None:
    chromium = shutil.which("chromium")
    if chromium is None:
        sys.exit("needs Debian's chromium (apt-get install chromium)")
    subprocess.run(
        [
            chromium,
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--hide-scrollbars",
            f"--window-size={size}",
            "--virtual-time-budget=5000",
            f"--screenshot={out}",
            html.as_uri(),
        ],
        check=True,
        timeout=120,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=HERE / "dashboard.png", help="PNG to write")
    parser.add_argument("--theme", choices=["light", "dark"], default="light", help="theme to pin")
    parser.add_argument("--size", default="1400,1500", help="browser window W,H")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        html = Path(tmp) / "dash.html"
        run_archive(html, args.theme)
        screenshot(html, args.out.resolve(), args.size)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
