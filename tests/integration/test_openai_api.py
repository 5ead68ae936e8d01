"""The OpenAI API as the official SDK sees it, against a real router and sim replicas."""

from __future__ import annotations

import asyncio
import json
import socket

import httpx
import openai
import pytest
import yaml

from tests.helpers import DEMO_TENANTS, GOLD, MODEL, RouterProcess, parse_sse, poll

IGNORE_EOS = {"ignore_eos": True}
REPLACEMENT = "\ufffd"


@pytest.fixture(scope="module")
def client(shared_router: RouterProcess):
    with openai.OpenAI(base_url=shared_router.base_url + "/v1", api_key=GOLD, max_retries=0, timeout=30) as c:
        yield c


@pytest.fixture
async def aclient(shared_router: RouterProcess):
    async with openai.AsyncOpenAI(
        base_url=shared_router.base_url + "/v1", api_key=GOLD, max_retries=0, timeout=30
    ) as c:
        yield c


def _chat(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def stream_chat(client: openai.OpenAI, content: str, **kw) -> tuple[list[str], str | None, list]:
    """(content pieces, finish reason, chunks) of one streamed chat completion."""
    pieces: list[str] = []
    finish = None
    chunks = []
    with client.chat.completions.create(model=MODEL, messages=_chat(content), stream=True, **kw) as stream:
        for chunk in stream:
            chunks.append(chunk)
            for choice in chunk.choices:
                if choice.delta.content:
                    pieces.append(choice.delta.content)
                if choice.finish_reason is not None:
                    assert finish is None, "two chunks carry a finish_reason"
                    finish = choice.finish_reason
    return pieces, finish, chunks


def stream_completion(client: openai.OpenAI, prompt: str, **kw) -> tuple[list[str], str | None, list]:
    pieces: list[str] = []
    finish = None
    chunks = []
    with client.completions.create(model=MODEL, prompt=prompt, stream=True, **kw) as stream:
        for chunk in stream:
            chunks.append(chunk)
            for choice in chunk.choices:
                if choice.text:
                    pieces.append(choice.text)
                if choice.finish_reason is not None:
                    assert finish is None, "two chunks carry a finish_reason"
                    finish = choice.finish_reason
    return pieces, finish, chunks


def test_models_lists_the_sim_model(client: openai.OpenAI) -> None:
    import time

    models = list(client.models.list())
    assert MODEL in [m.id for m in models]
    card = client.models.retrieve(MODEL)
    # a real time, as vLLM's and OpenAI's cards have (it was 0, 1970), and
    # the context length vLLM's cards carry
    assert 0 < time.time() - card.created < 3600 and card.owned_by == "fairstream", card
    assert card.model_extra["max_model_len"] == 4096 and card.model_extra["root"] == MODEL, card


def test_chat_stream_arrives_in_several_chunks(client: openai.OpenAI) -> None:
    # The router may merge up to the tenant's chunk_tokens (16 for gold) per
    # event when the client lags: 64 tokens are at least 4 events.
    pieces, finish, chunks = stream_chat(client, "Hello", max_tokens=64, extra_body=IGNORE_EOS)
    assert len(pieces) >= 4, pieces
    assert "".join(pieces).strip()
    assert finish == "length"
    assert all(c.object == "chat.completion.chunk" and c.model == MODEL for c in chunks)
    assert len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.usage is None for c in chunks), "usage without stream_options.include_usage"


