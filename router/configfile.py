"""Strict YAML loading into msgspec structs, with ``file:line: key: reason`` errors.

PyYAML's node tree keeps a line for every key and value; msgspec's validation
errors carry a JSON path (``$.tenants.gold.limits.rpm``). ``load_yaml`` maps the
one onto the other so every error names the file, the line and the key.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import yaml

__all__ = ["ConfigError", "load_yaml", "read_text", "Located", "parse_validation_error"]

T = TypeVar("T")

# libyaml's parser when PyYAML has it (about 10x faster), with the safe constructor
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
MAX_VALUES = 1_000_000  # values in one file, YAML aliases expanded


class ConfigError(ValueError):
    """A config file is invalid; ``errors`` holds one ``file:line: key: reason`` per problem."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        super().__init__("\n".join(errors))


class Located:
    """Line numbers of every path in a YAML document."""

    def __init__(self, path: str, root: yaml.Node | None) -> None:
        self.path = path
        self.lines: dict[tuple[Any, ...], int] = {}
        self.key_lines: dict[tuple[Any, ...], int] = {}
        self.duplicates: list[str] = []
        self._left = MAX_VALUES
        if root is not None:
            self._walk(root, ())

    def _walk(self, node: yaml.Node, at: tuple[Any, ...]) -> None:
        self._left -= 1
        if self._left < 0:
            # (aliases expand: a few hundred bytes of nested ones would be billions of values)
            raise ConfigError([f"{self.path}:{node.start_mark.line + 1}: (file): more than {MAX_VALUES} values "
                               "once YAML aliases are expanded; write the values out or use fewer aliases"])
        self.lines[at] = node.start_mark.line + 1
        if isinstance(node, yaml.MappingNode):
            for k, v in node.value:
                key = k.value
                line = k.start_mark.line + 1
                first = self.key_lines.get(at + (key,))
                if first is not None:
                    # YAML would silently keep the last one (and drop, say, a tenant's keys)
                    dotted = ".".join(str(p) for p in at + (key,))
                    self.duplicates.append(f"{self.path}:{line}: {dotted}: defined twice (first at line {first})")
                    continue
                self.key_lines[at + (key,)] = line
                self._walk(v, at + (key,))
        elif isinstance(node, yaml.SequenceNode):
            for i, v in enumerate(node.value):
                self._walk(v, at + (i,))

    def line(self, at: tuple[Any, ...]) -> int:
        while at:
            if at in self.key_lines:
                return self.key_lines[at]
            if at in self.lines:
                return self.lines[at]
            at = at[:-1]
        return self.lines.get((), 1)

    def error(self, at: tuple[Any, ...], reason: str) -> str:
        key = ".".join(str(p) for p in at) or "(top level)"
        return f"{self.path}:{self.line(at)}: {key}: {reason}"


_ANY = object()  # a dict entry msgspec reports as `[...]`
_PATH_RE = re.compile(r" - at `\$(.*)`$")
_PART_RE = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")
_UNKNOWN_RE = re.compile(r"Object contains unknown field `([^`]+)`")
_MISSING_RE = re.compile(r"Object missing required field `([^`]+)`")


def _parse_error(err: str) -> tuple[tuple[Any, ...], str]:
    m = _PATH_RE.search(err)
    reason = err[: m.start()] if m else err
    at: tuple[Any, ...] = ()
    if m:
        for name, idx in _PART_RE.findall(m.group(1)):
            if name:
                at += (name,)
            elif idx == "...":
                at += (_ANY,)
            else:
                at += (int(idx),)
    u = _UNKNOWN_RE.match(reason)
    if u:
        return at + (u.group(1),), "unknown key"
    mm = _MISSING_RE.match(reason)
    if mm:
        return at, f"missing required key `{mm.group(1)}`"
    return at, reason


def _name_dict_entry(data: Any, type_: type, at: tuple[Any, ...], err: str) -> tuple[Any, ...]:
    """msgspec names a failing dict entry ``[...]``: find which key it is by
    validating the document with that dict cut down to one entry at a time."""
    i = at.index(_ANY)
    prefix = at[:i]
    container: Any = data
    try:
        for p in prefix:
            container = container[p]
    except (KeyError, IndexError, TypeError):
        return prefix + tuple(p for p in at[i + 1 :] if p is not _ANY)
    rest = tuple(p for p in at[i + 1 :] if p is not _ANY)
    if isinstance(container, dict):
        for key, value in container.items():
            trial = _replace_at(data, prefix, {key: value})
            try:
                msgspec.convert(trial, type_, strict=True)
            except msgspec.ValidationError as e:
                if str(e) == err:
                    return prefix + (key,) + rest
    return prefix + rest


