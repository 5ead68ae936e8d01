"""An OpenAI-compatible server (``vllm serve``, ...) used as a replica.

``UpstreamClient`` has ``ReplicaClient``'s interface (``generate`` returns the
same single-slot ``Collector``; ``abort``, ``release``, ``ping``, ``load``,
``close``), so the pool, the supervisor and the router's failover treat an
upstream like any other replica. Each request is one task that POSTs a
streaming request through ``replicas.http11`` (keep-alive pool, httptools
parsing) and then only waits: the response body is parsed into deltas for its
collector inside the connection's ``data_received``, with no task wake-up per
chunk (``replicas.upstream_sse``). Health checks, ``/metrics`` and
``/detokenize`` go through one aiohttp session per upstream (its load:
``replicas.upstream_load``). A stream resumed here with stop strings continues
through a ``Splice`` (``replicas.splice``); ``replicas.upstream_errors`` reads
its error bodies and the 400s that refuse a field the router adds;
``replicas.upstream_credentials`` keeps whether it takes the router's API key.

Token ids (docs/upstreams.md). With ``return_token_ids`` (vLLM >= 0.10) the
upstream returns the prompt's token ids in its first chunk and the new token
ids in every chunk, and accepts token-id prompts on ``/v1/completions``; a
stream it served can then move to any replica token-exact, and it can take
over streams from others. An upstream that returns no token ids gets requests
as text or messages only, and no continuation (``continues``): it may be
replaced before its first output, but a failure after output ends the request
with ``FinishReason.ERROR``, never with a restart that would repeat text.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable
from typing import Any

import aiohttp
import msgspec

from replicas.client import Collector, CredentialsRefused, ReplicaBusy, ReplicaDead, ReplicaStalled
from replicas.http11 import HeadTimeout, HttpError, HttpPool, Response, Sent
from replicas.protocol import (
    FEATURES,
    PROTOCOL_VERSION,
    UNSET_FREQUENCY_PENALTY, UNSET_MIN_P, UNSET_PRESENCE_PENALTY, UNSET_REPETITION_PENALTY, UNSET_TEMPERATURE,
    UNSET_TOP_K, UNSET_TOP_P, Delta, FinishReason, LoadReport, Pong, Ready, SamplingParams,
)
from replicas.spec import ReplicaSpec
from replicas.splice import post_detokenize, splice_at
from replicas.upstream_checks import ModelCard, ModelList, Stall
from replicas.upstream_credentials import Credentials
from replicas.upstream_errors import UpstreamFailed, error_text, rejects_field, retry_after_seconds
from replicas.upstream_load import poll_vllm_load
from replicas.upstream_sse import Chunk, SseReader, Stream

__all__ = ["UpstreamClient", "ModelCard", "ModelList"]

log = logging.getLogger("fairstream.upstream")


def _root(url: str) -> str:
    """Server root of a ``.../v1`` base URL (where vLLM serves /metrics, /detokenize)."""
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


class UpstreamClient:
    """One OpenAI-compatible upstream, duck-typed as a ``ReplicaClient``."""

    def __init__(self, name: str, spec: ReplicaSpec, session: aiohttp.ClientSession, http: HttpPool,
                 model: str, upstream_model: str, max_model_len: int, head_timeout: float = 0.0,
                 stalling: str | None = None) -> None:
        self.name = name
        # longest wait for a response head (health_timeout; 0: none; vLLM sends it before the first
        # token): one that never comes (a proxy whose backend hangs) fails over, not a 504 at first_token
        self.head_timeout = head_timeout
        self.url = (spec.url or "").rstrip("/")
        self.model = model
        self.upstream_model = upstream_model
        # (every field goes to the upstream as the client sent it: FEATURES)
        self.ready = Ready(PROTOCOL_VERSION, model, "openai", max_model_len, 0, int(FEATURES))
        self.closed: BaseException | None = None
        # A connect was refused: not chosen for new requests until a health
        # check begun after it (asked for at once, through ``check_now``)
        # answers, when the supervisor clears it; the streams it has go on.
        # A failed check takes it down.
        self.refused = False
        self.refusals = 0  # (one during a check keeps it refused: the supervisor checks again)
        self.check_now = asyncio.Event()
        # A 401/403 to a generation request (its /models may need no key, so
        # health checks pass): not chosen until its health check's probe, or
        # a request, shows the key is taken (``credentials_refused``).
        self.credentials = Credentials(name, spec.api_key_env, self.check_now)
        # A generation request got no response head within head_timeout: out of dispatch, a stall, until a probe
        # a health check starts is answered (``stalling``: its last connection's, its server's: kept, probed at once)
        self._stall = Stall(name, http, upstream_model, head_timeout, self.check_now.set, stalling)
        # Whether the upstream returns token ids (None: not known yet).
        self.token_ids: bool | None = {"yes": True, "no": False}.get(spec.token_ids)
        self._require_ids = spec.token_ids == "yes"
        # Whether to ask for the usage chunk (stream_options.include_usage) while token ids are
        # not known to come: where they never come, the only count of the prompt. False once refused.
        self._ask_usage = True
        self._session = session
        self._http = http
        self._streams: dict[int, Stream] = {}
        self._tasks: set[asyncio.Task[None]] = set()  # requests still being sent (until their response head)
        self._ids = itertools.count(1)
        self._pings = itertools.count(1)
        self._vllm_load: LoadReport | None = None
        self._poller = asyncio.get_running_loop().create_task(
            poll_vllm_load(session, _root(self.url), name, self._loaded), name=f"upstream-metrics-{name}")

    @property
    def active(self) -> int:
        return len(self._streams)

    @property
    def stalling(self) -> str | None:  # (why its generation requests get no response head; None: they do)
        return self._stall.why

    @property
    def credentials_refused(self) -> str | None:
        """Why it refuses the router's API key (None: it takes it): not ready meanwhile."""
        return self.credentials.refused

    @property
    def continues(self) -> bool:
        """It can continue a stream from its token ids: unless known to return none (pool.CONTINUES)."""
        return self.token_ids is not False

    @property
    def load(self) -> LoadReport:
        """vLLM's scheduler stats (polled every METRICS_INTERVAL s) if served, else the router's streams on it."""
        return self._vllm_load or LoadReport(len(self._streams), 0, 0.0)

    def generate(
        self,
        params: SamplingParams,
        *,
        prompt: str | None = None,
        messages: list[dict[str, str]] | None = None,
        prompt_token_ids: list[int] | None = None,
        prefix_token_ids: list[int] | None = None,
        prefix_text_len: int = 0,
        chat_template_kwargs: dict[str, Any] | None = None,
        reasoning_effort: str | None = None,
    ) -> Collector:
        if self.closed is not None:
            raise ReplicaDead(f"upstream {self.name} is disconnected")
        prefix = prefix_token_ids or []
        if prefix and self.token_ids is False:
            raise ReplicaDead(f"upstream {self.name} returns no token ids, so it cannot continue a resumed stream")
        col = Collector(next(self._ids))
        st = Stream(col, prompt_token_ids)
        first = None
        on_head = self._on_head(st, bool(prefix))
        # (not when _run has work to do first: a stop-string splice, or no tokens left)
        if self._http.can_send_now() and not (prefix and params.stop) and params.max_tokens > len(prefix):
            # On a kept-alive connection the request goes out now, not when
            # the task below first runs: one turn of a busy loop less before
            # the first token (docs/perf.md, "Where time to first token goes").
            try:
                path, body, asked = self._request(params, prompt, messages, prompt_token_ids, prefix,
                                                  chat_template_kwargs, reasoning_effort)
            except (TypeError, ValueError, msgspec.EncodeError):
                pass  # the task meets it again and reports it, as for any request
            else:
                st.asked_usage = asked[1]
                sent = self._http.send_now("POST", path, body, on_head)  # None: no idle connection after all
                if sent is not None:
                    st.resp = sent.response  # an abort closes it
                first = (path, body, asked, sent)
        task = st.task = asyncio.get_running_loop().create_task(
            self._run(st, params, prompt, messages, (chat_template_kwargs, reasoning_effort), prefix, prefix_text_len,
                      on_head, first),
            name=f"upstream-{self.name}-{col.rid}",
        )
        self._streams[col.rid] = st
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return col

    def abort(self, col: Collector) -> None:
        """Stop the request: closing its connection makes vLLM abort it."""
        st = self._streams.pop(col.rid, None)
        if st is not None:
            if st.task is not None:
                st.task.cancel()
            if st.resp is not None:
                st.resp.close()

    def release(self, col: Collector) -> None:
        """Forget a finished request."""
        self._streams.pop(col.rid, None)

    async def ping(self, timeout: float | None) -> Pong:
        """GET {url}/models; ``ReplicaDead`` if it fails, TimeoutError after ``timeout`` s (None: no
        limit). After a refused connect it goes on a new connection (the session's kept-alive one would
        not tell whether new ones are taken). While stalled it starts a probe (``Stall``), not waited for."""
        session = self._session
        if self.refused:
            session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                            headers=self._session.headers, auto_decompress=False)
        try:
            async with asyncio.timeout(timeout):
                async with session.get(self.url + "/models") as r:
                    body = await r.read()
                    if r.status != 200:
                        raise UpstreamFailed(f"GET /models: HTTP {r.status}: {error_text(body)}")
            # (restarted with another model, or a balancer now reaching another server: 404 to everything)
            listed = [m.id for m in msgspec.json.decode(body, type=ModelList).data]
            if listed and self.upstream_model not in listed:
                raise UpstreamFailed(f"GET /models no longer lists {self.upstream_model!r} (it lists {listed})")
            if self.credentials.refused is not None:  # (/models may need no key: ask a generation endpoint)
                await self.credentials.probe(session, self.url, self.upstream_model)
            self._stall.probe()  # (while stalled; its own task: a probe's wait is not this check's)
        except TimeoutError:
            raise
        except (aiohttp.ClientError, OSError, UpstreamFailed, msgspec.ValidationError, msgspec.DecodeError) as e:
            self.closed = ReplicaDead(f"upstream {self.name} failed its health check: {e}")
            raise self.closed from e
        finally:
            if session is not self._session:
                await session.close()
        return Pong(next(self._pings), self.load)

    async def close(self, why: BaseException | None = None) -> None:
        if self.closed is None:  # (``why``: the router's reason, as ReplicaClient.close)
            self.closed = ReplicaDead(f"upstream {self.name} closed by the router" + (f": {why}" if why else ""))
        streams = list(self._streams.values())
        self._streams.clear()
        for st in streams:
            if st.resp is not None:
                st.resp.close()  # including a request written before its task ran
            st.col.fail(self.closed)
        tasks = [self._poller, *self._tasks]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, self._stall.close(), return_exceptions=True)
        await self._http.close()
        await self._session.close()

    # -- one request -------------------------------------------------------

    def _body(self, params: SamplingParams, prefix: list[int], ask_ids: bool, ask_usage: bool) -> dict[str, Any]:
        max_tokens = params.max_tokens
        if params.max_tokens_default and self.ready.max_model_len > 0:
            # (an unset max_tokens is the router's default, sent as set: over
            # the upstream's whole context, vLLM refuses it, for a field the
            # client never sent; within it, vLLM lowers it to what is left)
            max_tokens = min(max_tokens, self.ready.max_model_len)
        body: dict[str, Any] = {
            "model": self.upstream_model,
            "stream": True,
            "max_tokens": max_tokens - len(prefix),
        }
        # What the client set, and only that: an upstream vLLM fills the rest
        # from the model's generation config, as it would for the client.
        # (top_k, min_p and repetition_penalty, vLLM's own, only when they ask
        # for something or were set, for upstreams that do not know them.)
        unset = params.unset
        if not unset & UNSET_TEMPERATURE:
            body["temperature"] = params.temperature
        if not unset & UNSET_TOP_P:
            body["top_p"] = params.top_p
        if params.top_k > 0 or not unset & UNSET_TOP_K:
            body["top_k"] = params.top_k
        if params.min_p > 0 or not unset & UNSET_MIN_P:
            body["min_p"] = params.min_p
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop and not prefix:  # (a resumed stream's: the router's Splice looks for them)
            body["stop"] = params.stop
        if params.stop_token_ids:
            body["stop_token_ids"] = params.stop_token_ids
        if params.ignore_eos:
            body["ignore_eos"] = True
        if params.min_tokens > len(prefix):
            body["min_tokens"] = params.min_tokens - len(prefix)
        if params.presence_penalty or not unset & UNSET_PRESENCE_PENALTY:
            body["presence_penalty"] = params.presence_penalty
        if params.frequency_penalty or not unset & UNSET_FREQUENCY_PENALTY:
            body["frequency_penalty"] = params.frequency_penalty
        if params.repetition_penalty != 1.0 or not unset & UNSET_REPETITION_PENALTY:
            body["repetition_penalty"] = params.repetition_penalty
        if params.include_stop_str_in_output:
            body["include_stop_str_in_output"] = True
        if ask_ids:
            body["return_token_ids"] = True
        if ask_usage:
            body["stream_options"] = {"include_usage": True}
        return body

    def _request(self, params: SamplingParams, prompt: str | None, messages: list[dict[str, str]] | None,
                 prompt_ids: list[int] | None, prefix: list[int],
                 template_kwargs: dict[str, Any] | None = None,
                 reasoning_effort: str | None = None) -> tuple[str, bytes, tuple[bool, bool]]:
        """The path and JSON body of one generation request; whether it asks for token ids and usage."""
        if prompt_ids is not None:
            path, payload = "/completions", {"prompt": prompt_ids + prefix}
        elif messages is not None:
            path, payload = "/chat/completions", {"messages": messages}
            if template_kwargs:  # (as the client sent them: the upstream renders the template)
                payload["chat_template_kwargs"] = template_kwargs
            if reasoning_effort is not None:
                payload["reasoning_effort"] = reasoning_effort
        else:
            path, payload = "/completions", {"prompt": prompt or ""}
        ask_ids = self.token_ids is not False
        ask_usage = self.token_ids is not True and self._ask_usage
        body = msgspec.json.encode(self._body(params, prefix, ask_ids, ask_usage) | payload)
        return path, body, (ask_ids, ask_usage)

    async def _run(self, st: Stream, params: SamplingParams, prompt: str | None,
                   messages: list[dict[str, str]] | None, chat: tuple[dict[str, Any] | None, str | None],
                   prefix: list[int], prefix_text_len: int,
                   on_head: Callable[[Response], None],
                   first: tuple[str, bytes, tuple[bool, bool], Sent | None] | None) -> None:
        """Send the request (``chat``: a chat's template kwargs and reasoning
        effort); once its response streams, this task ends and the body is
        parsed in ``data_received`` (``SseReader``) until ``_ended``."""
        col = st.col
        prompt_ids = st.prompt_ids
        streaming = False
        try:
            if prefix and params.max_tokens == len(prefix):
                # (its replica failed after the last token, before the finish: nothing to generate; the text it
                # held back, which could have started a stop string, then length, as replicas.prepare ends it)
                splice = await splice_at(self._detokenize, prefix, prefix_text_len, params) if params.stop else None
                text, stopped = splice.feed("", True) if splice is not None else ("", False)
                self.finish(st, Delta(col.rid, [], text, FinishReason.STOP if stopped else FinishReason.LENGTH,
                                      stop_reason=splice.stops.matched if splice is not None else None))
                return
            if params.max_tokens - len(prefix) <= 0:
                self.finish(st, Delta(col.rid, [], "", FinishReason.ERROR, None,
                                      "max_tokens already reached by the resumed prefix"))
                return
            if prefix and params.stop:
                st.splice = await splice_at(self._detokenize, prefix, prefix_text_len, params)
            for attempt in range(3):
                if attempt == 0 and first is not None:  # encoded, and maybe written, by generate()
                    path, body, (ask_ids, ask_usage), sent = first
                else:
                    path, body, (ask_ids, ask_usage) = self._request(params, prompt, messages, prompt_ids, prefix,
                                                                     *chat)
                    st.asked_usage = ask_usage
                    sent = None
                if sent is not None:
                    resp = await self._http.response_to(sent, self.head_timeout)
                else:
                    resp = await self._http.request("POST", path, body, on_head, self.head_timeout)
                if resp.status == 200:
                    streaming = True  # on_head attached its SSE reader
                    if self.credentials.refused is not None:
                        self.credentials.taken()
                    return
                try:
                    msg = error_text(await resp.read())
                finally:
                    resp.close()
                if resp.status == 400 and attempt < 2:  # an API that rejects a field we add: ask without it
                    if ask_ids and self.token_ids is not True and rejects_field(msg, "return_token_ids"):
                        self._set_token_ids(False)
                        continue
                    if ask_usage and rejects_field(msg, "stream_options"):
                        if self._ask_usage:
                            self._ask_usage = False
                            log.info("upstream %s refuses stream_options: its prompt tokens go uncounted", self.name)
                        continue
                if resp.status in (401, 403):  # (the router's key: the request moves on, and not back here)
                    why = await self.credentials.confirm(self._session, self.url, self.upstream_model, path,
                                                         resp.status, msg, self.head_timeout or None)
                    if why is not None:
                        self._streams.pop(col.rid, None)
                        col.fail(CredentialsRefused(why))
                        return
                    # (the key is taken: this request's own refusal; it moves on as before, the upstream ready)
                # (404: the model or path is not served there: the upstream's state, not the client's error)
                if 400 <= resp.status < 500 and resp.status not in (401, 403, 404, 408, 429):
                    self.finish(st, Delta(col.rid, [], "", FinishReason.ERROR, None, msg))
                    return
                busy = resp.status in (429, 503)
                raise UpstreamFailed(f"HTTP {resp.status}: {msg}", busy,
                                     retry_after_seconds(resp.headers.get(b"retry-after")) if busy else 0.0)
        except asyncio.CancelledError:
            raise
        except (HttpError, aiohttp.ClientError, OSError, UpstreamFailed, msgspec.DecodeError, ValueError) as e:
            if isinstance(e.__cause__, ConnectionRefusedError):
                # Nothing listens there (it died, or is restarting), or a
                # proxy in front refused this one connect: not chosen until
                # the health check, asked for now, tells which. So a failover
                # does not come straight back here (using up max_failovers on
                # refusals); with no other replica ready it waits.
                self.refusals += 1
                self.check_now.set()
                if not self.refused:
                    self.refused = True
                    log.warning("upstream %s refused a connection; not chosen until a health check on a new "
                                "connection answers", self.name)
            if not st.done:
                if isinstance(e, UpstreamFailed) and e.busy and not st.delivered:
                    self._streams.pop(col.rid, None)
                    st.col.fail(ReplicaBusy(f"upstream {self.name} failed: {e}", e.retry_after))
                elif isinstance(e, HeadTimeout):  # (its /models may answer all along: a stall, not a death)
                    self._stall.caught(f"upstream {self.name} failed: {e}")
                    self._streams.pop(col.rid, None)
                    st.col.fail(ReplicaStalled(self._stall.why))
                else:
                    self._lost(st, f"upstream {self.name} failed: {e or type(e).__name__}")
        except Exception as e:  # noqa: BLE001 - a bug here must not leave the stream hanging
            log.exception("upstream %s: request %d failed", self.name, col.rid)
            if not st.done:
                self._lost(st, f"upstream {self.name} failed: {e!r}")
        finally:
            st.task = None
            if not st.done and not streaming:
                self._streams.pop(col.rid, None)

    def _on_head(self, st: Stream, resumed: bool) -> Callable[[Response], None]:
        """A response's head hook: a 200 streams from the connection's
        callback on, so the first token goes on in the loop turn that read
        it, not when the request's task next runs."""
        def on_head(resp: Response) -> None:
            if resp.status == 200:
                self._stream(st, resp, resumed)
        return on_head

    def _stream(self, st: Stream, resp: Response, resumed: bool) -> None:
        """Parse the 200 response's SSE body as it arrives."""
        reader = SseReader(self, st, resumed, resp)
        st.resp = resp
        resp.stream_to(reader.feed)
        resp.when_finished(lambda exc: self._ended(st, reader, exc))

    def _ended(self, st: Stream, reader: SseReader, exc: BaseException | None) -> None:
        """The response of a streaming request ended (``exc``: how it broke)."""
        st.resp = None
        if not self.current(st):
            return  # finished, aborted or released: nothing to report
        if reader.held is not None:
            reader.flush()  # the finish came, its usage chunk did not: a finished stream all the same
            return
        try:
            if exc is not None:
                raise exc
            reader.end()
        except (HttpError, OSError, UpstreamFailed, msgspec.DecodeError, ValueError) as e:
            self._lost(st, f"upstream {self.name} failed: {e or type(e).__name__}")
        except Exception as e:  # noqa: BLE001 - a bug here must not leave the stream hanging
            log.exception("upstream %s: request %d failed", self.name, st.col.rid)
            self._lost(st, f"upstream {self.name} failed: {e!r}")

    def current(self, st: Stream) -> bool:
        """``st`` is still running here (not finished, aborted or released)."""
        return not st.done and self._streams.get(st.col.rid) is st

    def first_chunk(self, st: Stream, chunk: Chunk, resumed: bool) -> None:
        """The first chunk of ``st``'s response (``SseReader``): whether this
        upstream returns token ids, and the prompt's."""
        choice = chunk.choices[0] if chunk.choices else None
        upstream_prompt = chunk.prompt_token_ids or (choice.prompt_token_ids if choice else None)
        if upstream_prompt is None:
            if self._require_ids:
                log.error("upstream %s returned no token ids but its spec says token_ids: yes", self.name)
                raise UpstreamFailed("returned no token ids (token_ids: yes)")
            self._set_token_ids(False)
            if resumed:
                raise UpstreamFailed("returns no token ids, so it cannot continue a resumed stream")
            st.prompt_ids = None
            return
        self._set_token_ids(True)
        st.resumable = True
        if st.prompt_ids is None:
            st.prompt_ids = upstream_prompt

    def _set_token_ids(self, value: bool) -> None:
        if self.token_ids is None:
            self.token_ids = value
            log.info("upstream %s %s token ids%s", self.name, "returns" if value else "does not return",
                     "" if value else ": its streams move to other replicas only before their first token")

    def finish(self, st: Stream, delta: Delta) -> None:
        """``st`` ends with ``delta`` (here or in its ``SseReader``)."""
        st.done = True
        self._streams.pop(st.col.rid, None)
        st.col.put(delta)

    def _lost(self, st: Stream, reason: str) -> None:
        if not st.delivered or st.resumable:
            self._streams.pop(st.col.rid, None)
            st.col.fail(ReplicaDead(reason))
        else:
            self.finish(st, Delta(st.col.rid, [], "", FinishReason.ERROR, None,
                                  f"{reason}; this upstream returns no token ids, so the stream cannot "
                                  "continue on another replica"))

    async def _detokenize(self, ids: list[int]) -> str:
        """The text of ``ids`` from this upstream's ``/detokenize`` (for a ``Splice``)."""
        return await post_detokenize(self._session, _root(self.url), self.upstream_model, ids)

    def _loaded(self, report: LoadReport | None) -> None:
        self._vllm_load = report
