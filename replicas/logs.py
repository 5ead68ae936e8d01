"""Log lines of the router and of its replica processes: one JSON object per
line (or plain text), on stderr.

Every JSON record carries the time, level, logger and message, plus the
record's extra fields. A replica process adds ``replica`` (its name, from
``FAIRSTREAM_REPLICA_NAME``, which the supervisor sets), so the lines of
every process of a router can be told apart in one stream. The format a
router was started with is passed to the processes it starts through
``FAIRSTREAM_LOG_FORMAT`` (and its level through ``FAIRSTREAM_LOG_LEVEL``),
so its stderr is all JSON or all text (vLLM's own lines excepted: vLLM
formats them itself).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import sys
import threading
import time

import msgspec

__all__ = ["JsonFormatter", "TextFormatter", "TurnHandler", "SummaryLog", "setup_logging", "batch_lines",
           "LOG_FORMAT_ENV", "LOG_LEVEL_ENV", "REPLICA_NAME_ENV", "REPLICA_ERROR_FILE_ENV", "write_error_file"]

LOG_FORMAT_ENV = "FAIRSTREAM_LOG_FORMAT"
LOG_LEVEL_ENV = "FAIRSTREAM_LOG_LEVEL"
REPLICA_NAME_ENV = "FAIRSTREAM_REPLICA_NAME"
# where a replica the supervisor started writes why it failed (its exit status says nothing more)
REPLICA_ERROR_FILE_ENV = "FAIRSTREAM_REPLICA_ERROR_FILE"

_encode = msgspec.json.Encoder().encode
_RESERVED = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}
_PIPE_BUF = 4096  # bytes a pipe takes in one write, whole, from any number of writers (POSIX: at least 512; Linux 4096)


class JsonFormatter(logging.Formatter):
    """One JSON object per record; ``static`` fields go on every line."""

    def __init__(self, static: dict[str, object] | None = None) -> None:
        super().__init__()
        self.static = static or {}
        self._date: tuple[int, str] = (-1, "")  # (whole second, its formatted date)

    def head(self, created: float, level: str, name: str, msg: str) -> dict[str, object]:
        """A line's fields before its record's own: time, level, logger,
        message, then ``static``."""
        second = int(created)
        cached, date = self._date  # one tuple: a record formatted on another thread cannot mix them
        if second != cached:  # strftime once a second, not once a line
            date = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._date = (second, date)
        return {
            "ts": round(created, 6),
            "time": f"{date}.{int((created - second) * 1000):03d}Z",  # (LogRecord.msecs)
            "level": level,
            "logger": name,
            "msg": msg,
            **self.static,
        }

    def more(self, out: dict[str, object]) -> None:
        """Fields a subclass adds last (router.logs: the request's id)."""

    def fields(self, record: logging.LogRecord) -> dict[str, object]:
        out = self.head(record.created, record.levelname.lower(), record.name, record.getMessage())
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        self.more(out)
        return out

    def format(self, record: logging.LogRecord) -> str:
        return _encoded(self.fields(record))

    def line(self, name: str, msg: str, fields: dict[str, object]) -> str:
        """The line ``logging.getLogger(name).info(msg, extra=fields)`` would
        make, with no record (``SummaryLog``)."""
        out = self.head(time.time(), "info", name, msg)
        out.update(fields)
        self.more(out)
        return _encoded(out)


def _encoded(out: dict[str, object]) -> str:
    try:
        return _encode(out).decode()
    except (TypeError, msgspec.EncodeError):
        return _encode({k: str(v) for k, v in out.items()}).decode()


class TextFormatter(logging.Formatter):
    """``text_format``, then the record's extra fields as ``key=value`` (a
    value with spaces or quotes JSON-quoted), so a text line carries what a
    JSON line does."""

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = [f"{k}={_text_value(v)}" for k, v in record.__dict__.items()
                 if k not in _RESERVED and not k.startswith("_")]
        if not extra:
            return line
        first, nl, rest = line.partition("\n")  # (a traceback follows on the next lines)
        return f"{first} {' '.join(extra)}{nl}{rest}"


def _text_value(v: object) -> str:
    """``v`` bare, or JSON-quoted when it has a space, a quote, an ``=`` or
    anything unprintable: a client's ``\r`` or other control character
    (a path, a model name) could otherwise rewrite what a terminal or a log
    viewer shows of the line."""
    s = v if isinstance(v, str) else str(v)
    if s and s.isprintable() and not any(c in s for c in ' "='):
        return s
    try:
        out = _encode(s).decode()
    except (TypeError, UnicodeEncodeError, msgspec.EncodeError):  # (a lone surrogate)
        return json.dumps(s)
    # (JSON lets C1 controls and U+2028 through as they are: those go \u-escaped)
    return out if out.isprintable() else json.dumps(s)


class TurnHandler(logging.StreamHandler):
    """A ``StreamHandler`` that, while it is bound to an event loop (``bind``),
    writes the lines that loop's thread logs during one turn of the loop
    together, at the start of the next turn, instead of one write and flush
    per line.

    The router logs one summary line per request; when a burst of requests
    ends in the same turn, their lines cost one system call per
    ``PIPE_BUF`` bytes (4 KiB: a pipe shared with other processes, the
    workers' and replicas', takes a write that size whole, so lines never
    interleave). A line is late by at most one turn of the loop. Lines from
    other threads, and every line while no loop is bound (or once it is
    closed), are written at once, after the lines waiting for the turn to
    end (so the order is kept). ``flush`` (``logging.shutdown`` at exit calls
    it) and ``unbind`` write what waits. A process that dies without
    running its exit handlers (SIGKILL, a crash) loses the lines of its last
    turn. A failed write is reported once per batch (``handleError``), as
    ``StreamHandler`` reports each failed line."""

    def __init__(self, stream=None) -> None:
        super().__init__(stream)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: int | None = None
        self._lines: list[str] = []
        self._last: logging.LogRecord | None = None  # (for handleError on a failed write)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Batch the lines logged on ``loop``'s thread (call from that thread)."""
        with self.lock:  # type: ignore[union-attr]
            self._loop, self._thread = loop, threading.get_ident()

    def unbind(self) -> None:
        """Write what waits; from now on every line is written at once."""
        with self.lock:  # type: ignore[union-attr]
            self._loop = self._thread = None
            self._write_waiting()

    def emit(self, record: logging.LogRecord) -> None:  # (called with the handler's lock held)
        if not self._batching():
            super().emit(record)
            return
        try:
            line = self.format(record)
        except RecursionError:
            raise
        except Exception:  # noqa: BLE001 - logging's own contract: report, do not raise
            self.handleError(record)
            return
        self._add(line)
        self._last = record

    def emit_line(self, line: str) -> None:
        """Write a line formatted already (``SummaryLog``), as ``emit``
        writes a record's."""
        with self.lock:  # type: ignore[union-attr]
            if self._batching():
                self._add(line)
                self._last = None
            else:  # (written at once, as a batch of one: _write_waiting reports a failed write)
                self._lines.append(line)
                self._write_waiting()

    def _batching(self) -> bool:
        """Whether a line logged now waits for the turn's end (else: written
        at once, after the lines that wait). With the lock held."""
        loop = self._loop
        if loop is not None and loop.is_closed():  # closed without unbind (a start that failed, a forced exit)
            self._loop = self._thread = loop = None
        if loop is None or threading.get_ident() != self._thread:
            if self._lines:
                self._write_waiting()
            return False
        return True

    def _add(self, line: str) -> None:
        if not self._lines:
            self._loop.call_soon(self._turn_end)  # type: ignore[union-attr]
        self._lines.append(line)

    def _turn_end(self) -> None:
        with self.lock:  # type: ignore[union-attr]
            self._write_waiting()

    def flush(self) -> None:
        with self.lock:  # type: ignore[union-attr]
            self._write_waiting()
            super().flush()

    def _write_waiting(self) -> None:
        if not self._lines:
            return
        lines, self._lines = self._lines, []
        last, self._last = self._last, None
        stream, end = self.stream, self.terminator
        try:
            batch: list[str] = []
            size = 0
            for line in lines:
                n = (len(line) if line.isascii() else len(line.encode())) + 1
                if batch and size + n > _PIPE_BUF:
                    stream.write(end.join(batch) + end)
                    stream.flush()
                    batch, size = [], 0
                batch.append(line)
                size += n
            stream.write(end.join(batch) + end)
            stream.flush()
        except RecursionError:
            raise
        except Exception:  # noqa: BLE001 - as StreamHandler.emit: report, do not raise
            self.handleError(last if last is not None else logging.makeLogRecord({"msg": lines[-1]}))


class SummaryLog:
    """The INFO lines of one logger whose fields are all given (the router's
    line per request): written straight to ``setup_logging``'s JSON handler
    while it is the only thing that would see them. A ``LogRecord`` and the
    logging module's dispatch cost three quarters of such a line (~28 of
    ~37 us; docs/perf.md, "Session 28"). Whenever anything else listens (a
    filter, another handler such as pytest's ``caplog``, a logger that does
    not propagate) or the format is text, the line goes through ``logging``,
    so it reaches whatever a record would."""

    __slots__ = ("logger",)

    def __init__(self, name: str) -> None:
        self.logger = logging.getLogger(name)

    def info(self, msg: str, fields: dict[str, object]) -> None:
        """``logger.info(msg, extra=fields)``; ``msg`` is not %-formatted."""
        logger = self.logger
        if not logger.isEnabledFor(logging.INFO):
            return
        handler = _sole_handler(logger)
        if handler is None:
            logger.info(msg, extra=fields)
        else:
            try:
                line = handler.formatter.line(logger.name, msg, fields)  # type: ignore[union-attr]
            except RecursionError:
                raise
            except Exception:  # noqa: BLE001 - as emit: a line that cannot be formatted is reported, not raised
                handler.handleError(logging.makeLogRecord({"name": logger.name, "msg": msg}))
                return
            handler.emit_line(line)


def _sole_handler(logger: logging.Logger) -> TurnHandler | None:
    """The one handler an INFO record of ``logger`` would reach, if it is a
    ``TurnHandler`` writing JSON and no filter is on the way; else None."""
    while logger.parent is not None:
        if logger.filters or logger.handlers or not logger.propagate:
            return None
        logger = logger.parent
    if logger.filters or len(logger.handlers) != 1:
        return None
    handler = logger.handlers[0]
    if (type(handler) is not TurnHandler or handler.filters or handler.level > logging.INFO
            or not isinstance(handler.formatter, JsonFormatter)):
        return None
    return handler


def batch_lines(loop: asyncio.AbstractEventLoop | None) -> None:
    """Bind the root logger's ``TurnHandler`` (``setup_logging``'s) to ``loop``
    (lines batched per turn), or unbind it with ``None``. No-op when logging
    was set up otherwise."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler, TurnHandler):
            if loop is None:
                handler.unbind()
            else:
                handler.bind(loop)


def setup_logging(level: str = "info", json: bool = True, formatter: logging.Formatter | None = None,
                  text_format: str = "%(asctime)s %(name)s %(levelname)s %(message)s",
                  lean: bool = True) -> None:
    """Log ``level`` and up to stderr, as JSON (``formatter`` or a plain
    ``JsonFormatter``) or as text; processes started from here afterwards
    log in the same format and level.

    ``lean``: records carry no caller file and line, thread or process (the
    logging module's documented switches): without them a record costs no
    stack walk and no process lookup (one per request line in the router).
    A replica process keeps them: vLLM's own formats use ``%(process)d``,
    and every one of its lines failed to format without it."""
    if lean:
        logging._srcfile = None  # type: ignore[attr-defined]
        logging.logThreads = False
        logging.logProcesses = False
        logging.logMultiprocessing = False
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = TurnHandler(sys.stderr)
    handler.setFormatter((formatter or JsonFormatter()) if json else TextFormatter(text_format))
    root.addHandler(handler)
    root.setLevel(level.upper())
    os.environ[LOG_FORMAT_ENV] = "json" if json else "text"
    os.environ[LOG_LEVEL_ENV] = level.lower()


def write_error_file(reason: str) -> None:
    """Tell the supervisor that started this replica why it fails (its
    /admin/replicas ``last_error``); nothing when no supervisor asked."""
    path = os.environ.get(REPLICA_ERROR_FILE_ENV)
    if path:
        try:
            with open(path, "w", encoding="utf-8") as f:
                f.write(reason[:2000])
        except OSError:
            pass
