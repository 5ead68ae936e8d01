"""The load client: raw asyncio HTTP/1.1 with SSE parsing, or the replica protocol.

One ``Job`` runs in one worker process (uvloop): ``concurrency`` virtual users,
each on its own keep-alive connection, send streaming requests back to back
until ``requests`` were sent or ``budget_s`` passed; whatever is still open at
``deadline_s`` is cancelled and counted as an error. The parent splits a
scenario over several worker processes so that the client is not the
bottleneck on a small machine, and reports the workers' own CPU time.

Measured per request, from just before the request bytes are written:

* **TTFT**: to the first network read that completes an event carrying
  content (a token).
* **Inter-token latency**: for each later read that carries ``k`` tokens,
  ``(gap since the previous such read) / k``, counted ``k`` times (per-token
  percentiles, as a user sees them; events that arrive in one read arrived
  together).
* **Tokens**: ``usage.completion_tokens`` of the final usage chunk when the
  server sends one, else counted from the text (the mock's tokens are 4
  characters; the sim's byte-level tokens are one UTF-8 byte each).

Errors: ``http_<status>``, ``truncated`` (no ``[DONE]``), ``short`` (fewer
tokens than asked), ``stream_error``, ``transport:<Exception>``, ``cancelled``.
"""

from __future__ import annotations

import asyncio
import resource
import time
from array import array

import msgspec

from ops.loadgen.sse import decode_chunk
from replicas.http11 import sse_data

__all__ = ["Job", "WorkerResult", "run_job"]


class Job(msgspec.Struct, kw_only=True):
    kind: str = "http"  # "http" or "replica"
    host: str = "127.0.0.1"
    ports: list[int] = []  # http: users alternate between these
    path: str = "/v1/chat/completions"
    body: bytes = b""  # http: the JSON request body
    keys: list[str] = []  # API keys, used round robin by the users
    addresses: list[str] = []  # replica: "unix:/path" of each replica
    max_tokens: int = 16  # replica: tokens per request; both: expected tokens
    concurrency: int = 1
    requests: int = 1
    budget_s: float = 30.0
    deadline_s: float = 60.0
    ramp_s: float = 0.0  # spread the users' first requests over this
    token_chars: int = 4  # 0: count UTF-8 bytes (byte-level tokenizer)
    worker: int = 0


class WorkerResult(msgspec.Struct, kw_only=True):
    ttft: list[float] = []
    itl: bytes = b""  # array('d') of per-token gaps
    e2e: list[float] = []
    tokens: int = 0
    events: int = 0  # SSE events (replica: collector gets) that carried tokens
    ok: int = 0
    errors: dict[str, int] = {}
    t_start: float = 0.0  # time.time() of the first send
    t_end: float = 0.0  # time.time() when the last request ended
    cpu_s: float = 0.0  # the worker's own user+system CPU for the job




class _Stats:
    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.itl = array("d")
        self.e2e: list[float] = []
        self.tokens = 0
        self.events = 0
        self.ok = 0
        self.errors: dict[str, int] = {}
        self.t_start = 0.0
        self.t_end = 0.0

    def error(self, kind: str) -> None:
        self.errors[kind] = self.errors.get(kind, 0) + 1


class _HttpError(Exception):
    pass


class _Conn:
    """One keep-alive HTTP/1.1 connection."""

    def __init__(self, job: Job, port: int) -> None:
        self.job = job
        self.port = port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.job.host, self.port, limit=1 << 20)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None


def _head(job: Job, port: int, key: str) -> bytes:
    return (
        f"POST {job.path} HTTP/1.1\r\nHost: {job.host}:{port}\r\nAuthorization: Bearer {key}\r\n"
        f"Content-Type: application/json\r\nAccept: text/event-stream\r\nContent-Length: {len(job.body)}\r\n\r\n"
    ).encode()


