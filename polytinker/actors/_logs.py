"""Per-actor structured logs: one JSON object per line in ``<run_dir>/actors/<name>.log``.

Each line has ``time`` (ISO 8601, UTC), ``level``, ``actor``, ``pid``, ``message`` and ``extra``
(whatever was passed as ``extra=`` to the logging call, plus ``traceback`` for exceptions and
``stream`` for captured stdout/stderr). The child writes its own records; the parent writes the
child's stdout and stderr, line by line, so output survives a child killed with SIGKILL. Both
open the file with O_APPEND and write each line with one ``write``, so lines never interleave.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import traceback
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

# Attributes every LogRecord has; anything else on a record came from ``extra=`` and goes to "extra".
_RECORD_FIELDS = frozenset(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


def actors_dir(run_dir: str | os.PathLike[str]) -> Path:
    """The folder that holds every actor's log, traceback and mailbox socket files."""
    return Path(run_dir) / "actors"


def log_path(run_dir: str | os.PathLike[str], name: str) -> Path:
    """Where the actor called ``name`` writes its JSON-lines log."""
    return actors_dir(run_dir) / f"{name}.log"


def traceback_path(run_dir: str | os.PathLike[str], name: str, pid: int) -> Path:
    """Where the incarnation ``pid`` of actor ``name`` leaves its traceback when it dies of an exception."""
    return actors_dir(run_dir) / f"{name}.{pid}.traceback"


def _jsonable(value: Any) -> Any:
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return repr(value)


def make_line(actor: str, pid: int, level: str, message: str, extra: dict[str, Any] | None = None) -> str:
    """One log line, newline included."""
    record = {
        "time": datetime.now(UTC).isoformat(timespec="microseconds"),
        "level": level,
        "actor": actor,
        "pid": pid,
        "message": message,
        "extra": {k: _jsonable(v) for k, v in (extra or {}).items()},
    }
    return json.dumps(record, ensure_ascii=False) + "\n"


class LogFile:
    """An append-only file of JSON lines; safe to share between processes (one write per line)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def write_line(self, line: str) -> None:
        fd = self._fd
        if fd >= 0:
            # A line racing close() is lost rather than raised into a logging or pump thread.
            with contextlib.suppress(OSError):
                os.write(fd, line.encode("utf-8", errors="replace"))

    def close(self) -> None:
        fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


class JsonLinesHandler(logging.Handler):
    """A logging handler that writes records as JSON lines for one actor."""

    def __init__(self, log: LogFile, actor: str) -> None:
        super().__init__()
        self._log = log
        self._actor = actor

    def emit(self, record: logging.LogRecord) -> None:
        try:
            extra = {k: v for k, v in vars(record).items() if k not in _RECORD_FIELDS}
            if record.exc_info and record.exc_info[0] is not None:
                extra["traceback"] = "".join(traceback.format_exception(*record.exc_info))
            if record.name != "root":
                extra.setdefault("logger", record.name)
            self._log.write_line(
                make_line(self._actor, record.process or os.getpid(), record.levelname, record.getMessage(), extra)
            )
        except Exception:
            self.handleError(record)


def read_log(run_dir: str | os.PathLike[str], name: str) -> list[dict[str, Any]]:
    """Every record of the actor's log, oldest first (the lines of all its incarnations)."""
    return list(iter_log(log_path(run_dir, name)))


def iter_log(path: str | os.PathLike[str]) -> Iterator[dict[str, Any]]:
    """The records of one JSON-lines log file; a torn last line (a process killed mid-write) is skipped."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return
    for line in text.splitlines():
        if line.strip():
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                continue
