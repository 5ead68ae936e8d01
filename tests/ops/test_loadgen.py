"""The load generator: its pure parts, its guards, and a short real run against a router."""

from __future__ import annotations

import json
import random
import socket
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from ops.loadgen.cli import main
from ops.loadgen.plan import Planner, make_prompt, sample, split_workers
from ops.loadgen.scenario import ConfigError, LogNormal, Uniform, load_scenario
from ops.loadgen.sse import SseParser, decode_chunk
from ops.loadgen.stats import wpercentile
from ops.loadgen.target import check_base_url
from tests.helpers import ROOT, RouterProcess

DEMO = ROOT / "ops" / "scenarios" / "demo.yaml"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
PNGS = ["ttft_cdf.png", "itl_cdf.png", "e2e_cdf.png", "tokens_per_s.png", "queue_depth.png"]

TINY = """\
name: tiny
model: fairstream-sim
duration_s: 3
max_requests: 400
drain_timeout_s: 10
mode: concurrency
concurrency: 6
chars_per_token: 1.0
classes:
  chat: {prompt_tokens: {dist: uniform, min: 16, max: 64}, max_tokens: 32, weight: 3}
  text: {api: completions, prompt_tokens: 40, max_tokens: 24}
  unary: {stream: false, prompt_tokens: 20, max_tokens: 16}
tenants:
  gold: {api_key: fs-demo-gold, weight: 2}
  silver: {api_key: fs-demo-silver, weight: 1, classes: {chat: 1}}
"""


