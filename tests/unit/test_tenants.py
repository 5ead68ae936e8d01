"""tenants.yaml: one bad file per failure mode, defaults inheritance, the demo file.

Every file under tests/data/tenants/ named in BAD must fail to load with a
single ``ConfigError`` line ``path:LINE: KEY: reason``; the table below gives
the line and key each one must name (the file's first comment says what is
wrong with it).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from router.configfile import ConfigError, load_yaml
from router.tenants import BUILTIN, TenantPolicy, TenantsFile

DATA = Path(__file__).resolve().parents[1] / "data" / "tenants"
ROOT = Path(__file__).resolve().parents[2]


# file, line, key, reason (regex searched in the reason)
BAD = [
    ("unknown_top_key.yaml", 7, "tenant", r"^unknown key$", None),
    ("unknown_limits_key.yaml", 7, "tenants.alpha.limits.rpm", r"^unknown key$", None),
    ("unknown_defaults_limits_key.yaml", 4, "defaults.limits.tokens_per_minut", r"^unknown key$", None),
    ("wrong_type.yaml", 6, "tenants.alpha.limits.tokens_per_minute", r"Expected `int \| null`, got `str`", None),
    ("wrong_type_defaults.yaml", 4, "defaults.weight", r"Expected `float \| null`, got `array`", None),
    ("missing_keys.yaml", 5, "tenants.beta", r"missing required key `keys`", None),
    ("negative_limit.yaml", 10, "tenants.beta.limits.max_concurrent", r"must not be negative", None),
    ("duplicate_key.yaml", 10, "tenants.beta.keys.1", r"duplicate key \(also at tenants\.alpha\.keys\.1\)", None),
    ("bad_digest.yaml", 8, "tenants.beta.keys.1", r"must be a SHA-256 hex digest", None),
    ("unknown_priority.yaml", 6, "tenants.alpha.priority", r"unknown priority class 'urgent'", None),
    ("zero_weight.yaml", 8, "tenants.beta.weight", r"must be greater than 0", None),
    ("infinite_weight.yaml", 8, "tenants.beta.weight", r"must be finite", None),
    ("tiny_weight.yaml", 8, "tenants.beta.weight", r"^must be at least 0\.001 ", None),
    ("huge_weight.yaml", 3, "defaults.weight", r"^must be at most 1000 ", None),
    ("exponent_as_text.yaml", 6, "tenants.alpha.limits.max_concurrent",
     r"^Expected `int \| null`, got `str`: `1e3` is text in YAML 1\.1, .*takes a whole number: write it as 1000$", None),
    ("quoted_number.yaml", 5, "tenants.alpha.timeouts.total",
     r"got `str`: `1\.5e-3` is in quotes, which make it text; write it without them$", None),
    ("huge_limit.yaml", 10, "tenants.beta.limits.max_concurrent", r"must be at most 9007199254740992", None),
    ("infinite_timeout.yaml", 5, "tenants.alpha.timeouts.total", r"must be at most 9007199254740992", None),
    ("syntax_error.yaml", 6, "(syntax)", r"expected ',' or '}' \(while parsing a flow mapping from line 5\)$", None),
    ("empty_tenants.yaml", 4, "tenants", r"at least one tenant is needed", None),
    ("duplicate_tenant.yaml", 6, "tenants.alpha", r"twice|duplicate", None),
]


def _params():
    for name, line, key, reason, _ in BAD:
        yield pytest.param(name, line, key, reason, id=name.removesuffix(".yaml"))


@pytest.mark.parametrize("name, line, key, reason", list(_params()))
def test_bad_file_names_file_line_and_key(name: str, line: int, key: str, reason: str) -> None:
    path = DATA / name
    with pytest.raises(ConfigError) as info:
        load_yaml(path, TenantsFile)
    errors = info.value.errors
    assert len(errors) == 1, errors  # one failure mode per file
    m = re.fullmatch(rf"{re.escape(str(path))}:(\d+): (\S+): (.+)", errors[0])
    assert m, f"not `path:LINE: KEY: reason`: {errors[0]!r}"
    assert (int(m.group(1)), m.group(2)) == (line, key), errors[0]
    assert re.search(reason, m.group(3)), errors[0]
    assert str(info.value) == errors[0]


def test_every_data_file_is_in_the_table() -> None:
    listed = {name for name, *_ in BAD} | {"good_inherit.yaml"}
    assert {p.name for p in DATA.glob("*.yaml")} == listed


def test_text_is_reported_under_the_given_path() -> None:
    text = (DATA / "zero_weight.yaml").read_text()
    with pytest.raises(ConfigError) as info:
        load_yaml("live-edit.yaml", TenantsFile, text=text)
    assert info.value.errors == ["live-edit.yaml:8: tenants.beta.weight: must be greater than 0 (weights go from "
                                 "0.001 to 1000: a tenant's share is proportional to its weight)"]


def test_unreadable_file() -> None:
    missing = DATA / "no-such-file.yaml"
    with pytest.raises(ConfigError) as info:
        load_yaml(missing, TenantsFile)
    assert re.fullmatch(rf"{re.escape(str(missing))}:1: \(file\): cannot read: .+", info.value.errors[0])


# -- inheritance -----------------------------------------------------------------


@pytest.fixture(scope="module")
def inherit() -> dict[str, TenantPolicy]:
    file, _ = load_yaml(DATA / "good_inherit.yaml", TenantsFile)
    return file.policies()


def test_tenant_setting_only_rpm_keeps_the_rest(inherit: dict[str, TenantPolicy]) -> None:
    p = inherit["only_rpm"]
    lim = p.limits
    assert lim.requests_per_minute == 7  # its own
    assert lim.tokens_per_minute == 50000  # from defaults
    assert lim.stall == 5.0  # defaults.timeouts, field by field
    # nobody sets these: the built-in values
    builtin_limits, builtin_timeouts = BUILTIN.limits, BUILTIN.timeouts
    assert builtin_limits is not None and builtin_timeouts is not None
    assert lim.max_concurrent == builtin_limits.max_concurrent == 0
    assert lim.max_prompt_tokens == builtin_limits.max_prompt_tokens
    assert lim.max_tokens == builtin_limits.max_tokens
    assert (lim.queue_wait, lim.first_token, lim.total) == (
        builtin_timeouts.queue_wait, builtin_timeouts.first_token, builtin_timeouts.total,
    )
    assert p.priority == "normal"
    assert (p.weight, p.models, p.queue_depth, p.chunk_tokens, p.on_limit, p.log_content) == (
        BUILTIN.weight, BUILTIN.models, BUILTIN.queue_depth, BUILTIN.chunk_tokens, BUILTIN.on_limit,
        BUILTIN.log_content,
    )


def test_tenant_setting_nothing_gets_defaults(inherit: dict[str, TenantPolicy]) -> None:
    lim = inherit["bare"].limits
    assert (lim.requests_per_minute, lim.tokens_per_minute, lim.stall) == (100, 50000, 5.0)


def test_explicit_zero_overrides_defaults(inherit: dict[str, TenantPolicy]) -> None:
    """0 means unlimited and is a value, not "unset": it must not fall through to defaults."""
    p = inherit["overrides"]
    assert p.limits.tokens_per_minute == 0
    assert p.limits.requests_per_minute == 100
    assert p.limits.max_concurrent == 3
    assert (p.limits.total, p.limits.stall) == (30.0, 5.0)
    assert (p.priority, p.weight) == ("low", 2.5)
    assert isinstance(p.weight, float)


def test_a_tenant_change_does_not_leak_into_another(inherit: dict[str, TenantPolicy]) -> None:
    assert inherit["only_rpm"].limits.max_concurrent == 0
    assert inherit["bare"].limits.requests_per_minute == 100


# -- the demo file ---------------------------------------------------------------


def test_demo_tenants_file_loads() -> None:
    file, _ = load_yaml(ROOT / "configs" / "tenants.yaml", TenantsFile)
    policies = file.policies()
    assert {"gold", "free"} <= set(policies)
    gold, free = policies["gold"], policies["free"]
    assert (gold.priority, gold.weight) == ("high", 3.0)
    assert free.priority == "low"
    order = file.priority_classes
    assert order.index(gold.priority) < order.index(free.priority)


@pytest.mark.parametrize("key, shown", [("abcdefghi", "****"), ("x" * 23, "****"),
                                        ("sk-" + "a" * 20 + "wxyz", "sk-****wxyz")])
def test_a_wrong_key_is_shown_only_by_a_small_part(key: str, shown: str) -> None:
    from router.auth import _redact

    assert _redact(key) == shown


# -- refusals the data files do not cover (a mutation audit found them untested) --

KEY = "a" * 64  # (a well-formed digest)


def _errors(text: str) -> list[str]:
    with pytest.raises(ConfigError) as info:
        load_yaml("t.yaml", TenantsFile, text=text)
    return info.value.errors


def test_a_tenant_with_no_keys_is_refused() -> None:
    # (a tenant nobody can authenticate as: a typo'd list, not a configuration)
    assert _errors("priority_classes: [normal]\ntenants:\n  a:\n    keys: []\n") == \
        ["t.yaml:4: tenants.a.keys: a tenant needs at least one key"]


@pytest.mark.parametrize("field, value, says", [
    ("chunk_tokens", 0, "must be at least 1"),
    ("chunk_tokens", 2**53 + 1, "must be at most 9007199254740992"),
    ("queue_depth", 2**53 + 1, "must be at most 9007199254740992"),
])
def test_a_tenant_count_out_of_range_is_refused(field: str, value: int, says: str) -> None:
    text = f"priority_classes: [normal]\ntenants:\n  a:\n    keys: [{KEY}]\n    {field}: {value}\n"
    assert _errors(text) == [f"t.yaml:5: tenants.a.{field}: {says}"]


def test_a_count_at_its_bounds_is_taken() -> None:
    text = f"priority_classes: [normal]\ntenants:\n  a:\n    keys: [{KEY}]\n    chunk_tokens: 1\n" \
           f"    queue_depth: {2**53}\n"
    file, _ = load_yaml("t.yaml", TenantsFile, text=text)
    assert (file.policies()["a"].chunk_tokens, file.policies()["a"].queue_depth) == (1, 2**53)


def test_a_priority_class_named_twice_is_refused() -> None:
    errors = _errors(f"priority_classes: [normal, normal]\ntenants:\n  a:\n    keys: [{KEY}]\n")
    assert errors == ["t.yaml:1: priority_classes: must list distinct class names"]
