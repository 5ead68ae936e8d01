"""OpenAI-compatible upstreams as replicas (docs/upstreams.md).

A sim replica serving the OpenAI API (``python -m replicas --engine sim
--openai HOST:PORT``) stands in for ``vllm serve``: same field names,
``return_token_ids``, vLLM's /metrics gauges. The router reaches it by
``url``; a local sim replica with the same seed (and the same byte tokenizer)
is there to take over, so a resumed stream must equal the uninterrupted
reference exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from pathlib import Path
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
import yaml

from replicas.openai_server import OpenAIServer
from replicas.output import OutputProcessor
from replicas.protocol import FinishReason, SamplingParams
from replicas.sim import ByteTokenizer, SimConfig, SimEngine
from replicas.spec import ReplicaSpec
from replicas import upstream_sse
from replicas.upstream_open import open_upstream
from replicas.upstream_load import parse_vllm_metrics
from router.auth import hash_key
from tests.helpers import GOLD, MODEL, RouterProcess, aiter_sse, loopback_http, poll
from tests.sim_openai import SimOpenAI

PROMPT = "Once upon a time"
CHAT = [{"role": "user", "content": "Tell me about the cluster."}]
UPSTREAM = "up-0"

KEY_ENV = "FS_TEST_UPSTREAM_KEY"
TOK = ByteTokenizer()


@contextlib.asynccontextmanager
async def _sim_upstream() -> AsyncIterator[tuple[OpenAIServer, Any]]:
    """The sim's OpenAI server in this process (no step delays) and an
    upstream client on it, both closed at the end."""
    server = OpenAIServer("sim", {"model": MODEL, "seed": 0, "step_base_ms": 0, "step_per_seq_ms": 0})
    port = await server.start("127.0.0.1", 0)
    try:
        client = await open_upstream(UPSTREAM, ReplicaSpec(name=UPSTREAM, url=f"http://127.0.0.1:{port}/v1"))
        try:
            yield server, client
        finally:
            await client.close()
    finally:
        await server.close()


# -- helpers -------------------------------------------------------------------


def upstream_router(workdir: Path, url: str, *, local: int = 1, sim: dict[str, Any] | None = None,
                    tenants: Path | None = None, **spec: Any) -> RouterProcess:
    """A router whose first replica is the upstream at ``url``, then ``local`` sim replicas.

    With equal loads the balancer picks the first ready replica, so a request
    sent while nothing else runs goes to the upstream."""
    r = RouterProcess(workdir, replicas=local, sim=sim, **({"tenants": tenants} if tenants else {}))
    r.config["replicas"].insert(0, {"name": UPSTREAM, "url": url, "config": {"model": MODEL}, **spec})
    r.replica_names.insert(0, UPSTREAM)
    r.config_path.write_text(yaml.safe_dump(r.config, sort_keys=False))
    return r


async def reference(prompt_ids: list[int], max_tokens: int, stop: list[str] | None = None,
                    include: bool = False) -> str:
    """The uninterrupted greedy text of a sim with seed 0, computed in-process
    (``include``: with include_stop_str_in_output)."""
    done = asyncio.Event()
    pieces: list[str] = []
    proc = OutputProcessor(TOK, stop or [], include_stop_str=include)

    def sink(rid: int, ids: list[int], finish: FinishReason, error: str) -> None:
        if done.is_set():
            return
        text, fin = proc.process(ids, finish)
        pieces.append(text)
        if fin != FinishReason.NONE:
            done.set()

    engine = SimEngine(SimConfig(model=MODEL, seed=0, step_base_ms=0, step_per_seq_ms=0), sink)
    await engine.start()
    engine.add(1, prompt_ids, SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, stop=stop or []))
    await done.wait()
    await engine.close()
    return "".join(pieces)


def greedy(max_tokens: int) -> dict[str, Any]:
    return {"max_tokens": max_tokens, "temperature": 0, "extra_body": {"ignore_eos": True}}


async def consume(aclient: openai.AsyncOpenAI, kind: str, max_tokens: int, got: list[str]) -> tuple[str, str | None]:
    """Stream one greedy request, appending text pieces to ``got`` as they arrive."""
    finish = None
    if kind == "chat":
        stream = await aclient.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **greedy(max_tokens))
    else:
        stream = await aclient.completions.create(model=MODEL, prompt=PROMPT, stream=True, **greedy(max_tokens))
    async with stream:
        async for chunk in stream:
            for c in chunk.choices:
                piece = c.delta.content if kind == "chat" else c.text
                if piece:
                    got.append(piece)
                if c.finish_reason is not None:
                    finish = c.finish_reason
    return "".join(got), finish


def prompt_ids(kind: str) -> list[int]:
    return TOK.chat(CHAT) if kind == "chat" else TOK.encode(PROMPT)


@pytest.fixture
async def aclient_for():
    made: list[openai.AsyncOpenAI] = []

    def make(router: RouterProcess) -> openai.AsyncOpenAI:
        c = openai.AsyncOpenAI(base_url=router.base_url + "/v1", api_key=GOLD, max_retries=0, timeout=60)
        made.append(c)
        return c

    yield make
    for c in made:
        await c.close()


@pytest.fixture
def cleanup():
    """Stops what a test started, routers first (their leak check), then servers."""
    things: list[Any] = []
    yield things.append
    errors = []
    for t in reversed(things):
        try:
            t.stop()
        except AssertionError as e:
            errors.append(str(e))
    assert not errors, "\n".join(errors)


# -- streaming through an upstream ---------------------------------------------------


@pytest.fixture(scope="module")
def only_upstream(tmp_path_factory):
    """A router with one replica: an upstream that needs an API key."""
    work = tmp_path_factory.mktemp("only_upstream")
    server = SimOpenAI(work, {"step_base_ms": 1}, api_key="upstream-secret").start()
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(KEY_ENV, "upstream-secret")
        router = upstream_router(work / "router", server.url, local=0, api_key_env=KEY_ENV)
        try:
            router.start()
            yield router, server
        finally:
            router.stop()
            server.stop()


def test_streams_through_upstream_with_token_ids(only_upstream):
    router, server = only_upstream
    assert httpx.get(server.url + "/models").status_code == 401  # the key is needed, and the router has it
    with openai.OpenAI(base_url=router.base_url + "/v1", api_key=GOLD, max_retries=0, timeout=30) as client:
        assert [m.id for m in client.models.list().data] == [MODEL]
        pieces, usage, finish = [], None, None
        with client.completions.create(model=MODEL, prompt=PROMPT, stream=True,
                                       stream_options={"include_usage": True}, **greedy(64)) as stream:
            for chunk in stream:
                for c in chunk.choices:
                    pieces.append(c.text)
                    finish = c.finish_reason or finish
                usage = chunk.usage or usage
        assert "".join(pieces) == asyncio.run(reference(prompt_ids("completion"), 64))
        assert finish == "length"
        assert len(pieces) > 3  # streamed, not one blob
        # Token ids came back: the router knows the prompt and completion tokens.
        assert usage is not None and usage.prompt_tokens == len(PROMPT.encode()) > 0
        assert usage.completion_tokens == 64

        chat = client.chat.completions.create(model=MODEL, messages=CHAT, **greedy(48))
        assert chat.choices[0].message.content == asyncio.run(reference(prompt_ids("chat"), 48))
        assert chat.usage.prompt_tokens == len(prompt_ids("chat"))
        assert chat.usage.completion_tokens == 48
        # streamed: the upstream's role-only first chunk is not relayed, the router's own is (one, as vLLM's)
        chunks = list(client.chat.completions.create(model=MODEL, messages=CHAT, stream=True, **greedy(48)))
        deltas = [c.choices[0].delta for c in chunks]
        assert (deltas[0].role, deltas[0].content) == ("assistant", "") and deltas[1].content, deltas[:2]
        assert [d.role for d in deltas[1:]] == [None] * (len(deltas) - 1)
        assert "".join(d.content or "" for d in deltas) == chat.choices[0].message.content

        # Stop strings go upstream.
        ref = asyncio.run(reference(prompt_ids("completion"), 200, stop=["quietly"]))
        out = client.completions.create(model=MODEL, prompt=PROMPT, stop=["quietly"], **greedy(200))
        assert out.choices[0].text == ref and out.choices[0].finish_reason == "stop"

        # So does vLLM's min_p: 1 keeps only the most likely token, greedy at any temperature.
        sampled = {**greedy(48), "temperature": 1.0, "seed": 5}
        out = client.completions.create(model=MODEL, prompt=PROMPT, **sampled)
        assert out.choices[0].text != asyncio.run(reference(prompt_ids("completion"), 48))
        sampled["extra_body"] = {**sampled["extra_body"], "min_p": 1.0}
        out = client.completions.create(model=MODEL, prompt=PROMPT, **sampled)
        assert out.choices[0].text == asyncio.run(reference(prompt_ids("completion"), 48))

    assert router.metrics().value("fairstream_replica_up", replica=UPSTREAM) == 1


@pytest.mark.parametrize("stream", [False, True])
def test_stop_reason_comes_through_an_upstream(only_upstream, stream):
    # vLLM's stop_reason (the stop string, the stop token's id, or null) as
    # the upstream gave it, or the stop string the router's splice matched;
    # the sim OpenAI server gives it as vllm serve does. It was dropped.
    router, server = only_upstream

    def run(base: str, key: str, **kw) -> tuple[str, str | int | None]:
        with openai.OpenAI(base_url=base, api_key=key, max_retries=0, timeout=30) as client:
            args = greedy(200)
            args["extra_body"] = {**args["extra_body"], **kw}
            r = client.completions.create(model=MODEL, prompt=PROMPT, stream=stream, **args)
            choice = r.choices[0] if not stream else [c for c in r if c.choices][-1].choices[0]
            return choice.finish_reason, choice.model_extra["stop_reason"]

    for base, key in ((server.url, "upstream-secret"), (router.base_url + "/v1", GOLD)):
        assert run(base, key, stop=["quietly"]) == ("stop", "quietly")
        assert run(base, key, stop_token_ids=[ord("e")]) == ("stop", ord("e"))
        assert run(base, key, max_tokens=8) == ("length", None)


def test_the_sim_openai_server_refuses_min_p_out_of_range_as_vllm_serve(only_upstream):
    # (as vllm serve does; the sim engine alone would take 1.5 as 1)
    _, server = only_upstream
    r = httpx.post(server.url + "/completions", headers={"Authorization": "Bearer upstream-secret"},
                   json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "min_p": 1.5})
    assert r.status_code == 400 and r.json()["error"]["param"] == "min_p", r.text


def only_this_upstream(tmp_path: Path, cleanup, sim: dict[str, Any]) -> tuple[SimOpenAI, RouterProcess]:
    """A sim OpenAI server and a router whose only replica it is (both started)."""
    server = SimOpenAI(tmp_path, sim)
    cleanup(server)
    server.start()
    router = upstream_router(tmp_path / "router", server.url, local=0)
    cleanup(router)
    router.start()
    return server, router


async def test_many_upstream_events_in_one_read_are_cut_at_chunk_tokens(tmp_path, cleanup):
    """599 upstream events of one token each arrive in one network read: the
    router relays them in events of at most the tenant's ``chunk_tokens`` (16
    for the demo tenants), not as one 600-token event nor as 600 events. (One upstream chunk is
    never split: its text has no per-token boundaries; see docs/upstreams.md.)"""
    n = 600
    first = {"choices": [{"index": 0, "text": "a", "token_ids": [97], "prompt_token_ids": [1, 2, 3],
                          "finish_reason": None}]}
    more = {"choices": [{"index": 0, "text": "a", "token_ids": [97], "finish_reason": None}]}
    last = {"choices": [{"index": 0, "text": "a", "token_ids": [97], "finish_reason": "length"}]}
    events = [first] + [more] * (n - 2) + [last]
    sse = [b"data: %s\n\n" % json.dumps(e).encode() for e in events]
    head_sse, rest_sse = sse[0], b"".join(sse[1:]) + b"data: [DONE]\n\n"
    models = json.dumps({"data": [{"id": MODEL}]}).encode()

    async def answer(head: bytes, body: bytes, writer: asyncio.StreamWriter) -> None:
        path = head.split(b" ")[1]
        if path.endswith(b"/models"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (len(models), models))
        elif path.endswith(b"/completions"):
            # the first event, then (once the client has its head) the rest in one write
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
                         b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n" % (len(head_sse), head_sse))
            await writer.drain()
            await asyncio.sleep(0.5)
            writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(rest_sse), rest_sse))
        else:
            writer.write(b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n")

    async with loopback_http(answer) as port:
        url = f"http://127.0.0.1:{port}/v1"
        router = upstream_router(tmp_path / "router", url, local=0)
        cleanup(router)
        await asyncio.to_thread(router.start)  # its readiness check needs this loop's server
        async with httpx.AsyncClient(base_url=router.base_url, headers={"Authorization": f"Bearer {GOLD}"},
                                     timeout=30) as http:
            async with http.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "stream": True, "max_tokens": n,
            }) as r:
                assert r.status_code == 200, await r.aread()
                sizes, before, text = [], 0, []
                async for ev in aiter_sse(r):
                    if ev.data == "[DONE]":
                        break
                    tokens = int(ev.id.split("-")[1])  # N-T-C: T = completion tokens so far
                    sizes.append(tokens - before)
                    before = tokens
                    text.append(ev.json()["choices"][0]["text"])
    assert before == n and "".join(text) == "a" * n
    assert max(sizes) <= 16, sizes
    assert len(sizes) >= n // 16
    # and merged up to that limit (not one event per upstream event): the
    # events of one read become as few deltas as the limit allows
    assert len(sizes) <= n // 8, f"{len(sizes)} events: the events of one read were not merged"


async def test_client_disconnect_aborts_the_request_on_the_upstream(tmp_path, cleanup):
    """The client leaves mid-stream: the router closes the upstream
    connection, which is how an OpenAI server (vLLM) learns to abort."""
    server, router = only_this_upstream(tmp_path, cleanup, {"step_base_ms": 20})
    async with httpx.AsyncClient(base_url=router.base_url, headers={"Authorization": f"Bearer {GOLD}"},
                                 timeout=30) as http:
        for _ in range(2):  # twice: the second request may reuse a kept-alive connection
            async with http.stream("POST", "/v1/completions", json={
                "model": MODEL, "prompt": PROMPT, "stream": True, "max_tokens": 1000, "ignore_eos": True,
            }) as r:
                events = aiter_sse(r)
                for _ in range(3):
                    await events.__anext__()
                assert server.running() == 1  # 1000 tokens x 20 ms: far from done
                await events.aclose()
            await asyncio.to_thread(poll, lambda: server.running() == 0, 5, what="the upstream aborts")
    assert router.metrics().value("fairstream_requests_total", tenant="gold", outcome="cancelled") == 2


def test_upstream_metrics_parse():
    page = (b'# HELP vllm:num_requests_running x\nvllm:num_requests_running{engine="0",model_name="m"} 3.0\n'
            b'vllm:num_requests_running{engine="1",model_name="m"} 2.0\n'
            b'vllm:num_requests_waiting{engine="0",model_name="m"} 4.0\n'
            b'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            b'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5\n')
    load = parse_vllm_metrics(page)
    assert (load.running, load.waiting, load.kv_usage) == (5, 4, 0.5)
    assert parse_vllm_metrics(b"# some other server\nhttp_requests_total 3\n") is None


@pytest.mark.parametrize("include", [False, True], ids=["", "include_stop_str_in_output"])
async def test_resume_onto_upstream_is_text_exact(include: bool):
    """A stream another replica started continues on the upstream text-exact,
    whatever was held back there: split UTF-8 characters, stop-string prefixes
    (with include_stop_str_in_output, nothing is held back: a stop string
    that starts in the text the client has is found by the router's splice)."""
    async with _sim_upstream() as (server, client):
        ids = TOK.encode(PROMPT)
        full_col = client.generate(SamplingParams(max_tokens=120, temperature=0, ignore_eos=True), prompt=PROMPT)
        full = await _drain(full_col)
        assert client.token_ids is True
        for stop in (["quietly"], ["Así"], []):
            params = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True, stop=stop,
                                    include_stop_str_in_output=include)
            ref = await reference(ids, 120, stop, include)
            assert not stop or ref.endswith(stop[0]) is include, (stop, ref)
            for cut in range(1, 120, 7 if not include else 3):
                proc = OutputProcessor(TOK, stop, include_stop_str=include)  # what the first replica delivered
                delivered, fin = "", FinishReason.NONE
                for t in full[0][:cut]:
                    text, fin = proc.process([t], FinishReason.NONE)
                    delivered += text
                    if fin != FinishReason.NONE:
                        break
                if fin != FinishReason.NONE:
                    break
                col = client.generate(params, prompt_token_ids=ids, prefix_token_ids=full[0][:cut],
                                      prefix_text_len=len(delivered))
                _, text, _ = await _drain(col)
                assert delivered + text == ref, (stop, cut)


