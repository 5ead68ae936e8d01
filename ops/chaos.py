"""Chaos runner: load a live router and kill or freeze its replicas on a schedule.

    python ops/chaos.py --base-url http://127.0.0.1:8080 --admin-key fs-demo-admin \\
        --api-key fs-demo-gold --streams 16 --duration 30 --kill-every 3

It first computes a reference completion for each of a few prompts (greedy,
``ignore_eos``, a fixed ``max_tokens``), then keeps ``--streams`` streams
running for ``--duration`` seconds while, every ``--kill-every`` seconds, it
picks a ready replica (from ``GET /admin/replicas``) and sends it SIGKILL, or
SIGSTOP followed by SIGCONT after ``--freeze`` seconds (``--mode``), as long
as another ready replica it has not frozen stays serving: a turn that finds
fewer than two skips its action (with the demo's two replicas, until the one
frozen or killed is back: about one action per freeze and restart). Every
stream's text is compared with its reference. The report counts streams
started, completed and errored, token mismatches, failovers and lost streams
(from /metrics), the p99 failover latency, and replica restarts.

Loopback only: replicas are signalled by pid, so the runner must run on the
router's host, and it refuses a non-loopback URL. It needs at least two local
replicas with pids (a ``serve --workers`` router lists its replicas as
remote: run it against a single-process router), and refuses to report a
run in which it took no action. A freeze (7 s by default) outlasts the
router's ``health_interval`` + ``health_timeout`` (6 s), so the router notices
it; while a replica is frozen the runner watches ``/admin/replicas`` for it
to go not ready, and a run whose actions the router never noticed (no
failover, no restart, no frozen replica seen not ready: a ``--freeze`` too
short for the router's settings) fails with "nothing was tested", as does
one after which a replica is not ready ``--recover-wait`` seconds (30) on:
raise it above the replicas' restart time (a vLLM replica: 45-110 s on a
small host, more for a real model). Bounded in time and count.
"""

from __future__ import annotations

import argparse
import asyncio
import ipaddress
import json
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from urllib.parse import urlparse

import httpx

__all__ = ["ChaosConfig", "ChaosReport", "run_chaos", "config_from_args", "verdict", "main"]

PROMPTS = ["Le caf", "The cluster", "東京の", "Streams should", "Über den", "A good router"]


@dataclass
class ChaosConfig:
    base_url: str
    api_key: str
    admin_key: str
    model: str = "fairstream-sim"
    streams: int = 8
    duration: float = 20.0
    max_tokens: int = 200
    kill_every: float = 3.0
    freeze: float = 7.0  # above the router's default health_timeout (5 s): a freeze is noticed
    mode: str = "mixed"  # kill | freeze | mixed (as the command line)
    seed: int = 0
    max_requests: int = 10_000
    recover: float = 30.0  # seconds the replicas get to be ready again after the run (--recover-wait)


@dataclass
class ChaosReport:
    started: int = 0
    completed: int = 0
    errored: int = 0
    mismatches: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    actions: list[str] = field(default_factory=list)
    failovers: float = 0.0
    streams_lost: float = 0.0
    failover_p99: float | None = None
    restarts: int = 0
    freezes: int = 0
    freezes_seen: int = 0  # freezes the router marked not ready (or restarted) while they lasted
    not_back: list[str] = field(default_factory=list)  # replicas not ready ``recover`` s after the run
    duration: float = 0.0

    def table(self) -> str:
        rows = [
            ("streams started", self.started),
            ("streams completed", self.completed),
            ("streams errored", self.errored),
            ("token mismatches", self.mismatches),
            ("failovers (router)", int(self.failovers)),
            ("streams lost (router)", int(self.streams_lost)),
            ("failover latency p99 (from detection; histogram bucket bound)",
             "n/a" if self.failover_p99 is None else f"{self.failover_p99 * 1000:.0f} ms"),
            ("replica restarts", self.restarts),
            ("freezes the router noticed (replica not ready)", f"{self.freezes_seen} of {self.freezes}"),
            ("replicas not back (not ready --recover-wait s after the run)", ", ".join(self.not_back) or "none"),
            ("chaos actions", len(self.actions)),
            ("duration", f"{self.duration:.1f} s"),
        ]
        w = max(len(k) for k, _ in rows)
        lines = [f"| {'metric'.ljust(w)} | value |", f"| {'-' * w} | ----- |"]
        lines += [f"| {k.ljust(w)} | {v} |" for k, v in rows]
        if self.errors:
            lines.append("errors: " + ", ".join(f"{k}={v}" for k, v in sorted(self.errors.items())))
        return "\n".join(lines)

    def noticed(self) -> bool:
        """Whether the router noticed any of the run's actions: a run whose
        freezes were all too short for its health check, with no failover
        and no restart, tested nothing."""
        return bool(self.failovers or self.restarts or self.freezes_seen)


