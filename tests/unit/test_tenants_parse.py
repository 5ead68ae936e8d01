"""A reload's parse in a child process (router.tenants_parse) gives what
load_yaml gives in the router's own process: the same file, or the same
``file:line: key: reason`` errors (those check-config prints)."""

from __future__ import annotations

from pathlib import Path

import pytest

from ops.bench_reload import tenants_text
from router.configfile import ConfigError, load_yaml
from router.tenants import TenantsFile
from router.tenants_parse import decode, parse_elsewhere

DEMO = Path(__file__).resolve().parents[2] / "configs" / "tenants.yaml"


@pytest.mark.parametrize("text", [DEMO.read_text(), tenants_text(300)], ids=["demo", "generated"])
async def test_a_valid_file_comes_back_as_parsed_here(tmp_path, text):
    path = tmp_path / "tenants.yaml"
    assert decode(await parse_elsewhere(path, text)) == load_yaml(path, TenantsFile, text)[0]


@pytest.mark.parametrize("bad", [
    DEMO.read_text().replace("weight: 3", "weight: x").replace("  timeouts:", "  timeoutz:", 1),
    "tenants:\n  a\n    keys: []\n",  # (a syntax error)
    "a: &a [1]\n" + "".join(f"b{i}: &b{i} [*{'a' if i == 0 else f'b{i - 1}'}, *a, *a, *a, *a, *a, *a, *a]\n"
                            for i in range(9)),
])
async def test_a_bad_file_gets_the_errors_it_gets_here(tmp_path, bad):
    path = tmp_path / "tenants.yaml"
    with pytest.raises(ConfigError) as here:
        load_yaml(path, TenantsFile, bad)
    with pytest.raises(ConfigError) as there:
        decode(await parse_elsewhere(path, bad))
    assert there.value.errors == here.value.errors and here.value.errors