def _one_replica(ids: list[int], stop: list[str], min_tokens: int = 0, upto: int | None = None,
                 final: FinishReason = FinishReason.LENGTH) -> tuple[str, FinishReason]:
    """What one replica's processor emits for ``ids`` fed token by token
    (``upto``: only the first so many, with no finish: what a replica
    delivered before it died)."""
    proc = OutputProcessor(TOK, stop, min_tokens=min_tokens)
    out, fin = "", FinishReason.NONE
    n = len(ids) if upto is None else upto
    for i, t in enumerate(ids[:n]):
        text, fin = proc.process([t], final if upto is None and i == n - 1 else FinishReason.NONE)
        out += text
        if fin != FinishReason.NONE:
            break
    return out, fin


@pytest.mark.parametrize("stop, min_tokens", [
    (["soo", "oon"], 0),  # overlapping: "soo" completes first, "oon" is the upstream's own
    ([".\n\n", "\nThe"], 0),
    (["to"], "past the first"),  # "to" inside the first min_tokens tokens' text ends nothing
], ids=["overlapping", "overlapping-newlines", "min_tokens"])
async def test_resume_onto_upstream_cuts_at_stop_strings_as_one_replica(stop: list[str], min_tokens):
    """The router, not the upstream, looks for stop strings in a resumed
    stream's text, as one replica would: overlapping ones across the splice
    (the upstream cut its text before its own, and the text ran on past the
    one that spans the splice) and none that ends in the text of the first
    min_tokens tokens, the delivered ones counted (the router's splice ended
    the stream there)."""
    async with _sim_upstream() as (server, client):
        ids = TOK.encode(PROMPT)
        full, _, _ = await _drain(client.generate(SamplingParams(max_tokens=160, temperature=0, ignore_eos=True),
                                                  prompt=PROMPT))
        if min_tokens:  # (three tokens past the one that ends the first "to"; the next is far off)
            min_tokens = next(n for n in range(len(full)) if "to" in TOK.decode(full[:n])) + 3
            text = TOK.decode(full)
            assert text.index("to", text.index("to") + 1) > len(TOK.decode(full[:min_tokens])) + 30, text
        want = _one_replica(full, stop, min_tokens)
        assert want[1] == FinishReason.STOP, want
        params = SamplingParams(max_tokens=160, temperature=0, ignore_eos=True, stop=stop, min_tokens=min_tokens)
        for cut in range(1, len(full)):  # (every resume point up to where one replica stops)
            delivered, fin = _one_replica(full, stop, min_tokens, upto=cut)
            if fin != FinishReason.NONE:
                break
            col = client.generate(params, prompt_token_ids=ids, prefix_token_ids=full[:cut],
                                  prefix_text_len=len(delivered))
            _, text, fin = await _drain(col)
            assert (delivered + text, fin) == want, cut
        else:
            raise AssertionError("one replica never stopped")


