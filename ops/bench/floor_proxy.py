"""The floor of a Python streaming router: the least per-token work one can do on uvloop.

A benchmark reference, not a product: it answers "how close to vllm-router
can a router written in Python get, whatever its design?". Per request it
parses the client's request (httptools), checks the bearer key in a dict,
decodes the body (msgspec), asks an upstream for it with token ids on a
kept-alive connection (round robin), and relays the stream. Per token it does
what any relay that counts tokens and can resume must do, and nothing else:
HTTP/1.1 chunked decoding and SSE splitting of the upstream's body, one
msgspec decode of the chunk, the token ids kept, the stream position counted,
a clock read, the client's event encoded once (fairstream's chunk format and
``id: N-T-C``), kept for a resume (a list append) and written with one
``transport.write``. No limits, fair share, metrics, timeouts, failover or
backpressure: those are what fairstream adds on top.

``--features`` adds fairstream's bookkeeping, each done the cheapest way
this design allows, to tell what the features cost from what fairstream's
layering costs: per token a Prometheus inter-token histogram sample
(prometheus-client, one labelled child per tenant), the tenant's fair-share
counter charged, the replica's in-flight token load and the stall
watchdog's last-token time moved; per request a token counter, a duration
histogram and a JSON log line (msgspec) to a file.

``python -m ops.bench.floor_proxy --port P --upstream 127.0.0.1:9001 --upstream 127.0.0.1:9002 --key K``
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import sys
import time

import httptools
import msgspec

__all__ = ["main"]

_enc = msgspec.json.encode


class _Delta(msgspec.Struct):
    content: str | None = None


class _Choice(msgspec.Struct):
    index: int = 0
    text: str | None = None
    delta: _Delta | None = None
    token_ids: list[int] | None = None
    finish_reason: str | None = None


class _Chunk(msgspec.Struct):
    choices: list[_Choice] = []
    prompt_token_ids: list[int] | None = None


_decode_chunk = msgspec.json.Decoder(_Chunk).decode
_SSE_HEAD = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ncache-control: no-cache\r\n"
             b"transfer-encoding: chunked\r\n\r\n")
_DONE = b"e\r\ndata: [DONE]\n\n\r\n0\r\n\r\n"


class _Stream:
    """One relayed stream: the client's transport and the per-token state."""

    __slots__ = (
        "chars",
        "client",
        "head",
        "ids",
        "itl",
        "kept",
        "last",
        "load",
        "n",
        "started",
        "t0",
        "tenant",
        "tokens",
    )

    def __init__(self, client, rid: int, model: str, tenant: str = "", itl=None) -> None:
        self.client = client
        self.tenant = tenant
        self.itl = itl  # the tenant's inter-token histogram child (--features)
        self.t0 = time.monotonic()
        self.load = None
        self.head = (b'{"id":"chatcmpl-' + str(rid).encode() + b'","object":"chat.completion.chunk","created":'
                     + str(int(time.time())).encode() + b',"model":' + _enc(model) + b',"choices":[{"index":0,')
        self.n = 0
        self.tokens = 0
        self.chars = 0
        self.ids: list[int] = []
        self.kept: list[bytes] = []  # the resume buffer
        self.last = 0.0
        self.started = False


