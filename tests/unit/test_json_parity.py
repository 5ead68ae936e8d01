"""An unpaired surrogate escape's 400 (``router.json_parity``): a key that
holds one is named by its escape, the search for one costs a few bytes of
work for any body msgspec refused, and no body makes ``decode_request``
raise anything but a ``BadRequest`` that encodes."""

from __future__ import annotations

import json
import re
import sys

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router import json_parity
from router.errors import BadRequest
from router.openai_types import ChatRequest, CompletionRequest, decode_request

HEAD = '{"model": "m", "messages": [{"role": "user", "content": "hi"'


def refusal(body: bytes, kind: type = ChatRequest) -> BadRequest:
    with pytest.raises(BadRequest) as e:
        decode_request(body, kind)
    return e.value


@pytest.mark.parametrize("body, param", [
    (HEAD + '}], "metadata": {"\\ud83d": "x"}}', "metadata.\\ud83d"),
    (HEAD + ', "\\ud83d": 1}]}', "messages[0].\\ud83d"),
    (HEAD + ', "a\\udc00b": 1}]}', "messages[0].a\\udc00b"),
    (HEAD + '}], "metadata": {"\\u00e9\\ud83d": "x"}}', "metadata.\u00e9\\ud83d"),  # (only the surrogate escaped)
])
def test_a_key_holding_an_unpaired_surrogate_is_named_by_its_escape(body: str, param: str) -> None:
    # (the key itself went into the message and param: a string no UTF-8
    # encoder takes, so the error body raised and the answer was a 500)
    err = refusal(body.encode())
    assert err.param == param
    assert err.message.startswith(f"The request body is not valid JSON: '{param}' holds the unpaired")
    assert json.loads(err.body())["error"]["param"] == param


def test_a_long_key_holding_an_unpaired_surrogate_is_clipped() -> None:
    key = "k" * 5000 + "\\ud83d"
    err = refusal((HEAD + '}], "metadata": {"%s": "x"}}' % key).encode())
    assert len(err.message) < 500 and len(err.param or "") < 300, (len(err.message), len(err.param or ""))
    assert err.message.startswith("The request body is not valid JSON: 'metadata.kkk")


class _Spy:
    """A compiled pattern that counts the bytes its searches may look at."""

    def __init__(self, pattern: re.Pattern, seen: list[int]) -> None:
        self._pattern, self._seen = pattern, seen

    def __getattr__(self, name: str):
        fn = getattr(self._pattern, name)
        if name not in ("search", "match", "fullmatch", "finditer", "findall"):
            return fn

        def spied(string, pos: int = 0, endpos: int = sys.maxsize):
            if isinstance(string, (bytes, bytearray, memoryview)):
                self._seen.append(max(0, min(endpos, len(string)) - pos))
            return fn(string, pos, endpos)
        return spied


BIG = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hello world " * 100}] * 900}).encode()


@pytest.mark.parametrize("body, named", [
    (BIG[:-5], False),  # truncated
    (BIG[:-2] + b",]}", False),  # a trailing comma
    (BIG[:-30] + b"\\ud83d" + BIG[-30:], True),  # a lone surrogate near the end: its 400 names it
    (BIG[:-4] + b'\\ud83d"}]}', True),  # one that ends the body but for a few bytes (msgspec: "truncated")
    # a megabyte of backslashes before one (an escaped backslash each pair)
    (b'{"model": "m", "messages": [{"role": "user", "content": "' + b"\\\\" * len(BIG) + b'\\ud83d"}]}', True),
    # an even number: text, in a body cut short
    (b'{"model": "m", "messages": [{"role": "user", "content": "' + b"\\\\" * len(BIG) + b'ud83d"', False),
])
def test_the_search_for_an_unpaired_surrogate_reads_a_few_bytes_of_a_large_body(body: bytes, named: bool,
                                                                                monkeypatch) -> None:
    # (it searched the whole body for every malformed one, a byte at a time:
    # 0.3-0.7 s of the event loop for 4 MiB, which a 4 KB gzip body inflates to)
    seen: list[int] = []
    for name, value in vars(json_parity).items():
        if isinstance(value, re.Pattern):
            monkeypatch.setattr(json_parity, name, _Spy(value, seen))
    err = refusal(body)
    assert sum(seen) <= 64, seen
    assert ("the unpaired UTF-16 surrogate escape \\ud83d," in err.message) is named, err.message


# JSON-ish bodies: a chat request (its fields, some of the wrong type), keys
# and strings that may hold unpaired surrogates (json.dumps writes them as
# escapes), then perhaps cut short, or a few bytes changed
_text = st.text(st.characters(codec=None, categories=None), max_size=8) | st.sampled_from(
    ["\ud83d", "\ude00", "a\ud800b", "\\", "\ud83d\ude00", "x" * 300])
_value = st.recursive(st.none() | st.booleans() | st.integers(-3, 2**64) | st.floats(allow_nan=False) | _text,
                      lambda inner: st.lists(inner, max_size=3) | st.dictionaries(_text, inner, max_size=3),
                      max_leaves=8)
_field = st.sampled_from(["metadata", "logit_bias", "max_tokens", "stop", "seed", "chat_template_kwargs",
                          "stream_options", "user", "n", "stop_token_ids", "tools"]) | _text
_message = st.dictionaries(st.sampled_from(["role", "content", "name"]) | _text, _value, max_size=4)


@st.composite
def _bodies(draw) -> bytes:
    doc: dict = {"model": draw(_text | st.just("m")), "messages": draw(st.lists(_message, max_size=3))}
    doc.update(draw(st.dictionaries(_field, _value, max_size=4)))
    if draw(st.booleans()):
        doc["prompt"] = draw(_value)
    body = json.dumps(doc, ensure_ascii=draw(st.booleans())).encode("utf-8", "surrogatepass")
    cut = draw(st.integers(0, 3))
    if cut == 1:
        body = body[: draw(st.integers(0, len(body)))]
    elif cut == 2:
        at = draw(st.integers(0, len(body)))
        body = body[:at] + draw(st.sampled_from([b"\\", b"\\u", b"\\ud83d", b"\\udc00", b",", b"\xff", b'"', b"\\\\"]))\
            + body[at + draw(st.integers(0, 2)):]
    return body


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_bodies(), st.sampled_from([ChatRequest, CompletionRequest]))
def test_any_body_is_taken_or_a_400_that_encodes(body: bytes, kind: type) -> None:
    try:
        decode_request(body, kind)
    except BadRequest as e:
        e.message.encode("utf-8")  # (what error_body must write: a lone surrogate raised, a 500)
        if e.param is not None:
            e.param.encode("utf-8")
        assert msgspec.json.decode(e.body())["error"]["message"] == e.message