def write(tmp_path: Path, text: str, name: str = "s.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# -- scenario schema ------------------------------------------------------------------


def test_demo_scenario_loads() -> None:
    s = load_scenario(DEMO)
    assert s.mode == "concurrency" and s.duration_s and set(s.tenants) == {"gold", "silver", "free"}


@pytest.mark.parametrize("change, where", [
    ("duration_s: 3\nmax_requests: 400\n", ":1: duration_s: set duration_s and/or max_requests"),
    ("mode: concurrency\n", "mode"),
    ("concurrency: 6\n", "concurrency: mode concurrency needs concurrency >= 1"),
    ("max_tokens: 32, weight: 3}", "unknown key"),
])
def test_scenario_errors_name_file_line_and_key(tmp_path: Path, change: str, where: str) -> None:
    text = TINY.replace(change, "max_tokens: 32, weight: 3, colour: red}" if "weight" in change else "")
    with pytest.raises(ConfigError) as e:
        load_scenario(write(tmp_path, text))
    msg = str(e.value)
    assert msg.startswith(str(tmp_path / "s.yaml") + ":"), msg
    assert where in msg if where.startswith(":") else where in msg, msg


def test_scenario_rejects_bad_distribution(tmp_path: Path) -> None:
    text = TINY.replace("{dist: uniform, min: 16, max: 64}", "{dist: uniform, min: 64, max: 16}")
    with pytest.raises(ConfigError, match=r"s.yaml:10: classes.chat.prompt_tokens: needs 1 <= min <= max"):
        load_scenario(write(tmp_path, text))


@pytest.mark.parametrize("change, new, where", [
    ("chars_per_token: 1.0", "chars_per_token: .inf", "s.yaml:8: chars_per_token: must be a finite number"),
    ("drain_timeout_s: 10", "drain_timeout_s: .nan", "s.yaml:5: drain_timeout_s: must be a finite number"),
    ("max_tokens: 32, weight: 3}", "max_tokens: 32, weight: .nan}", "s.yaml:10: classes.chat.weight: must be a finite"),
    ("{api_key: fs-demo-gold, weight: 2}", "{api_key: fs-demo-gold, weight: .nan}",
     "s.yaml:14: tenants.gold.weight: must be a finite"),
    ("classes: {chat: 1}}", "classes: {chat: .inf}}", "tenants.silver.classes.chat: must be a finite"),
    ("{dist: uniform, min: 16, max: 64}", "{dist: normal, mean: .nan, stddev: 3}",
     "s.yaml:10: classes.chat.prompt_tokens: needs finite numbers"),
])
def test_scenario_refuses_nan_and_inf(tmp_path: Path, change: str, new: str, where: str) -> None:
    # (accepted before: NaN weights silently sent nothing, an infinite
    # chars_per_token killed every worker with OverflowError, 0 requests, exit 0)
    assert change in TINY
    with pytest.raises(ConfigError) as e:
        load_scenario(write(tmp_path, TINY.replace(change, new)))
    assert where in str(e.value), str(e.value)


# -- pure parts ----------------------------------------------------------------------


def test_sample_and_prompt_are_seeded_and_bounded() -> None:
    rng = random.Random(1)
    xs = [sample(LogNormal(median=100, sigma=1.0, min=8, max=400), rng) for _ in range(500)]
    assert min(xs) >= 8 and max(xs) <= 400
    assert all(5 <= sample(Uniform(5, 9), rng) <= 9 for _ in range(100))
    a, b = make_prompt(50, 1.0, random.Random(3)), make_prompt(50, 1.0, random.Random(3))
    assert a == b and len(a) == 50


def test_split_workers_by_weight() -> None:
    assert split_workers(10, {"a": 3, "b": 1, "c": 1}) == {"a": 6, "b": 2, "c": 2}
    assert split_workers(3, {"a": 100, "b": 1, "c": 1}) == {"a": 1, "b": 1, "c": 1}
    assert sum(split_workers(7, {"a": 1.5, "b": 2.5}).values()) == 7


def test_planner_builds_requests(tmp_path: Path) -> None:
    s = load_scenario(write(tmp_path, TINY))
    p = Planner(s)
    specs = [p.next("silver") for _ in range(20)]
    assert {x.cls for x in specs} == {"chat"} and all(x.path == "/v1/chat/completions" for x in specs)
    body = json.loads(specs[0].body)
    assert body["stream"] is True and body["ignore_eos"] is True and body["max_tokens"] == 32
    assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    again = Planner(s)
    assert [x.body for x in specs] == [again.next("silver").body for _ in range(20)]


def test_sse_parser_handles_split_lines_crlf_and_comments() -> None:
    p = SseParser()
    raw = b': hi\r\nid: 1\r\ndata: {"a":\r\ndata: 1}\r\n\r\nda' + b'ta: [DONE]\n\n'
    out = []
    for i in range(0, len(raw), 3):
        out += p.feed(raw[i:i + 3])
    assert out == [b'{"a":\n1}', b"[DONE]"]
    c = decode_chunk(b'{"choices":[{"index":0,"delta":{"content":"h\\u00e9"}}],"usage":{"prompt_tokens":3,'
                     b'"completion_tokens":2,"total_tokens":5}}')
    assert c.text() == "hé" and c.usage.completion_tokens == 2
    assert decode_chunk(b'{"error":{"message":"x","type":"server_error","code":"stream_lost"}}').error.code == "stream_lost"


def test_weighted_percentiles() -> None:
    assert wpercentile([], 50) is None
    assert wpercentile([(v, 1.0) for v in range(1, 101)], 50) == 50
    assert wpercentile([(v, 1.0) for v in range(1, 101)], 99) == 99
    assert wpercentile([(1.0, 1.0), (10.0, 9.0)], 50) == 10.0  # per-token weighting


@pytest.mark.parametrize("url", ["http://127.0.0.1:8080", "http://127.9.9.9", "http://localhost:1/",
                                 "http://[::1]:8080", "https://LOCALHOST"])
def test_loopback_urls_are_allowed(url: str) -> None:
    assert check_base_url(url, allow_remote=False) == url.rstrip("/")


def test_the_sdk_base_url_names_the_router_too() -> None:
    # (".../v1", as the openai SDK takes it, made every request /v1/v1/...: all 404)
    assert check_base_url("http://127.0.0.1:8080/v1", allow_remote=False) == "http://127.0.0.1:8080"
    assert check_base_url("http://127.0.0.1:8080/v1/", allow_remote=False) == "http://127.0.0.1:8080"


@pytest.mark.parametrize("url", ["http://10.0.0.1:8080", "http://example.com", "http://localhost.example.com",
                                 "http://128.0.0.1", "http://[::2]:80", "ftp://127.0.0.1", "http://0.0.0.0"])
def test_remote_urls_are_refused(url: str) -> None:
    with pytest.raises(ValueError):
        check_base_url(url, allow_remote=False)


def test_cli_refuses_remote_without_flag(tmp_path: Path, capsys) -> None:
    scenario = write(tmp_path, TINY)
    assert main(["--scenario", str(scenario), "--base-url", "http://192.0.2.1:8080", "--out", str(tmp_path / "o")]) == 2
    assert "--allow-remote" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()
    assert check_base_url("http://192.0.2.1:8080", allow_remote=True) == "http://192.0.2.1:8080"


def test_a_run_in_which_no_request_succeeded_exits_1(tmp_path: Path, capsys) -> None:
    # (a router that is down, a wrong key or model: every request failed, and
    # the run exited 0 like a good one, so a script or CI job went on)
    port = socket.socket()
    port.bind(("127.0.0.1", 0))
    dead = port.getsockname()[1]
    port.close()
    scenario = write(tmp_path, TINY)
    code = main(["--scenario", str(scenario), "--base-url", f"http://127.0.0.1:{dead}", "--max-requests", "3",
                 "--no-progress", "--no-scrape", "--no-plots", "--out", str(tmp_path / "o")])
    assert code == 1
    assert "no request succeeded" in capsys.readouterr().err
    assert (tmp_path / "o" / "summary.json").exists()  # (what was measured is still written)


# -- a real run ---------------------------------------------------------------------


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path.name} is not a PNG"
    assert data[12:16] == b"IHDR" and data[-8:-4] == b"IEND", f"{path.name} is truncated"
    return struct.unpack(">II", data[16:24])


