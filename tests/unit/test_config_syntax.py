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
    assert "`1e100000000` is text in YAML 1.1" in message and message.endswith("takes a whole number"), message
    floats = _error(TENANTS.replace("weight: 3", "weight: 1e100000000", 1))
    assert len(floats) < 500 and floats.endswith("write it as 1.0e+100000000"), floats[:500]
    small = _error(TENANTS.replace("max_concurrent: 4", "max_concurrent: 2e3", 1))
    assert small.endswith("write it as 2000"), small


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


@pytest.mark.parametrize("value", ["abc", ""], ids=["abc", "empty"])
@pytest.mark.parametrize("tag", ["!!float", "!!int", "!!bool", "!!timestamp"])
def test_a_tagged_value_that_is_not_of_its_tag_is_a_config_error(tmp_path: Path, tag: str, value: str) -> None:
    # (SafeConstructor raises ValueError, KeyError or AttributeError for
    # these, not a YAMLError: a traceback from load_yaml, reload, check-config;
    # and an IndexError for an empty `!!int` or `!!float`, found by the
    # mutation test below in a fresh clone's run)
    text = f"tenants:\n  a:\n    keys: [x]\n    weight: {tag} {value}\n"
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


_GOLD = TENANTS.splitlines().index("  gold:") + 1


@pytest.mark.parametrize("edit", [
    ("  gold:", "  gold  # our best customer"),  # (a comment ends the key: it does not run on into its entries)
    ("  gold:", "  gold\n  # our best customer"),
    ("  gold:", "  gold\n\n    # our best customer"),
    ("  silver:", "  silver  # c"),
    ("  silver:", "  silver\n  # c"),
    ("admin_keys:", "admin_keys  # c"),  # (the document's first key: the parser wants a new document)
])
def test_a_key_without_its_colon_before_a_comment_is_reported_at_its_line(edit: tuple[str, str]) -> None:
    # (the first three were "did not find expected key" at the line after the
    # comment; the two after said `silver  # c` "runs on" into the next line)
    text = TENANTS.replace(*edit, 1)
    assert text != TENANTS
    key = edit[0].strip(" :")
    line = TENANTS.splitlines().index(edit[0]) + 1
    assert line == _GOLD or key != "gold"
    assert _error(text).startswith(f"f.yaml:{line}: (syntax): a ':' is missing after a key on this line: `{key}` ("), \
        _error(text)


def test_a_top_level_key_without_its_colon_before_a_comment_line_is_reported_at_its_line() -> None:
    message = _error("port 8080\n# the port\nhost: 127.0.0.1\n", RouterConfig)
    assert message.startswith("f.yaml:1: (syntax): a ':' is missing after a key on this line: `port 8080` ("), message


@pytest.mark.parametrize("char", ["\x07", "\x00", "\ufffe"])
def test_an_unprintable_character_is_reported_at_its_line_and_column(char: str) -> None:
    # (it was reported at line 1, as "unacceptable character #x0007 ... position 1332")
    lines = TENANTS.splitlines(keepends=True)
    lines[38] = lines[38][:10] + char + lines[38][10:]
    message = _error("é" * 3 + "".join(lines))  # (libyaml counts bytes: the line's column is in characters)
    assert message.startswith(f"f.yaml:39: (syntax): character U+{ord(char):04X} at column 11: "), message
    assert "\n" not in message and "position" not in message, message


def test_the_hint_for_an_integer_written_with_an_exponent_gives_an_integer() -> None:
    # (it said "as in 1.0e+3", a float, which an integer field refuses too)
    message = _error(TENANTS.replace("max_concurrent: 4", "max_concurrent: 1e3", 1))
    assert message.endswith("`1e3` is text in YAML 1.1, which this reader follows: this field takes a whole number: "
                            "write it as 1000"), message
    assert "1.0e+3" not in message, message
    fraction = _error(TENANTS.replace("max_concurrent: 4", "max_concurrent: 1e-3", 1))
    assert fraction.endswith("this field takes a whole number"), fraction
    dotted = _error(TENANTS.replace("max_concurrent: 4", "max_concurrent: 1.50e3", 1))
    assert dotted.endswith("write it as 1500"), dotted
    floats = _error(TENANTS.replace("weight: 3", "weight: 1e3", 1))  # (a float field: 1.0e+3 is right there)
    assert "as in 1.0e+3" in floats and floats.endswith("write it as a plain number: 1000"), floats


@pytest.mark.parametrize(("edit", "want"), [
    (("  gold:", "  gold  # our best customer"), f":{_GOLD}: (syntax): a ':' is missing after a key on this line"),
    (("  gold:", "  gold:\x07"), f":{_GOLD}: (syntax): character U+0007 at column 8: "),
])
async def test_a_reload_of_such_a_file_names_its_line_and_keeps_the_policy(tmp_path, edit, want: str) -> None:
    path = tmp_path / "tenants.yaml"
    path.write_text(TENANTS)
    registry = PolicyRegistry(path)
    path.write_text(TENANTS.replace(*edit, 1))
    result = await registry.reload()
    assert not result.ok and result.errors[0].startswith(f"{path}{want}"), result.errors
    assert registry.current.version == 1


def test_a_key_without_its_colon_on_the_first_line_after_a_byte_order_mark_is_reported_at_its_line() -> None:
    # (libyaml does not count the mark in columns, the text's first line held
    # it: the key was not found, "expected <document start>" at line 2)
    message = _error("\ufeffport 8080  # the port\nhost: 127.0.0.1\n", RouterConfig)
    assert message.startswith("f.yaml:1: (syntax): a ':' is missing after a key on this line: `port 8080` ("), message


@pytest.mark.parametrize("loader", ["libyaml", "pure"])
@pytest.mark.parametrize("bom", ["", "\ufeff"], ids=["plain", "bom"])
def test_an_unprintable_character_is_at_its_column_with_either_reader(monkeypatch, loader: str, bom: str) -> None:
    # PyYAML's own reader (a PyYAML without libyaml) gives the offset in
    # characters, libyaml in bytes: it was converted from bytes either way;
    # a byte order mark was counted in line 1's columns
    import yaml

    from router import configfile, yaml_syntax

    if loader == "pure":
        monkeypatch.setattr(configfile, "FAST_LOADER", yaml.SafeLoader)
        monkeypatch.setattr(yaml_syntax, "FAST_LOADER", yaml.SafeLoader)
    elif yaml_syntax.FAST_LOADER is yaml.SafeLoader:
        pytest.skip("this PyYAML has no libyaml")
    assert _error(bom + "ééé\x07: 1\n").startswith("f.yaml:1: (syntax): character U+0007 at column 4: ")
    message = _error(bom + "é: 1\nxéé\x07: 1\n")
    assert message.startswith("f.yaml:2: (syntax): character U+0007 at column 4: "), message