def _base_url(url: str) -> str:
    """The router's root from ``--base-url`` (a trailing ``/v1``, the openai
    SDK's base URL, is dropped, as the load generator drops it); ``ChaosError``
    (exit 2) for a URL it will not use."""
    parts = urlparse(url)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ChaosError(f"--base-url must be http:// or https:// with a host, not {url!r}")
    host = parts.hostname
    loopback = host == "localhost"
    try:
        loopback = loopback or ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    if not loopback:
        raise ChaosError(f"refusing non-loopback target {url!r}; run it on the router's host")
    url = url.rstrip("/")
    return url[:-3] if url.endswith("/v1") else url


def _body(cfg: ChaosConfig, prompt: str, stream: bool) -> dict:
    return {
        "model": cfg.model, "prompt": prompt, "max_tokens": cfg.max_tokens, "temperature": 0,
        "ignore_eos": True, "stream": stream,
    }


def _refused(what: str, r: httpx.Response) -> ChaosError:
    """The router's refusal of ``what``, with its own message."""
    try:
        err = r.json()["error"]
        why = f"{err.get('code') or err.get('type')}: {err['message']}"
    except (ValueError, KeyError, TypeError):
        why = r.text[:200]
    return ChaosError(f"{what}: HTTP {r.status_code}: {why}")


async def _replicas(admin: httpx.AsyncClient) -> list[dict]:
    r = await admin.get("/admin/replicas")
    if r.status_code != 200:
        raise _refused("GET /admin/replicas (--admin-key)", r)
    return r.json()["replicas"]


async def _reference(client: httpx.AsyncClient, cfg: ChaosConfig) -> dict[str, str]:
    refs = {}
    for p in PROMPTS:
        r = await client.post("/v1/completions", json=_body(cfg, p, False))
        if r.status_code != 200:
            raise _refused("the reference completion (--api-key, --model, --max-tokens)", r)
        refs[p] = r.json()["choices"][0]["text"]
    return refs


async def _one_stream(client: httpx.AsyncClient, cfg: ChaosConfig, prompt: str, ref: str, rep: ChaosReport) -> None:
    rep.started += 1
    parts: list[str] = []
    done = False
    try:
        async with client.stream("POST", "/v1/completions", json=_body(cfg, prompt, True)) as r:
            if r.status_code != 200:
                await r.aread()
                raise RuntimeError(f"http_{r.status_code}")
            async for line in r.aiter_lines():
                if line.startswith("data: [DONE]"):
                    done = True
                elif line.startswith("data: "):
                    d = json.loads(line[6:])
                    if "error" in d:
                        raise RuntimeError(d["error"].get("code") or "stream_error")
                    if d.get("choices"):
                        parts.append(d["choices"][0]["text"])
        if not done:
            raise RuntimeError("truncated")
    except (httpx.HTTPError, RuntimeError) as e:
        kind = str(e) if isinstance(e, RuntimeError) else type(e).__name__
        rep.errored += 1
        rep.errors[kind] = rep.errors.get(kind, 0) + 1
        return
    rep.completed += 1
    if "".join(parts) != ref:
        rep.mismatches += 1


async def _metrics(admin: httpx.AsyncClient) -> dict[str, float]:
    """The counters the report takes from ``/metrics``, read with the admin key
    (router.yaml's ``metrics_require_admin_key`` refuses a tenant's); a refusal
    is an error, never a count of 0."""
    r = await admin.get("/metrics")
    if r.status_code != 200:
        raise _refused("GET /metrics (--admin-key)", r)
    text = r.text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#") or not line:
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        if name in ("fairstream_failovers_total", "fairstream_streams_lost_total",
                    "fairstream_failover_latency_seconds_count"):
            out[name] = out.get(name, 0.0) + float(value)
        elif name == "fairstream_failover_latency_seconds_bucket":
            le = name_labels.split('le="', 1)[1].split('"', 1)[0]
            out["bucket:" + le] = out.get("bucket:" + le, 0.0) + float(value)
    return out


