"""An upstream's health checks: what its ``GET /models`` lists, and whether
one whose generation requests got no response head answers them again.

That check, ``GET /models``, may pass all along (a proxy or balancer
that black-holes the POSTs, a front end whose generation route hangs), so
the check alone would put it back in dispatch and every request sent there
would wait out the head timeout again. While it is ``stalling`` each health
check also starts a POST probe to its completions endpoint (``Stall``), on
the connections generation requests use, one at a time and beside the check,
not inside it: a probe that gets no answer (the very case it tests) must not
make the check overrun its own limit, which takes the upstream down and fails
over every stream on it, healthy ones too.

The probe's body (``probe_body``) is refused before any generation by the servers
that matter, and caps what any other could generate at one token: no
``prompt`` (vLLM answers 400, "Either prompt or prompt_embeds must be
provided"), ``n: 0`` (below the OpenAI API's minimum of 1; llama.cpp's server
refuses both with a 500, "Only one completion choice is allowed"),
``max_tokens: 1`` (OpenAI's legacy completions take a missing prompt as the
start of a document and would generate, by default 16 tokens, billed, were
``n`` not refused first; a server that ignores both fields still stops at
one). Any answer shows its generation route answers, a 500 too, but a
gateway's 502, 503 or 504, or Cloudflare's 520-524 (no server behind it
takes them yet). A gateway
that validates requests itself answers for the server behind it: the probe
cannot see past it."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

import msgspec

from replicas.http11 import HttpError, HttpPool

__all__ = ["ModelCard", "ModelList", "probe_body", "Stall", "answers_post"]

log = logging.getLogger("fairstream.upstream")

# An upstream whose probe is answered while its generation requests hang
# (a front end that answers a request it refuses at once but not one it
# would run) stalls again at its next request, each time costing that
# request the head timeout. A stall of a request sent within RELAPSE_WINDOW
# seconds after an answered probe is a relapse: the next probe waits
# RELAPSE_HOLD seconds, doubled at each relapse in a row, at most
# RELAPSE_HOLD_MAX.
RELAPSE_WINDOW = 60.0
RELAPSE_HOLD = 5.0
RELAPSE_HOLD_MAX = 60.0

# a gateway's answers for a server behind it that does not answer: a proxy's
# 502/503/504, Cloudflare's 520-524 (the origin down, refused, timed out)
_GATEWAY = frozenset({502, 503, 504, 520, 521, 522, 523, 524})


class ModelCard(msgspec.Struct):
    id: str
    max_model_len: int | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]


def probe_body(model: str) -> bytes:
    """The probe's body (the module's docstring says why these fields)."""
    return msgspec.json.encode({"model": model, "n": 0, "max_tokens": 1})


async def answers_post(http: HttpPool, name: str, model: str, budget: float) -> bool:
    """Whether upstream ``name`` answers a POST within ``budget`` s in all: the wait for a
    ``max_concurrency`` slot and the connect count, as the answer's body does (0: no limit)."""
    try:
        async with asyncio.timeout(budget or None):
            resp = await http.request("POST", "/completions", probe_body(model), None, budget)
            try:
                await resp.read()
            finally:
                resp.close()
    except (HttpError, OSError, TimeoutError) as e:
        log.debug("upstream %s: its generation endpoint still does not answer: %s", name, e or "timed out")
        return False
    if resp.status in _GATEWAY:  # (no server behind the gateway takes them yet)
        return False
    log.info("upstream %s answers generation requests again: chosen again", name)
    return True


class Stall:
    """Why an upstream's generation requests get no response head (``why``;
    None: they do), and its probes, one at a time (``probe``, at each health
    check while ``why`` is set). A probe that is answered clears ``why`` and
    calls ``answered`` (the client's ``check_now``: the health check that then
    puts it back in dispatch comes at once) unless a request got no head while
    it was under way: it shows nothing of that request, sent before its answer.
    A stall of a request sent soon after an answered probe holds the next
    probe back (``RELAPSE_WINDOW``), longer at each relapse in a row
    (``hold``)."""

    def __init__(self, name: str, http: HttpPool, model: str, budget: float, answered: Callable[[], None],
                 why: str | None = None) -> None:
        self.name = name
        self._http = http
        self._model = model
        # (a probe's whole time, slot and connect included: a generation request's head limit, so an
        # answered probe was at least as quick as that request had to be; 0: none, as for the request)
        self._budget = budget
        self._answered = answered
        self.why = why
        self._caught = 0  # (stalls caught so far: one during a probe keeps it stalled)
        self._task: asyncio.Task[None] | None = None
        self._closed = False  # (its client closed: a ping still under way starts none)
        self._cleared_at: float | None = None  # (loop time of the last answered probe)
        # (stalls in a row, each of a request sent within RELAPSE_WINDOW after the probe that ended the one before)
        self.relapses = 0
        self._hold_until = 0.0  # (no probe before this loop time)

    def hold(self) -> float:
        """Seconds the next probe waits after a stall (0 unless a relapse)."""
        # (the exponent capped: a float past 2**1023 is an OverflowError, some 17 hours of relapses)
        return 0.0 if not self.relapses else min(RELAPSE_HOLD_MAX, RELAPSE_HOLD * 2 ** min(self.relapses - 1, 16))

    def caught(self, why: str) -> None:
        """A generation request got no response head (``why``), ``_budget``
        seconds after it was sent."""
        if self.why is None:  # (a new stall; the other requests it caught add nothing)
            now = asyncio.get_running_loop().time()
            sent, cleared = now - self._budget, self._cleared_at
            self._hold_until = 0.0
            if cleared is None or sent > cleared + RELAPSE_WINDOW:
                self.relapses = 0
            elif sent >= cleared:  # (else the last stall's request, sent before the answer: the count stays)
                self.relapses += 1
                hold = self.hold()
                self._hold_until = now + hold
                log.warning("upstream %s stalled again on a request sent %.0fs after its probe was answered (%d in "
                            "a row): its generation route answers the probe but not requests; the next probe "
                            "waits %.0fs", self.name, sent - cleared, self.relapses, hold)
        self.why = why
        self._caught += 1

    @property
    def probing(self) -> bool:
        """Whether a probe is under way."""
        return self._task is not None and not self._task.done()

    def probe(self) -> None:
        """Start a probe while stalled, unless one is under way or a relapse holds it back."""
        if self.why is not None and not self._closed and not self.probing \
                and asyncio.get_running_loop().time() >= self._hold_until:
            self._task = asyncio.get_running_loop().create_task(self._probe(), name=f"upstream-probe-{self.name}")

    async def _probe(self) -> None:
        caught = self._caught
        if await answers_post(self._http, self.name, self._model, self._budget) and caught == self._caught:
            self.why = None
            self._cleared_at = asyncio.get_running_loop().time()
            self._answered()

    async def close(self) -> None:
        self._closed = True
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