def test_chat_non_stream(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(model=MODEL, messages=_chat("Hello"), max_tokens=24, extra_body=IGNORE_EOS)
    assert r.object == "chat.completion"
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content and choice.message.content.strip()
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 24
    assert r.usage.prompt_tokens > 0
    assert r.usage.total_tokens == r.usage.prompt_tokens + 24


def test_completions_stream(client: openai.OpenAI) -> None:
    pieces, finish, chunks = stream_completion(client, "The ", max_tokens=64, extra_body=IGNORE_EOS)
    assert len(pieces) >= 4
    assert "".join(pieces).strip()
    assert finish == "length"
    assert all(c.object == "text_completion" for c in chunks)


def test_completions_non_stream(client: openai.OpenAI) -> None:
    r = client.completions.create(model=MODEL, prompt="The ", max_tokens=24, extra_body=IGNORE_EOS)
    assert r.object == "text_completion"
    assert r.choices[0].text.strip()
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 24
    assert r.usage.prompt_tokens == len("The ".encode())  # the sim's tokens are bytes


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_include_usage_adds_a_final_usage_chunk(client: openai.OpenAI, endpoint: str) -> None:
    kw = dict(max_tokens=17, stream_options={"include_usage": True}, extra_body=IGNORE_EOS)
    if endpoint == "chat":
        _, finish, chunks = stream_chat(client, "Hi", **kw)
    else:
        _, finish, chunks = stream_completion(client, "Hi", **kw)
    assert finish == "length"
    last = chunks[-1]
    assert last.choices == []
    assert last.usage is not None
    assert last.usage.completion_tokens == 17
    assert last.usage.prompt_tokens > 0
    assert last.usage.total_tokens == last.usage.prompt_tokens + 17
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_continuous_usage_stats_puts_the_usage_so_far_on_every_chunk(client: openai.OpenAI, endpoint: str) -> None:
    # vLLM's stream_options.continuous_usage_stats (ops.loadgen asks for it)
    kw = dict(max_tokens=17, stream_options={"include_usage": True, "continuous_usage_stats": True},
              extra_body=IGNORE_EOS)
    stream = stream_chat if endpoint == "chat" else stream_completion
    _, finish, chunks = stream(client, "Hi", **kw)
    assert finish == "length"
    final = chunks[-1].usage
    assert chunks[-1].choices == [] and final is not None and final.completion_tokens == 17
    if endpoint == "chat":  # vLLM's role-only first chunk: the prompt's usage, no completion tokens yet
        role, chunks = chunks[0], chunks[1:]
        assert (role.choices[0].delta.role, role.choices[0].delta.content, role.usage.completion_tokens) == (
            "assistant", "", 0) and role.usage.prompt_tokens == final.prompt_tokens, role
    counts = []
    for c in chunks[:-1]:
        assert c.usage is not None, c
        assert c.usage.prompt_tokens == final.prompt_tokens > 0
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
        counts.append(c.usage.completion_tokens)
    assert counts == sorted(counts) and counts[0] >= 1 and counts[-1] == 17, counts
    # only together with include_usage, as in vLLM
    _, _, chunks = stream(client, "Hi", max_tokens=5, stream_options={"continuous_usage_stats": True},
                          extra_body=IGNORE_EOS)
    assert all(c.usage is None for c in chunks)


def test_greedy_is_deterministic(client: openai.OpenAI) -> None:
    texts = [
        client.chat.completions.create(
            model=MODEL, messages=_chat("Tell me"), max_tokens=48, temperature=0, extra_body=IGNORE_EOS
        ).choices[0].message.content
        for _ in range(3)  # the two replicas and the same one again
    ]
    assert texts[0] and texts[0] == texts[1] == texts[2]
    pieces, _, _ = stream_chat(client, "Tell me", max_tokens=48, temperature=0, extra_body=IGNORE_EOS)
    assert "".join(pieces) == texts[0]


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def run(seed: int) -> str:
        return client.completions.create(
            model=MODEL, prompt="The ", max_tokens=48, temperature=1.0, seed=seed, extra_body=IGNORE_EOS
        ).choices[0].text

    a = run(7)
    assert a == run(7)


def test_vllms_min_p_from_the_sdks_extra_body(client: openai.OpenAI) -> None:
    # (it was a 400, an unknown field, for every client that sends it)
    def run(temperature: float, **extra: object) -> str:
        return client.completions.create(model=MODEL, prompt="The ", max_tokens=48, temperature=temperature, seed=7,
                                         extra_body={**IGNORE_EOS, **extra}).choices[0].text

    greedy = run(0)
    assert run(1.0, min_p=1.0) == greedy, "min_p 1 keeps only the most likely token"
    assert run(1.0, min_p=0) == run(1.0) != greedy, "min_p 0 is off"
    pieces, finish, _ = stream_chat(client, "Tell me", max_tokens=16, temperature=1.0,
                                    extra_body={**IGNORE_EOS, "min_p": 0.05})
    assert "".join(pieces) and finish == "length"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=MODEL, messages=_chat("Hi"), max_tokens=4, extra_body={"min_p": 1.5})
    assert e.value.param == "min_p" and "must be in [0, 1]" in e.value.message