class _Upstream(asyncio.Protocol):
    """One kept-alive connection to an upstream; relays one response at a time."""

    def __init__(self, pool: list) -> None:
        self.pool = pool
        self.transport = None
        self.stream: _Stream | None = None
        self.buf = b""
        self.body = False
        self.sse = b""

    def connection_made(self, transport) -> None:
        self.transport = transport

    def connection_lost(self, exc) -> None:
        if self in self.pool:
            self.pool.remove(self)
        st, self.stream = self.stream, None
        if st is not None:
            st.client.transport.close()

    def send(self, st: _Stream, request: bytes) -> None:
        self.stream, self.buf, self.body, self.sse = st, b"", False, b""
        self.transport.write(request)

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        if not self.body:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                self.buf = buf
                return
            buf = buf[end + 4:]
            self.body = True
        # chunked body: size line, data, CRLF
        out = []
        pos = 0
        size_end = buf.find(b"\r\n", pos)
        while size_end >= 0:
            size = int(buf[pos:size_end], 16)
            if size == 0:
                self._finish(out)
                return
            stop = size_end + 2 + size
            if len(buf) < stop + 2:
                break
            out.append(buf[size_end + 2:stop])
            pos = stop + 2
            size_end = buf.find(b"\r\n", pos)
        self.buf = buf[pos:]
        if out:
            self._events(b"".join(out))

    def _events(self, body: bytes) -> None:
        sse = self.sse + body if self.sse else body
        *events, self.sse = sse.split(b"\n\n")
        st = self.stream
        for ev in events:
            if not ev.startswith(b"data: ") or ev == b"data: [DONE]":
                continue
            chunk = _decode_chunk(ev[6:])
            if not chunk.choices:
                continue
            ch = chunk.choices[0]
            text = ch.delta.content if ch.delta is not None else ch.text
            ids = ch.token_ids
            if not ids and not text:
                continue
            now = time.monotonic()
            n = len(ids) if ids else 0
            if ids:
                st.ids += ids
                st.tokens += n
            st.chars += len(text)
            if st.itl is not None:
                if st.n:
                    st.itl.observe((now - st.last) / (n or 1))
                _FAIR[st.tenant] = _FAIR.get(st.tenant, 0.0) + 2.0 * n
                st.load.inflight_tokens -= n
            st.last = now
            st.n += 1
            fin = b"null" if ch.finish_reason is None else _enc(ch.finish_reason)
            event = (b"id: %d-%d-%d\ndata: " % (st.n, st.tokens, st.chars) + st.head
                     + b'"delta":{"content":' + _enc(text) + b'},"logprobs":null,"finish_reason":' + fin
                     + b"}]}\n\n")
            st.kept.append(event)
            w = st.client.transport.write
            if not st.started:
                st.started = True
                w(_SSE_HEAD)
            w(b"%x\r\n%s\r\n" % (len(event), event))

    def _finish(self, out: list[bytes]) -> None:
        if out:
            self._events(b"".join(out))
        st, self.stream, self.buf, self.body = self.stream, None, b"", False
        self.pool.append(self)
        if st is not None:
            if not st.started:
                st.client.transport.write(_SSE_HEAD)
            st.client.transport.write(_DONE)
            st.client.busy = False
            if st.itl is not None:
                _settle(st)


_FAIR: dict[str, float] = {}  # fair-share counters (--features)
_METRICS = None


class _Load:
    __slots__ = ("inflight", "inflight_tokens")

    def __init__(self) -> None:
        self.inflight = 0
        self.inflight_tokens = 0


def _settle(st: _Stream) -> None:
    tokens, e2e, log = _METRICS
    elapsed = time.monotonic() - st.t0
    tokens.labels(st.tenant, "completion").inc(st.tokens)
    e2e.labels(st.tenant).observe(elapsed)
    st.load.inflight -= 1
    log.write(_enc({"ts": time.time(), "level": "info", "logger": "fairstream.request", "msg": "request ok",
                    "tenant": st.tenant, "outcome": "ok", "duration_s": round(elapsed, 4),
                    "completion_tokens": st.tokens}) + b"\n")


class _Client(asyncio.Protocol):
    """One client connection (keep-alive, one request at a time)."""

    def __init__(self, proxy: _Proxy) -> None:
        self.proxy = proxy
        self.transport = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.key = b""
        self.body: list[bytes] = []
        self.busy = False

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.transport.close()

    def on_url(self, url: bytes) -> None:
        self.url = url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"authorization":
            self.key = value

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        body, self.body = b"".join(self.body), []
        self.proxy.handle(self, body)


