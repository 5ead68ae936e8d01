"""Request and lease ids: 96 random bits (24 hex characters) from the kernel.

Request ids are what a client names to resume its stream, and only the
tenant check stands behind them: another key of the same tenant that could
guess an id could read that stream. So ids are drawn whole from
``os.urandom``, not a counter behind a random prefix, whose neighbours a
client could count to from its own id. They are drawn 64 at a time (one
system call per 64 ids, not one per request; the bits are the same) and
handed out from a deque, whose ``popleft`` is atomic: two threads never get
the same id. A forked child drops what its parent had drawn. 96 random bits
also keep ids unique across router processes (and forked workers) without
coordination: the first collision is expected after ~2^48 ids.
"""

from __future__ import annotations

import os
from collections import deque

__all__ = ["new_id"]

_BATCH = 64
_ids: deque[str] = deque()
os.register_at_fork(after_in_child=_ids.clear)


def new_id() -> str:
    """A new, unguessable id: 24 hex characters."""
    try:
        return _ids.popleft()
    except IndexError:
        raw = os.urandom(12 * _BATCH).hex()
        _ids.extend([raw[i:i + 24] for i in range(24, len(raw), 24)])
        return raw[:24]
