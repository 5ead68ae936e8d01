"""The resume writer while the state store is down (fail-closed: every append raises)."""

from __future__ import annotations

import logging

from router.resume import ResumeWriter
from router.state import StoreUnavailable


class DownStore:
    """A Redis store in a fail-closed outage: every buffer call raises."""

    async def stream_open(self, *a, **k):
        raise StoreUnavailable("state store redis is unavailable")

    async def stream_append(self, *a, **k):
        raise StoreUnavailable("state store redis is unavailable")

    async def stream_release(self, *a, **k):
        raise StoreUnavailable("state store redis is unavailable")


async def test_a_failed_append_is_logged_once_per_stream_not_once_per_event(caplog) -> None:
    # (a fail-closed router logged one warning per event of every running
    # stream while Redis was down: 1,052 lines in 4.5 s for 5 streams)
    w = ResumeWriter(DownStore(), 60.0)
    with caplog.at_level(logging.WARNING, logger="fairstream.resume"):
        for sid in ("s1", "s2"):
            w._written[sid] = 0
        for n in range(50):
            for sid in ("s1", "s2"):
                w.append(sid, b"data: %d" % n, [n], n)
            await w._flush()
    failed = [r for r in caplog.records if "append for" in r.getMessage()]
    assert len(failed) == 2, [r.getMessage() for r in failed]
