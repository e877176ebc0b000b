"""timeline.py: a high-frequency event timeline, written as a Chrome trace.

The controller records what happened when (sync rounds, windows, evals,
checkpoints, data waits, epoch edges, anchor changes, throttles, ranks lost
or joined) and, at teardown, writes one JSON file that ``chrome://tracing``
and https://ui.perfetto.dev open. Recording is a lock and an append into a
bounded ring, so it is cheap enough for the training path; all formatting
happens once, in ``to_chrome_trace()``. ``validate_chrome_trace()`` checks a
trace against the format's rules and is what tests assert with.

Times are seconds on the timeline's clock (``time.monotonic`` by default).
Ranks stamp events with their own clock; ``ClockAlign`` estimates the
offset, and every recording call takes ``offset_s`` to apply it.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeGuard

Track = tuple[str, str]
"""A display row: (process name, thread name), e.g. ("controller", "cadence")."""

INSTANT_SCOPES = frozenset({"g", "p", "t"})
PHASES = frozenset(["B", "E", "X", "i", "I", "C", "M", "b", "e", "n", "s", "t", "f", "P", "O", "N", "D"])
METADATA_NAMES = frozenset({"process_name", "thread_name", "process_sort_index", "thread_sort_index", "process_labels"})
DEFAULT_CAT = "flodl"
_US_PER_S = 1_000_000.0


@dataclass(frozen=True, slots=True)
class _Event:
    """One recorded event, kept raw so recording stays cheap."""

    ph: str
    name: str
    pid: int
    tid: int
    t_s: float
    dur_s: float = 0.0
    args: Mapping[str, Any] | None = None
    cat: str = DEFAULT_CAT
    scope: str = "t"


class Timeline:
    """Thread-safe, bounded recorder of complete, instant and counter events.

    Beyond ``max_events`` the oldest events are dropped and counted in
    ``dropped``, so a long run keeps its most recent history in bounded
    memory. Events with a non-finite time are skipped and counted in
    ``invalid`` rather than raised: a timeline must never fail training.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic, max_events: int = 1_000_000) -> None:
        if max_events < 1:
            raise ValueError("max_events must be at least 1")
        self.clock = clock
        self.start_s = clock()
        self.max_events = max_events
        self.dropped = 0
        self.invalid = 0
        self._lock = threading.Lock()
        self._events: deque[_Event] = deque(maxlen=max_events)
        self._pids: dict[str, int] = {}
        self._tids: dict[Track, int] = {}
        self._sort: dict[str, int] = {}

    # ---- recording -------------------------------------------------------

    def span(
        self,
        name: str,
        *,
        track: Track,
        start_s: float,
        end_s: float,
        args: Mapping[str, Any] | None = None,
        cat: str = DEFAULT_CAT,
        offset_s: float = 0.0,
    ) -> None:
        """A complete event (``ph: X``) from ``start_s`` to ``end_s``.

        A span that ends before it starts (clock jitter across an offset
        estimate) is kept with zero duration rather than lost.
        """
        start, end = start_s + offset_s, end_s + offset_s
        self._push("X", name, track, start, max(0.0, end - start), args, cat, "t")

    def instant(
        self,
        name: str,
        *,
        track: Track,
        at_s: float | None = None,
        args: Mapping[str, Any] | None = None,
        scope: str = "t",
        cat: str = DEFAULT_CAT,
        offset_s: float = 0.0,
    ) -> None:
        """A point event (``ph: i``); ``at_s`` defaults to now.

        ``scope`` draws it across the thread ("t"), process ("p") or the
        whole trace ("g", e.g. an epoch edge).

        Raises:
            ValueError: ``scope`` is not one of "t", "p", "g" (a caller bug).
        """
        if scope not in INSTANT_SCOPES:
            raise ValueError(f"instant scope must be one of t, p, g; got {scope!r}")
        at = self.clock() if at_s is None else at_s + offset_s
        self._push("i", name, track, at, 0.0, args, cat, scope)

    def counter(
        self, name: str, *, track: Track, at_s: float, values: Mapping[str, float], cat: str = DEFAULT_CAT, offset_s: float = 0.0
    ) -> None:
        """A counter sample (``ph: C``): one series per key of ``values``."""
        self._push("C", name, track, at_s + offset_s, 0.0, dict(values), cat, "t")

    @contextlib.contextmanager
    def measure(self, name: str, *, track: Track, args: Mapping[str, Any] | None = None, cat: str = DEFAULT_CAT) -> Iterator[None]:
        """Record the body as a span; an exception is noted in its args and re-raised."""
        start = self.clock()
        extra: dict[str, Any] = dict(args or {})
        try:
            yield
        except BaseException as exc:
            extra["error"] = type(exc).__name__
            raise
        finally:
            self.span(name, track=track, start_s=start, end_s=self.clock(), args=extra or None, cat=cat)

    def sort_process(self, process: str, index: int) -> None:
        """Order a process row (lower first); unsorted rows follow first-seen order."""
        with self._lock:
            self._pid(process)
            self._sort[process] = index

    def _push(
        self, ph: str, name: str, track: Track, t_s: float, dur_s: float, args: Mapping[str, Any] | None, cat: str, scope: str
    ) -> None:
        if not (math.isfinite(t_s) and math.isfinite(dur_s)):
            with self._lock:
                self.invalid += 1
            return
        with self._lock:
            pid, tid = self._pid(track[0]), self._tid(track)
            # deque(maxlen) evicts the oldest itself; count it before it goes.
            if len(self._events) == self.max_events:
                self.dropped += 1
            self._events.append(_Event(ph, name, pid, tid, t_s, dur_s, args, cat, scope))

    def _pid(self, process: str) -> int:
        # Caller holds the lock. Ids start at 1 and never change for a name.
        return self._pids.setdefault(process, len(self._pids) + 1)

    def _tid(self, track: Track) -> int:
        if track not in self._tids:
            same_process = sum(1 for p, _ in self._tids if p == track[0])
            self._tids[track] = same_process + 1
        return self._tids[track]

    def __len__(self) -> int:
        with self._lock:
            return len(self._events)

    # ---- export ----------------------------------------------------------

    def to_chrome_trace(self) -> dict[str, Any]:
        """The trace in the Chrome Trace Event Format's JSON Object form.

        ``ts`` is microseconds since the timeline's start; if a remote
        event (after offset) precedes the start, the origin moves back to it
        so no ``ts`` is negative. Metadata comes first, then events by time
        (ties: longer spans first, so parents precede children).
        """
        with self._lock:
            events = list(self._events)
            pids, tids, sort = dict(self._pids), dict(self._tids), dict(self._sort)
            dropped, invalid = self.dropped, self.invalid
        origin = min([self.start_s, *(e.t_s for e in events)])
        body = sorted((_format(e, origin) for e in events), key=lambda ev: (ev["ts"], -ev.get("dur", 0)))
        return {
            "traceEvents": _metadata(pids, tids, sort) + body,
            "displayTimeUnit": "ms",
            "otherData": {
                "producer": "flodl",
                "clock": "monotonic seconds; ts = microseconds since origin",
                "origin_s": origin,
                "max_events": self.max_events,
                "dropped_events": dropped,
                "invalid_events": invalid,
            },
        }

    def write(self, path: str | os.PathLike[str]) -> Path:
        """Write the trace atomically (temp file + rename), creating parents.

        Raises:
            OSError: the directory cannot be created or written.
        """
        target = Path(path)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                # allow_nan=False: a NaN that slipped past sanitizing fails here, not in the viewer.
                json.dump(self.to_chrome_trace(), f, allow_nan=False, separators=(",", ":"))
            os.replace(tmp, target)
        finally:
            tmp.unlink(missing_ok=True)
        return target


