"""The router's file descriptors: the open-file limit, raised at start to
its hard limit (``open_file_limit``), the default ``max_connections`` it
allows (``default_max_connections``), and what is kept out of it for
everything but client connections (``FILE_RESERVE``, of which connections
past the cap may hold ``OVER_CAP_HELD``: router.connection)."""

from __future__ import annotations

import logging
from typing import Any

__all__ = ["FILE_RESERVE", "OVER_CAP_HELD", "default_max_connections", "open_file_limit"]

log = logging.getLogger("fairstream.router")

# descriptors kept out of the default cap: listeners, replica and Redis
# connections, health checks, log files
FILE_RESERVE = 256
# connections past max_connections read (OVER_CAP_READ) or lingering (LINGER)
# at once, at most: a quarter of the reserve. One more is answered as it
# connects, without reading its request, and closed at once. Unbounded, a
# client that connected again at each close held ~4 descriptors per
# connection a second out of the reserve, until replicas could not restart.
OVER_CAP_HELD = FILE_RESERVE // 4


def default_max_connections(files: int) -> int:
    """The cap from the open-file limit (0: none): half of what the reserve
    leaves, since a stream through a ``url:`` upstream holds two."""
    return max(64, (files - FILE_RESERVE) // 2) if files else 0


# what to raise the open-file limit to when its hard limit is unlimited (macOS
# by default): Linux's default ceiling (fs.nr_open), else macOS's OPEN_MAX
_UNLIMITED_TARGETS = (1 << 20, 10240)


def open_file_limit(res: Any = None) -> int:
    """Raise the process's open-file limit to its hard limit (as Go's
    runtime does; an unlimited hard limit, macOS's default, to the most of
    ``_UNLIMITED_TARGETS`` the system takes), and return it (0: unlimited,
    or no such limit here). ``res``: the ``resource`` module (tests)."""
    if res is None:
        try:
            import resource as res
        except ImportError:  # pragma: no cover - Windows: no rlimits
            return 0
    soft, hard = res.getrlimit(res.RLIMIT_NOFILE)
    if soft != hard and soft != res.RLIM_INFINITY:
        targets = (hard,) if hard != res.RLIM_INFINITY else _UNLIMITED_TARGETS
        error: Exception | None = None
        for target in (t for t in targets if t > soft):
            try:
                res.setrlimit(res.RLIMIT_NOFILE, (target, hard))
            except (ValueError, OSError) as e:  # (a sandbox that forbids it, or past the system's ceiling)
                error = e
                continue
            soft = target
            break
        else:
            if error is not None:
                log.warning("could not raise the open-file limit from %d: %s", soft, error)
    return 0 if soft == res.RLIM_INFINITY else soft
