"""Debian's chromium, headless, for the dashboard tests; and the console errors a page logged."""

from __future__ import annotations

import asyncio
import re
import shutil

import pytest

CHROMIUM = shutil.which("chromium")


needs_chromium = pytest.mark.skipif(
    CHROMIUM is None, reason="Debian's `chromium` is not installed (apt-get install chromium; .ci/run installs it)"
)


CONSOLE_ERROR = re.compile(r"CONSOLE.*(Uncaught|flodl dashboard:)")


def console_errors(stderr: str) -> list[str]:
    """Real JS console errors from chromium's log (not its dbus/GPU chatter)."""
    return [line for line in stderr.splitlines() if CONSOLE_ERROR.search(line)]


async def chromium(*args: str, timeout_s: float = 40.0) -> tuple[str, str]:
    """Run chromium off the event loop (the server shares it); (stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        CHROMIUM,
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        *args,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        async with asyncio.timeout(timeout_s):
            out, err = await proc.communicate()
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
    return out.decode(errors="replace"), err.decode(errors="replace")