@pytest.mark.parametrize("run", [
    "\ufffd\ufffd\ufffd\ufffd".encode(),  # real replacement characters, as a model copies them
    b"\x80" * 12,  # bytes that are no UTF-8
    "\ufffd".encode() + b"\xe6\x97",  # one, then a character the prefix ends inside (exact before too)
], ids=["U+FFFD", "bad-bytes", "U+FFFD-then-split"])
async def test_resume_onto_upstream_at_or_in_replacement_characters_is_text_exact(run: bytes):
    """A delivered prefix whose text ends in U+FFFD, some of which the client
    may already have (a replica sends the text of a long run of them before
    the run ends): the stream continues on the upstream with stop strings
    set, nothing dropped or repeated (the router refused such a resume: the
    text it rebuilt for the splice had lost the client's trailing U+FFFD)."""
    async with _sim_upstream() as (server, client):
        ids = TOK.encode(PROMPT)
        head, _, _ = await _drain(client.generate(SamplingParams(max_tokens=12, temperature=0, ignore_eos=True),
                                                  prompt=PROMPT))
        run_ids = list(run)
        for stop in (["zzz"], ["\ufffd" * 5], ["\ufffde", "\ufffd早", "ly"]):
            for j in range(1, len(run_ids) + 1):
                prefix = head + run_ids[:j]
                delivered, fin = _one_replica(prefix, stop, upto=len(prefix))
                if fin != FinishReason.NONE:
                    continue  # (it stopped before the resume point)
                params = SamplingParams(max_tokens=len(prefix) + 30, temperature=0, ignore_eos=True, stop=stop)
                col = client.generate(params, prompt_token_ids=ids, prefix_token_ids=prefix,
                                      prefix_text_len=len(delivered))
                new, text, fin = await _drain(col)
                want = _one_replica(prefix + new, stop, final=fin if fin == FinishReason.LENGTH else FinishReason.NONE)
                assert (delivered + text, fin) == (want[0], want[1] if fin == FinishReason.LENGTH else fin), (stop, j)


