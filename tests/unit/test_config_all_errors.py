"""A config file with several mistakes reports them all in one go.

Each file under tests/data/several_errors/ starts with one line per error it
must report, in the order reported (file order)::

    # expect: LINE: KEY: REASON-REGEX

and nothing else may be reported: an error that depends on another one (in
a value whose type is already wrong, or a check whose context failed) is
not. Files named ``tenants_*.yaml`` are tenant policy files, the others
router configs. They are checked by ``load_yaml``, ``fairstream
check-config``, ``fairstream serve`` and a live reload.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import msgspec
import pytest

from router.config import RouterConfig
from router import configfile
from router.configfile import ConfigError, load_yaml
from router.policy import PolicyRegistry
from router.tenants import TenantsFile
from tests.helpers import DEMO_TENANTS, ROOT
from tests.unit.test_config import _cli

DATA = Path(__file__).resolve().parents[1] / "data" / "several_errors"
FILES = sorted(DATA.glob("*.yaml"))
THREE = DATA / "tenants_three_tenants.yaml"
_EXPECT = re.compile(r"^# expect: (\d+): (.+?): (.+)$")


def expectations(path: Path) -> list[tuple[int, str, str]]:
    found = []
    for line in path.read_text().splitlines():
        m = _EXPECT.match(line)
        if not m:
            break
        found.append((int(m.group(1)), m.group(2), m.group(3)))
    assert found, f"{path.name}: starts with no '# expect: LINE: KEY: REASON-REGEX' line"
    return found


def check_errors(path: Path, errors: list[str]) -> None:
    """``errors`` are exactly the ones ``path`` expects, in its order."""
    want = expectations(path)
    assert len(errors) == len(want), "\n".join(errors)
    for error, (line, key, reason) in zip(errors, want):
        m = re.fullmatch(rf"{re.escape(str(path))}:(\d+): (.+?): (.+)", error)
        assert m, f"not `{path}:LINE: KEY: reason`: {error!r}"
        assert (int(m.group(1)), m.group(2)) == (line, key), error
        assert re.search(reason, m.group(3)), error


def kind_of(path: Path) -> type:
    return TenantsFile if path.name.startswith("tenants_") else RouterConfig


def test_the_cases_are_there() -> None:
    assert {p.stem for p in FILES} >= {"tenants_three_tenants", "tenants_schema_and_checks",
                                        "tenants_depends_on_an_error", "router_several"}
    assert len(expectations(THREE)) == 3


@pytest.mark.parametrize("path", FILES, ids=lambda p: p.stem)
def test_load_reports_every_error_in_file_order(path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_yaml(path, kind_of(path))
    check_errors(path, info.value.errors)
    assert str(info.value) == "\n".join(info.value.errors)


def test_check_config_prints_every_error_of_every_file() -> None:
    proc = _cli("check-config", *map(str, FILES))
    assert proc.returncode == 1
    lines = proc.stderr.splitlines()
    for path in FILES:
        check_errors(path, [line for line in lines if line.startswith(f"{path}:")])
    assert len(lines) == sum(len(expectations(p)) for p in FILES), proc.stderr


def test_serve_refuses_a_tenants_file_with_every_error() -> None:
    proc = _cli("serve", "--config", str(ROOT / "configs" / "router.yaml"), "--tenants", str(THREE),
                "--port", "1")
    assert proc.returncode == 1
    check_errors(THREE, proc.stderr.strip().splitlines()[-3:])


async def test_a_refused_reload_lists_every_error_and_keeps_the_old_policy(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    live = tmp_path / "tenants.yaml"
    live.write_text(DEMO_TENANTS.read_text())
    registry = PolicyRegistry(live)
    text = THREE.read_text()
    live.write_text(text)
    with caplog.at_level(logging.ERROR, logger="fairstream.policy"):
        result = await registry.reload()
    assert not result.ok and not result.changed and result.version == 1
    named = [e.replace(str(live), str(THREE), 1) for e in result.errors]
    check_errors(THREE, named)
    assert registry.last_errors == result.errors and registry.current.version == 1
    logged = [r.getMessage() for r in caplog.records]
    assert len(logged) == 3 and all(f"keeping version 1: {e}" in m for e, m in zip(result.errors, logged))
    # put back as it was: valid again, and still version 1 (it counted as a new version, whose
    # reload re-declared every tenant's metrics and woke every waiting request)
    calls = []
    registry._on_reload = lambda ok, changed: calls.append((ok, changed))
    live.write_text(DEMO_TENANTS.read_text())
    result = await registry.reload()
    assert result.ok and not result.changed and result.version == registry.current.version == 1
    # a success to count, with nothing to apply (declaring metrics, waking waiters)
    assert registry.last_errors == [] and calls == [(True, False)]


def _tenants(n_bad: int) -> str:
    lines = ["tenants:"]
    for i in range(n_bad):
        lines += [f"  t{i}:", f"    keys: ['{i:064x}']", "    weight: -1"]
    return "\n".join(lines) + "\n"


def test_errors_past_the_cap_are_counted_in_one_line(tmp_path: Path) -> None:
    MAX_ERRORS = configfile.MAX_ERRORS
    assert MAX_ERRORS == 20  # (README says so)
    path = tmp_path / "tenants.yaml"
    path.write_text(_tenants(MAX_ERRORS + 5))
    with pytest.raises(ConfigError) as info:
        load_yaml(path, TenantsFile)
    errors = info.value.errors
    assert len(errors) == MAX_ERRORS + 1
    assert all(": must be greater than 0" in e for e in errors[:-1])
    assert errors[MAX_ERRORS - 1].startswith(f"{path}:{3 * MAX_ERRORS + 1}: tenants.t{MAX_ERRORS - 1}.weight:")
    # (the line of the first error not listed)
    assert errors[-1] == (f"{path}:{3 * MAX_ERRORS + 4}: (more): 5 more errors from this line on "
                          f"(only the first {MAX_ERRORS} are listed)")


def test_as_many_errors_as_the_cap_are_listed_whole(tmp_path: Path) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(_tenants(configfile.MAX_ERRORS))
    with pytest.raises(ConfigError) as info:
        load_yaml(path, TenantsFile)
    assert len(info.value.errors) == configfile.MAX_ERRORS and "(more)" not in str(info.value)


# -- schema_errors: msgspec's types, walked -----------------------------------------


class _Uniform(msgspec.Struct, forbid_unknown_fields=True, tag_field="dist", tag="uniform"):
    low: int
    high: int


class _Choice(msgspec.Struct, forbid_unknown_fields=True, tag_field="dist", tag="choice"):
    values: list[int]


class _Doc(msgspec.Struct, forbid_unknown_fields=True):
    sizes: dict[str, _Uniform | _Choice]
    names: list[str] = []


def test_schema_errors_follow_a_tagged_union_and_name_dict_keys() -> None:
    from router.schema_errors import schema_errors

    data = {
        "sizes": {
            "a": {"dist": "uniform", "low": "x", "hgh": 2},  # two errors, and a missing field
            "b": {"dist": "choice", "values": [1, "two"]},
            "c": {"dist": "normal"},  # no such tag: msgspec's own message, at the tag
            1: {"dist": "choice", "values": []},
        },
        "names": ["ok", 3],
    }
    assert schema_errors(data, _Doc) == [
        (("sizes", "a", "low"), "Expected `int`, got `str`"),
        (("sizes", "a", "hgh"), "unknown key"),
        (("sizes", "a"), "missing required key `high`"),
        (("sizes", "b", "values", 1), "Expected `int`, got `str`"),
        (("sizes", "c", "dist"), "Invalid value 'normal'"),
        (("sizes", 1), "not a valid key here: Expected `str`, got `int`"),
        (("names", 1), "Expected `str`, got `int`"),
    ]
    assert schema_errors({"sizes": {}}, _Doc) == []


def test_a_duplicate_names_the_other_item_as_the_file_numbers_it(tmp_path: Path) -> None:
    key = "ca978112ca1bbdcafac231b39a23dc4da786eff8147c4e72b9807785afee48bb"
    f = tmp_path / "tenants.yaml"
    f.write_text(f"admin_keys:\n  - 123\n  - {key}\n  - {key}\ntenants:\n  a:\n    keys: [{key[::-1]}]\n")
    with pytest.raises(ConfigError) as e:
        load_yaml(f, TenantsFile)
    # (the first item fails the schema and is set aside: the other two keep their numbers)
    assert any(":4: admin_keys.2: duplicate key (also at admin_keys.1)" in m for m in e.value.errors), e.value.errors
