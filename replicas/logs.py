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

import logging
import os
import sys
import time

import msgspec

__all__ = ["JsonFormatter", "TextFormatter", "setup_logging", "LOG_FORMAT_ENV", "LOG_LEVEL_ENV", "REPLICA_NAME_ENV"]

LOG_FORMAT_ENV = "FAIRSTREAM_LOG_FORMAT"
LOG_LEVEL_ENV = "FAIRSTREAM_LOG_LEVEL"
REPLICA_NAME_ENV = "FAIRSTREAM_REPLICA_NAME"

_encode = msgspec.json.Encoder().encode
_RESERVED = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per record; ``static`` fields go on every line."""

    def __init__(self, static: dict[str, object] | None = None) -> None:
        super().__init__()
        self.static = static or {}
        self._date: tuple[int, str] = (-1, "")  # (whole second, its formatted date)

    def fields(self, record: logging.LogRecord) -> dict[str, object]:
        created = record.created
        second = int(created)
        cached, date = self._date  # one tuple: a record formatted on another thread cannot mix them
        if second != cached:  # strftime once a second, not once a line
            date = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
            self._date = (second, date)
        out: dict[str, object] = {
            "ts": round(created, 6),
            "time": f"{date}.{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **self.static,
        }
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return out

    def format(self, record: logging.LogRecord) -> str:
        out = self.fields(record)
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
    s = v if isinstance(v, str) else str(v)
    if s and not any(c in s for c in ' "=\n'):
        return s
    try:
        return _encode(v if isinstance(v, str) else s).decode()
    except (TypeError, msgspec.EncodeError):
        return repr(s)


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
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter((formatter or JsonFormatter()) if json else TextFormatter(text_format))
    root.addHandler(handler)
    root.setLevel(level.upper())
    os.environ[LOG_FORMAT_ENV] = "json" if json else "text"
    os.environ[LOG_LEVEL_ENV] = level.lower()