async def _drain(col) -> tuple[list[int], str, FinishReason]:
    ids: list[int] = []
    text = ""
    while True:
        i, t, f = await col.get()
        ids += i
        text += t
        if f != FinishReason.NONE:
            return ids, text, f


async def test_chat_template_kwargs_go_to_the_upstream_as_sent():
    """vLLM's chat_template_kwargs reach an upstream's chat template (the sim
    OpenAI server's takes them and uses none), and what it refuses, as vLLM
    refuses it, is the request's error."""
    async with _sim_upstream() as (server, client):
        seen: list = []
        chat = server.engine.tokenizer.chat
        server.engine.tokenizer.chat = lambda messages, kw=None: seen.append(kw) or chat(messages, kw)
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        plain = await _drain(client.generate(params, messages=CHAT))
        kwargs = {"enable_thinking": False, "documents": [{"title": "t", "text": "x"}]}
        assert await _drain(client.generate(params, messages=CHAT, chat_template_kwargs=kwargs)) == plain
        assert seen == [None, kwargs]
        col = client.generate(params, messages=CHAT, chat_template_kwargs={"tokenize": True})
        _, _, finish = await _drain(col)
        assert finish == FinishReason.ERROR and "unexpected chat template kwargs" in col.error, col.error


# -- failover ------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["completion", "chat"])
async def test_upstream_killed_mid_stream_continues_token_exact(kind, tmp_path, cleanup, aclient_for):
    server = SimOpenAI(tmp_path, {"step_base_ms": 15})
    server.start()
    cleanup(server)
    router = upstream_router(tmp_path / "router", server.url, sim={"step_base_ms": 1})
    cleanup(router)
    router.start()
    aclient = aclient_for(router)
    max_tokens = 400
    expected = await reference(prompt_ids(kind), max_tokens)
    got: list[str] = []
    task = asyncio.create_task(consume(aclient, kind, max_tokens, got))
    try:
        await asyncio.to_thread(poll, lambda: len("".join(got)) >= 40 or task.done(), 20, what="40 characters")
        assert not task.done(), task.result()
        assert server.running() == 1  # it is the upstream that streams
        # The router polls the upstream's gauges into its view of the replica.
        await asyncio.to_thread(poll, lambda: router.running(UPSTREAM) == 1, 5, what="upstream load in the router")
        server.kill()
        text, finish = await asyncio.wait_for(task, 30)
    finally:
        task.cancel()
    assert text == expected
    assert finish == "length"
    m = router.metrics()
    assert m.value("fairstream_failovers_total", replica=UPSTREAM) == 1
    assert m.value("fairstream_resumed_tokens_total") >= 40

    # Down, then back on the same address: the supervisor reconnects.
    await asyncio.to_thread(poll, lambda: router.metrics().value("fairstream_replica_up", replica=UPSTREAM) == 0, 10,
                            what="upstream marked down")
    server.start(port=server.port)
    await asyncio.to_thread(router.wait_ready, 20)