def _p99(before: dict[str, float], after: dict[str, float]) -> float | None:
    buckets = sorted(
        ((float("inf") if k[7:] == "+Inf" else float(k[7:])), after[k] - before.get(k, 0.0))
        for k in after if k.startswith("bucket:")
    )
    if not buckets or buckets[-1][1] <= 0:
        return None
    total = buckets[-1][1]
    for le, count in buckets:
        if count >= 0.99 * total:
            return le
    return None


def _thaw(pid: int, frozen: dict[int, asyncio.TimerHandle]) -> None:
    """SIGCONT a replica this run froze (at the end of its freeze, or of the run).
    (Continued before it leaves ``frozen``: a SIGTERM, raised as a
    KeyboardInterrupt between two lines, must not leave one stopped that
    ``frozen`` no longer names.)"""
    try:
        os.kill(pid, signal.SIGCONT)
    except ProcessLookupError:
        pass  # the supervisor killed it for not answering pings
    handle = frozen.pop(pid, None)
    if handle is not None:
        handle.cancel()


def _thaw_all(frozen: dict[int, asyncio.TimerHandle]) -> None:
    """Thaw every replica in ``frozen``, a Ctrl-C or SIGTERM during it too
    (raised once all are thawed)."""
    interrupted: KeyboardInterrupt | None = None
    while frozen:
        try:
            for pid in list(frozen):
                _thaw(pid, frozen)
        except KeyboardInterrupt as e:
            interrupted = e
    if interrupted is not None:
        raise interrupted


# how often the runner looks at /admin/replicas while a replica is frozen
# (to see whether the router noticed the freeze)
WATCH_EVERY = 0.25


async def _chaos(admin: httpx.AsyncClient, cfg: ChaosConfig, rep: ChaosReport, stop: asyncio.Event) -> None:
    """An action every ``kill_every`` seconds; a frozen replica is thawed
    ``freeze`` seconds later by a timer, so freezes do not hold up the next
    actions, and every replica still frozen is thawed when this ends
    (cancelled too: a Ctrl-C leaves none stopped). While a replica is
    frozen, ``/admin/replicas`` is read every ``WATCH_EVERY`` seconds: a
    frozen replica listed not ready (or with another pid: restarted) counts
    in ``freezes_seen``."""
    rng = random.Random(cfg.seed)
    loop = asyncio.get_running_loop()
    frozen: dict[int, asyncio.TimerHandle] = {}
    watched: dict[int, str] = {}  # pid -> name of a frozen replica not yet seen not ready
    next_action = loop.time() + cfg.kill_every
    try:
        while not stop.is_set():
            watching = bool(watched) and any(pid in frozen for pid in watched)
            wait = next_action - loop.time()
            try:
                await asyncio.wait_for(stop.wait(), min(wait, WATCH_EVERY) if watching else wait)
                return
            except asyncio.TimeoutError:
                pass
            acting = loop.time() >= next_action
            if not (acting or watching):
                continue
            try:
                listed = await _replicas(admin)
            except (httpx.HTTPError, ChaosError) as e:  # (a slow or failed answer: this tick acts on nothing)
                key = f"admin: {type(e).__name__}"
                rep.errors[key] = rep.errors.get(key, 0) + 1
                if acting:
                    next_action = loop.time() + cfg.kill_every
                continue
            _seen(listed, watched, rep)
            for pid in [pid for pid in watched if pid not in frozen]:
                del watched[pid]  # thawed before the router noticed it
            if stop.is_set():
                return  # (the run ended while the router answered: no action after it)
            if not acting:
                continue
            next_action = loop.time() + cfg.kill_every
            ready = [r for r in listed if r["ready"] and r["local"] and r["pid"] and r["pid"] not in frozen]
            if len(ready) < 2:
                continue  # keep one replica serving
            victim = rng.choice(ready)
            mode = cfg.mode if cfg.mode != "mixed" else rng.choice(["kill", "freeze"])
            if mode == "kill":
                os.kill(victim["pid"], signal.SIGKILL)
                rep.actions.append(f"kill {victim['name']} pid {victim['pid']}")
            else:
                # (named in ``frozen`` before it is stopped: a SIGTERM between
                # the two, a KeyboardInterrupt here, left it stopped for good)
                frozen[victim["pid"]] = loop.call_later(cfg.freeze, _thaw, victim["pid"], frozen)
                os.kill(victim["pid"], signal.SIGSTOP)
                watched[victim["pid"]] = victim["name"]
                rep.freezes += 1
                rep.actions.append(f"freeze {victim['name']} pid {victim['pid']} for {cfg.freeze}s")
    finally:
        _thaw_all(frozen)


