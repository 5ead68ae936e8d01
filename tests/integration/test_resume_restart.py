"""A resume that comes while no replica is ready (its only one restarting):
its continuation waits for one as a failover does (``failover_wait``),
then continues the stream text-exact."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal

import httpx
import yaml

from router.auth import hash_key
from tests.helpers import ADMIN, RouterProcess
from tests.integration.test_resume import (
    KEY_A,
    REPLICA,
    auth,
    check_whole_stream,
    read_all,
    reference,
    start_and_drop,
)


async def test_a_resume_while_the_only_replica_restarts_waits_for_it_and_continues_exactly(tmp_path) -> None:
    # (before, the continuation of a resume that came while no replica was
    # ready failed at once with no_replica_available after the replay, while
    # a failover in the same case waits up to failover_wait)
    d = tmp_path / "r"
    d.mkdir()
    tenants = d / "tenants.yaml"
    tenants.write_text(yaml.safe_dump({"admin_keys": [hash_key(ADMIN)], "tenants": {"a": {"keys": [hash_key(KEY_A)]}}}))
    router = RouterProcess(d, replicas=1, tenants=tenants, sim={"step_base_ms": 10}).start()
    frozen: list[int] = []
    try:
        async with httpx.AsyncClient(base_url=router.base_url, headers=auth(), timeout=30) as http:
            prompt, max_tokens = "東京の", 150
            ref, prompt_tokens = await reference(http, False, prompt, max_tokens)
            rid, events = await start_and_drop(http, False, prompt, max_tokens, 20)
            old = router.kill_replica(REPLICA)
            # its next process is held (SIGSTOP) before it can be ready: the
            # resume comes while the replica restarts, however fast that is
            new = router.wait_replica_pid(REPLICA, other_than=old)
            os.kill(new, signal.SIGSTOP)
            frozen.append(new)
            assert (await http.get("/ready")).json()["replicas"][REPLICA] != "ready"
            async with http.stream("GET", f"/v1/streams/{rid}", headers={"Last-Event-ID": events[-1].id}) as r:
                assert r.status_code == 200
                await asyncio.sleep(1.5)  # (its continuation waits for the replica meanwhile)
                os.kill(new, signal.SIGCONT)
                frozen.clear()
                rest = await read_all(r)
        check_whole_stream(events + rest, False, ref, prompt_tokens, max_tokens)
    finally:
        for pid in frozen:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        router.stop()