class _Proxy:
    def __init__(self, upstreams: list[tuple[str, int]], keys: dict[bytes, str], features: bool = False) -> None:
        self.upstreams = upstreams
        self.keys = keys
        self.features = features
        self.loads = [_Load() for _ in upstreams]
        self.itl: dict[str, object] = {}
        self.pools: list[list[_Upstream]] = [[] for _ in upstreams]
        self.next = itertools.cycle(range(len(upstreams)))
        self.ids = itertools.count(1)
        self.tasks: set[asyncio.Task] = set()

    def handle(self, client: _Client, body: bytes) -> None:
        if client.url.startswith(b"/health"):
            client.transport.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\n{}")
            return
        if client.key not in self.keys:
            msg = b'{"error":{"message":"bad key","type":"invalid_request_error"}}'
            client.transport.write(b"HTTP/1.1 401 Unauthorized\r\ncontent-type: application/json\r\n"
                                   b"content-length: %d\r\n\r\n%s" % (len(msg), msg))
            return
        req = msgspec.json.decode(body)
        req["return_token_ids"] = True
        up_body = _enc(req)
        i = next(self.next)
        host, port = self.upstreams[i]
        request = (b"POST /v1/chat/completions HTTP/1.1\r\nhost: %s:%d\r\ncontent-type: application/json\r\n"
                   b"content-length: %d\r\n\r\n%s" % (host.encode(), port, len(up_body), up_body))
        tenant = self.keys[client.key]
        itl = None
        if self.features:
            itl = self.itl.get(tenant)
            if itl is None:
                itl = self.itl[tenant] = _ITL.labels(tenant)
        st = _Stream(client, next(self.ids), str(req.get("model", "")), tenant, itl)
        if self.features:
            st.load = self.loads[i]
            st.load.inflight += 1
            st.load.inflight_tokens += int(req.get("max_tokens") or 16)
        client.busy = True
        pool = self.pools[i]
        if pool:
            pool.pop().send(st, request)
            return
        t = asyncio.get_running_loop().create_task(self._open(i, st, request))
        self.tasks.add(t)
        t.add_done_callback(self.tasks.discard)

    async def _open(self, i: int, st: _Stream, request: bytes) -> None:
        host, port = self.upstreams[i]
        pool = self.pools[i]
        try:
            _, up = await asyncio.get_running_loop().create_connection(lambda: _Upstream(pool), host, port)
        except OSError:
            st.client.transport.close()
            return
        up.send(st, request)


_ITL = None


async def _serve(port: int, upstreams: list[tuple[str, int]], keys: dict[bytes, str], features: bool) -> None:
    global _ITL, _METRICS
    if features:
        from prometheus_client import Counter, Histogram

        _ITL = Histogram("floor_itl_seconds", "inter-token latency", ["tenant"],
                         buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0))
        _METRICS = (Counter("floor_tokens", "tokens", ["tenant", "kind"]),
                    Histogram("floor_e2e_seconds", "request duration", ["tenant"]), sys.stderr.buffer)
    proxy = _Proxy(upstreams, keys, features)
    server = await asyncio.get_running_loop().create_server(lambda: _Client(proxy), "127.0.0.1", port,
                                                            backlog=4096)
    print(f"floor proxy ready on 127.0.0.1:{port}", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="floor_proxy", description=__doc__.split("\n\n")[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--upstream", action="append", required=True, help="host:port (repeat)")
    p.add_argument("--key", action="append", default=[], help="accepted API key (repeat)")
    p.add_argument("--features", action="store_true", help="fairstream's bookkeeping too (see the docstring)")
    a = p.parse_args(argv)
    ups = [(u.rsplit(":", 1)[0], int(u.rsplit(":", 1)[1])) for u in a.upstream]
    import uvloop

    keys = {b"Bearer " + k.encode(): f"t{i}" for i, k in enumerate(a.key)}
    uvloop.run(_serve(a.port, ups, keys, a.features))


if __name__ == "__main__":
    main()