class _Body:
    """Incremental HTTP body decoder (chunked, content-length or until close)."""

    __slots__ = ("chunked", "remaining", "buf", "need", "state", "done")

    def __init__(self, chunked: bool, length: int | None) -> None:
        self.chunked = chunked
        self.remaining = length  # content-length mode
        self.buf = bytearray()
        self.need = 0  # chunked: data bytes of the current chunk still to come
        self.state = 0  # chunked: 0 size line, 1 data, 2 CRLF after the data
        self.done = False

    def feed(self, data: bytes) -> bytes:
        if not self.chunked:
            if self.remaining is not None:
                data = data[: self.remaining]
                self.remaining -= len(data)
                if self.remaining <= 0:
                    self.done = True
            return data
        buf = self.buf
        buf += data
        out = bytearray()
        pos = 0
        n = len(buf)
        while not self.done:
            if self.state == 0:
                eol = buf.find(b"\r\n", pos)
                if eol < 0:
                    break
                size = int(bytes(buf[pos:eol]).split(b";", 1)[0], 16)
                pos = eol + 2
                if size == 0:
                    self.done = True
                    pos = n
                    break
                self.need = size
                self.state = 1
            elif self.state == 1:
                take = min(self.need, n - pos)
                if take <= 0:
                    break
                out += buf[pos : pos + take]
                pos += take
                self.need -= take
                if self.need:
                    break
                self.state = 2
            else:
                if n - pos < 2:
                    break
                pos += 2
                self.state = 0
        del buf[:pos]
        return bytes(out)


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    data = b""
    while True:
        chunk = await reader.read(65536)
        if not chunk:
            raise ConnectionResetError("closed before the response head")
        data += chunk
        end = data.find(b"\r\n\r\n")
        if end >= 0:
            break
    lines = data[:end].decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    headers = {}
    for line in lines[1:]:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    return status, headers, data[end + 4 :]


async def _http_request(conn: _Conn, job: Job, key: str, st: _Stats, open_streams) -> None:
    if conn.writer is None:
        await conn.open()
    reader, writer = conn.reader, conn.writer
    token_chars = job.token_chars
    t0 = time.perf_counter()
    if not st.t_start:
        st.t_start = time.time()
    writer.write(_head(job, conn.port, key) + job.body)
    status, headers, rest = await _read_head(reader)
    chunked = "chunked" in headers.get("transfer-encoding", "")
    length = int(headers["content-length"]) if "content-length" in headers else None
    body = _Body(chunked, length)
    keep = headers.get("connection", "").lower() != "close"
    if status != 200:
        data = body.feed(rest)
        while not body.done:
            chunk = await reader.read(65536)
            if not chunk:
                break
            body.feed(chunk)
        if not keep or not body.done:
            conn.close()
        raise _HttpError(f"http_{status}")
    sse = b""
    counted = 0
    usage = None
    done = False
    first_at = None
    last_at = 0.0
    itl = st.itl
    opened = False
    stream_error = False
    pending = rest
    try:
        while True:
            if pending:
                data, pending = pending, b""
            else:
                data = await reader.read(262144)
                if not data:
                    break
            now = time.perf_counter()
            sse += body.feed(data)
            if b"\n\n" not in sse and b"\r\n\r\n" not in sse:
                if body.done:
                    break
                continue
            payloads, sse = sse_data(sse)
            k = 0
            for payload in payloads:
                if payload == b"[DONE]":
                    done = True
                    continue
                chunk = decode_chunk(payload)  # the load generator's chunk decoder
                if chunk.error is not None:
                    stream_error = True
                    continue
                if chunk.usage is not None and chunk.usage.completion_tokens:
                    usage = chunk.usage.completion_tokens
                t = chunk.text()
                if t:
                    k += len(t) // token_chars if token_chars else len(t.encode())
                    st.events += 1
            if k:
                counted += k
                if first_at is None:
                    first_at = now
                    st.ttft.append(now - t0)
                    open_streams_add(open_streams, 1)
                    opened = True
                else:
                    gap = (now - last_at) / k
                    itl.extend([gap] * k) if k > 1 else itl.append(gap)
                last_at = now
            if done or body.done:
                break
    finally:
        if opened:
            open_streams_add(open_streams, -1)
    if not body.done:
        # drain the terminating chunk so the connection can be reused
        while not body.done:
            data = await reader.read(65536)
            if not data:
                break
            body.feed(data)
    if not keep or not body.done:
        conn.close()
    st.e2e.append(time.perf_counter() - t0)
    st.t_end = time.time()
    tokens = usage if usage is not None else counted
    st.tokens += tokens
    if stream_error:
        raise _HttpError("stream_error")
    if not done:
        raise _HttpError("truncated")
    if tokens < job.max_tokens:
        raise _HttpError("short")


def open_streams_add(counter, n: int) -> None:
    if counter is not None:
        with counter.get_lock():
            counter.value += n