@pytest.mark.parametrize("prompt", ["東京の", "Le caf", "Über"])
def test_multibyte_text_is_never_garbled_mid_stream(client: openai.OpenAI, prompt: str) -> None:
    kw = dict(max_tokens=60, temperature=0, extra_body=IGNORE_EOS)
    reference = client.completions.create(model=MODEL, prompt=prompt, **kw).choices[0].text
    assert any(ord(ch) > 127 for ch in reference), f"prompt {prompt!r} should steer to multi-byte text: {reference!r}"
    assert REPLACEMENT not in reference
    pieces, finish, _ = stream_completion(client, prompt, **kw)
    assert finish == "length"
    assert all(REPLACEMENT not in p for p in pieces), pieces
    assert "".join(pieces) == reference
    # Token boundaries split characters (bytes are tokens), so some events
    # must have waited for a character's last byte: fewer pieces than tokens.
    assert len(pieces) < 60


def test_multibyte_chat_stream_equals_non_stream(client: openai.OpenAI) -> None:
    kw = dict(max_tokens=160, temperature=0, extra_body=IGNORE_EOS)
    ref = client.chat.completions.create(model=MODEL, messages=_chat("東京の"), **kw).choices[0].message.content
    pieces, _, _ = stream_chat(client, "東京の", **kw)
    assert "".join(pieces) == ref
    assert REPLACEMENT not in ref


def test_stop_string_cuts_the_stream_before_it(client: openai.OpenAI) -> None:
    kw = dict(max_tokens=80, temperature=0, extra_body=IGNORE_EOS)
    reference = client.completions.create(model=MODEL, prompt="Le caf", **kw).choices[0].text
    stop = reference[20:24]
    expected = reference[: reference.index(stop)]
    pieces, finish, _ = stream_completion(client, "Le caf", stop=[stop], **kw)
    assert finish == "stop"
    assert "".join(pieces) == expected
    r = client.completions.create(model=MODEL, prompt="Le caf", stop=stop, **kw)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (expected, "stop")


def test_sse_wire_format(shared_router: RouterProcess) -> None:
    """Every event has an ``id:``, ids count up from 1 without gaps, the last is [DONE]."""
    body = {"model": MODEL, "prompt": "The ", "max_tokens": 20, "stream": True, "ignore_eos": True}
    r = httpx.post(
        shared_router.base_url + "/v1/completions", json=body, headers={"authorization": f"Bearer {GOLD}"}, timeout=30
    )
    assert r.status_code == 200
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.headers.get("x-request-id")
    events = parse_sse(r.text)
    assert events[-1].data == "[DONE]"
    ids = [e.number for e in events]  # ([DONE]'s too, its number alone: test_resume_done)
    assert ids == list(range(1, len(ids) + 1)) and events[-1].id == str(ids[-1])


