"""Request and lease ids, unique across router processes, without a syscall each.

An id is a random per-process prefix (48 bits from ``secrets``, drawn again
in a forked child) and a counter: 24 hex characters, like the uuid4-based
ids they replace (``uuid4`` reads ``os.urandom`` for every id, which showed
in the per-request profile). Ids key shared state (resume buffers, leases
in Redis), so two processes must never share a prefix.
"""

from __future__ import annotations

import itertools
import os
import secrets

__all__ = ["new_id"]

_prefix = ""
_counter = itertools.count(1)


def _reseed() -> None:
    global _prefix, _counter
    _prefix = secrets.token_hex(6)
    _counter = itertools.count(1)


_reseed()
os.register_at_fork(after_in_child=_reseed)


def new_id() -> str:
    """A new id: 12 hex characters of prefix, 12 of counter."""
    return f"{_prefix}{next(_counter):012x}"
