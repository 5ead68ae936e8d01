"""Redis state store (redis.asyncio): every operation is one Lua script.

Scripts live beside this module (``lua/*.lua``) and run atomically on the
Redis server with the server's clock, so limits stay exact across any number
of router processes. Keys use a ``{tenant}`` hash tag so one tenant's keys
share a Redis Cluster slot.
"""

from __future__ import annotations

import array
import asyncio
import logging
import secrets
import sys
from collections.abc import Callable
from pathlib import Path

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import AuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, RedisError, ResponseError

from policies.ratelimit import QUEUED_RETRY, Decision
from router.background import LOG_EVERY, KeepGoing, spawn
from router.state.base import (CLAIM_TTL, LINE_SLACK, SETTLED_TTL, AdmitRequest, StateStore, StoreUnavailable,
                               StreamSnapshot, TenantUsage)
from router.stopping import stop

__all__ = ["RedisStore"]

log = logging.getLogger("fairstream.state")

CLAIMS_PER_TRIP = 500  # streams whose claims one pipeline renews (stream_renew)
TURNS_WARN_AFTER = 30.0  # seconds the turns subscription fails in a row before that is a warning


def _script(name: str) -> str:
    return (Path(__file__).parent / "lua" / name).read_text("utf-8")


_MAX_EVENT = 1 << 52  # past any buffer's event count, exact as a double