async def test_twenty_concurrent_async_streams(aclient: openai.AsyncOpenAI) -> None:
    async def one(i: int) -> tuple[str, str | None, int | None]:
        text, finish, usage = [], None, None
        stream = await aclient.chat.completions.create(
            model=MODEL, messages=_chat(f"stream {i}"), max_tokens=48, stream=True,
            stream_options={"include_usage": True}, extra_body=IGNORE_EOS,
        )
        async with stream:
            async for chunk in stream:
                if chunk.usage is not None:
                    usage = chunk.usage.completion_tokens
                for c in chunk.choices:
                    text.append(c.delta.content or "")
                    finish = c.finish_reason or finish
        return "".join(text), finish, usage

    results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(20))), 60)
    assert len(results) == 20
    for text, finish, usage in results:
        assert text
        assert finish == "length"
        assert usage == 48


def _dechunk(body: bytes) -> bytes:
    """A chunked body's data as far as it arrived (the last chunk may be cut)."""
    out = b""
    while body:
        size_line, sep, rest = body.partition(b"\r\n")
        if not sep:
            break
        size = int(size_line, 16)
        if size == 0:
            break
        out += rest[:size]
        body = rest[size + 2:]
    return out


LONG = {"model": MODEL, "prompt": "Slow", "max_tokens": 40000, "temperature": 0, "ignore_eos": True}
_LONG_BODY = json.dumps({**LONG, "stream": True}).encode()
LONG_REQUEST = (b"POST /v1/completions HTTP/1.1\r\nhost: x\r\nconnection: close\r\n"
                b"content-type: application/json\r\nauthorization: Bearer " + GOLD.encode()
                + b"\r\ncontent-length: %d\r\n\r\n" % len(_LONG_BODY) + _LONG_BODY)


def _long_stream_router(tmp_path, chunk_tokens: int | None = None) -> RouterProcess:
    """One fast sim replica; gold may ask for 40,000 tokens (in events of at
    most ``chunk_tokens``, where given)."""
    tenants = yaml.safe_load(DEMO_TENANTS.read_text())
    tenants["tenants"]["gold"]["limits"]["max_tokens"] = 40000
    if chunk_tokens is not None:
        tenants["tenants"]["gold"]["chunk_tokens"] = chunk_tokens
    (tmp_path / "tenants.yaml").write_text(yaml.safe_dump(tenants))
    sim = {"step_base_ms": 0.2, "max_model_len": 65536}
    return RouterProcess(tmp_path / "r", replicas=1, sim=sim, tenants=tmp_path / "tenants.yaml")


def _long_reference(router: RouterProcess) -> str:
    with openai.OpenAI(base_url=router.base_url + "/v1", api_key=GOLD, max_retries=0, timeout=60) as c:
        kw = {k: v for k, v in LONG.items() if k not in ("model", "prompt", "ignore_eos")}
        return "".join(stream_completion(c, LONG["prompt"], extra_body=IGNORE_EOS, **kw)[0])


