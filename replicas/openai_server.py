"""An OpenAI-compatible HTTP server in front of one engine (``--openai HOST:PORT``).

It lets fairstream (or anything else) treat a ``sim`` replica like a
``vllm serve``: for tests, demos and benchmarks of OpenAI upstreams
(docs/upstreams.md). It speaks the subset of vLLM's server that fairstream's
``UpstreamClient`` uses, with vLLM's field names and shapes:

* ``GET /v1/models``; ``GET /health``; ``GET /metrics`` with vLLM's
  ``vllm:num_requests_running``, ``vllm:num_requests_waiting``,
  ``vllm:kv_cache_usage_perc`` gauges and ``vllm:generation_tokens_total``;
* ``POST /v1/completions`` (text or token-id prompt) and
  ``POST /v1/chat/completions``, streamed (SSE) or not, with ``max_tokens``,
  ``temperature``, ``top_p``, ``top_k``, ``min_p``, ``seed``, ``stop``,
  ``stop_token_ids``, ``ignore_eos``, ``min_tokens``,
  ``include_stop_str_in_output``, ``chat_template_kwargs`` (the sim's template
  uses none) and vLLM's ``return_token_ids`` (``prompt_token_ids`` in the
  first chunk, ``token_ids`` per chunk);
* ``POST /tokenize`` and ``POST /detokenize``.

Text is produced exactly as by the replica protocol server (same engine, same
``OutputProcessor``), except that the first completion tokens are decoded in
the context of the prompt, as vLLM does. ``token_ids=False`` (the
``--no-token-ids`` switch) makes it ignore ``return_token_ids``, to stand in
for upstreams that cannot return token ids. When a secret is set, ``/v1/*``
needs ``Authorization: Bearer <secret>`` (like ``vllm serve --api-key``).

One engine request per HTTP request; the engine's output goes through a
single-slot ``Collector`` per request, so a slow client gets merged chunks and
never makes the server buffer without bound. A client that disconnects has
its request aborted at once.
"""

from __future__ import annotations

import hmac
import itertools
import logging
import time
import uuid
from typing import Any

import msgspec
from aiohttp import web

from replicas import openai_requests as rq
from replicas.client import Collector
from replicas.engine import EngineDead, EngineError
from replicas.output import OutputProcessor
from replicas.prepare import prepare
from replicas.protocol import Delta, FinishReason, SamplingParams
from replicas.server import create_engine, exit_if_dead, wait_for_stop, watch_engine
from replicas.spec import join_host_port

__all__ = ["OpenAIServer", "serve_openai"]

log = logging.getLogger("fairstream.openai_server")

_enc = msgspec.json.encode
_DONE = b"data: [DONE]\n\n"
_SSE_HEADERS = {"content-type": "text/event-stream", "cache-control": "no-cache"}


class _Request:
    __slots__ = ("col", "proc", "sent", "ids", "text")

    def __init__(self, col: Collector, proc: OutputProcessor) -> None:
        self.col = col
        self.proc = proc
        self.sent = False  # the first token went out
        self.ids: list[int] = []  # held back by stream_interval
        self.text = ""


