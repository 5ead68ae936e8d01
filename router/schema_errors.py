"""Every schema error of a document, not only msgspec's first, each by path.

msgspec stops converting at the first error. ``schema_errors`` converts the
whole document first (the fast path, and the one a valid file takes), and
where that fails it converts each field of a struct, each entry of a dict
and each item of a list on its own with msgspec, so one bad tenant (or
replica, or key) does not hide the next. The structs stay the only schema:
nothing here knows a field's rules, only how to walk msgspec's types. An
error inside a value whose type is already wrong (a mapping where a list
belongs) is not looked for: it would depend on that one.

Paths are tuples of keys and list indexes (``("tenants", "gold", "limits",
"rpm")``), for ``configfile.Located`` to turn into a file line.
"""

from __future__ import annotations

import re
import types
import typing
from typing import Any

import msgspec

__all__ = ["schema_errors", "entries_of", "KeyPath"]

KeyPath = tuple[Any, ...]  # a place in a document: keys and list indexes

_ANY = object()  # a dict entry msgspec reports as `[...]`
_PATH_RE = re.compile(r" - at `\$(.*)`$")
_PART_RE = re.compile(r"\.([^.\[]+)|\[(\d+|\.\.\.)\]")
_UNKNOWN_RE = re.compile(r"Object contains unknown field `([^`]+)`")
_MISSING_RE = re.compile(r"Object missing required field `([^`]+)`")


def schema_errors(data: Any, type_: Any) -> list[tuple[KeyPath, str]]:
    """(path, reason) of every error in ``data`` as ``type_`` (strict, as
    ``load_yaml`` converts), in the document's order; ``[]`` if it converts."""
    return _errors(data, type_, ())


def entries_of(type_: Any, data: Any) -> bool:
    """``data`` holds entries of ``type_``, a dict or list type (or a union
    with one): each entry can be left out without changing what the others
    mean, unlike the fields of a struct."""
    shape = _shape(type_, data)
    return shape is not None and shape[0] in ("dict", "list")


def _errors(data: Any, type_: Any, at: KeyPath) -> list[tuple[KeyPath, str]]:
    try:
        msgspec.convert(data, type_, strict=True)
    except msgspec.ValidationError as e:
        # (msgspec's own message when the parts convert one by one but not
        # together: a struct's __post_init__, or a type this does not walk)
        return _split(data, type_, at) or [_located(data, type_, at, str(e))]
    return []


def _split(data: Any, type_: Any, at: KeyPath) -> list[tuple[KeyPath, str]]:
    shape = _shape(type_, data)
    if shape is None:
        return []
    kind, t = shape
    found: list[tuple[KeyPath, str]] = []
    if kind == "struct":
        config = t.__struct_config__
        fields = {f.encode_name: f for f in msgspec.structs.fields(t)}
        for key, value in data.items():
            field = fields.get(key)
            if field is not None:
                found += _errors(value, field.type, at + (key,))
            elif config.forbid_unknown_fields and (config.tag_field is None or key != config.tag_field):
                found.append((at + (key,), "unknown key"))
        found += [(at, f"missing required key `{name}`") for name, f in fields.items()
                  if f.required and name not in data]
    elif kind == "dict":
        key_type, value_type = typing.get_args(t)
        for key, value in data.items():
            try:
                msgspec.convert(key, key_type, strict=True)
            except msgspec.ValidationError as e:
                found.append((at + (key,), f"not a valid key here: {_parse_error(str(e))[1]}"))
                continue
            found += _errors(value, value_type, at + (key,))
    else:
        item_type = typing.get_args(t)[0]
        for i, value in enumerate(data):
            found += _errors(value, item_type, at + (i,))
    return found


def _shape(type_: Any, data: Any) -> tuple[str, Any] | None:
    """("struct" | "dict" | "list", the type) of the one alternative of
    ``type_`` that ``data`` has the shape of; None if none or several."""
    options = typing.get_args(type_) if typing.get_origin(type_) in (typing.Union, types.UnionType) else (type_,)
    found: list[tuple[str, Any]] = []
    if isinstance(data, dict):
        structs = [t for t in options if isinstance(t, type) and issubclass(t, msgspec.Struct)
                   and not t.__struct_config__.array_like]
        if len(structs) > 1:  # (a tagged union: the tag picks one)
            structs = [t for t in structs if t.__struct_config__.tag_field is not None
                       and data.get(t.__struct_config__.tag_field) == t.__struct_config__.tag]
        found += [("struct", t) for t in structs]
        found += [("dict", t) for t in options if typing.get_origin(t) is dict and len(typing.get_args(t)) == 2]
    elif isinstance(data, list):
        found += [("list", t) for t in options if typing.get_origin(t) is list and typing.get_args(t)]
    return found[0] if len(found) == 1 else None


def _located(data: Any, type_: Any, at: KeyPath, err: str) -> tuple[KeyPath, str]:
    """msgspec's first error in ``data``, its path made whole (``at`` + the
    path inside, a dict entry's ``[...]`` named) and an enum's values listed."""
    inside, reason = _parse_error(err)
    if _ANY in inside:
        inside = _name_dict_entry(data, type_, inside, err)
    if reason.startswith("Invalid enum value"):
        allowed = _literal_values(type_, inside)
        if allowed:
            reason += f"; expected one of {', '.join(map(repr, allowed))}"
    return at + inside, reason


def _parse_error(err: str) -> tuple[KeyPath, str]:
    m = _PATH_RE.search(err)
    reason = err[: m.start()] if m else err
    at: KeyPath = ()
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


def _name_dict_entry(data: Any, type_: Any, at: KeyPath, err: str) -> KeyPath:
    """msgspec names a failing dict entry ``[...]``: find which key it is by
    validating the document with that dict cut down to one entry at a time.
    (Only a dict this module does not walk gets here: one inside a union of
    several struct or container types.)"""
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


def _replace_at(data: Any, path: KeyPath, value: Any) -> Any:
    if not path:
        return value
    head, tail = path[0], path[1:]
    copy = dict(data) if isinstance(data, dict) else list(data)
    copy[head] = _replace_at(data[head], tail, value)
    return copy


def _literal_values(type_: Any, at: KeyPath) -> list[Any]:
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
