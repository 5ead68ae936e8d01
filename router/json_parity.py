"""What vLLM's server (FastAPI, Python's json and pydantic in lax mode)
takes in a request body and msgspec's strict decode refuses, for
``openai_types.decode_request``:

* a UTF-8 byte order mark before the JSON (RFC 8259 lets a parser ignore
  it; Python's json does, read as ``utf-8-sig``): dropped (``without_bom``);
* a whole number written as a float (``"max_tokens": 3.0``, ``1e2``) in an
  integer field: taken as that integer (``integral_floats``), as pydantic
  takes it; ``3.5`` stays a 400 that says it has a fractional part;
* an unpaired UTF-16 surrogate escape (``"\\ud83d"``, what JavaScript's
  ``JSON.stringify`` writes for text cut inside an emoji): valid JSON
  grammar but no character. vLLM's json keeps it and its tokenizer refuses
  it (a 400); here it is one 400 that names the field and the escape
  (``lone_surrogate``), where msgspec had three messages for it.

Each runs only where msgspec refused the body (or, the BOM, at its first
byte): a valid body takes msgspec's path alone.
"""

from __future__ import annotations

import json
import re
from typing import Any

import msgspec

from router.errors import clip

__all__ = ["without_bom", "integral_floats", "lone_surrogate", "FRACTION", "FLOAT_FOR_INT", "SURROGATE_SCAN_LIMIT", "TRUNCATED"]

BOM = b"\xef\xbb\xbf"
# (msgspec's reason for a float where an int belongs: "Expected `int | null`, got `float`")
FLOAT_FOR_INT = re.compile(r"Expected `int( \| null)?`, got `float`")
FRACTION = "a number with a fractional part is not an integer"
# A surrogate escape; its pairing and the backslashes before it are checked
# in Python (a pattern that began with a lookbehind for them tried every byte
# of the body: 0.3-0.7 s for 4 MiB).
_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_LOW = re.compile(rb"\\u[dD][c-fC-F][0-9a-fA-F]{2}")
# msgspec's words (0.23) for a string with an unpaired surrogate escape,
# N the byte after the escape it stopped at: a high one followed by no \u,
# "JSON is malformed: unexpected end of escaped utf-16 surrogate pair (byte N)";
# by a \u that is not a low one, or a low one alone, "... invalid utf-16
# surrogate pair (byte N)"; a high one with fewer than 6 bytes after it,
# "Input data was truncated", as for any body that ends early.
_PAIR_ERROR = re.compile(r"JSON is malformed: (?:unexpected end of escaped|invalid) utf-16 surrogate pair "
                         r"\(byte (\d+)\)")
# (msgspec skipping a Raw field: a WebSocket message's body)
_HEX_END = re.compile(r"JSON is malformed: unexpected end of hex escape \(byte (\d+)\)")
TRUNCATED = "Input data was truncated"
_WINDOW = 12  # (bytes before msgspec's N, or the body's end, that hold the escape: a pair's two)
SURROGATE_SCAN_LIMIT = 64 * 1024


def without_bom(body: bytes) -> bytes:
    """``body`` without a leading UTF-8 byte order mark."""
    return body[3:] if body[:3] == BOM else body


def _int_fields(kind: type[msgspec.Struct]) -> dict[str, bool]:
    """The fields of ``kind`` that hold an integer (False) or a list of them (True)."""
    mi = msgspec.inspect
    found: dict[str, bool] = {}
    for f in mi.type_info(kind).fields:
        for t in (f.type.types if isinstance(f.type, mi.UnionType) else (f.type,)):
            if isinstance(t, mi.IntType):
                found[f.encode_name] = False
            elif isinstance(t, mi.ListType) and isinstance(t.item_type, mi.IntType):
                found[f.encode_name] = True
    return found


_INT_FIELDS: dict[type, dict[str, bool]] = {}


def _whole(value: Any) -> Any:
    return int(value) if type(value) is float and value.is_integer() else value


