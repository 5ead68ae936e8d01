"""Request and lease ids: 96 random bits (24 hex characters) from the kernel.

Request ids are what a client names to resume its stream, and only the
tenant check stands behind them: another key of the same tenant that could
guess an id could read that stream. So ids are drawn whole from
``os.urandom`` (about 0.5 us here), not a counter behind a random prefix,
whose neighbours a client could count to from its own id. 96 random bits
also keep ids unique across router processes (and forked workers) without
coordination: the first collision is expected after ~2^48 ids.
"""

from __future__ import annotations

import os

__all__ = ["new_id"]


def new_id() -> str:
    """A new, unguessable id: 24 hex characters."""
    return os.urandom(12).hex()