def _unavailable(e: Exception) -> BaseException:
    """``StoreUnavailable`` for a Redis error; but a ``CancelledError`` when
    the task is being cancelled: redis-py's own timeout (``asyncio.timeout``
    on 3.11) can turn a cancel that arrives as it expires into a timeout,
    and a loop that outlives store outages (the lease keeper) then swallowed
    its own cancel and ran on, holding the router's shutdown for good."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        return asyncio.CancelledError()
    if isinstance(e, AuthenticationError):  # (Redis answers, but not to this router: a config error)
        return StoreUnavailable(f"redis refused the router's credentials (the password or user in state.url is "
                                f"missing or wrong): {e}")
    return StoreUnavailable(f"redis: {e}")

class RedisStore(StateStore):
    name = "redis"
    shared = True

    def __init__(self, url: str, prefix: str = "fs", timeout: float = 1.0, max_connections: int = 128) -> None:
        # (a capped pool: redis-py's default one grows to the most calls ever
        # in flight at once and keeps every connection for good; a burst of
        # 150 requests left a router with 100 connections to Redis)
        pool = aioredis.BlockingConnectionPool.from_url(
            url,
            max_connections=max_connections,
            timeout=timeout,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            health_check_interval=0,
            retry_on_timeout=False,
            # A pooled connection that a restarted Redis closed fails once, when
            # it is next used: one retry on a new connection, at once, so that
            # each idle connection left from before a restart does not count
            # as an outage of its own (seconds of them, each one a 503 in
            # fail-closed mode). A timeout is not retried: a hung Redis is an
            # outage after ``timeout``, not after twice that. (A reply lost after
            # the command ran runs it twice: an admission counted twice, an
            # append that then marks its resume buffer broken. Rare, and on
            # the safe side: a limit reached early, a resume refused. A
            # settlement counts once all the same: ``SETTLED_TTL``.)
            retry=Retry(NoBackoff(), 1, supported_errors=(RedisConnectionError,)),
            retry_on_error=[RedisConnectionError],  # (redis-py 5 retries only what this lists)
        )
        self._redis = aioredis.Redis.from_pool(pool)  # (closes the pool with the client)
        self._prefix = prefix
        r = self._redis
        self._admit = r.register_script(_script("admit.lua"))
        self._settle = r.register_script(_script("settle.lua"))
        self._undo = r.register_script(_script("undo.lua"))
        self._renew = r.register_script(_script("renew.lua"))
        self._usage = r.register_script(_script("usage.lua"))
        self._s_open = r.register_script(_script("stream_open.lua"))
        self._s_append = r.register_script(_script("stream_append.lua"))
        self._s_read = r.register_script(_script("stream_read.lua"))
        self._s_claim = r.register_script(_script("stream_claim.lua"))
        self._s_renew = r.register_script(_script("stream_renew.lua"))
        self._peers = r.register_script(_script("peers.lua"))
        self._turn = r.register_script(_script("turn.lua"))
        self._generation = r.register_script(_script("generation.lua"))
        # where the scripts say a tenant's waiting requests should ask again
        self._channel = f"{prefix}:turns"
        self._watcher: asyncio.Task[None] | None = None
        self._s_release = r.register_script(_script("stream_release.lua"))
        # every script, for ``prepare`` (one added above is in it without a second mention)
        self._scripts = [v for v in vars(self).values() if isinstance(v, AsyncScript)]

    def _keys(self, tenant: str) -> list[str]:
        base = f"{self._prefix}:{{{tenant}}}"
        return [f"{base}:rq", f"{base}:tk", f"{base}:leases", f"{base}:line", f"{base}:line-until", f"{base}:held",
                f"{base}:held-until", f"{base}:settled"]

    async def admit(self, tenant: str, req: AdmitRequest) -> Decision:
        try:
            res = await self._admit(
                keys=self._keys(tenant)[:7],
                args=[req.rpm, req.tpm, req.max_concurrent, req.cost_tokens, req.lease_id, req.lease_ttl,
                      int(req.line), QUEUED_RETRY, LINE_SLACK, self._channel, tenant, req.hold, req.base,
                      *req.replaces],
            )
        except RedisError as e:
            raise _unavailable(e) from e
        ok, reason, wait, rem_req, rem_tok, rst_req, rst_tok = res[:7]
        taken, base = (int(res[7]), int(res[8])) if len(res) > 7 else (0, 0)
        retry = float(wait)
        return Decision(
            bool(int(ok)),
            reason.decode() if isinstance(reason, bytes) else str(reason),
            float("inf") if retry >= 1e299 else retry,
            float(rem_req),
            float(rem_tok),
            float(rst_req),
            float(rst_tok),
            taken,
            base,
        )

    async def undo_admit(self, tenant: str, req: AdmitRequest, *, keep_lease: bool = False) -> None:
        if not req.lease_id:
            return  # (nothing says whether it ran)
        k = self._keys(tenant)
        try:
            await self._undo(keys=[k[0], k[1], k[2], k[5], k[6], k[7], k[3]],
                             args=[req.rpm, req.tpm, req.cost_tokens, req.lease_id, int(keep_lease), SETTLED_TTL,
                                   self._channel, tenant, *req.replaces])
        except RedisError as e:
            raise _unavailable(e) from e

    async def leave(self, tenant: str, lease_id: str) -> None:
        await self._turn_op("leave", tenant, lease_id)

    async def _turn_op(self, op: str, tenant: str, lease_id: str) -> None:
        keys = self._keys(tenant)
        try:
            await self._turn(keys=keys[2:5], args=[op, lease_id, self._channel, tenant])
        except RedisError as e:
            raise _unavailable(e) from e

    async def settle(self, tenant: str, *, tpm: int, reserved: int, used: int, lease_id: str = "",
                     held: bool = False) -> None:
        if not tpm:
            return
        try:
            keys = self._keys(tenant)
            await self._settle(keys=[keys[1], keys[3], keys[5], keys[6], keys[7]],
                               args=[tpm, reserved, used, self._channel, tenant, lease_id, int(held), SETTLED_TTL])
        except RedisError as e:
            raise _unavailable(e) from e

    async def renew(self, tenant: str, lease_ids: list[str], ttl: float) -> None:
        if not lease_ids:
            return
        try:
            k = self._keys(tenant)
            await self._renew(keys=[k[2], k[5], k[6]], args=[ttl, *lease_ids])
        except RedisError as e:
            raise _unavailable(e) from e

    async def release(self, tenant: str, lease_id: str) -> None:
        await self._turn_op("release", tenant, lease_id)

    async def usage(self, tenant: str, *, rpm: int, tpm: int) -> TenantUsage:
        try:
            req, tok, leases = await self._usage(keys=self._keys(tenant)[:3], args=[rpm, tpm])
        except RedisError as e:
            raise _unavailable(e) from e
        return TenantUsage(float(req), float(tok), int(leases))

    # -- stream resume buffers ----------------------------------------------

    def _skeys(self, sid: str) -> list[str]:
        base = f"{self._prefix}:stream:{{{sid}}}"
        return [f"{base}:h", f"{base}:ev", f"{base}:tok"]

    async def stream_open(self, sid: str, meta: bytes, owner: str, ttl: float, *, lease: str = "",
                          lost: bool = False, charged: int = 0) -> None:
        try:
            await self._s_open(keys=self._skeys(sid), args=[meta, owner, ttl, CLAIM_TTL, lease, int(lost), charged])
        except RedisError as e:
            raise _unavailable(e) from e

    async def stream_append(self, sid, events, token_ids, text_len, finished, owner, ttl, first=-1) -> bool:
        try:
            done = await self._s_append(
                keys=self._skeys(sid),
                # (text_len -1: unchanged)
                args=[owner, ttl, CLAIM_TTL, -1 if text_len is None else text_len, 1 if finished else 0,
                      _pack(token_ids), first, *events],
            )
        except RedisError as e:
            raise _unavailable(e) from e
        return done == 1  # (0: no such buffer, 2 broken, 3 not this router's)

    async def stream_read(self, sid: str, after: int, tokens: bool = True) -> StreamSnapshot | None:
        try:
            # (clamped: the script counts in doubles, and past 2**53 LRANGE
            # refused the number, which read as the store being down)
            res = await self._s_read(keys=self._skeys(sid), args=[min(max(0, after), _MAX_EVENT), int(tokens)])
        except RedisError as e:
            raise _unavailable(e) from e
        if not res:
            return None
        meta, toks, text_len, events, total, finished, owner, broken, lease, lost, charged = res
        return StreamSnapshot(
            bytes(meta), _unpack(toks or b""), int(text_len), [bytes(e) for e in events], int(total),
            finished in (b"1", "1", 1), _text(owner), broken in (b"1", "1", 1), _text(lease),
            lost in (b"1", "1", 1), int(charged),
        )

    async def stream_claim(self, sid: str, owner: str, claim_ttl: float, lease: str = "") -> bool:
        try:
            return bool(await self._s_claim(keys=self._skeys(sid)[:1], args=[owner, claim_ttl, lease]))
        except RedisError as e:
            raise _unavailable(e) from e

    async def stream_renew(self, sids: list[str], owner: str, claim_ttl: float) -> list[bool]:
        """The renewal script once per stream, ``CLAIMS_PER_TRIP`` streams to
        a pipeline (one round trip each): a router with thousands of streams
        renews them all every few seconds, and one round trip per stream
        (~0.1 ms on loopback, more across hosts) added up to more than the
        renewal interval (3.3 s) at ~3,300 streams across a 1 ms link. The
        script goes by its hash; a server that does not know it (restarted,
        flushed) gets it loaded and the batch again (a renewal is idempotent)."""
        out: list[bool] = []
        try:
            for at in range(0, len(sids), CLAIMS_PER_TRIP):
                batch = sids[at:at + CLAIMS_PER_TRIP]
                try:
                    out += await self._renew_trip(batch, owner, claim_ttl)
                except NoScriptError:
                    await self._redis.script_load(self._s_renew.script)
                    out += await self._renew_trip(batch, owner, claim_ttl)
        except RedisError as e:
            raise _unavailable(e) from e
        return out

    async def _renew_trip(self, sids: list[str], owner: str, claim_ttl: float) -> list[bool]:
        async with self._redis.pipeline(transaction=False) as pipe:
            sha = self._s_renew.sha
            for sid in sids:
                pipe.evalsha(sha, 1, self._skeys(sid)[0], owner, claim_ttl)
            return [bool(r) for r in await pipe.execute()]

    async def stream_release(self, sid: str, owner: str, charged: int = 0) -> None:
        try:
            await self._s_release(keys=self._skeys(sid)[:1], args=[owner, charged])
        except RedisError as e:
            raise _unavailable(e) from e

    async def peers(self, router: str, digest: str, ttl: float) -> dict[str, str]:
        try:
            flat = await self._peers(keys=[f"{self._prefix}:policy-peers"], args=[router, digest, ttl])
        except RedisError as e:
            raise _unavailable(e) from e
        out = [v.decode() if isinstance(v, bytes) else str(v) for v in flat]
        return dict(zip(out[::2], out[1::2]))

    async def ping(self) -> None:
        """A write, not a PING: a Redis that answers but refuses writes (at
        ``maxmemory`` with ``noeviction``: OOM; a replica after a failover:
        READONLY; a full disk with ``stop-writes-on-bgsave-error``: MISCONF)
        fails every script, and a PING that passes made the probe call it back
        after 0.1 s, so the router went down and up with every request."""
        try:
            await self._redis.set(f"{self._prefix}:probe", b"1", px=10_000)
        except RedisError as e:
            raise _unavailable(e) from e

    async def prepare(self) -> None:
        """Load every script in one round trip (a restarted Redis has none;
        until then each one's first use costs EVALSHA, NOSCRIPT, SCRIPT LOAD
        and EVALSHA: seconds of a burst's first requests on a busy box)."""
        try:
            async with self._redis.pipeline(transaction=False) as pipe:
                for script in self._scripts:
                    pipe.script_load(script.script)
                await pipe.execute()
        except RedisError as e:
            raise _unavailable(e) from e

    async def generation(self) -> str:
        try:
            gen = await self._generation(keys=[f"{self._prefix}:generation"], args=[secrets.token_hex(8)])
        except RedisError as e:
            raise _unavailable(e) from e
        return gen.decode() if isinstance(gen, bytes) else str(gen)

    def watch(self, on_turn: Callable[[str], None]) -> None:
        if self._watcher is None:
            self._watcher = spawn(self._watch(on_turn), "state-turns")

    async def _watch(self, on_turn: Callable[[str], None]) -> None:
        """Subscribed to the channel the scripts publish turns on, for
        good: a lost connection is made again (a turn missed meanwhile is
        found by the heads' polls). A subscription that fails for
        ``TURNS_WARN_AFTER`` seconds in a row, or that Redis refuses (an
        ACL without SUBSCRIBE: it will not pass by itself), is a warning
        every ``LOG_EVERY`` seconds; a moment's loss only a debug line. Any
        other failure (``on_turn``'s) is logged and subscribed again."""
        loop = asyncio.get_running_loop()
        guard = KeepGoing("turns subscription", log)
        failing: float | None = None  # since when it fails
        warned = -LOG_EVERY
        while True:
            async with guard:
                try:
                    async with self._redis.pubsub(ignore_subscribe_messages=True) as ps:
                        await ps.subscribe(self._channel)
                        failing = None
                        async for msg in ps.listen():
                            if msg["type"] == "message":
                                on_turn(msg["data"].decode())
                except (RedisError, OSError) as e:
                    now = loop.time()
                    failing = now if failing is None else failing
                    if (isinstance(e, ResponseError) or now - failing >= TURNS_WARN_AFTER) and \
                            now - warned >= LOG_EVERY:
                        warned = now
                        log.warning("turns subscription failing for %.0f s (%s): this router hears the turns of "
                                    "other routers' tenants only by its waiting requests' polls, later; trying again "
                                    "every 1 s", now - failing, e)
                    else:
                        log.debug("turns subscription lost (%s); again in 1 s", e)
                # (after a listen() that ended cleanly too: subscribing again at once could spin)
                await asyncio.sleep(1.0)

    async def close(self) -> None:
        await stop(self._watcher)
        await self._redis.aclose()


def _pack(ids: list[int]) -> bytes:
    a = array.array("I", ids)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tobytes()


def _text(value) -> str:
    """A script's string reply as text ('' for none)."""
    return value.decode() if isinstance(value, bytes) else str(value or "")


def _unpack(data: bytes) -> list[int]:
    a = array.array("I")
    a.frombytes(data)
    if sys.byteorder != "little":
        a.byteswap()
    return a.tolist()