async def test_a_stream_failed_over_onto_an_upstream_keeps_min_tokens_past_a_stop_string(tmp_path, cleanup,
                                                                                          aclient_for):
    """The local replica streaming a request with stop strings and min_tokens
    dies before the first stop string; the stream continues on the upstream,
    where a stop string inside the first min_tokens tokens' text does not end
    it (the router's splice ended it there), and the next one does."""
    server = SimOpenAI(tmp_path, {"step_base_ms": 1})
    server.start()
    cleanup(server)
    router = upstream_router(tmp_path / "router", server.url, sim={"step_base_ms": 40})
    # the local replica first, so the request starts there
    router.config["replicas"].append(router.config["replicas"].pop(0))
    router.replica_names.append(router.replica_names.pop(0))
    router.config_path.write_text(yaml.safe_dump(router.config, sort_keys=False))
    cleanup(router)
    router.start()
    aclient = aclient_for(router)
    ids = TOK.encode(await reference(prompt_ids("completion"), 160))
    first = next(n for n in range(len(ids)) if "to" in TOK.decode(ids[:n]))
    min_tokens = first + 3
    want, fin = _one_replica(ids, ["to"], min_tokens)
    assert fin == FinishReason.STOP and len(want) > len(TOK.decode(ids[:min_tokens])), want
    got: list[str] = []

    async def consume_with_stop() -> str | None:
        stream = await aclient.completions.create(model=MODEL, prompt=PROMPT, stream=True, stop=["to"],
                                                  **greedy(160) | {"extra_body": {"ignore_eos": True,
                                                                                  "min_tokens": min_tokens}})
        finish = None
        async with stream:
            async for chunk in stream:
                for c in chunk.choices:
                    got.append(c.text or "")
                    finish = c.finish_reason or finish
        return finish

    task = asyncio.create_task(consume_with_stop())
    try:
        await asyncio.to_thread(poll, lambda: len("".join(got)) >= 3 or task.done(), 20, what="3 characters")
        assert not task.done() and server.running() == 0  # (a local replica streams it)
        router.kill_replica(router.replica_names[0])
        finish = await asyncio.wait_for(task, 30)
    finally:
        task.cancel()
    assert ("".join(got), finish) == (want, "stop")
    assert router.metrics().value("fairstream_resumed_tokens_total") >= 1


