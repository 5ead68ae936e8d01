"""Structured JSON logs, one object per line.

Every record carries the time, level, logger and message; records logged
while a request is being handled carry its ``request_id`` (the same id the
response returns in ``x-request-id``) through a context variable. Request
summaries add tenant, endpoint, outcome, tokens and durations. Prompts and
completions are logged only for tenants whose policy sets ``log_content``.
"""

from __future__ import annotations

import contextvars
import logging
import sys
import time

import msgspec

__all__ = ["setup_logging", "request_id_var", "JsonFormatter"]

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")

_encode = msgspec.json.Encoder().encode
_RESERVED = set(vars(logging.makeLogRecord({}))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": round(record.created, 6),
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        rid = request_id_var.get()
        if rid:
            out["request_id"] = rid
        for key, value in record.__dict__.items():
            if key not in _RESERVED and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        try:
            return _encode(out).decode()
        except (TypeError, msgspec.EncodeError):
            return _encode({k: str(v) for k, v in out.items()}).decode()


def setup_logging(level: str = "info", json: bool = True) -> None:
    # No record needs its caller's file and line, thread or process (the
    # logging module's documented switches): without them a record costs
    # no stack walk and no process lookup (one per request line).
    logging._srcfile = None  # type: ignore[attr-defined]
    logging.logThreads = False
    logging.logProcesses = False
    logging.logMultiprocessing = False
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    if json:
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root.addHandler(handler)
    root.setLevel(level.upper())
