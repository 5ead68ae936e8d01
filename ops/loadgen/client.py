"""One request, sent and measured.

Timing starts right before the request is sent (``perf_counter``):

* **TTFT**: send -> first event that carries content text.
* **Inter-token latency**: for every later content arrival, the gap since the
  previous one divided by the tokens in it, weighted by those tokens (so
  percentiles are per token, as a user sees them). An arrival is the content
  events that reach the client within ``COALESCE_S`` of each other: httpx
  yields each HTTP chunk of one network read separately, and those events
  arrived together (counting them apart would add gaps of zero). Tokens
  per event come from per-event usage (``continuous_usage_stats``) when the
  server sends it; otherwise the final usage is spread over the events in
  proportion to their UTF-8 bytes (exact for byte-level tokenizers such as
  the sim's); without any usage, one token per event.
* **E2E**: send -> last byte (``[DONE]``, the error event, or the body).

Errors get a kind: ``http_<status>:<code>`` (error body's code), ``stream:<code>``
(an error event inside a 200 stream), ``stream:truncated`` (ended without
``[DONE]``), ``timeout`` (``request_timeout_s``), ``transport:<Exception>``,
``bad_response`` or ``cancelled`` (open at the end of the drain).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import httpx
import msgspec

from ops.loadgen.plan import RequestSpec
from ops.loadgen.sse import SseParser, decode_chunk, decode_error

__all__ = ["Result", "send", "COALESCE_S"]

COALESCE_S = 0.001
"""Content events closer than this to the previous one count as the same arrival."""


@dataclass(slots=True, eq=False)
class Result:
    """Measurements of one request. Times in seconds; ``start`` since the run began."""

    tenant: str
    cls: str
    stream: bool
    start: float
    status: int | None = None
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    events: int = 0
    """Content arrivals (network reads that carried content)."""
    tokens_exact: bool = False
    retry_after: float | None = None
    itl: list[tuple[float, float]] = field(default_factory=list)
    """(seconds per token, tokens) per content arrival after the first."""
    token_times: list[tuple[float, float]] = field(default_factory=list)
    """(seconds since the run began, tokens) per content arrival."""

    @property
    def ok(self) -> bool:
        return self.error is None

    def row(self) -> dict:
        """Flat record for JSON/CSV (no per-event lists)."""
        w = sum(n for _, n in self.itl)
        return {
            "tenant": self.tenant, "class": self.cls, "stream": self.stream, "start": round(self.start, 6),
            "status": self.status, "error": self.error, "ttft": self.ttft, "e2e": self.e2e,
            "itl_mean": (sum(v * n for v, n in self.itl) / w) if w else None,
            "prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
            "events": self.events, "tokens_exact": self.tokens_exact,
        }


def _retry_after(resp: httpx.Response) -> float | None:
    try:
        return float(resp.headers["retry-after"])
    except (KeyError, ValueError):
        return None


async def _http_error(resp: httpx.Response, r: Result) -> None:
    body = await resp.aread()
    err = decode_error(body)
    r.error = f"http_{resp.status_code}:{err.code}" if err is not None and err.code else f"http_{resp.status_code}"
    r.retry_after = _retry_after(resp)


async def _stream(client: httpx.AsyncClient, url: str, headers: dict, spec: RequestSpec, r: Result,
                  t_send: float, t0: float) -> None:
    parser = SseParser()
    # (arrival time, bytes of text, exact tokens or None) per content event
    events: list[tuple[float, int, int | None]] = []
    done = False
    last_usage = 0
    try:
        async with client.stream("POST", url, content=spec.body, headers=headers) as resp:
            r.status = resp.status_code
            if resp.status_code != 200:
                await _http_error(resp, r)
                return
            async for raw in resp.aiter_raw():
                if r.error is not None or done:
                    # Read the body to its end, as SDK clients do, so the
                    # connection goes back to the pool instead of being closed.
                    continue
                now = time.perf_counter()
                for data in parser.feed(raw):
                    if data == b"[DONE]":
                        done = True
                        r.e2e = now - t_send
                        continue
                    chunk = decode_chunk(data)
                    if chunk.error is not None:
                        r.error = f"stream:{chunk.error.code or chunk.error.type or 'error'}"
                        r.e2e = now - t_send
                        break
                    text = chunk.text()
                    exact = None
                    if chunk.usage is not None:
                        if text:
                            exact = chunk.usage.completion_tokens - last_usage
                        last_usage = chunk.usage.completion_tokens
                        r.prompt_tokens = chunk.usage.prompt_tokens
                        r.completion_tokens = chunk.usage.completion_tokens
                        r.tokens_exact = True
                    if text:
                        if not events:
                            r.ttft = now - t_send
                        if events and now - events[-1][0] < COALESCE_S:
                            _, b0, x0 = events[-1]
                            events[-1] = (now, b0 + len(text.encode()),
                                          None if x0 is None or exact is None else x0 + exact)
                        else:
                            events.append((now, len(text.encode()), exact))
        if r.error is None and not done:
            r.error = "stream:truncated"
            r.e2e = time.perf_counter() - t_send
    finally:
        # Also on timeout, transport error or cancellation: count what arrived.
        _spread(r, events, t0)


def _spread(r: Result, events: list[tuple[float, int, int | None]], t0: float) -> None:
    """Tokens per event, then ITL samples and the token timeline."""
    r.events = len(events)
    if not events:
        return
    if all(x is not None for _, _, x in events):
        counts = [float(x) for _, _, x in events]  # type: ignore[arg-type]
    elif r.tokens_exact and r.completion_tokens > 0:
        total_bytes = sum(b for _, b, _ in events) or 1
        counts = [r.completion_tokens * b / total_bytes for _, b, _ in events]
    else:
        counts = [1.0] * len(events)
    if not r.tokens_exact or r.error is not None:
        r.completion_tokens = int(round(sum(counts)))
        r.tokens_exact = r.tokens_exact and r.error is None
    prev = events[0][0]
    for i, ((t, _, _), n) in enumerate(zip(events, counts)):
        r.token_times.append((t - t0, n))
        if i and n > 0:
            r.itl.append(((t - prev) / n, n))
        prev = t


async def _unary(client: httpx.AsyncClient, url: str, headers: dict, spec: RequestSpec, r: Result,
                 t_send: float, t0: float) -> None:
    resp = await client.post(url, content=spec.body, headers=headers)
    r.status = resp.status_code
    if resp.status_code != 200:
        await _http_error(resp, r)
        return
    now = time.perf_counter()
    r.e2e = now - t_send
    try:
        body = msgspec.json.decode(resp.content)
        usage = body["usage"]
        r.prompt_tokens = int(usage["prompt_tokens"])
        r.completion_tokens = int(usage["completion_tokens"])
        r.tokens_exact = True
        r.events = 1
        r.token_times.append((now - t0, float(r.completion_tokens)))
    except (msgspec.DecodeError, KeyError, TypeError, ValueError):
        r.error = "bad_response"


async def send(client: httpx.AsyncClient, base_url: str, spec: RequestSpec, r: Result, *,
               t0: float, timeout: float) -> Result:
    """Send ``spec`` and fill ``r``. ``t0`` is the run's start (``perf_counter``).

    On cancellation ``r.error`` is ``cancelled`` and the ``CancelledError``
    propagates; every other failure is recorded in ``r``, never raised.
    """
    url = base_url + spec.path
    headers = {"authorization": f"Bearer {spec.api_key}", "content-type": "application/json"}
    t_send = time.perf_counter()
    try:
        async with asyncio.timeout(timeout):
            if spec.stream:
                await _stream(client, url, headers, spec, r, t_send, t0)
            else:
                await _unary(client, url, headers, spec, r, t_send, t0)
    except asyncio.CancelledError:
        if r.e2e is None:  # not a finished stream cancelled while reading its last bytes
            r.error = "cancelled"
            r.e2e = time.perf_counter() - t_send
        raise
    except (TimeoutError, httpx.TimeoutException):
        r.error = "timeout"
    except httpx.HTTPError as e:
        r.error = f"transport:{type(e).__name__}"
    except (msgspec.DecodeError, msgspec.ValidationError):
        r.error = "bad_response"
    if r.e2e is None:
        r.e2e = time.perf_counter() - t_send
    return r