def test_short_run_against_router(ops_router: RouterProcess, tmp_path: Path) -> None:
    scenario = write(tmp_path, TINY)
    out = tmp_path / "out"
    p = subprocess.run(
        [sys.executable, "-m", "ops.loadgen", "--scenario", str(scenario), "--base-url", ops_router.base_url,
         "--out", str(out), "--no-progress"],
        cwd=ROOT, capture_output=True, text=True, timeout=60,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    assert "TTFT ms p50/p90/p99" in p.stdout and "total" in p.stdout

    summary = json.loads((out / "summary.json").read_text())
    assert set(summary["tenants"]) == {"gold", "silver"}
    assert 2.5 < summary["send_s"] < 8 and summary["wall_s"] >= summary["send_s"]
    for name, row in [*summary["tenants"].items(), ("total", summary["total"])]:
        assert row["requests"] > 0 and row["ok"] == row["requests"], (name, row)
        assert row["errors"] == {}, (name, row)
        assert 0 < row["ttft_p50"] <= row["ttft_p90"] <= row["ttft_p99"] < 20, (name, row)
        assert 0 < row["itl_p50"] <= row["itl_p90"] <= row["itl_p99"] < 5, (name, row)
        assert row["ttft_p50"] < row["e2e_p50"] <= row["e2e_p99"], (name, row)
        assert row["completion_tokens"] > 0 and row["prompt_tokens"] > 0 and row["tokens_per_s"] > 0, (name, row)
    total = summary["total"]
    assert total["requests"] == sum(r["requests"] for r in summary["tenants"].values())

    results = json.loads((out / "results.json").read_text())
    reqs = results["requests"]
    assert len(reqs) == total["requests"]
    # ignore_eos: every request got exactly its max_tokens, counted exactly from usage
    assert all(r["tokens_exact"] and r["completion_tokens"] in (32, 24, 16) for r in reqs)
    assert {r["class"] for r in reqs if r["tenant"] == "silver"} == {"chat"}
    assert any(not r["stream"] and r["ttft"] is None for r in reqs)
    assert len(results["scrapes"]) >= 2, "the router's /metrics should be scraped about once a second"
    assert results["scrapes"][-1]["completion_tokens"].get("gold", 0) > 0
    csv_lines = (out / "results.csv").read_text().strip().splitlines()
    assert len(csv_lines) == total["requests"] + 1

    for name in PNGS:
        w, h = _png_size(out / name)
        assert w >= 400 and h >= 300, (name, w, h)


def test_ctrl_c_reports_what_was_measured(ops_router: RouterProcess, tmp_path: Path) -> None:
    # (a KeyboardInterrupt traceback, and no table and no files: the run's measurements lost)
    import signal
    import time

    scenario = write(tmp_path, TINY.replace("duration_s: 3", "duration_s: 60").replace("max_requests: 400",
                                                                                       "max_requests: 100000"))
    out = tmp_path / "out"

    def served() -> float:
        return ops_router.metrics().value("fairstream_requests_total", 0.0, tenant="gold", endpoint="chat",
                                          outcome="ok")

    before = served()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ops.loadgen", "--scenario", str(scenario), "--base-url", ops_router.base_url,
         "--out", str(out), "--no-progress", "--no-plots"],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while served() <= before:  # (its requests are being served: its Ctrl-C handling is up)
            assert time.monotonic() < deadline, "no request got through"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        stdout, stderr = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130, stdout + stderr
    assert "interrupted after" in stderr and "Traceback" not in stderr, stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["total"]["requests"] > 0 and summary["send_s"] < 30, summary


RATE = """\
name: rate
model: fairstream-sim
duration_s: 5
max_requests: 12
mode: rate
rate: 30
chars_per_token: 1.0
scrape_interval_s: 0
classes:
  chat: {prompt_tokens: 16, max_tokens: 8}
tenants:
  gold: {api_key: fs-demo-gold, weight: 1}
  stranger: {api_key: not-a-key, weight: 1}
"""


def test_rate_mode_is_bounded_by_count_and_classifies_errors(ops_router: RouterProcess, tmp_path: Path) -> None:
    import asyncio

    from ops.loadgen.runner import Run
    from ops.loadgen.stats import summarize

    s = load_scenario(write(tmp_path, RATE))
    data = asyncio.run(Run(s, ops_router.base_url).execute())
    assert len(data.results) == 12 and data.send_s < 3, "stops at max_requests, well before duration_s"
    assert data.snapshots == []
    rows = {r.tenant: r for r in summarize(data.results, data.wall_s, list(s.tenants))}
    assert rows["gold"].ok == rows["gold"].requests > 0 and rows["gold"].ttft_p50 > 0
    bad = rows["stranger"]
    assert bad.ok == 0 and bad.errors == {"http_401:invalid_api_key": bad.requests} and bad.requests > 0
    assert rows["total"].requests == 12