class OpenAIServer:
    """Owns the engine, the aiohttp app and every in-flight request."""

    def __init__(
        self,
        engine_name: str,
        engine_config: dict[str, Any],
        *,
        token_ids: bool = True,
        api_key: str = "",
        stream_interval: int = 1,
    ) -> None:
        self.engine = create_engine(engine_name, engine_config, self._on_output)
        self.token_ids = token_ids
        self.api_key = api_key
        self.stream_interval = max(1, stream_interval)  # tokens per chunk after the first, as vLLM's
        self._requests: dict[int, _Request] = {}
        self._ids = itertools.count(1)
        self._runner: web.AppRunner | None = None
        self._created = int(time.time())
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.add_routes([
            web.get("/v1/models", self._models),
            web.post("/v1/completions", self._completions),
            web.post("/v1/chat/completions", self._chat),
            web.post("/tokenize", self._tokenize),
            web.post("/detokenize", self._detokenize),
            web.get("/health", self._health),
            web.get("/metrics", self._metrics),
        ])
        self.app = app

    async def start(self, host: str, port: int) -> int:
        """Start the engine and listen; return the bound port."""
        await self.engine.start()
        self._runner = web.AppRunner(self.app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port, backlog=1024)
        await site.start()
        server = site._server  # noqa: SLF001 - the only way to learn an ephemeral port
        return server.sockets[0].getsockname()[1] if server is not None and server.sockets else port

    async def close(self) -> None:
        if self.engine.dead:  # (its requests get no more output: end them before the server waits for them)
            for rid, req in self._requests.items():
                req.col.put(Delta(rid, [], "", FinishReason.ERROR, None, f"engine died: {self.engine.death}"))
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        for rid in list(self._requests):
            self.engine.abort(rid)
        self._requests.clear()
        await self.engine.close()

    # -- engine output -----------------------------------------------------

    def _on_output(self, rid: int, new_ids: list[int], finish: FinishReason, error: str,
                   stop_id: int | None = None) -> None:
        req = self._requests.get(rid)
        if req is None:
            return
        text, finish_out = req.proc.process(new_ids, finish, stop_id)
        if finish_out != FinishReason.NONE:
            del self._requests[rid]
            if finish == FinishReason.NONE:  # a stop string ended it early
                self.engine.abort(rid)
        elif self.stream_interval > 1:
            if req.sent:
                req.ids += new_ids
                req.text += text
                if len(req.ids) < self.stream_interval:
                    return
                new_ids, text = req.ids, req.text
                req.ids, req.text = [], ""
            req.sent = True
        if req.ids:  # the finish flushes what stream_interval held
            new_ids, text = req.ids + new_ids, req.text + text
        req.col.put(Delta(rid, new_ids, text, finish_out, None, error, stop_reason=req.proc.stop_reason))

    # -- endpoints ---------------------------------------------------------

    def _authorized(self, request: web.Request) -> bool:
        if not self.api_key:
            return True
        got = request.headers.get("authorization", "")
        return hmac.compare_digest(got.encode(), f"Bearer {self.api_key}".encode())

    async def _models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return rq.error_response("invalid API key", 401)
        eng = self.engine
        card = {"id": eng.model, "object": "model", "created": self._created, "owned_by": "fairstream",
                "root": eng.model, "parent": None, "max_model_len": eng.max_model_len}
        return web.Response(body=_enc({"object": "list", "data": [card]}), content_type="application/json")

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200)

    async def _metrics(self, request: web.Request) -> web.Response:
        load = self.engine.load()
        labels = f'{{engine="0",model_name="{self.engine.model}"}}'
        lines = []
        for name, kind, value, doc in (
            ("vllm:num_requests_running", "gauge", load.running, "Number of requests in model execution batches."),
            ("vllm:num_requests_waiting", "gauge", load.waiting, "Number of requests waiting to be processed."),
            ("vllm:kv_cache_usage_perc", "gauge", load.kv_usage, "KV-cache usage. 1 means 100 percent usage."),
            ("vllm:generation_tokens_total", "counter", load.tokens_generated, "Number of generation tokens processed."),
        ):
            lines += [f"# HELP {name} {doc}", f"# TYPE {name} {kind}", f"{name}{labels} {float(value)}"]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def _tokenize(self, request: web.Request) -> web.Response:
        try:
            req = msgspec.json.decode(await request.read(), type=rq.TokenizeRequest)
            tok = self.engine.tokenizer
            if req.messages is not None:
                ids = tok.chat(rq.chat_messages(req.messages), rq.template_kwargs(req.chat_template_kwargs))
            else:
                ids = tok.encode(req.prompt or "")
        except (msgspec.DecodeError, rq.RequestError, EngineError) as e:
            return rq.error_response(str(e))
        body = {"count": len(ids), "max_model_len": self.engine.max_model_len, "tokens": ids}
        return web.Response(body=_enc(body), content_type="application/json")

    async def _detokenize(self, request: web.Request) -> web.Response:
        try:
            req = msgspec.json.decode(await request.read(), type=rq.DetokenizeRequest)
        except msgspec.DecodeError as e:
            return rq.error_response(str(e))
        text = self.engine.tokenizer.decode(req.tokens)
        return web.Response(body=_enc({"prompt": text}), content_type="application/json")

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        return await self._generate(request, chat=True)

    async def _generate(self, request: web.Request, chat: bool) -> web.StreamResponse:
        if not self._authorized(request):
            return rq.error_response("invalid API key", 401)
        eng = self.engine
        try:
            body = await request.read()
            req: rq.Sampling
            if chat:
                req = msgspec.json.decode(body, type=rq.ChatRequest)
                prompt_ids = eng.tokenizer.chat(rq.chat_messages(req.messages),
                                                rq.template_kwargs(req.chat_template_kwargs))
                max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
            else:
                req = msgspec.json.decode(body, type=rq.CompletionRequest)
                prompt = rq.token_prompt(req.prompt)
                prompt_ids = eng.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
                max_tokens = req.max_tokens
                if req.echo:
                    raise rq.RequestError("echo is not supported", param="echo")
            if req.model is not None and req.model != eng.model:
                raise rq.RequestError(f"The model `{req.model}` does not exist.", 404, "model")
            if (req.n or 1) != 1:
                raise rq.RequestError("only n=1 is supported", param="n")
            if req.logprobs not in (None, False):
                raise rq.RequestError("logprobs are not supported", param="logprobs")
            if not prompt_ids:
                raise rq.RequestError("The prompt cannot be empty", param="messages" if chat else "prompt")
            if max_tokens is None:
                max_tokens = max(1, eng.max_model_len - len(prompt_ids))
            if max_tokens < 1:
                raise rq.RequestError("max_tokens must be at least 1", param="max_tokens")
            if req.min_p is not None and not 0.0 <= req.min_p <= 1.0:  # (the sim would take it as 0 or 1)
                raise rq.RequestError(f"min_p must be in [0, 1], got {req.min_p}.", param="min_p")
            stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
            params = SamplingParams.from_openai(req, max_tokens, stop)
            ids, params, proc = prepare(eng, prompt_ids, params, prime=True)
        except rq.RequestError as e:
            return rq.error_response(str(e), e.status, e.param)
        except (msgspec.DecodeError, EngineError, ValueError) as e:
            return rq.error_response(str(e))
        rid = next(self._ids)
        col = Collector(rid)
        self._requests[rid] = _Request(col, proc)
        try:
            eng.add(rid, ids, params)
        except EngineDead as e:  # (the process exits: the caller retries elsewhere)
            del self._requests[rid]
            return rq.error_response(str(e), 503)
        except EngineError as e:
            del self._requests[rid]
            return rq.error_response(str(e))
        enc = _Encoder(chat, eng.model, prompt_ids, self.token_ids and bool(req.return_token_ids))
        try:
            if req.stream:
                opts = req.stream_options
                return await self._stream(request, col, enc, bool(opts and opts.include_usage), proc)
            return await self._collect(col, enc, proc)
        finally:
            if self._requests.pop(rid, None) is not None:
                eng.abort(rid)

    async def _stream(self, request: web.Request, col: Collector, enc: _Encoder, usage: bool,
                      proc: OutputProcessor) -> web.StreamResponse:
        resp = web.StreamResponse(headers=_SSE_HEADERS)
        resp.enable_chunked_encoding()
        await resp.prepare(request)
        try:
            while True:
                ids, text, finish = await col.get()
                if finish == FinishReason.ERROR:
                    out = enc.chunk(ids, text, FinishReason.NONE) if ids or text else b""
                    error = rq.error_json(col.error or "generation failed", 500)
                    await resp.write(out + b"data: " + error + b"\n\n" + _DONE)
                    break
                out = enc.chunk(ids, text, finish, proc.stop_reason)
                if finish != FinishReason.NONE:
                    if usage:
                        out += enc.usage()
                    await resp.write(out + _DONE)
                    break
                await resp.write(out)
            await resp.write_eof()
        except ConnectionResetError:
            pass  # the client left; the caller aborts the request
        return resp

    async def _collect(self, col: Collector, enc: _Encoder, proc: OutputProcessor) -> web.Response:
        parts: list[str] = []
        all_ids: list[int] = []
        while True:
            ids, text, finish = await col.get()
            parts.append(text)
            all_ids.extend(ids)
            enc.completion_tokens += len(ids)
            if finish == FinishReason.ERROR:
                return rq.error_response(col.error or "generation failed", 500)
            if finish != FinishReason.NONE:
                break
        body = enc.full("".join(parts), all_ids, finish, proc.stop_reason)
        return web.Response(body=body, content_type="application/json")