def integral_floats(body: bytes, kind: type[msgspec.Struct], error: str) -> bytes | None:
    """``body`` with the whole-number floats of ``kind``'s integer fields
    written as integers, if msgspec's ``error`` was one of those (else, or
    if there is none to rewrite, None). Only the top-level object is split
    (the fields' values of other types are passed on as their JSON), so a
    large body's messages are not decoded twice."""
    if not FLOAT_FOR_INT.match(error):
        return None
    fields = _INT_FIELDS.get(kind)
    if fields is None:
        fields = _INT_FIELDS[kind] = _int_fields(kind)
    try:
        top = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
    except msgspec.DecodeError:
        return None
    changed = False
    for name, is_list in fields.items():
        raw = top.get(name)
        if raw is None:
            continue
        value = msgspec.json.decode(raw)
        if is_list and isinstance(value, list):
            fixed: Any = [_whole(v) for v in value]
            differs = any(type(a) is not type(b) for a, b in zip(fixed, value))
        else:
            fixed = _whole(value)
            differs = type(fixed) is not type(value)
        if differs:
            top[name] = msgspec.Raw(msgspec.json.encode(fixed))
            changed = True
    return msgspec.json.encode(top) if changed else None


def _is_surrogate(c: str) -> bool:
    return "\ud800" <= c <= "\udfff"


def _key_name(key: str) -> str:
    """``key`` for an error's text: an unpaired surrogate in it as its escape
    (``\\ud83d``): the text is sent as UTF-8, which has no such character."""
    if not any(_is_surrogate(c) for c in key):
        return key
    return key.encode("utf-8", "backslashreplace").decode("utf-8")


def _path_of(value: Any, at: str = "") -> str | None:
    """Where in ``value`` (decoded by Python's json) the first string with a
    lone surrogate is: ``messages[0].content``; a key that holds one is
    named as itself (``metadata.\\ud83d``)."""
    if isinstance(value, str):
        return at if any(_is_surrogate(c) for c in value) else None
    if isinstance(value, dict):
        for k, v in value.items():
            name = f"{at}.{_key_name(k)}" if at else _key_name(k)
            if _path_of(k) is not None:
                return name
            found = _path_of(v, name)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = _path_of(v, f"{at}[{i}]")
            if found is not None:
                return found
    return None


def _escapes(body: bytes, i: int) -> bool:
    """Whether the backslash at ``body[i]`` begins an escape: an even number
    of backslashes before it (``\\\\ud83d`` is text). Only the escapes
    msgspec's error points at are asked about (``_WINDOW``)."""
    if body[i - 1:i] != b"\\":  # (the usual case: no copy of the body)
        return True
    head = body[:i]
    return (i - len(head.rstrip(b"\\"))) % 2 == 0


def _first_lone(body: bytes, start: int, end: int) -> int | None:
    """Where the first unpaired surrogate escape in ``body[start:end]`` begins."""
    for m in _ESCAPE.finditer(body, max(0, start), end):
        i = m.start()
        if not _escapes(body, i):
            continue
        if body[i + 3] in b"89abAB":  # (high: a low one must follow)
            if _LOW.match(body, i + 6, i + 12) is None:
                return i
        elif i < 6 or _ESCAPE.match(body, i - 6, i) is None or body[i - 3] not in b"89abAB" \
                or not _escapes(body, i - 6):
            return i
    return None


def lone_at(body: bytes, error: str, skipped: bool = False) -> int | None:
    """Where the unpaired surrogate escape msgspec refused ``body`` for with
    ``error`` begins (``lone_surrogate``); None if that was not its reason."""
    m = _PAIR_ERROR.fullmatch(error) or (_HEX_END.fullmatch(error) if skipped else None)
    if m is not None:
        end = int(m.group(1))
    elif error == TRUNCATED:
        end = len(body)
    else:
        return None
    return _first_lone(body, end - _WINDOW, end)


def lone_surrogate(body: bytes, error: str, skipped: bool = False) -> tuple[str, str | None] | None:
    """The message and field (None: not known) of the unpaired surrogate
    escape msgspec refused ``body`` for with ``error``; None if that was not
    its reason. msgspec says where it stopped, or, "truncated", it was at the
    end: only a few bytes there are read (``_WINDOW``), whatever the size.
    ``skipped``: ``body`` has a ``msgspec.Raw`` field, which msgspec skips
    without decoding: it says "unexpected end of hex escape" there, its
    byte 6 past the escape too."""
    at = lone_at(body, error, skipped)
    if at is None:
        return None
    escape = body[at:at + 6].decode("ascii")
    param = None
    if len(body) <= SURROGATE_SCAN_LIMIT:
        try:
            param = _path_of(json.loads(body))
        except (ValueError, RecursionError):
            pass
    where = f"'{clip(param)}' holds" if param else f"a string holds (at byte {at})"
    return (f"The request body is not valid JSON: {where} the unpaired UTF-16 surrogate escape {escape}, "
            "which encodes no character (text cut inside a character such as an emoji?); send the "
            "escape's pair with it, or neither.", param)