def _seen(listed: list[dict], watched: dict[int, str], rep: ChaosReport) -> None:
    """Count the frozen replicas the router lists as not ready, or under a
    new pid (its supervisor restarted one that stopped answering)."""
    by_name = {r["name"]: r for r in listed}
    for pid, name in list(watched.items()):
        r = by_name.get(name)
        if r is not None and (not r["ready"] or r["pid"] != pid):
            del watched[pid]
            rep.freezes_seen += 1


class ChaosError(Exception):
    """The run cannot test anything (no replica to act on)."""


async def run_chaos(cfg: ChaosConfig, progress=None) -> ChaosReport:
    base_url = _base_url(cfg.base_url)
    rep = ChaosReport()
    headers = {"Authorization": f"Bearer {cfg.api_key}"}
    limits = httpx.Limits(max_connections=cfg.streams + 4, max_keepalive_connections=cfg.streams + 4)
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=120, limits=limits) as client, \
            httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {cfg.admin_key}"},
                              timeout=10) as admin:
        reps = await _replicas(admin)
        usable = [r for r in reps if r["local"] and r["pid"]]
        if len(usable) < 2:
            raise ChaosError(
                f"chaos needs at least two local replicas it can signal; this router lists {len(usable)} of "
                f"{len(reps)} (a `serve --workers` router lists its replicas as remote: use a single-process one)")
        refs = await _reference(client, cfg)
        before = await _metrics(admin)
        restarts0 = sum(r["restarts"] for r in await _replicas(admin))
        stop = asyncio.Event()
        t0 = time.monotonic()
        chaos = asyncio.create_task(_chaos(admin, cfg, rep, stop))

        async def worker(i: int) -> None:
            rng = random.Random(cfg.seed * 1000 + i)
            while time.monotonic() - t0 < cfg.duration and rep.started < cfg.max_requests:
                p = rng.choice(PROMPTS)
                await _one_stream(client, cfg, p, refs[p], rep)
                if progress:
                    progress(rep)

        try:
            await asyncio.gather(*(worker(i) for i in range(cfg.streams)))
        finally:
            stop.set()
            await chaos  # (it thaws what it froze, a Ctrl-C included)
        rep.duration = time.monotonic() - t0
        # let the supervisor bring replicas back before reading the counters
        deadline = time.monotonic() + cfg.recover
        while True:
            reps = await _replicas(admin)
            if all(r["ready"] for r in reps) or time.monotonic() >= deadline:
                break
            await asyncio.sleep(0.2)
        # (a replica that never came back is a failure the streams do not show:
        # they went to the others)
        rep.not_back = sorted(r["name"] for r in reps if not r["ready"])
        rep.restarts = sum(r["restarts"] for r in reps) - restarts0
        after = await _metrics(admin)
        rep.failovers = after.get("fairstream_failovers_total", 0) - before.get("fairstream_failovers_total", 0)
        rep.streams_lost = after.get("fairstream_streams_lost_total", 0) - before.get(
            "fairstream_streams_lost_total", 0)
        rep.failover_p99 = _p99(before, after)
    return rep


def _positive(kind):
    def parse(text: str):
        value = kind(text)
        if not value > 0:
            raise argparse.ArgumentTypeError(f"must be more than 0, not {text}")
        return value
    parse.__name__ = kind.__name__  # (argparse names the type in its errors)
    return parse


