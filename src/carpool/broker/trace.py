"""trace.py: TraceWriter — the JSON-lines trace of admitted arrivals (``carpool record``).

The core appends one tuple per admitted request to ``BrokerCore.recording``; the server
hands that list to :meth:`TraceWriter.write` once a loop turn, which writes a line per
record and flushes. Opening a trace locks a regular file for this broker and repairs a
last line that a cut recording left half written (:func:`open_trace`). The models its
last lines name are the ones a restarted broker expects back (:func:`recorded_models`).
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import stat
from collections.abc import Sequence
from typing import TextIO

from carpool.broker.intake import Arrival
from carpool.common.clock import Clock, MonotonicClock, wall_offset_s
from carpool.common.errors import ConfigError
from carpool.common.jsonlines import parses

logger = logging.getLogger(__name__)

#: How far back from its end a trace is searched for its last whole line.
TAIL_BYTES = 64 * 1024
#: How far back from its end a trace is read for the models it names, and how many
#: names are kept (the newest).
MODELS_TAIL_BYTES = 1 << 20
MAX_RECORDED_MODELS = 256
#: The longest model name (protocol §14).
_MAX_NAME = 256


def recorded_models(path: str) -> list[str]:
    """The models named in the last lines of the trace at ``path``, newest first: those
    the broker that recorded it served last, expected back after a restart. Bounded:
    only its last :data:`MODELS_TAIL_BYTES` are read, and at most
    :data:`MAX_RECORDED_MODELS` names kept. A missing, unreadable or non-regular file (a
    pipe) names none."""
    try:
        if not stat.S_ISREG(os.stat(path).st_mode):  # (opening a pipe to read would block)
            return []
        with open(path, "rb") as f:
            size = f.seek(0, os.SEEK_END)
            start = max(0, size - MODELS_TAIL_BYTES)
            f.seek(start)
            lines = f.read().split(b"\n")
    except OSError:
        return []
    if start:
        lines = lines[1:]  # (read from the middle of a line)
    names: dict[str, None] = {}
    for line in reversed(lines):
        try:
            record = json.loads(line)
        except ValueError:
            continue
        model = record.get("model") if isinstance(record, dict) else None
        if isinstance(model, str) and 0 < len(model) <= _MAX_NAME:
            names[model] = None
            if len(names) >= MAX_RECORDED_MODELS:
                break
    return list(names)


def open_trace(path: str) -> TextIO:
    """The trace to append to.

    A regular file is locked for this broker (``flock``): two brokers appending to one
    trace at once would interleave parts of their lines. A recording that was cut (a
    kill, a full disk) can end in part of a line: that part is dropped, so the next
    run's lines are not glued to it and the file stays readable (only the cut line is
    lost); a last line that is whole but lacks its newline gets one. A pipe or
    ``/dev/stdout`` is appended to as it is.

    Raises:
        ConfigError: another process is recording to the same file.
    """
    trace = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by its owner)
    try:
        if stat.S_ISREG(os.fstat(trace.fileno()).st_mode):
            try:
                fcntl.flock(trace.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                raise ConfigError(f"trace {path}: another broker is recording to it") from None
            except OSError as exc:  # (a file system without locks: NFS without lockd)
                logger.warning("trace %s: not locked: %s", path, exc)
            try:
                end_on_a_whole_line(path)
            except OSError as exc:  # (a file this broker may write but not read)
                logger.warning("trace %s: its last line was not checked: %s", path, exc)
    except BaseException:
        trace.close()
        raise
    return trace


def end_on_a_whole_line(path: str) -> None:
    """Make the file at ``path`` end on a whole line: a cut last line is dropped, a whole
    one without its newline gets one (a line longer than :data:`TAIL_BYTES` is left)."""
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return
        f.seek(max(0, size - TAIL_BYTES))
        tail = f.read()
        if tail.endswith(b"\n"):
            return
        cut = tail.rfind(b"\n") + 1
        if (cut == 0 and size > TAIL_BYTES) or parses(tail[cut:]):
            f.write(b"\n")  # a whole line (or one longer than any record: not ours to cut)
            return
        logger.warning(
            "trace %s ended in a line cut short (%d bytes): dropped", path, len(tail) - cut
        )
        f.truncate(size - len(tail) + cut)


class TraceWriter:
    """Appends records to an open trace.

    Args:
        path: the trace's file (opened and checked by :func:`open_trace`).
        offset_s: added to each record's time: the clock's offset to Unix time, so that
            a file several runs append to stays in order with the real gaps between them.
    """

    @classmethod
    def for_clock(cls, path: str, clock: Clock) -> TraceWriter:
        """A writer for a broker on ``clock``: trace times are Unix seconds (steady within
        a run) under the monotonic clock, so a file that several runs append to stays in
        order with the real gaps between them, reboots included; a test's clock as is."""
        return cls(path, wall_offset_s() if isinstance(clock, MonotonicClock) else 0.0)

    def __init__(self, path: str, offset_s: float = 0.0) -> None:
        self._file = open_trace(path)
        self.offset_s = offset_s

    def write(self, records: Sequence[Arrival]) -> None:
        """Write one line per record and flush."""
        offset_s = self.offset_s
        trace = self._file
        for t, model, shape, timeout_ms, priority, max_batch in records:
            line = {
                "t_s": round(t + offset_s, 6),
                "model": model,
                "shape": list(shape),
                "timeout_ms": timeout_ms,
                "priority": priority,
                "max_batch": max_batch,
            }
            trace.write(json.dumps(line) + "\n")
        trace.flush()

    def close(self) -> None:
        """Close the file (and give up its lock)."""
        self._file.close()
