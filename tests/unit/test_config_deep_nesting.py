"""A tenants.yaml nested nearly as deep as libyaml allows (its limit is
1,000 levels) is one ``file:line: key: reason`` error, not a RecursionError:
on a live reload that was a 500 on ``POST /admin/reload`` and, from the file
watcher, a reload that failed with no error recorded
(``last_reload_errors`` empty, ``fairstream_config_last_reload_successful`` 1)."""

from __future__ import annotations

from pathlib import Path

import pytest

from router.configfile import ConfigError, load_yaml
from router.policy import PolicyRegistry
from router.tenants import TenantsFile
from tests.helpers import DEMO_TENANTS


@pytest.mark.parametrize("depth", [960, 995])
def test_deep_nesting_is_a_config_error(tmp_path: Path, depth: int) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(DEMO_TENANTS.read_text() + "  x: " + "[" * depth + "]" * depth + "\n")
    with pytest.raises(ConfigError) as e:
        load_yaml(path, TenantsFile)
    assert e.value.errors and "(syntax)" in e.value.errors[0]


async def test_a_reload_of_a_deeply_nested_file_keeps_the_policy_and_says_why(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(DEMO_TENANTS.read_text())
    registry = PolicyRegistry(path)
    path.write_text(DEMO_TENANTS.read_text() + "  x: " + "[" * 995 + "]" * 995 + "\n")
    result = await registry.reload()  # (in a thread, as the watcher and /admin/reload do)
    assert not result.ok and result.version == 1
    assert registry.last_errors and "nested too deeply" in registry.last_errors[0]
