"""The tiny model's directory, made by several replicas at once."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.vllm.support import require_vllm

pytestmark = pytest.mark.vllm


def test_replicas_that_share_the_directory_make_the_model_once(tmp_path) -> None:
    # (each replica with `tiny: true` makes it on start; two at once raced on
    # the same temporary names and one died: FileNotFoundError config.json.tmp)
    require_vllm()
    code = "import sys; from replicas.tinymodel import ensure_tiny_model; ensure_tiny_model(sys.argv[1])"
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "tiny")], stderr=subprocess.PIPE)
             for _ in range(4)]
    results = [(p.wait(timeout=120), p.stderr.read().decode()) for p in procs]
    assert all(rc == 0 for rc, _ in results), results
    assert (tmp_path / "tiny" / "model.safetensors").is_file()
