"""The resume buffers a fail-open outage left in the local fallback, moved to
Redis as it returns: ``StreamMove``.

During an outage the streams that begin keep their buffers in the fallback
(``MemoryStore``); once Redis is back, resumes read Redis only. Dropped, a
stream begun in a moment's outage could not be resumed on any router, its
own included, for the rest of its life, and its resume was a 404 naming
causes that were not its own. So ``ResilientStore``'s probe runs ``move``
before Redis counts as back, and meanwhile asks ``where`` each stream op
goes.
"""

from __future__ import annotations

from router.state.base import StateStore
from router.state.memory import MemoryStore

__all__ = ["StreamMove", "MOVE_TRIES"]

# looks at one fallback buffer while it moves to Redis: what its writer adds
# meanwhile goes after it, until a look finds nothing new (past this, its
# next write finds Redis short of events and marks the buffer broken)
MOVE_TRIES = 8


class StreamMove:
    """One store's move of its fallback's buffers to its primary (Redis)."""

    __slots__ = ("primary", "fallback", "_moving")

    def __init__(self, primary: StateStore, fallback: MemoryStore) -> None:
        self.primary = primary
        self.fallback = fallback
        # from the start of a move until Redis counts as back: the buffers
        # not moved yet (empty once all moved, while the releases owed
        # meanwhile are made); None: no move under way
        self._moving: set[str] | None = None

    @property
    def under_way(self) -> bool:
        return self._moving is not None

    def where(self, sid: str) -> StateStore | None:
        """Redis, while a move runs, for stream ``sid`` unless it is one the
        fallback holds that has not moved yet (a stream opened meanwhile is
        opened there, not missed); None: where the outage mode says."""
        moving = self._moving
        if moving is not None and sid not in moving:
            return self.primary
        return None

    async def move(self) -> None:
        """Copy the buffers the fallback took during the outage (the streams
        that began then) to Redis. One buffer at a time: what its writer
        adds to the fallback while it is copied goes after it (Redis checks
        the count of events, ``first``), until a look finds nothing new;
        from that look on (no await between), its reads and writes go to
        Redis (``where``). A buffer keeps its last claim's leases, whether a
        router that held it died (``lost``: a client may have events it
        lacks) and the tokens charged for it (``charged``); a claim that ran
        out moves as none, as a read shows it. The move stays under way
        until ``done``, whether it ends or fails."""
        self._moving = set(self.fallback.held_streams())
        for sid in list(self._moving):
            at = None  # (events, tokens, finished) in Redis
            for _ in range(MOVE_TRIES):
                held = self.fallback.held_stream(sid)
                if held is None:
                    break
                st, ttl = held
                has = (st.total_events, len(st.token_ids), st.finished)
                if has == at:
                    break  # (all of it in Redis: its next writes go there, with no await since this look)
                if at is None:
                    await self.primary.stream_open(sid, st.meta, st.owner, ttl, lease=st.lease, lost=st.lost,
                                                   charged=st.charged)
                    at = (0, 0, False)
                if has != at:
                    await self.primary.stream_append(sid, st.events[at[0]:], st.token_ids[at[1]:], st.text_len,
                                                     st.finished, st.owner, ttl, at[0])
                at = has
            self._moving.discard(sid)

    def done(self) -> None:
        """Redis counts as back, or the try failed: ops go where the store's
        state says (the caller makes no await between this and that)."""
        self._moving = None
