"""Fixtures of the ops tests: one real router for the whole package.

``ops_router`` runs two sim replicas with the demo tenants plus ``tiny``
(key ``fs-test-tiny``: one request a minute, rejected over it), so a test can
produce a 429 on demand.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import pytest
import yaml

from tests.helpers import DEMO_TENANTS, RouterProcess

TINY_KEY = "fs-test-tiny"


@pytest.fixture(scope="package")
def ops_router(tmp_path_factory) -> Iterator[RouterProcess]:
    workdir = tmp_path_factory.mktemp("ops_router")
    tenants = yaml.safe_load(DEMO_TENANTS.read_text())
    tenants["tenants"]["tiny"] = {
        "keys": [hashlib.sha256(TINY_KEY.encode()).hexdigest()],
        "priority": "low",
        "limits": {"requests_per_minute": 1},
        "on_limit": "reject",
    }
    path = workdir / "tenants.yaml"
    path.write_text(yaml.safe_dump(tenants, sort_keys=False))
    router = RouterProcess(workdir / "router", tenants=path)
    router.start()
    yield router
    router.stop()
