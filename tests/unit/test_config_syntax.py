"""Config files the parser refuses, or that reach corners of the loader,
fail as ``ConfigError`` (a located message), never as another exception: a
500 on ``POST /admin/reload``, a watcher that retries for ever, a traceback
from ``serve`` or ``check-config``. The one-file-per-mode cases are in
tests/data/bad_configs/ (test_config.py); these need text built in code."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router import cli
from router.config import RouterConfig
from router.configfile import ConfigError, load_yaml
from router.policy import PolicyRegistry
from router.tenants import TenantsFile
from tests.helpers import ROOT

TENANTS = (ROOT / "configs" / "tenants.yaml").read_text()
ROUTER = (ROOT / "configs" / "router.yaml").read_text()


def _error(text: str, kind: type = TenantsFile, name: str = "f.yaml") -> str:
    with pytest.raises(ConfigError) as info:
        load_yaml(name, kind, text)
    return str(info.value)


async def test_an_unprintable_character_past_a_missing_colon_fails_the_reload_not_the_router(tmp_path) -> None:
    # (the missing ':' is re-read with PyYAML's pure reader, which checks the
    # whole text for unprintable characters as it is built, outside its try:
    # libyaml stopped at the ':' first, the re-read raised ReaderError)
    line = TENANTS.splitlines().index("  gold:") + 1
    bad = TENANTS.replace("  gold:", "  gold", 1) + "#" * 17000 + "\n# \x1b[0m\n"
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS)
    registry = PolicyRegistry(path)
    path.write_text(bad)
    result = await registry.reload()
    want = f"{path}:{line}: (syntax): a ':' is missing after a key on this line: `gold` runs on"
    assert not result.ok and result.errors[0].startswith(want), result.errors
    assert registry.current.version == 1


def test_a_huge_exponent_is_refused_in_a_short_message() -> None:
    # (the hint wrote the number out in full: 100 MB for 1e100000000)
    text = TENANTS.replace("max_concurrent: 4", "max_concurrent: 1e100000000", 1)
    assert text != TENANTS
    message = _error(text)
    assert len(message) < 500, message[:500]
    assert "`1e100000000` is text in YAML 1.1" in message and message.endswith("write it as 1.0e+100000000"), message
    small = _error(TENANTS.replace("max_concurrent: 4", "max_concurrent: 2e3", 1))
    assert small.endswith("write it as a plain number: 2000"), small


@pytest.mark.parametrize("quoted", [False, True])
def test_a_number_of_thousands_of_digits_is_a_config_error(quoted: bool) -> None:
    # (Python refuses to read an int of more than 4,300 digits: ValueError)
    digits = "1" * 5000
    text = TENANTS.replace("max_concurrent: 4", f"max_concurrent: {digits!r}" if quoted else
                           f"max_concurrent: {digits}", 1)
    assert text != TENANTS
    message = _error(text)
    assert ".limits.max_concurrent:" in message and len(message) < 500, message[:500]


_LIMITS = "tenants:\n  a:\n    keys: [x]\n    limits:\n"


@pytest.mark.parametrize("key", ["9" * 5000, "0x" + "f" * 4200], ids=["decimal", "hex"])
def test_a_key_of_thousands_of_digits_is_a_config_error(key: str) -> None:
    # (keys were not checked: the decimal one raised ValueError as the data
    # was built, the hex one, which Python reads, when its name was written out)
    message = _error(_LIMITS + f"      ? {key}\n      : 1\n")
    assert message.startswith("f.yaml:5: a.limits") or message.startswith("f.yaml:5: tenants.a.limits"), message[:300]
    assert "4,300 digits" in message and len(message) < 500, message[:500]


@pytest.mark.parametrize("tag", ["!!float", "!!int", "!!bool", "!!timestamp"])
def test_a_tagged_value_that_is_not_of_its_tag_is_a_config_error(tmp_path: Path, tag: str) -> None:
    # (SafeConstructor raises ValueError, KeyError or AttributeError for
    # these, not a YAMLError: a traceback from load_yaml, reload, check-config)
    text = f"tenants:\n  a:\n    keys: [x]\n    weight: {tag} abc\n"
    message = _error(text)
    assert message.startswith("f.yaml:4: tenants.a.weight: ") and f"{tag}" in message, message
    path = tmp_path / "tenants.yaml"
    path.write_text(text)
    assert cli._config_kind(str(path)) is TenantsFile


@pytest.mark.parametrize("depth", [900, 5000])
def test_check_config_tells_the_kind_of_a_deeply_nested_file(tmp_path: Path, depth: int) -> None:
    # (the kind was told by a second, recursive parse: RecursionError)
    path = tmp_path / "f.yaml"
    path.write_text("tenants: " + "[" * depth + "]" * depth + "\n")
    assert cli._config_kind(str(path)) is TenantsFile


def test_a_byte_order_mark_is_not_shown_in_the_quoted_key() -> None:
    message = _error("\ufefftenants\n  a: {}\n")
    assert message.startswith("f.yaml:1: (syntax): a ':' is missing after a key on this line: `tenants` runs on"), \
        message


# random edits of the shipped configs: characters the syntax turns on, and
# control characters (which libyaml and PyYAML's own reader refuse at
# different points); whole lines doubled or dropped
_CHARS = st.sampled_from([":", "-", " ", "\n", "#", "?", "[", "{", "'", '"', "&", "*", "!", "|", ">", "\t",
                          "\x00", "\x01", "\x1b", "\x85", "\ufeff", "\u2028", "a", "1", "e"])
# whole pieces the characters above would rarely spell: a tag of a scalar type
# the constructor may fail to build (not with a YAMLError), an explicit key,
# nesting deeper than Python's stack
_PIECES = st.sampled_from(["!!int ", "!!float ", "!!bool ", "!!timestamp ", "? ", "[" * 1200, "{a: " * 1000,
                           "9" * 4400 + " "])


@st.composite
def _mutated(draw, text: str) -> str:
    for _ in range(draw(st.integers(1, 4))):
        lines = text.splitlines(keepends=True)
        how = draw(st.sampled_from(["insert", "delete", "duplicate", "drop"]))
        if how in ("duplicate", "drop") and lines:
            i = draw(st.integers(0, len(lines) - 1))
            lines[i:i + 1] = [lines[i]] * (2 if how == "duplicate" else 0)
            text = "".join(lines)
            continue
        at = draw(st.integers(0, len(text)))
        if how == "insert":
            piece = draw(st.one_of(st.text(_CHARS, min_size=1, max_size=3), _PIECES))
            text = text[:at] + piece + text[at:]
        else:
            text = text[:at] + text[at + draw(st.integers(1, 3)):]
    return text


def _kind_is_told(tmp_path: Path, text: str) -> None:
    path = tmp_path / "f.yaml"
    path.write_text(text, encoding="utf-8", errors="surrogatepass")
    assert cli._config_kind(str(path), beside_router=True) in (TenantsFile, RouterConfig)


@pytest.mark.parametrize(("source", "kind"), [(TENANTS, TenantsFile), (ROUTER, RouterConfig)],
                         ids=["tenants", "router"])
@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_mutated_config_fails_only_as_a_config_error(tmp_path, source: str, kind: type, data) -> None:
    text = data.draw(_mutated(source))
    try:
        load_yaml("f.yaml", kind, text)
    except ConfigError as e:
        assert e.errors and all(line.startswith("f.yaml:") for line in e.errors), e.errors
    _kind_is_told(tmp_path, text)
