"""The key of a bad entry of a request's JSON object field (``metadata``,
``logit_bias``), which msgspec's error names ``[...]``: ``metadata.a``."""

from __future__ import annotations

import re
from collections.abc import Iterator
from json.decoder import JSONDecoder, scanstring
from typing import Any

import msgspec

__all__ = ["key_of_entry", "LOC"]

LOC = re.compile(r" - at `\$([^`]*)`$")  # (msgspec's location: ".messages[0].role", "[...]")


def key_of_entry(body: bytes, kind: type[msgspec.Struct], param: str, reason: str) -> str:
    """msgspec names a failing entry of a top-level object field ``[...]``
    (``metadata[...]``): name its key instead (``metadata.a``), as a config
    file's errors do. An error path, but its body may be megabytes of
    entries (a review: 330,000 of ``logit_bias`` took 1.5 s decoded to
    Python objects and walked whole): the body is split into raw JSON (C),
    and a field of at most ``_KEYED_BYTES`` into its entries, whose values
    are tried one at a time, in order (a larger one keeps msgspec's
    ``[...]``). The field is first decoded whole (C): if it holds no value
    refused for ``reason`` (the bad one was in an earlier copy of a field
    sent twice), no entry is tried. The decode judged each occurrence of a
    key sent twice: if no last value is the bad one, the occurrences in the
    field's first ``_OCCURRENCE_BYTES`` are (``_occurrences``: Python)."""
    field, _, rest = param.partition("[...]")
    fields = {f.encode_name: f.type for f in msgspec.structs.fields(kind)}
    value_type = next((t.__args__[1] for t in getattr(fields.get(field), "__args__", ())
                       if getattr(t, "__origin__", None) is dict), None)
    if value_type is None:
        return param
    try:
        raw = msgspec.json.decode(body, type=dict[str, msgspec.Raw])[field]
        if len(raw) > _KEYED_BYTES or _refused(raw, dict[str, value_type]) != reason:
            return param
        for entries in (msgspec.json.decode(raw, type=dict[str, msgspec.Raw]).items(),
                        _occurrences(raw, _OCCURRENCE_BYTES)):
            for key, value in entries:
                if _refused(value, value_type) == reason:
                    return f"{field}.{key}" + rest
    except (msgspec.MsgspecError, KeyError, ValueError, IndexError, RecursionError):
        return param
    return param


def _refused(value: bytes | msgspec.Raw, type_: Any) -> str | None:
    """Why msgspec refuses the JSON ``value`` as ``type_`` (its words, without
    the location); None if it takes it, or it is no JSON it can read."""
    try:
        msgspec.json.decode(value, type=type_)
    except msgspec.ValidationError as e:
        m = LOC.search(str(e))
        return str(e)[: m.start()] if m else str(e)
    except (msgspec.MsgspecError, RecursionError):
        return None
    return None


_JSON = JSONDecoder()
_SPACE = re.compile(r"[ \t\n\r]*")


def _occurrences(raw: msgspec.Raw, limit: int) -> Iterator[tuple[str, bytes]]:
    """(key, value as sent) of each entry of the JSON object ``raw`` in order,
    a key sent twice twice, up to the first that begins past character
    ``limit``. Its structure was read already, but not all of its text as
    UTF-8: msgspec stops at the first value it refuses, and a string's bytes
    it skips (a ``Raw`` value, a value after the one refused) it does not
    check. So the text is read with ``surrogateescape`` (here, in the second
    pass only: a byte that is not UTF-8 after the bad entry hid the key the
    first pass names) and each value given back as the bytes sent. The keys
    up to the first value refused are valid UTF-8: the field's decode read them."""
    obj = bytes(raw).decode("utf-8", "surrogateescape")
    at = _SPACE.match(obj, 1).end()
    while at <= limit and obj[at] == '"':
        key, at = scanstring(obj, at + 1)
        at = _SPACE.match(obj, _SPACE.match(obj, at).end() + 1).end()  # (past the ':')
        end = _JSON.raw_decode(obj, at)[1]
        yield key, obj[at:end].encode("utf-8", "surrogateescape")
        at = _SPACE.match(obj, _SPACE.match(obj, end).end() + 1).end()  # (past the ',' or '}')


_KEYED_BYTES = 64 * 1024  # (about 5,000 entries: a few ms of tries, in C when none is bad)
# The part of a field read entry by entry in Python (2-3 us an entry, where
# the decode and the first pass take 1-3 ms for a 64 KiB field): ~170 entries
# at most (a review: read whole, 10,000 held the event loop 20-55 ms)
_OCCURRENCE_BYTES = 1024
