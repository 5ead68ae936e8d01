"""A fast mock OpenAI-compatible upstream for router benchmarks.

Raw asyncio HTTP/1.1 (keep-alive, chunked responses) on uvloop, so the mock
costs little CPU next to the routers it feeds. It serves:

* ``POST /v1/completions`` and ``POST /v1/chat/completions``: ``max_tokens``
  tokens (4-character texts shaped like ``TOKEN``), streamed as OpenAI chunks
  (``data: {...}``, one write per token, ``data: [DONE]``) or as one JSON
  body. The first token goes out ``first_ms`` after the request, the second
  ``hold_ms`` + ``delay_ms`` after the first, the rest ``delay_ms`` apart
  (``delay_ms`` 0: one event-loop turn between tokens). vLLM extensions:
  ``return_token_ids`` (``prompt_token_ids`` with the first chunk, ``token_ids``
  in every chunk) and ``stream_options.include_usage``.
* ``GET /v1/models``, ``GET /health``; ``GET /metrics`` is 404 (not vLLM).
* ``POST /_bench/config`` ``{"delay_ms", "hold_ms", "first_ms"}`` changes the
  timing for later requests; ``GET /_bench/stats`` counts requests, tokens
  and open streams.

``python -m ops.bench.mock_upstream --port 9001 [--delay-ms 0] [--hold-ms 0]``
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import time

import msgspec

__all__ = ["TOKEN", "MODEL", "MockConfig", "serve"]

TOKEN = "t000"
"""Shape of a generated token's text: 4 characters (``t`` and the token's index
modulo 1000), so clients count tokens by length; the text varies because
LiteLLM ends streams that repeat one chunk."""
MODEL = "mock"

_enc = msgspec.json.encode


class MockConfig(msgspec.Struct):
    delay_ms: float = 0.0
    hold_ms: float = 0.0
    first_ms: float = 0.0


class _StreamOptions(msgspec.Struct):
    include_usage: bool = False


class _Message(msgspec.Struct):
    content: str | None = ""
    role: str = "user"


class _Body(msgspec.Struct):
    model: str = MODEL
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    stream: bool = False
    stream_options: _StreamOptions | None = None
    return_token_ids: bool = False
    prompt: str | list | None = None
    messages: list[_Message] | None = None


_decode_body = msgspec.json.Decoder(_Body).decode

_MODELS = _enc({"object": "list", "data": [
    {"id": MODEL, "object": "model", "created": 0, "owned_by": "bench", "max_model_len": 65536}]})
_HEALTH = b"{}"
_REASONS = {200: b"OK", 400: b"Bad Request", 404: b"Not Found", 405: b"Method Not Allowed"}


class _Stats:
    requests = 0
    tokens = 0
    open_streams = 0


class _Server:
    def __init__(self, config: MockConfig) -> None:
        self.config = config
        self.stats = _Stats()
        self.ids = itertools.count(1)


def _response(status: int, body: bytes, ctype: bytes = b"application/json") -> bytes:
    return (b"HTTP/1.1 %d %s\r\ncontent-type: %s\r\ncontent-length: %d\r\n\r\n%s"
            % (status, _REASONS.get(status, b"X"), ctype, len(body), body))


def _chunk(data: bytes) -> bytes:
    """One HTTP/1.1 chunk."""
    return b"%x\r\n%s\r\n" % (len(data), data)


_SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
             b"transfer-encoding: chunked\r\n\r\n")
_DONE = _chunk(b"data: [DONE]\n\n")
_END = b"0\r\n\r\n"


class _Protocol(asyncio.Protocol):
    __slots__ = ("srv", "transport", "buf", "task", "paused", "drain", "closed")

    def __init__(self, srv: _Server) -> None:
        self.srv = srv
        self.transport: asyncio.Transport | None = None
        self.buf = b""
        self.task: asyncio.Task | None = None
        self.paused = False
        self.drain: asyncio.Future | None = None
        self.closed = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        self.closed = True
        if self.task is not None:
            self.task.cancel()
        if self.drain is not None and not self.drain.done():
            self.drain.set_result(None)

    def pause_writing(self) -> None:
        self.paused = True

    def resume_writing(self) -> None:
        self.paused = False
        if self.drain is not None and not self.drain.done():
            self.drain.set_result(None)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        if self.task is None:
            self._next()

    def _next(self) -> None:
        """Parse and start the next complete request in the buffer (keep-alive)."""
        buf = self.buf
        end = buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = buf[:end].decode("latin-1")
        lines = head.split("\r\n")
        try:
            method, path, _ = lines[0].split(" ", 2)
        except ValueError:
            self.transport.close()
            return
        length = 0
        for line in lines[1:]:
            k, _, v = line.partition(":")
            if k.strip().lower() == "content-length":
                length = int(v.strip())
        if len(buf) < end + 4 + length:
            return
        body = buf[end + 4 : end + 4 + length]
        self.buf = buf[end + 4 + length :]
        self.task = asyncio.get_running_loop().create_task(self._handle(method, path.split("?", 1)[0], body))

    async def _wait_drain(self) -> None:
        if self.paused and not self.closed:
            self.drain = asyncio.get_running_loop().create_future()
            await self.drain

    async def _handle(self, method: str, path: str, body: bytes) -> None:
        try:
            await self._route(method, path, body)
        except asyncio.CancelledError:
            return
        except Exception as e:  # noqa: BLE001 - a broken request must not kill the server
            if not self.closed:
                self.transport.write(_response(400, _enc({"error": {"message": str(e), "type": "bad_request"}})))
        self.task = None
        if not self.closed and self.buf:
            self._next()

    async def _route(self, method: str, path: str, body: bytes) -> None:
        w = self.transport.write
        srv = self.srv
        if path in ("/v1/completions", "/v1/chat/completions") and method == "POST":
            await self._generate(path.endswith("chat/completions"), _decode_body(body))
        elif path == "/v1/models":
            w(_response(200, _MODELS))
        elif path in ("/health", "/v1/health", "/health_generate", "/readiness", "/liveness"):
            w(_response(200, _HEALTH))
        elif path == "/_bench/config" and method == "POST":
            srv.config = msgspec.json.decode(body, type=MockConfig)
            w(_response(200, _enc(srv.config)))
        elif path == "/_bench/stats":
            s = srv.stats
            w(_response(200, _enc({"requests": s.requests, "tokens": s.tokens, "open_streams": s.open_streams})))
        else:
            w(_response(404, _enc({"error": {"message": f"no route {path}", "type": "not_found"}})))

    async def _generate(self, chat: bool, req: _Body) -> None:
        srv = self.srv
        cfg = srv.config
        n = req.max_tokens or req.max_completion_tokens or 16
        srv.stats.requests += 1
        rid = next(srv.ids)
        created = int(time.time())
        if chat:
            prompt_len = sum(len((m.content or "").encode()) for m in (req.messages or ()))
        elif isinstance(req.prompt, list):
            prompt_len = len(req.prompt)
        else:
            prompt_len = len((req.prompt or "").encode()) if isinstance(req.prompt, (str, type(None))) else 1
        prompt_len = max(prompt_len, 1)
        usage = {"prompt_tokens": prompt_len, "completion_tokens": n, "total_tokens": prompt_len + n}
        if not req.stream:
            if cfg.first_ms or cfg.delay_ms or cfg.hold_ms:
                await asyncio.sleep((cfg.first_ms + cfg.hold_ms + cfg.delay_ms * max(0, n - 1)) / 1000)
            text = "".join(f"t{i % 1000:03d}" for i in range(n))
            choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
                      if chat else {"index": 0, "text": text, "finish_reason": "length"})
            obj = {"id": f"cmpl-{rid}", "object": "chat.completion" if chat else "text_completion",
                   "created": created, "model": req.model, "choices": [choice], "usage": usage}
            srv.stats.tokens += n
            self.transport.write(_response(200, _enc(obj)))
            return
        ids = req.return_token_ids
        head = (b'data: {"id":"' + (b"chatcmpl-" if chat else b"cmpl-") + str(rid).encode() + b'","object":"'
                + (b"chat.completion.chunk" if chat else b"text_completion") + b'","created":'
                + str(created).encode() + b',"model":' + _enc(req.model) + b',"choices":[')
        if chat:
            pre = b'{"index":0,"delta":{"content":"t'
            post = b'"},"logprobs":null,"finish_reason":'
        else:
            pre = b'{"index":0,"text":"t'
            post = b'","logprobs":null,"finish_reason":'
        w = self.transport.write
        s = srv.stats
        s.open_streams += 1
        try:
            w(_SSE_HEAD)
            if cfg.first_ms:
                await asyncio.sleep(cfg.first_ms / 1000)
            first = b""
            if chat:
                extra = b""
                if ids:
                    extra = b',"prompt_token_ids":' + _enc(list(range(prompt_len)))
                first = _chunk(head + b'{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,'
                               b'"finish_reason":null}]' + extra + b"}\n\n")
            delay = cfg.delay_ms / 1000
            for i in range(n):
                if i:
                    pause = delay + (cfg.hold_ms / 1000 if i == 1 else 0.0)
                    await asyncio.sleep(pause)
                    if self.closed:
                        return
                    await self._wait_drain()
                last = i == n - 1
                fin = b'"length"' if last else b"null"
                tail = b"}]}\n\n"
                if ids:
                    tail = b',"token_ids":[' + str(100 + i % 100).encode() + b"]"
                    if i == 0 and not chat:
                        tail += b',"prompt_token_ids":' + _enc(list(range(prompt_len)))
                    tail += b"}]}\n\n"
                data = _chunk(head + pre + b"%03d" % (i % 1000) + post + fin + tail)
                if i == 0 and first:
                    data = first + data
                w(data)
                s.tokens += 1
            if req.stream_options is not None and req.stream_options.include_usage:
                w(_chunk(head + b"]," + b'"usage":' + _enc(usage) + b"}\n\n"))
            w(_DONE + _END)
        finally:
            s.open_streams -= 1


async def serve(host: str, port: int, config: MockConfig) -> None:
    srv = _Server(config)
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: _Protocol(srv), host, port, backlog=4096, reuse_address=True)
    print(f"mock upstream ready on {host}:{port}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="mock_upstream", description=__doc__.split("\n\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--delay-ms", type=float, default=0.0)
    p.add_argument("--hold-ms", type=float, default=0.0)
    p.add_argument("--first-ms", type=float, default=0.0)
    a = p.parse_args(argv)
    cfg = MockConfig(a.delay_ms, a.hold_ms, a.first_ms)
    try:
        import uvloop

        uvloop.run(serve(a.host, a.port, cfg))
    except ImportError:  # pragma: no cover
        asyncio.run(serve(a.host, a.port, cfg))
    except KeyboardInterrupt:
        pass


if __name__ == "__main__":
    main()
