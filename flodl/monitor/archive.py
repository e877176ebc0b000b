"""The dashboard archive: the live page frozen into one self-contained HTML file.

`archive.py` writes the same page the live server serves, with the feed's
snapshot embedded as JSON, so it opens offline with no server (reference
12.8). It is written at teardown, after the stream drained; the write is
atomic (temporary file + ``os.replace``) so a reader never sees half a page,
and its size is bounded: the feed's records thinned to ``ARCHIVE_PER_PATH`` per
node path (``Feed.archive_lines``: both ends whole, evenly spaced between), the
full series being in the record stream.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .feed import Feed, encode_record
from .page import check_theme, render_page


def archive_html(feed_or_snapshot: Feed | Iterable[dict[str, Any]], *, theme: str | None = None) -> str:
    """The archive document for a feed, or for a snapshot (meta first, then records).

    Raises:
        ValueError: ``theme`` is not a valid ``dashboard_theme``.
    """
    check_theme(theme)
    lines = feed_or_snapshot.archive_lines() if isinstance(feed_or_snapshot, Feed) else [encode_record(r) for r in feed_or_snapshot]
    data = '{"v":1,"saved_ts":%d,"records":[%s]}' % (time.time() * 1000, ",".join(lines))  # noqa: UP031 - a JSON template: braces stay readable
    return render_page(theme=theme, data_json=data)


def write_archive(path: str | os.PathLike[str], feed_or_snapshot: Feed | Iterable[dict[str, Any]], *, theme: str | None = None) -> Path:
    """Write the archive to ``path`` atomically; returns the path written.

    Raises:
        ValueError: ``theme`` is not None, "light", "dark" or "auto".
        OSError: the directory cannot be created or written.
    """
    html = archive_html(feed_or_snapshot, theme=theme)  # validate before touching the disk
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(html)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)  # only still there when the write failed
    return target