class NullTimeline(Timeline):
    """A timeline that records nothing, for runs without ``timeline``.

    Lets call sites record unconditionally instead of testing for None.
    """

    def _push(self, *args: Any) -> None:
        return None


def _metadata(pids: dict[str, int], tids: dict[Track, int], sort: dict[str, int]) -> list[dict[str, Any]]:
    """``M`` events naming and ordering every process and thread row."""
    out: list[dict[str, Any]] = []
    for process, pid in pids.items():
        out.append(_meta("process_name", pid, 0, {"name": process}))
        out.append(_meta("process_sort_index", pid, 0, {"sort_index": sort.get(process, pid)}))
    for (process, thread), tid in tids.items():
        out.append(_meta("thread_name", pids[process], tid, {"name": thread}))
        out.append(_meta("thread_sort_index", pids[process], tid, {"sort_index": tid}))
    return out


def _meta(name: str, pid: int, tid: int, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "ts": 0, "args": args}


def _format(e: _Event, origin: float) -> dict[str, Any]:
    """One raw event as a trace dict (times in µs, args sanitized)."""
    ev: dict[str, Any] = {"name": e.name, "cat": e.cat, "ph": e.ph, "pid": e.pid, "tid": e.tid, "ts": _us(e.t_s - origin)}
    if e.ph == "X":
        ev["dur"] = _us(e.dur_s)
    elif e.ph == "i":
        ev["s"] = e.scope
    if e.ph == "C":
        ev["args"] = _numbers(e.args or {})
    elif e.args:
        ev["args"] = _json_safe(e.args)
    return ev


