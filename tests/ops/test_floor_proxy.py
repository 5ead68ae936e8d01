"""The benchmark's Python floor (ops/bench/floor_proxy.py) relays what the
mock upstream streams, token for token, to the official openai client: its
CPU numbers are only a reference if it does the relay's whole job."""

from __future__ import annotations

import sys

import openai
import pytest

from ops.bench.procs import Proc, free_port, wait_http

KEY = "sk-floor-test"


@pytest.fixture(params=[False, True], ids=["floor", "floor-features"])
def floor(request, tmp_path):
    mock_port, port = free_port(), free_port()
    procs = [Proc("mock", [sys.executable, "-m", "ops.bench.mock_upstream", "--port", str(mock_port)],
                  tmp_path / "mock.log")]
    try:
        assert wait_http(f"http://127.0.0.1:{mock_port}/health", 20, procs[0]), (tmp_path / "mock.log").read_text()
        cmd = [sys.executable, "-m", "ops.bench.floor_proxy", "--port", str(port),
               "--upstream", f"127.0.0.1:{mock_port}", "--key", KEY]
        if request.param:
            cmd.append("--features")
        procs.append(Proc("floor", cmd, tmp_path / "floor.log"))
        assert wait_http(f"http://127.0.0.1:{port}/health", 20, procs[1]), (tmp_path / "floor.log").read_text()
        yield port
    finally:
        for p in procs:
            p.stop()


def test_streams_every_token_in_order(floor):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{floor}/v1", api_key=KEY, max_retries=0)
    for _ in range(2):  # the second request reuses the kept-alive upstream connection
        stream = client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "hi"}],
                                                max_tokens=20, stream=True)
        text = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        assert text == "".join(f"t{i:03d}" for i in range(20))


def test_refuses_an_unknown_key(floor):
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{floor}/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "hi"}], stream=True)
