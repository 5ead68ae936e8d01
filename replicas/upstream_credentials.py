"""Whether an OpenAI-compatible upstream takes the router's credentials.

An upstream whose ``/models`` needs no key (many do not) passes its health
check with a wrong one, and then answers every generation request 401 or
403. That is the operator's configuration, not the client's request: the
``UpstreamClient`` reports it here, which logs it once as an error and keeps
the reason (``refused``) until a probe of a generation endpoint, made with
each health check meanwhile, or a request's 200 shows the key is taken. The
pool does not choose the upstream while it is set (``ReplicaSlot.ready``)."""

from __future__ import annotations

import asyncio
import logging
import os

import aiohttp

from replicas.upstream_errors import error_text

__all__ = ["Credentials", "refusal"]

log = logging.getLogger("fairstream.upstream")


def refusal(name: str, key_env: str | None, status: int, message: str) -> str:
    """Why upstream ``name`` answered ``status`` (401/403): which key the
    router sent (``api_key_env``'s, or none), for the log, ``last_error``
    and the clients' 503s."""
    if not key_env:
        key = "it sent no API key: api_key_env is not set"
    elif not os.environ.get(key_env):
        key = f"it sent no API key: ${key_env} is empty"
    else:
        key = f"the key in ${key_env}"
    return f"upstream {name} refused the router's credentials ({key}): HTTP {status}: {message}"


class Credentials:
    """One upstream's standing with the router's API key."""

    __slots__ = ("name", "key_env", "refused", "check_now", "path", "_refusals", "_confirming")

    def __init__(self, name: str, key_env: str | None, check_now: asyncio.Event) -> None:
        self.name = name
        self.key_env = key_env
        self.refused: str | None = None  # why, while it refuses them
        self.check_now = check_now  # (the supervisor's: set to show it down at once)
        # the generation endpoint refused last, which the probes ask (a chat-only
        # upstream's gateway may answer 403 to /completions whatever the key)
        self.path = "/completions"
        self._refusals = 0  # (one during a probe keeps it refused)
        self._confirming: asyncio.Future[bool] | None = None  # (one probe for a burst of refusals)

    def refuse(self, status: int, message: str, path: str = "") -> str:
        """It answered ``status`` (401/403) (to a request to ``path``):
        refused until taken again; logged at the first refusal. Returns why,
        for the request's failure."""
        self._refusals += 1
        if path:
            self.path = path
        why = refusal(self.name, self.key_env, status, message)
        if self.refused is None:
            log.error("%s; not chosen until a health check shows it takes them", why)
            self.check_now.set()
        self.refused = why
        return why

    def taken(self) -> None:
        """A generation endpoint took them (a request's 200, or a probe)."""
        if self.refused is not None:
            self.refused = None
            log.warning("upstream %s takes the router's credentials again", self.name)

    async def confirm(self, session: aiohttp.ClientSession, url: str, model: str, path: str, status: int,
                      message: str, timeout: float | None) -> str | None:
        """A generation request to ``path`` got ``status`` (401/403): is it
        the key, or that request (an upstream's moderation, a per-model
        rule)? A probe of ``path`` tells (one for a burst of refusals): the
        key refused there too, or it already was, gives why (the request
        moves on, the upstream is not ready); else None (the upstream stays
        ready: that refusal was the request's own)."""
        if self.refused is not None:
            return self.refuse(status, message, path)
        if self._confirming is None:
            self._confirming = asyncio.ensure_future(self._refuses(session, url + path, model, timeout))
            self._confirming.add_done_callback(self._confirmed)
        try:
            refused = await asyncio.shield(self._confirming)
        except (aiohttp.ClientError, OSError, TimeoutError):
            refused = False  # (not known: the request moves on as any failure, the upstream ready)
        return self.refuse(status, message, path) if refused else None

    def _confirmed(self, probe: asyncio.Future[bool]) -> None:
        """The probe ended: the next refusal asks again. Its error is taken
        here, so that one whose waiters all left (cancelled) is not reported
        as never retrieved."""
        self._confirming = None
        if not probe.cancelled():
            probe.exception()

    async def probe(self, session: aiohttp.ClientSession, url: str, model: str) -> None:
        """A health check's while it is refused: whether ``path`` still
        refuses the key (see ``_post``)."""
        before = self._refusals
        status, body = await _post(session, url + self.path, model)
        if status in (401, 403):
            self.refuse(status, error_text(body))
        elif self._refusals == before:  # (no request was refused meanwhile)
            self.taken()

    @staticmethod
    async def _refuses(session: aiohttp.ClientSession, url: str, model: str, timeout: float | None) -> bool:
        async with asyncio.timeout(timeout):
            status, _ = await _post(session, url, model)
        return status in (401, 403)


async def _post(session: aiohttp.ClientSession, url: str, model: str) -> tuple[int, bytes]:
    """POST a request with no prompt (or messages) to a generation endpoint:
    an OpenAI server (vLLM, api.openai.com) refuses a wrong key with 401/403
    before it reads the body, and a right one's request as the client's
    error (400), generating nothing."""
    async with session.post(url, json={"model": model}) as r:
        return r.status, await r.read()
