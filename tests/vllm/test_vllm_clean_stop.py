"""A clean router stop with a real vLLM (CPU) replica logs no error.

The supervisor SIGTERMed the replica's whole process group at once: vLLM's
worker died under its engine core before the engine core stopped it, and
every clean stop logged ERROR tracebacks ("Worker proc VllmWorker-0 died
unexpectedly", "EngineCore encountered a fatal error", EngineDeadError).
The replica's process is signalled first and stops its engine itself.
"""

from __future__ import annotations

import httpx
import pytest

from tests.helpers import GOLD, RouterProcess, descendants

pytestmark = pytest.mark.vllm

MODEL = "tiny-llama"


def test_a_clean_stop_logs_no_error_and_leaves_no_vllm_process(tmp_path, tiny_model) -> None:
    config = {"model": tiny_model, "served_name": MODEL, "seed": 0, "max_model_len": 2048, "kv_cache_gib": 0.5}
    replicas = [{"name": "vllm-0", "engine": "vllm", "config": config, "start_timeout": 300,
                 "env": {"VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1"}}]
    r = RouterProcess(tmp_path / "r", replicas=0, settings={"replicas": replicas}, start_timeout=400)
    r.replica_names = ["vllm-0"]
    r.start()
    try:
        got = httpx.post(r.base_url + "/v1/completions", headers={"Authorization": f"Bearer {GOLD}"}, timeout=120,
                         json={"model": MODEL, "prompt": "The cluster", "max_tokens": 8, "ignore_eos": True})
        assert got.status_code == 200, got.text
        engine = descendants(r.proc.pid)
        assert len(engine) >= 3, engine  # (the replica, its engine core, its worker)
    finally:
        r.stop(timeout=60)  # (it fails on a leftover process)
    log = r.log()
    bad = [line for line in log.splitlines()
           if "ERROR" in line or "died unexpectedly" in line or "EngineDeadError" in line]
    assert not bad, "\n".join(bad[:20])
