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

__all__ = ["without_bom", "integral_floats", "lone_surrogate", "FRACTION", "FLOAT_FOR_INT", "SURROGATE_SCAN_LIMIT"]

BOM = b"\xef\xbb\xbf"
# (msgspec's reason for a float where an int belongs: "Expected `int | null`, got `float`")
FLOAT_FOR_INT = re.compile(r"Expected `int( \| null)?`, got `float`")
FRACTION = "a number with a fractional part is not an integer"
# an escape \uD800-\uDBFF not followed by \uDC00-\uDFFF, or \uDC00-\uDFFF not
# preceded by one; after an even number of backslashes (\\ud83d is text)
_LONE = re.compile(rb"(?<!\\)(?:\\\\)*(\\u[dD][89abAB][0-9a-fA-F]{2}(?!\\u[dD][c-fC-F])"
                   rb"|(?<![dD][89abAB][0-9a-fA-F]{2})\\u[dD][c-fC-F][0-9a-fA-F]{2})")
# A body up to this size is read with Python's json to name the field that
# holds the escape (a few ms); a larger one's error names only its byte.
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


def _path_of(value: Any, at: str = "") -> str | None:
    """Where in ``value`` (decoded by Python's json) the first string with a
    lone surrogate is: ``messages[0].content``; a key that holds one is
    named as itself."""
    if isinstance(value, str):
        return at if any("\ud800" <= c <= "\udfff" for c in value) else None
    if isinstance(value, dict):
        for k, v in value.items():
            name = f"{at}.{k}" if at else k
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


def lone_surrogate(body: bytes) -> tuple[str, str | None] | None:
    """The message and field (None: not known) of the first unpaired
    surrogate escape in ``body``; None if it has none."""
    m = _LONE.search(body)
    if m is None:
        return None
    escape = m.group(1).decode("ascii")
    param = None
    if len(body) <= SURROGATE_SCAN_LIMIT:
        try:
            param = _path_of(json.loads(body))
        except (ValueError, RecursionError):
            pass
    where = f"'{param}' holds" if param else f"a string holds (at byte {m.start(1)})"
    return (f"The request body is not valid JSON: {where} the unpaired UTF-16 surrogate escape {escape}, "
            "which encodes no character (text cut inside a character such as an emoji?); send the "
            "escape's pair with it, or neither.", param)
