"""Structured JSON logs of the router, one object per line.

The format itself is ``replicas.logs`` (shared with the replica processes
the router starts). Records logged while a request is being handled carry
its ``request_id`` (the same id the response returns in ``x-request-id``)
through a context variable. Request summaries add tenant, endpoint, outcome,
tokens and durations. Prompts and completions are logged only for tenants
whose policy sets ``log_content``.
"""

from __future__ import annotations

import contextvars
import os

from replicas import logs as _logs

__all__ = ["setup_logging", "request_id_var", "JsonFormatter", "batch_lines"]

batch_lines = _logs.batch_lines

request_id_var: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="")


class JsonFormatter(_logs.JsonFormatter):
    def more(self, out: dict[str, object]) -> None:
        rid = request_id_var.get()
        if rid:
            out.setdefault("request_id", rid)


def setup_logging(level: str = "info", json: bool = True, worker: bool = False) -> None:
    """``worker``: a worker of ``serve --workers`` (its JSON lines carry its
    ``pid``: the workers log the same things, a reload each, say)."""
    _logs.setup_logging(level, json, JsonFormatter({"pid": os.getpid()} if worker else None))