def config_from_args(argv: list[str] | None = None) -> ChaosConfig:
    """The run's settings from the command line."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8080",
                   help="the router (loopback only; a trailing /v1, as the SDK's base URL has, is dropped)")
    p.add_argument("--api-key", default="fs-demo-gold", help="a tenant's key, for the streams")
    p.add_argument("--admin-key", default="fs-demo-admin", help="for GET /admin/replicas (the replicas' pids)")
    p.add_argument("--model", default="fairstream-sim", help="the model the streams ask for")
    p.add_argument("--streams", type=_positive(int), default=8, help="streams kept running at once")
    p.add_argument("--duration", type=_positive(float), default=20.0, help="seconds of load and actions")
    p.add_argument("--max-tokens", type=_positive(int), default=200, help="tokens per stream (greedy, ignore_eos)")
    p.add_argument("--kill-every", type=_positive(float), default=3.0,
                   help="seconds between two actions on replicas (a freeze does not hold up the next one, but a turn "
                   "with fewer than two ready replicas it has not frozen is skipped: one is kept serving)")
    p.add_argument("--freeze", type=_positive(float), default=7.0,
                   help="seconds a frozen replica stays stopped; above the router's health_interval + health_timeout "
                        "(6 s by default) for the router to notice it")
    p.add_argument("--mode", choices=["kill", "freeze", "mixed"], default="mixed",
                   help="SIGKILL, SIGSTOP then SIGCONT, or either at random")
    p.add_argument("--seed", type=int, default=0, help="seed of the choice of replica and action")
    p.add_argument("--recover-wait", type=_positive(float), default=30.0,
                   help="seconds the replicas get after the run to be ready again (one that is not fails the run); "
                        "above a replica's restart time: a vLLM replica's is 45-110 s on a small host")
    a = p.parse_args(argv)
    return ChaosConfig(a.base_url, a.api_key, a.admin_key, a.model, a.streams, a.duration, a.max_tokens,
                       a.kill_every, a.freeze, a.mode, a.seed, recover=a.recover_wait)


def verdict(rep: ChaosReport, recover: float) -> int:
    """The run's exit status (0: passed), with why it failed on stderr
    where its table alone does not say."""
    if not rep.actions:
        print("chaos: no action was taken (fewer than two replicas were ready at every tick); nothing was tested",
              file=sys.stderr)
        return 1
    if not rep.noticed():
        print(f"chaos: the router noticed none of the {len(rep.actions)} actions (no failover, no restart, no frozen "
              "replica listed not ready); nothing was tested: make --freeze longer than the router's "
              "health_interval + health_timeout", file=sys.stderr)
        return 1
    if rep.not_back:
        print(f"chaos: {', '.join(rep.not_back)} not ready {recover:g} s after the run (a replica that restarts "
              "slower, a vLLM one, needs a longer --recover-wait)", file=sys.stderr)
    ok = rep.errored == 0 and rep.mismatches == 0 and rep.streams_lost == 0 and not rep.not_back
    return 0 if ok else 1


def main(argv: list[str] | None = None) -> int:
    cfg = config_from_args(argv)

    def progress(rep: ChaosReport) -> None:
        """A line rewritten in place, on a terminal only: in a log or a pipe
        its updates, one per stream, would pile up as one long line."""
        if not sys.stderr.isatty():
            return
        sys.stderr.write(f"\rstarted {rep.started} completed {rep.completed} errored {rep.errored} "
                         f"mismatches {rep.mismatches} actions {len(rep.actions)}   ")
        sys.stderr.flush()

    # SIGTERM (kill, `timeout`, a CI job's end) ends the run as Ctrl-C does:
    # asyncio.run then cancels the run and the chaos task thaws what it froze
    # (the default action killed the process with replicas left SIGSTOPped)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        rep = asyncio.run(run_chaos(cfg, progress))
    except ChaosError as e:
        print(f"\nchaos: {e}", file=sys.stderr)
        return 2
    except httpx.HTTPError as e:
        print(f"\nchaos: {cfg.base_url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nchaos: interrupted (every replica it froze was thawed)", file=sys.stderr)
        return 130
    sys.stderr.write("\n")
    for a_ in rep.actions:
        print("-", a_)
    print(rep.table())
    return verdict(rep, cfg.recover)


if __name__ == "__main__":
    sys.exit(main())