async def _http_user(job: Job, i: int, st: _Stats, launched: list[int], t_begin: float, open_streams) -> None:
    conn = _Conn(job, job.ports[(job.worker + i) % len(job.ports)])
    key = job.keys[(job.worker + i) % len(job.keys)] if job.keys else "none"
    try:
        if job.ramp_s:
            await asyncio.sleep(job.ramp_s * i / max(1, job.concurrency))
        while launched[0] < job.requests and time.perf_counter() - t_begin < job.budget_s:
            launched[0] += 1
            try:
                await _http_request(conn, job, key, st, open_streams)
                st.ok += 1
            except _HttpError as e:
                st.error(str(e))
            except (OSError, asyncio.IncompleteReadError, ValueError, msgspec.DecodeError) as e:
                st.error(f"transport:{type(e).__name__}")
                conn.close()
                st.t_end = time.time()
    except asyncio.CancelledError:
        st.error("cancelled")
        raise
    finally:
        conn.close()


async def _replica_user(job: Job, i: int, st: _Stats, launched: list[int], t_begin: float, open_streams,
                        clients: list) -> None:
    from replicas.client import ReplicaDead
    from replicas.protocol import FinishReason, SamplingParams

    params = SamplingParams(max_tokens=job.max_tokens, temperature=0.0, ignore_eos=True)
    prompt = f"bench user {job.worker}-{i}: tell me about the cluster"
    n = 0
    try:
        if job.ramp_s:
            await asyncio.sleep(job.ramp_s * i / max(1, job.concurrency))
        while launched[0] < job.requests and time.perf_counter() - t_begin < job.budget_s:
            launched[0] += 1
            client = clients[(i + n) % len(clients)]
            n += 1
            t0 = time.perf_counter()
            if not st.t_start:
                st.t_start = time.time()
            col = client.generate(params, prompt=prompt)
            first_at = None
            last_at = 0.0
            tokens = 0
            opened = False
            try:
                while True:
                    ids, _text, finish = await col.get()
                    now = time.perf_counter()
                    k = len(ids)
                    if k:
                        st.events += 1
                        tokens += k
                        if first_at is None:
                            first_at = now
                            st.ttft.append(now - t0)
                            open_streams_add(open_streams, 1)
                            opened = True
                        else:
                            gap = (now - last_at) / k
                            st.itl.extend([gap] * k) if k > 1 else st.itl.append(gap)
                        last_at = now
                    if finish != FinishReason.NONE:
                        break
                client.release(col)
                st.e2e.append(time.perf_counter() - t0)
                st.t_end = time.time()
                st.tokens += tokens
                if finish == FinishReason.ERROR:
                    st.error("stream_error")
                elif tokens < job.max_tokens:
                    st.error("short")
                else:
                    st.ok += 1
            except ReplicaDead:
                st.error("transport:ReplicaDead")
            except asyncio.CancelledError:
                client.abort(col)
                raise
            finally:
                if opened:
                    open_streams_add(open_streams, -1)
    except asyncio.CancelledError:
        st.error("cancelled")
        raise


async def _run(job: Job, open_streams) -> _Stats:
    st = _Stats()
    launched = [0]
    t_begin = time.perf_counter()
    clients: list = []
    if job.kind == "replica":
        from replicas.client import connect

        for j, addr in enumerate(job.addresses):
            clients.append(await connect(f"bench-{j}", addr))
        users = [_replica_user(job, i, st, launched, t_begin, open_streams, clients) for i in range(job.concurrency)]
    else:
        users = [_http_user(job, i, st, launched, t_begin, open_streams) for i in range(job.concurrency)]
    tasks = [asyncio.ensure_future(u) for u in users]
    remaining = job.deadline_s - (time.perf_counter() - t_begin)
    done, pending = await asyncio.wait(tasks, timeout=max(0.1, remaining))
    for t in pending:
        t.cancel()
    if pending:
        await asyncio.gather(*pending, return_exceptions=True)
    for c in clients:
        await c.close()
    if not st.t_end:
        st.t_end = time.time()
    return st


def run_job(job: Job, open_streams=None, out_conn=None) -> WorkerResult:
    """Run ``job`` in this process (a worker); send the result to ``out_conn``."""
    import uvloop

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    st = uvloop.run(_run(job, open_streams))
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    res = WorkerResult(
        ttft=st.ttft, itl=st.itl.tobytes(), e2e=st.e2e, tokens=st.tokens, events=st.events, ok=st.ok,
        errors=st.errors,
        t_start=st.t_start, t_end=st.t_end,
        cpu_s=(ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime),
    )
    if out_conn is not None:
        out_conn.send_bytes(msgspec.msgpack.encode(res))
        out_conn.close()
    return res


def _worker_main(job_bytes: bytes, open_streams, out_conn) -> None:
    run_job(msgspec.msgpack.decode(job_bytes, type=Job), open_streams, out_conn)