async def test_a_stream_whose_only_upstream_is_killed_waits_for_its_restart(tmp_path, cleanup, aclient_for):
    # A killed upstream stays "ready" until its next health ping (about a
    # second); a failover in that second went straight back to it, was
    # refused, and used up max_failovers in milliseconds (stream_lost). A
    # refused connection now marks it down at once: the stream waits for the
    # restart (failover_wait) and continues token-exact.
    server = SimOpenAI(tmp_path, {"step_base_ms": 15})
    server.start()
    cleanup(server)
    router = upstream_router(tmp_path / "router", server.url, local=0)
    cleanup(router)
    router.start()
    aclient = aclient_for(router)
    max_tokens = 300
    expected = await reference(prompt_ids("completion"), max_tokens)
    got: list[str] = []
    task = asyncio.create_task(consume(aclient, "completion", max_tokens, got))
    try:
        await asyncio.to_thread(poll, lambda: len("".join(got)) >= 40 or task.done(), 20, what="40 characters")
        assert not task.done(), task.result()
        server.kill()
        await asyncio.sleep(1.5)  # longer than the health interval: the stream waits, it does not end
        assert not task.done(), task.result()
        server.start(port=server.port)
        text, finish = await asyncio.wait_for(task, 30)
    finally:
        task.cancel()
    assert text == expected and finish == "length"
    m = router.metrics()
    # the death, the refusal that told the router it was down, and perhaps a
    # connection the dying server still accepted and then reset: within
    # max_failovers (3), where the refusals alone used to exceed it
    assert 2 <= m.value("fairstream_failovers_total", replica=UPSTREAM) <= 3
    assert m.value("fairstream_requests_total", tenant="gold", outcome="ok") == 1


async def test_upstream_without_token_ids_retries_before_first_token(tmp_path, cleanup, aclient_for):
    # A slow prefill: the first token comes seconds after the request arrives.
    server = SimOpenAI(tmp_path, {"step_base_ms": 5, "step_per_prefill_token_ms": 300}, token_ids=False)
    server.start()
    cleanup(server)
    router = upstream_router(tmp_path / "router", server.url, sim={"step_base_ms": 1})
    cleanup(router)
    router.start()
    aclient = aclient_for(router)
    expected = await reference(prompt_ids("completion"), 100)
    got: list[str] = []
    task = asyncio.create_task(consume(aclient, "completion", 100, got))
    try:
        await asyncio.to_thread(poll, lambda: server.running() == 1, 10, what="the request on the upstream")
        assert not got
        server.kill()
        text, finish = await asyncio.wait_for(task, 30)
    finally:
        task.cancel()
    assert (text, finish) == (expected, "length")
    assert router.metrics().value("fairstream_failovers_total", replica=UPSTREAM) == 1


