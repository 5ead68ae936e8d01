"""The replica wire protocol: every message survives encode/decode, and
``FrameDecoder`` reassembles frames from any byte chunking."""

from __future__ import annotations

import struct

import msgspec
import pytest
from hypothesis import given
from hypothesis import strategies as st

from replicas.protocol import (
    MAX_FRAME,
    PROTOCOL_VERSION,
    Abort,
    Delta,
    Deltas,
    FinishReason,
    FrameDecoder,
    Generate,
    Hello,
    LoadReport,
    Ping,
    Pong,
    Ready,
    Refused,
    SamplingParams,
    encode_frame,
    replica_decoder,
    router_decoder,
)

ids = st.integers(0, 2**31)
u64 = st.integers(0, 2**63 - 1)
token_ids = st.lists(st.integers(0, 300_000), max_size=20)
text = st.text(max_size=30)
finite = st.floats(allow_nan=False, allow_infinity=False)

params = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 1 << 20),
    temperature=st.floats(0, 2),
    top_p=st.floats(0, 1),
    top_k=st.integers(-1, 1000),
    min_p=st.floats(0, 1),
    seed=st.none() | u64,
    stop=st.lists(text, max_size=4),
    stop_token_ids=token_ids,
    ignore_eos=st.booleans(),
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
    repetition_penalty=st.floats(0.1, 2),
    min_tokens=st.integers(0, 100),
    include_stop_str_in_output=st.booleans(),
)
messages = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]), "content": text}),
                    max_size=3)

json_values = st.recursive(st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | finite | text,
                           lambda inner: st.lists(inner, max_size=3) | st.dictionaries(text, inner, max_size=3),
                           max_leaves=8)
template_kwargs = st.dictionaries(text, json_values, max_size=3)


@st.composite
def generates(draw) -> Generate:
    kind = draw(st.sampled_from(["prompt", "messages", "prompt_token_ids"]))
    return Generate(
        rid=draw(ids),
        params=draw(params),
        prompt=draw(text) if kind == "prompt" else None,
        messages=draw(messages) if kind == "messages" else None,
        prompt_token_ids=draw(token_ids) if kind == "prompt_token_ids" else None,
        prefix_token_ids=draw(token_ids),
        prefix_text_len=draw(st.integers(0, 1000)),
        chat_template_kwargs=draw(st.none() | template_kwargs) if kind == "messages" else None,
    )


loads = st.builds(LoadReport, running=ids, waiting=ids, kv_usage=st.floats(0, 1), steps=u64, tokens_generated=u64)
deltas = st.builds(
    Delta,
    rid=ids,
    token_ids=token_ids,
    text=text,
    finish=st.sampled_from(list(FinishReason)),
    prompt_token_ids=st.none() | token_ids,
    error=text,
    stop_reason=st.none() | text | ids,
)
router_messages = st.one_of(
    st.builds(Hello, version=st.integers(0, 100), secret=text),
    generates(),
    st.builds(Abort, rid=ids),
    st.builds(Ping, seq=u64),
)
replica_messages = st.one_of(
    st.builds(Ready, version=st.integers(0, 100), model=text, engine=st.sampled_from(["sim", "vllm"]),
              max_model_len=ids, pid=ids),
    st.builds(Deltas, items=st.lists(deltas, max_size=5)),
    loads,
    st.builds(Pong, seq=u64, load=loads),
    st.builds(Refused, reason=text),
)


@given(router_messages)
def test_router_messages_roundtrip(msg) -> None:
    frame = encode_frame(msg)
    (size,) = struct.unpack(">I", frame[:4])
    assert size == len(frame) - 4
    assert router_decoder().decode(frame[4:]) == msg
    assert FrameDecoder(router_decoder()).feed(frame) == [msg]


@given(replica_messages)
def test_replica_messages_roundtrip(msg) -> None:
    frame = encode_frame(msg)
    got = replica_decoder().decode(frame[4:])
    assert got == msg
    assert type(got) is type(msg)


def test_every_message_type_is_covered() -> None:
    """The strategies above must cover both unions (a new message type needs one)."""
    import typing

    from replicas import protocol

    assert set(typing.get_args(protocol.RouterMessage)) == {Hello, Generate, Abort, Ping}
    assert set(typing.get_args(protocol.ReplicaMessage)) == {Ready, Deltas, LoadReport, Pong, Refused}


@given(st.lists(replica_messages, max_size=8), st.lists(st.integers(0, 10_000), max_size=20))
def test_frame_decoder_reassembles_any_chunking(msgs: list, cuts: list[int]) -> None:
    stream = b"".join(encode_frame(m) for m in msgs)
    bounds = sorted({c % (len(stream) + 1) for c in cuts} | {0, len(stream)})
    dec = FrameDecoder(replica_decoder())
    out = []
    for a, b in zip(bounds, bounds[1:]):
        out.extend(dec.feed(stream[a:b]))
        out.extend(dec.feed(b""))  # an empty read changes nothing
    assert out == msgs
    assert dec.feed(b"") == []


@given(st.lists(router_messages, min_size=1, max_size=5))
def test_frame_decoder_byte_by_byte(msgs: list) -> None:
    stream = b"".join(encode_frame(m) for m in msgs)
    dec = FrameDecoder(router_decoder())
    out = []
    for i in range(len(stream)):
        got = dec.feed(stream[i : i + 1])
        out.extend(got)
    assert out == msgs


def test_frame_decoder_holds_an_incomplete_frame() -> None:
    frame = encode_frame(Ping(7))
    dec = FrameDecoder(router_decoder())
    assert dec.feed(frame[:-1]) == []
    assert dec.feed(frame[-1:]) == [Ping(7)]


def test_oversized_frame_is_refused() -> None:
    dec = FrameDecoder(router_decoder())
    with pytest.raises(ValueError, match="exceeds"):
        dec.feed(struct.pack(">I", MAX_FRAME + 1) + b"\x00")


def test_decoders_do_not_accept_the_other_sides_messages() -> None:
    with pytest.raises(msgspec.ValidationError):
        router_decoder().decode(encode_frame(Refused("no"))[4:])
    with pytest.raises(msgspec.ValidationError):
        replica_decoder().decode(encode_frame(Abort(1))[4:])


def test_hello_defaults_to_the_current_version() -> None:
    assert Hello().version == PROTOCOL_VERSION


def test_finish_reasons_map_to_openai() -> None:
    assert [r.openai for r in FinishReason] == [None, "stop", "length", "abort", "error"]



def test_a_delta_from_before_stop_reason_decodes_and_an_older_router_drops_it():
    # (stop_reason is the Delta's last item: a replica from before sends none,
    # and a router from before ignores it, as msgspec drops trailing items)
    old = msgspec.msgpack.encode([7, [1], "a", int(FinishReason.STOP)])
    assert msgspec.msgpack.decode(old, type=Delta).stop_reason is None
    new = msgspec.msgpack.encode(Delta(7, [1], "a", FinishReason.STOP, stop_reason="zz"))
    assert msgspec.msgpack.decode(new, type=Delta).stop_reason == "zz"

    class OldDelta(msgspec.Struct, array_like=True, omit_defaults=True):
        rid: int
        token_ids: list[int] = []
        text: str = ""
        finish: FinishReason = FinishReason.NONE
        prompt_token_ids: list[int] | None = None
        error: str = ""
        count: int = 0
        prompt_count: int = 0

    assert msgspec.msgpack.decode(new, type=OldDelta).finish == FinishReason.STOP