def _read_then_stall(router: RouterProcess, at_least: int) -> tuple[socket.socket, bytes]:
    """Start the long stream on a socket with a small receive buffer, read
    ``at_least`` bytes, then read nothing until the generation has ended on
    its replica (the rest waits in the socket buffers and in the router)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", router.port))
    try:
        sock.sendall(LONG_REQUEST)
        raw = b""
        while len(raw) < at_least:
            raw += sock.recv(4096)
        assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
        poll(lambda: router.inflight("sim-0") == 0, 60, what="the generation to end on its replica")
    except BaseException:
        sock.close()
        raise
    return sock, raw


def test_a_client_that_stops_reading_gets_every_token_in_merged_events(tmp_path) -> None:
    # Events are pushed to the client's socket as the replica produces them.
    # A client that stops reading fills the socket buffers, the router's
    # transport pauses, and the rest of the stream waits in the router,
    # merged into events of at most chunk_tokens (16 for gold): nothing is
    # lost, the text is exactly a fast client's, the positions add up.
    # (40,000 tokens, ~7.6 MB of events: loopback socket buffers grow to 4 MB
    # before the router's transport pauses.)
    with _long_stream_router(tmp_path) as router:
        ref = _long_reference(router)
        sock, raw = _read_then_stall(router, 1)  # the head and the first events: it runs
        try:
            sock.settimeout(30)
            while chunk := sock.recv(65536):
                raw += chunk
        finally:
            sock.close()
    head, _, chunked = raw.partition(b"\r\n\r\n")
    events = parse_sse(_dechunk(chunked).decode())
    assert events[-1].data == "[DONE]"
    chunks = [e.json() for e in events[:-1]]
    assert "".join(ch["choices"][0]["text"] for ch in chunks) == ref
    positions = [int(e.id.split("-")[1]) for e in events[:-1]]
    steps = [b - a for a, b in zip([0, *positions], positions)]
    assert positions[-1] == 40000 and all(0 <= s <= 16 for s in steps), max(steps)
    # a character is at most 4 byte tokens (the sim's tokenizer): more tokens
    # in one event were merged while they waited
    assert max(steps) > 4, f"{len(events)} events for 40,000 tokens: the waiting pieces were not merged"


def test_a_client_that_leaves_with_events_waiting_resumes_text_exact(tmp_path) -> None:
    # The generation runs ahead of a client that reads slowly: its last
    # pieces wait in the router when the client leaves. The resume buffer
    # holds what the client was sent, not what the generation produced, so
    # a resume from the client's last event id continues text-exact. (One token
    # per event: 40,000 of them outgrow the socket buffers, so pieces wait in
    # the router; the tokens of a read merged into events of 16 would fit.)
    with _long_stream_router(tmp_path, chunk_tokens=1) as router:
        ref = _long_reference(router)
        sock, raw = _read_then_stall(router, 100_000)  # some events, then it leaves
        sock.close()
        poll(lambda: router.metrics().value("fairstream_requests_total", 0.0, tenant="gold",
                                            endpoint="completions", outcome="cancelled") == 1,
             10, what="the stream to count as cancelled")
        head, _, chunked = raw.partition(b"\r\n\r\n")
        rid = next(line.split(b":", 1)[1].strip().decode() for line in head.split(b"\r\n")
                   if line.lower().startswith(b"x-request-id:"))
        data = _dechunk(chunked)
        got = parse_sse(data[:data.rindex(b"\n\n") + 2].decode())  # whole events only
        assert got and got[-1].data != "[DONE]"
        with httpx.stream("GET", f"{router.base_url}/v1/streams/{rid}", timeout=60,
                          headers={"Authorization": f"Bearer {GOLD}", "Last-Event-ID": got[-1].id}) as r:
            assert r.status_code == 200, r.read()
            rest = parse_sse(r.read().decode())
    assert rest[-1].data == "[DONE]" and rest[0].number == got[-1].number + 1
    text = "".join(e.json()["choices"][0]["text"] for e in got + rest[:-1] if e.json().get("choices"))
    assert text == ref



def _stream_request(version: bytes = b"1.1", extra: bytes = b"") -> bytes:
    body = json.dumps({"model": MODEL, "prompt": "The ", "max_tokens": 8, "stream": True,
                       "ignore_eos": True}).encode()
    return (b"POST /v1/completions HTTP/" + version + b"\r\nhost: x\r\ncontent-type: application/json\r\n"
            b"authorization: Bearer " + GOLD.encode() + b"\r\n" + extra
            + b"content-length: %d\r\n\r\n" % len(body) + body)


def _read_stream_response(sock: socket.socket) -> tuple[dict[bytes, list[bytes]], bytes, bytes]:
    """(head's header lines by lower-case name, the status line, the
    de-chunked body) of one streamed response; reads exactly to its end."""
    raw = b""
    while b"\r\n\r\n" not in raw:
        raw += sock.recv(65536) or b""
    head, _, rest = raw.partition(b"\r\n\r\n")
    status, *lines = head.split(b"\r\n")
    headers: dict[bytes, list[bytes]] = {}
    for line in lines:
        name, _, value = line.partition(b":")
        headers.setdefault(name.strip().lower(), []).append(value.strip())
    while not rest.endswith(b"0\r\n\r\n") or not _dechunk(rest).endswith(b"data: [DONE]\n\n"):
        more = sock.recv(65536)
        assert more, f"the connection closed before the body's end: {rest[-200:]!r}"
        rest += more
    return headers, status, _dechunk(rest)


def test_streamed_responses_on_the_wire_keep_alive_pipelined_and_http10(shared_router: RouterProcess) -> None:
    """The SSE head and the body's end the router writes itself
    (router/push.py ``TransportWire.open``/``finish``): each header once,
    uvicorn's ``date`` and ``server`` kept, a kept-alive connection serves
    the next (and a pipelined) request, an HTTP/1.0 one is told
    ``connection: close``, gets its body unchunked and closed after it."""
    with socket.create_connection(("127.0.0.1", shared_router.port), timeout=30) as sock:
        sock.sendall(_stream_request())
        first = _read_stream_response(sock)
        sock.sendall(_stream_request() + _stream_request(extra=b"x-request-id: trace-7\r\n"))  # pipelined
        second, third = _read_stream_response(sock), _read_stream_response(sock)
    for headers, status, body in (first, second, third):
        assert status == b"HTTP/1.1 200 OK"
        for name in (b"date", b"server", b"content-type", b"x-request-id", b"cache-control", b"transfer-encoding"):
            assert len(headers.get(name, [])) == 1, (name, headers)
        assert headers[b"content-type"] == [b"text/event-stream; charset=utf-8"]
        assert headers[b"transfer-encoding"] == [b"chunked"] and b"connection" not in headers
        assert headers[b"x-ratelimit-limit-requests"], headers
        events = parse_sse(body.decode())
        assert events[-1].data == "[DONE]" and len(events) > 2
    assert len({h[b"x-request-id"][0] for h, _, _ in (first, second, third)}) == 3

    with socket.create_connection(("127.0.0.1", shared_router.port), timeout=30) as sock:
        sock.sendall(_stream_request(b"1.0"))
        raw = b""
        while more := sock.recv(65536):  # (the router closes it after the body's end)
            raw += more
        head, _, body = raw.partition(b"\r\n\r\n")
        assert b"\r\nconnection: close\r\n" in head + b"\r\n", head
        assert b"transfer-encoding" not in head, head  # (HTTP/1.0 has no chunks: the body as is)
        assert parse_sse(body.decode())[-1].data == "[DONE]"


def test_a_stop_token_ends_the_text_without_its_own_text_as_vllm(client: openai.OpenAI) -> None:
    # (its text was output: vLLM's detokenizer leaves the stop token out, and
    # counts it as a completion token)
    kw = dict(max_tokens=80, temperature=0, extra_body=IGNORE_EOS)
    reference = client.completions.create(model=MODEL, prompt="Le caf", **kw).choices[0].text
    ch = next(c for c in reference[3:] if c.isascii() and c.isalpha())  # (the sim's tokens are bytes)
    stop_at = reference.index(ch, 3)
    extra = {**IGNORE_EOS, "stop_token_ids": [ord(ch)], "min_tokens": 3}
    r = client.completions.create(model=MODEL, prompt="Le caf", max_tokens=80, temperature=0, extra_body=extra)
    assert (r.choices[0].text, r.choices[0].finish_reason) == (reference[:stop_at], "stop"), (reference, ch)
    assert r.usage.completion_tokens == len(reference[: stop_at + 1].encode())
    pieces, finish, _ = stream_completion(client, "Le caf", max_tokens=80, temperature=0, extra_body=extra)
    assert ("".join(pieces), finish) == (reference[:stop_at], "stop")


@pytest.mark.parametrize("chat", [False, True])
def test_stop_reason_says_which_stop_ended_the_choice_as_vllm_does(client: openai.OpenAI, chat: bool) -> None:
    # vLLM's ``stop_reason`` (on each choice, and on a stream's finish chunk):
    # the stop string that matched, the stop token's id (of stop_token_ids;
    # the sim's tokens are bytes), or null. It was missing: SDK code reading
    # ``choice.model_extra["stop_reason"]`` broke. (Greedy: the text has an "e".)
    def run(stream: bool, **kw):
        if chat:
            args = dict(model=MODEL, messages=_chat("Le café"), max_tokens=40, temperature=0,
                        extra_body={**IGNORE_EOS, **kw})
            r = client.chat.completions.create(stream=stream, **args)
        else:
            args = dict(model=MODEL, prompt="Le café", max_tokens=40, temperature=0,
                        extra_body={**IGNORE_EOS, **kw})
            r = client.completions.create(stream=stream, **args)
        if not stream:
            return r.choices[0].finish_reason, r.choices[0].model_extra["stop_reason"]
        last = [c for c in r if c.choices][-1].choices[0]
        return last.finish_reason, last.model_extra["stop_reason"]

    for stream in (False, True):
        assert run(stream) == ("length", None)
        assert run(stream, stop=["e", "zzz"]) == ("stop", "e")
        assert run(stream, stop_token_ids=[ord("e")]) == ("stop", ord("e"))


def test_vllm_fields_at_their_default_from_the_sdks_extra_body_are_taken(client: openai.OpenAI) -> None:
    # (each was a 400 "Unrecognized request argument supplied", code null,
    # whatever its value: clients written for vLLM send its defaults)
    defaults = {"skip_special_tokens": True, "add_generation_prompt": True, "echo": False, "priority": 0,
                "truncate_prompt_tokens": None}
    plain = client.chat.completions.create(model=MODEL, messages=_chat("Hello"), max_tokens=12, temperature=0,
                                           extra_body=IGNORE_EOS)
    r = client.chat.completions.create(model=MODEL, messages=_chat("Hello"), max_tokens=12, temperature=0,
                                       extra_body={**IGNORE_EOS, **defaults})
    assert r.choices[0].message.content == plain.choices[0].message.content
    pieces, finish, _ = stream_completion(client, "The ", max_tokens=8, extra_body={
        **IGNORE_EOS, "skip_special_tokens": True, "echo": False, "priority": 0, "truncate_prompt_tokens": None})
    assert "".join(pieces) and finish == "length"
    # another value is refused, naming the field; an unknown one has a code too
    for extra, code in (({"skip_special_tokens": False}, "unsupported_parameter"),
                        ({"priority": 1}, "unsupported_parameter"),
                        ({"skip_special_tokenz": True}, "unknown_parameter")):
        with pytest.raises(openai.BadRequestError) as e:
            client.chat.completions.create(model=MODEL, messages=_chat("Hi"), max_tokens=4, extra_body=extra)
        ((name, _),) = extra.items()
        assert e.value.param == name and e.value.code == code and name in e.value.message, (extra, e.value.body)


def test_models_responses_carry_an_x_request_id(client: openai.OpenAI) -> None:
    # (every other /v1 response has one, and the SDK reads it as _request_id;
    # /v1/models and /v1/models/{id}, and a model not found, had none)
    ids = {client.models.with_raw_response.list().headers.get("x-request-id"),
           client.models.with_raw_response.retrieve(MODEL).headers.get("x-request-id")}
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    ids.add(e.value.response.headers.get("x-request-id"))
    assert None not in ids and len(ids) == 3, ids


def test_errors_of_unknown_paths_and_methods_carry_an_x_request_id(shared_router: RouterProcess) -> None:
    for method, path in (("GET", "/v1/nope"), ("DELETE", "/v1/models"), ("POST", "/v1/models/x")):
        r = httpx.request(method, shared_router.base_url + path, headers={"Authorization": f"Bearer {GOLD}"})
        assert r.status_code in (404, 405) and r.headers.get("x-request-id"), (method, path, r.status_code, r.headers)