async def test_upstream_without_token_ids_fails_explicitly_after_first_token(tmp_path, cleanup, aclient_for):
    server = SimOpenAI(tmp_path, {"step_base_ms": 15}, token_ids=False)
    server.start()
    cleanup(server)
    router = upstream_router(tmp_path / "router", server.url, sim={"step_base_ms": 1})
    cleanup(router)
    router.start()
    aclient = aclient_for(router)
    expected = await reference(prompt_ids("completion"), 400)
    got: list[str] = []
    task = asyncio.create_task(consume(aclient, "completion", 400, got))
    await asyncio.to_thread(poll, lambda: len("".join(got)) >= 20 or task.done(), 20, what="20 characters")
    assert not task.done(), task.result()
    server.kill()
    # Never a truncated stream that looks complete, never repeated text: an error event.
    with pytest.raises(openai.APIError) as info:
        await asyncio.wait_for(task, 30)
    assert not isinstance(info.value, openai.APIConnectionError), (
        "the router cut the connection instead of sending an error event: router/generation.py must treat "
        "text delivered without token ids as not resumable (docs/upstreams.md, 'What the router does')"
    )
    assert "could not be resumed" in str(info.value)
    partial = "".join(got)
    assert expected.startswith(partial) and len(partial) < len(expected)
    assert router.metrics().value("fairstream_requests_total", outcome="lost") == 1


async def test_upstream_without_token_ids_counts_one_token_per_chunk(tmp_path, cleanup, aclient_for):
    """Output without token ids still counts: usage, the tenant's token
    metrics and the stall timer see one token per chunk. (Counting nothing
    left the first-token limit armed for the whole stream: this 2.4 s stream
    was cut at the tenant's 1 s first-token limit.) Such a stream has no
    resume buffer: nothing could continue it exactly."""
    tenants = tmp_path / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({
        "defaults": {"timeouts": {"queue_wait": 30, "first_token": 1.0, "stall": 30, "total": 120}},
        "tenants": {"gold": {"keys": [hash_key(GOLD)]}},
    }))
    server = SimOpenAI(tmp_path, {"step_base_ms": 15}, token_ids=False)
    server.start()
    cleanup(server)
    router = upstream_router(tmp_path / "router", server.url, local=0, tenants=tenants)
    cleanup(router)
    router.start()
    aclient = aclient_for(router)
    expected = await reference(prompt_ids("completion"), 160)
    stream = await aclient.completions.create(model=MODEL, prompt=PROMPT, stream=True,
                                              stream_options={"include_usage": True}, **greedy(160))
    text, finish, usage, request_id = [], None, None, None
    async for chunk in stream:
        request_id = chunk.id
        if chunk.choices:
            text.append(chunk.choices[0].text)
            finish = chunk.choices[0].finish_reason or finish
        if chunk.usage is not None:
            usage = chunk.usage
    assert ("".join(text), finish) == (expected, "length")
    # the prompt's count comes from the upstream's usage chunk (asked for
    # with stream_options while ids are not known to come)
    prompt = len(prompt_ids("completion"))
    assert usage is not None and (usage.completion_tokens, usage.prompt_tokens) == (160, prompt), usage
    m = router.metrics()
    assert m.value("fairstream_tokens_total", tenant="gold", direction="completion") == 160
    assert m.value("fairstream_tokens_total", tenant="gold", direction="prompt") == prompt
    assert m.value("fairstream_requests_total", tenant="gold", outcome="ok") == 1
    async with httpx.AsyncClient(base_url=router.base_url, timeout=10) as http:
        r = await http.get(f"/v1/streams/{request_id.removeprefix('cmpl-')}",
                           headers={"authorization": f"Bearer {GOLD}", "last-event-id": "1"})
    assert r.status_code == 404, r.text
    # (the message named only the retention window: a client looked at the wrong setting)
    assert "served by an upstream that returns no token ids" in r.json()["error"]["message"], r.text



