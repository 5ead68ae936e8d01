"""``policies/`` holds pure decisions (docs/architecture.md): no event loop,
no sockets, no Redis, no web framework, no clock of its own, and nothing from
the router or the replicas; time and randomness come in as arguments."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

POLICIES = Path(__file__).resolve().parents[2] / "policies"
FORBIDDEN = {"asyncio", "socket", "ssl", "select", "selectors", "threading", "multiprocessing", "subprocess",
             "time", "datetime", "uvloop", "redis", "litestar", "uvicorn", "httpx", "httptools", "aiohttp",
             "prometheus_client", "watchfiles", "router", "replicas"}


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("path", sorted(POLICIES.glob("*.py")), ids=lambda p: p.name)
def test_policies_import_nothing_impure(path: Path) -> None:
    assert not _imports(path) & FORBIDDEN, f"{path.name} imports {sorted(_imports(path) & FORBIDDEN)}"


def test_the_check_sees_imports() -> None:
    assert {"asyncio", "router"} <= _imports(Path(__file__).parents[2] / "router" / "service.py")
