"""The token lane: a streamed generation's steady state, one call per read.

Once a streamed request's first tokens are out and its client takes
writes, every plain piece of its output (token ids and their text, no
finish) needs the same things. Those are: the generation's counters, the
replica's in-flight load, the watchdog's last-token time, the tenant's
fair-share charge, the inter-token sample, the event's encoding, its copy
in the resume buffer, and one write. The layered path does them across
``Collector.put`` → ``Generation._delta`` → ``PushRelay.piece`` →
``EventStream.event`` → ``TransportWire.write``: about 25 Python frames per
token (docs/perf.md, "The Python floor"). ``Lane.tokens`` does them in one
call, on the same objects, so either path can take the next piece.

A lane belongs to one run of a generation on one replica: the replica
readers (``replicas.client``, ``replicas.upstream_sse``) find it on the run's
``Collector`` (``col.lane``). ``Generation`` attaches it after a plain
piece (not the first token's) went the layered way and the sink offers one
(``PushRelay.lane``), and drops it when the run ends (finish, failover,
abort). Whatever the lane does not do, it declines (``tokens`` returns
False) and the caller takes the layered path: a finish, an error, output
without token ids or without text (no event: its ids go with the next
one), a client whose transport is paused or gone, pieces waiting behind
one, a resume still skipping text. Continuous usage and logged content
never get a lane.
"""

from __future__ import annotations

import asyncio
import time

from router.metrics import HistogramBatch

__all__ = ["Lane"]


class Lane:
    """The plain pieces of one streamed run, from the replica reader to the
    client's transport."""

    __slots__ = ("gen", "relay", "es", "enc", "cycle", "flow", "write", "handle", "dog", "charge", "observe",
                 "policy", "itl", "append")

    def __init__(self, gen, relay, es, wire, handle, dog, charge, observe, policy) -> None:
        self.gen = gen
        self.relay = relay  # its pieces waiting (a paused client) go first
        self.es = es
        self.enc = es.enc
        self.cycle = wire.cycle
        self.flow = wire.flow
        self.write = wire.write  # the chunked frame to the client's transport
        self.handle = handle
        self.dog = dog
        self.charge = charge  # the scheduler's VirtualCounters.charge
        self.observe = observe  # Scheduler.observe where the replica's in-flight cap adapts, else None
        self.policy = policy
        self.itl = HistogramBatch(es.itl, loop=asyncio.get_running_loop())  # inter-token samples, in bulk
        self.append = es.writer.appender(es.sid)  # None: not resumable

    def close(self) -> None:
        """The run ended: its samples go to the histogram."""
        self.itl.flush()

    def tokens(self, ids: list[int], text: str) -> bool:
        """Relay one plain piece (``ids`` not empty); False: not done, the
        caller takes the layered path."""
        gen = self.gen
        es = self.es
        if (not text or self.relay._pending or self.flow.write_paused or self.cycle.disconnected or gen.ended
                or gen.uncounted or es.skip_chars or es.sent_ids != es.tokens):
            return False
        try:
            n = len(ids)
            now = time.monotonic()
            gen.completion_ids += ids
            gen.text_len += len(text)
            dog = self.dog
            if self.observe is not None:
                self.observe(self.handle.slot, itl=(now - dog.last_token) / n)
            dog.token(now)
            self.handle.produced(n)
            policy = self.policy
            self.charge(policy.name, 0, n, policy.weight)
            self.itl.add((now - es.last) / n)
            es.last = now
            es.tokens += n
            es.chars += len(text)
            event = self.enc.plain(text, b"-%d-%d" % (es.tokens, es.chars) if es.sid is not None else b"")
            if self.append is not None:
                self.append(event, ids, es.chars)
            es.sent_ids = es.tokens
            self.write(event)
        except Exception as e:  # noqa: BLE001 - a bug here ends this stream only, not the replica connection
            gen.lane_failed(e)
        return True