class _Encoder:
    """The JSON bodies of one response (vLLM's shapes), fixed parts built once."""

    __slots__ = ("chat", "model", "prompt_ids", "token_ids", "completion_tokens", "_head", "_first", "_id", "_created")

    def __init__(self, chat: bool, model: str, prompt_ids: list[int], token_ids: bool) -> None:
        self.chat = chat
        self.model = model
        self.prompt_ids = prompt_ids
        self.token_ids = token_ids
        self.completion_tokens = 0
        self._first = True
        self._id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self._created = int(time.time())
        obj = b"chat.completion.chunk" if chat else b"text_completion"
        self._head = (
            b'data: {"id":"' + self._id.encode() + b'","object":"' + obj + b'","created":'
            + str(self._created).encode() + b',"model":' + _enc(model) + b',"choices":[{"index":0,'
        )

    def chunk(self, ids: list[int], text: str, finish: FinishReason, stop_reason: str | int | None = None) -> bytes:
        """SSE event(s) for new output (chat: a role chunk first); a finish
        chunk has vLLM's ``stop_reason``."""
        self.completion_tokens += len(ids)
        fin = b"null" if finish == FinishReason.NONE else _enc(finish.openai) + b',"stop_reason":' + _enc(stop_reason)
        tail = b',"token_ids":' + _enc(ids) if self.token_ids else b""
        out = b""
        if self.chat:
            if self._first:
                self._first = False
                extra = b',"prompt_token_ids":' + _enc(self.prompt_ids) if self.token_ids else b""
                out = (self._head + b'"delta":{"role":"assistant","content":""},"logprobs":null,'
                       b'"finish_reason":null}]' + extra + b"}\n\n")
            return out + (self._head + b'"delta":{"content":' + _enc(text) + b'},"logprobs":null,"finish_reason":'
                          + fin + tail + b"}]}\n\n")
        if self._first:
            self._first = False
            if self.token_ids:
                tail += b',"prompt_token_ids":' + _enc(self.prompt_ids)
        return self._head + b'"text":' + _enc(text) + b',"logprobs":null,"finish_reason":' + fin + tail + b"}]}\n\n"

    def _usage(self) -> dict[str, int]:
        p, c = len(self.prompt_ids), self.completion_tokens
        return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c}

    def usage(self) -> bytes:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return b"data: " + _enc({"id": self._id, "object": obj, "created": self._created, "model": self.model,
                                 "choices": [], "usage": self._usage()}) + b"\n\n"

    def full(self, text: str, ids: list[int], finish: FinishReason, stop_reason: str | int | None = None) -> bytes:
        """A non-streamed response."""
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish.openai,
                                  "stop_reason": stop_reason}
        body: dict[str, Any] = {"id": self._id, "created": self._created, "model": self.model}
        if self.chat:
            body["object"] = "chat.completion"
            choice["message"] = {"role": "assistant", "content": text}
            if self.token_ids:
                body["prompt_token_ids"] = self.prompt_ids
        else:
            body["object"] = "text_completion"
            choice["text"] = text
            if self.token_ids:
                choice["prompt_token_ids"] = self.prompt_ids
        if self.token_ids:
            choice["token_ids"] = ids
        body["choices"] = [choice]
        body["usage"] = self._usage()
        return _enc(body)


async def serve_openai(
    engine: str,
    config: dict[str, Any],
    host: str,
    port: int,
    *,
    token_ids: bool = True,
    api_key: str = "",
    stream_interval: int = 1,
    exit_with_parent: bool = False,
) -> None:
    """Run an OpenAI-compatible server until SIGTERM/SIGINT (or, with
    ``exit_with_parent``, until the process that started it exits)."""
    server = OpenAIServer(engine, config, token_ids=token_ids, api_key=api_key, stream_interval=stream_interval)
    bound = await server.start(host, port)
    where = f"http://{join_host_port(host, bound)}/v1"
    log.info("replica ready on %s: OpenAI server for %s (%s)%s", where, server.engine.model, engine,
             "" if token_ids else " (no token ids)")
    await wait_for_stop(exit_with_parent, watch_engine(server.engine))
    await server.close()
    exit_if_dead(server.engine)