class _PlainUpstream:
    """An OpenAI-style server that streams three one-token chunks, then ends
    as ``ending`` says, 0.2 s later:

    * "usage": the usage chunk (when asked), counting 5 completion tokens,
      more than its chunks, as a server that merges tokens would; ``[DONE]``;
    * "usage-on-finish": that usage on the finish chunk itself; ``[DONE]``;
    * "done": ``[DONE]`` only (a server that ignores ``stream_options``);
    * "cut": the connection breaks;
    * "silent": nothing more for a while.

    The body then stays open for ``linger`` s (its end is marked in
    ``marks``, as is when the usage went out). With ``ids`` it returns token
    ids (vLLM's ``return_token_ids``); when ``strict`` it rejects the request
    fields it does not know with a 400 naming them (as api.openai.com does
    for ``return_token_ids``, older servers for ``stream_options``)."""

    def __init__(self, ending: str, *, strict: bool = False, ids: bool = False, linger: float = 1.5) -> None:
        self.ending = ending
        self.strict = strict
        self.ids = ids
        self.linger = linger
        self.bodies: list[dict[str, Any]] = []
        self.marks: dict[str, float] = {}
        self.runner: Any = None
        self.url = ""

    async def start(self) -> None:
        from aiohttp import web

        async def models(request: web.Request) -> web.Response:
            return web.json_response({"object": "list", "data": [{"id": MODEL, "object": "model"}]})

        async def completions(request: web.Request) -> web.StreamResponse:
            body = await request.json()
            self.bodies.append(body)
            for field in ("return_token_ids", "stream_options"):
                if self.strict and field in body:
                    return web.json_response({"error": {"message": f"Unrecognized request argument supplied: "
                                                        f"{field}", "type": "invalid_request_error"}}, status=400)
            asked = bool((body.get("stream_options") or {}).get("include_usage"))
            usage = {"prompt_tokens": 7, "completion_tokens": 5, "total_tokens": 12}
            resp = web.StreamResponse(headers={"content-type": "text/event-stream"})
            await resp.prepare(request)
            for i, (text, finish) in enumerate([("a", None), ("b", None), ("c", "length")]):
                choice: dict[str, Any] = {"index": 0, "text": text, "finish_reason": finish}
                if self.ids and body.get("return_token_ids"):
                    choice["token_ids"] = [ord(text)]
                    if i == 0:
                        choice["prompt_token_ids"] = [1, 2, 3, 4, 5, 6, 7]
                chunk: dict[str, Any] = {"id": "cmpl-1", "choices": [choice]}
                if finish and asked and self.ending == "usage-on-finish":
                    chunk["usage"] = usage
                    self.marks["usage"] = time.monotonic()
                await resp.write(b"data: %s\n\n" % json.dumps(chunk).encode())
            await asyncio.sleep(0.2)
            if self.ending == "cut":
                assert request.transport is not None
                request.transport.abort()
                return resp
            if self.ending == "usage" and asked:
                self.marks["usage"] = time.monotonic()
                await resp.write(b"data: %s\n\n" % json.dumps({"id": "cmpl-1", "choices": [],
                                                                "usage": usage}).encode())
            if self.ending != "silent":
                await resp.write(b"data: [DONE]\n\n")
            await asyncio.sleep(self.linger)
            self.marks["end"] = time.monotonic()
            return resp

        app = web.Application()
        app.router.add_get("/v1/models", models)
        app.router.add_post("/v1/completions", completions)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}/v1"

    async def close(self) -> None:
        await self.runner.cleanup()


class _Deltas:
    """A collector's sink: every delta of one request, until its finish (and when that came)."""

    def __init__(self) -> None:
        self.deltas: list[Any] = []
        self.done = asyncio.get_running_loop().create_future()
        self.finished_at = 0.0

    def on_delta(self, col, d) -> None:
        self.deltas.append(d)
        if d.finish != FinishReason.NONE:
            self.finished_at = time.monotonic()
            self.done.set_result(None)

    def on_fail(self, col, exc) -> None:
        self.done.set_exception(exc)


@pytest.mark.parametrize("ending", ["usage", "usage-on-finish", "done", "cut", "silent", "ids", "strict"])
async def test_upstream_without_token_ids_reports_usage_at_its_finish(ending, monkeypatch):
    """Without token ids, the router asks for the usage chunk and holds the
    finish back for it: the finish carries the prompt's count and the
    upstream's larger completion count. A body that ends, breaks or goes
    silent after the finish without one still finishes the stream (silent:
    after ``USAGE_WAIT``), and before the body's end. A stream with token ids
    is never held. A strict server that rejects ``return_token_ids`` and then
    ``stream_options`` gets the request a third time with neither, and later
    ones without both."""
    monkeypatch.setattr(upstream_sse, "USAGE_WAIT", 0.5)
    server = _PlainUpstream("usage" if ending in ("ids", "strict") else ending,
                            strict=ending == "strict", ids=ending == "ids")
    await server.start()
    client = await open_upstream(UPSTREAM, ReplicaSpec(name=UPSTREAM, url=server.url))
    try:
        for _ in range(2 if ending == "strict" else 1):
            col = client.generate(SamplingParams(max_tokens=3, temperature=0), prompt=PROMPT)
            col.sink = sink = _Deltas()
            await asyncio.wait_for(sink.done, 10)
            last = sink.deltas[-1]
            assert "".join(d.text for d in sink.deltas) == "abc" and last.finish == FinishReason.LENGTH
            counted = sum(len(d.token_ids) + d.count for d in sink.deltas)
            usage = ending in ("usage", "usage-on-finish")
            assert (counted, last.prompt_count) == ((5, 7) if usage else (3, 0))
            if ending != "cut":
                assert sink.finished_at < server.marks.get("end", math.inf)  # not held to the body's end (none yet)
        if ending == "ids":
            assert sink.finished_at < server.marks.get("usage", math.inf)  # not held for the usage chunk
            assert sink.deltas[0].prompt_token_ids == [1, 2, 3, 4, 5, 6, 7] and client.token_ids is True
        else:
            assert client.token_ids is False
        assert client.continues is (ending == "ids")  # (the pool sends it no continuation: CONTINUES)
        asked = [("return_token_ids" in b, "stream_options" in b) for b in server.bodies]
        assert asked == ([(True, True), (False, True), (False, False), (False, False)] if ending == "strict"
                         else [(True, True)])
    finally:
        await client.close()
        await server.close()