def _us(seconds: float) -> float:
    # Nanosecond resolution is plenty and keeps the file small.
    return round(max(0.0, seconds) * _US_PER_S, 3)


def _numbers(values: Mapping[str, Any]) -> dict[str, float]:
    """Counter args: finite numbers only; anything else is dropped (null is not a number)."""
    return {str(k): v for k, v in values.items() if _is_number(v)}


def _is_number(v: Any) -> TypeGuard[float]:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _json_safe(value: Any) -> Any:
    """Args made JSON-safe: NaN/Infinity → None, containers recursed, the rest str()."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return str(value)


# ---- clock alignment -----------------------------------------------------


class ClockAlign:
    """Estimates a remote clock's offset from one-way message stamps.

    Each message carries ``sent_at_remote`` (the sender's clock) and is
    stamped ``received_at_local`` on arrival. Then
    ``received - sent = offset + delay`` with ``delay >= 0``, so the smallest
    difference seen is the best (least-delayed) estimate of ``offset``; it
    overshoots by the minimum one-way latency (microseconds on a LAN). The
    minimum is taken over the last ``window`` pairs so slow clock drift is
    followed. ``local = remote + offset_s``.
    """

    def __init__(self, window: int = 256) -> None:
        if window < 1:
            raise ValueError("window must be at least 1")
        self._diffs: deque[float] = deque(maxlen=window)
        self._lock = threading.Lock()

    def observe(self, sent_at_remote: float, received_at_local: float) -> None:
        """Add one (sent, received) pair; non-finite stamps are ignored."""
        diff = received_at_local - sent_at_remote
        if math.isfinite(diff):
            with self._lock:
                self._diffs.append(diff)

    @property
    def offset_s(self) -> float | None:
        """Seconds to add to a remote time to get local time; None before any pair."""
        with self._lock:
            return min(self._diffs) if self._diffs else None

    def to_local(self, remote_s: float) -> float:
        """A remote timestamp on the local clock.

        Raises:
            LookupError: no pair observed yet (the caller should observe the
                carrying message's stamps first).
        """
        offset = self.offset_s
        if offset is None:
            raise LookupError("no clock pairs observed yet")
        return remote_s + offset


# ---- validation ----------------------------------------------------------


def validate_chrome_trace(obj: Any) -> list[str]:
    """Problems with ``obj`` as a JSON-Object-form Chrome trace; [] if none.

    Checks the rules the viewers rely on: a ``traceEvents`` list; per event
    a known ``ph``, a str ``name`` (optional on ``E``), int ``pid``/``tid``,
    a finite ``ts >= 0`` (not required on ``M``); ``X`` has ``dur >= 0``;
    ``i`` scope in g/p/t; ``C`` args are numbers; ``M`` uses a known name
    with ``args``; ``B``/``E`` balance per (pid, tid) in file order.
    """
    if not isinstance(obj, dict):
        return [f"top level must be an object, got {type(obj).__name__}"]
    events = obj.get("traceEvents")
    if not isinstance(events, list):
        return ["'traceEvents' missing or not a list"]
    problems: list[str] = []
    open_b: dict[tuple[Any, Any], list[str]] = {}
    for i, ev in enumerate(events):
        problems += [f"event {i}: {p}" for p in _event_problems(ev, open_b)]
    for (pid, tid), stack in open_b.items():
        for name in stack:
            problems.append(f"unbalanced B/E: 'B' {name!r} on pid={pid} tid={tid} never ended")
    return problems


def _event_problems(ev: Any, open_b: dict[tuple[Any, Any], list[str]]) -> list[str]:
    if not isinstance(ev, dict):
        return [f"not an object ({type(ev).__name__})"]
    ph = ev.get("ph")
    if ph is None:
        return ["missing 'ph'"]
    if ph not in PHASES:
        return [f"unknown ph {ph!r}"]
    problems = _common_problems(ev, ph)
    check = _PHASE_CHECKS.get(ph)
    if check is not None:
        problems += check(ev)
    if ph in ("B", "E"):
        problems += _balance(ev, ph, open_b)
    return problems


def _common_problems(ev: dict[str, Any], ph: str) -> list[str]:
    problems = []
    name = ev.get("name")
    if not isinstance(name, str) and not (ph == "E" and name is None):
        problems.append(f"ph {ph!r}: 'name' missing or not a string")
    for key in ("pid", "tid"):
        if not isinstance(ev.get(key), int) or isinstance(ev.get(key), bool):
            problems.append(f"ph {ph!r} {name!r}: {key!r} missing or not an int")
    ts = ev.get("ts")
    if (ph != "M" or ts is not None) and (not _is_number(ts) or ts < 0):
        problems.append(f"ph {ph!r} {name!r}: 'ts' must be a non-negative number, got {ts!r}")
    return problems


def _check_x(ev: dict[str, Any]) -> list[str]:
    dur = ev.get("dur")
    if not _is_number(dur) or dur < 0:
        return [f"X {ev.get('name')!r}: 'dur' must be a non-negative number, got {dur!r}"]
    return []


def _check_instant(ev: dict[str, Any]) -> list[str]:
    if "s" in ev and ev["s"] not in INSTANT_SCOPES:
        return [f"instant {ev.get('name')!r}: scope 's' must be g, p or t, got {ev['s']!r}"]
    return []


def _check_counter(ev: dict[str, Any]) -> list[str]:
    args = ev.get("args")
    if not isinstance(args, dict):
        return [f"C {ev.get('name')!r}: 'args' must be an object of numbers"]
    bad = [k for k, v in args.items() if not _is_number(v)]
    return [f"C {ev.get('name')!r}: counter arg {k!r} is not a number ({args[k]!r})" for k in bad]


def _check_metadata(ev: dict[str, Any]) -> list[str]:
    name = ev.get("name")
    if name not in METADATA_NAMES:
        return [f"M: unknown metadata name {name!r}"]
    if not isinstance(ev.get("args"), dict):
        return [f"M {name!r}: 'args' missing or not an object"]
    return []


_PHASE_CHECKS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "X": _check_x,
    "i": _check_instant,
    "I": _check_instant,
    "C": _check_counter,
    "M": _check_metadata,
}


def _balance(ev: dict[str, Any], ph: str, open_b: dict[tuple[Any, Any], list[str]]) -> list[str]:
    """Push a B, pop an E; an E with nothing open is a problem."""
    key = (ev.get("pid"), ev.get("tid"))
    stack = open_b.setdefault(key, [])
    if ph == "B":
        stack.append(str(ev.get("name")))
        return []
    if not stack:
        return [f"unbalanced B/E: 'E' {ev.get('name')!r} on pid={key[0]} tid={key[1]} has no open 'B'"]
    stack.pop()
    return []