def _replace_at(data: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    head, tail = path[0], path[1:]
    copy = dict(data) if isinstance(data, dict) else list(data)
    copy[head] = _replace_at(data[head], tail, value)
    return copy


def _literal_values(type_: Any, at: tuple[Any, ...]) -> list[Any]:
    """The values a ``Literal`` field at ``at`` (in ``type_``) allows, if it is one."""
    mi = msgspec.inspect

    def alternatives(info: Any) -> tuple[Any, ...]:
        return info.types if isinstance(info, mi.UnionType) else (info,)

    infos = [mi.type_info(type_)]
    for key in at:
        nxt: list[Any] = []
        for t in (t for info in infos for t in alternatives(info)):
            if isinstance(t, mi.StructType):
                nxt += [f.type for f in t.fields if f.encode_name == key]
            elif isinstance(t, mi.DictType):
                nxt.append(t.value_type)
            elif isinstance(t, (mi.ListType, mi.VarTupleType, mi.SetType, mi.FrozenSetType)):
                nxt.append(t.item_type)
            elif isinstance(t, mi.TupleType) and isinstance(key, int) and key < len(t.item_types):
                nxt.append(t.item_types[key])
        infos = nxt
    return [v for info in infos for t in alternatives(info) if isinstance(t, mi.LiteralType) for v in t.values]


def parse_validation_error(err: str) -> tuple[tuple[Any, ...], str]:
    """(path, reason) of a msgspec validation message, for ``Located.error``."""
    at, reason = _parse_error(err)
    return tuple(p for p in at if p is not _ANY), reason


def read_text(path: str | Path) -> str:
    """The file's text; ``ConfigError`` if it cannot be read or is not UTF-8."""
    try:
        data = Path(path).read_bytes()
    except OSError as e:
        raise ConfigError([f"{path}:1: (file): cannot read: {e.strerror or e}"]) from e
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        raise ConfigError([f"{path}:{line}: (file): not UTF-8 text (byte {e.start}: {e.reason})"]) from e


def load_yaml(path: str | Path, type_: type[T], text: str | None = None) -> tuple[T, Located]:
    """Parse and validate ``path`` (or ``text`` reported as ``path``) as ``type_``.

    Raises ``ConfigError`` with located messages. Structs may define
    ``validate(located) -> list[str]`` for checks across fields.
    """
    name = str(path)
    if text is None:
        text = read_text(path)
    try:
        # one parse: the node graph (for line numbers), then the data built from it
        loader = _Loader(text)
        try:
            root = loader.get_single_node()
            # located first: building the data rewrites merge keys (<<:) in the
            # graph, and a graph of too many values must be refused unbuilt
            located = Located(name, root)
            if located.duplicates:
                raise ConfigError(located.duplicates)
            data = loader.construct_document(root) if root is not None else None
        finally:
            loader.dispose()
    except yaml.MarkedYAMLError as e:
        line = (e.problem_mark.line + 1) if e.problem_mark else 1
        raise ConfigError([f"{name}:{line}: (syntax): {e.problem or e}"]) from e
    except yaml.YAMLError as e:
        raise ConfigError([f"{name}:1: (syntax): {e}"]) from e
    if data is None:
        data = {}
    try:
        value = msgspec.convert(data, type_, strict=True)
    except msgspec.ValidationError as e:
        at, reason = _parse_error(str(e))
        if _ANY in at:
            at = _name_dict_entry(data, type_, at, str(e))
        if reason.startswith("Invalid enum value"):
            allowed = _literal_values(type_, at)
            if allowed:
                reason += f"; expected one of {', '.join(map(repr, allowed))}"
        raise ConfigError([located.error(at, reason)]) from e
    check = getattr(value, "validate", None)
    if check is not None:
        problems = check(located)
        if problems:
            raise ConfigError(problems)
    return value, located
