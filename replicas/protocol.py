"""Replica wire protocol: msgspec structs in length-prefixed msgpack frames.

One connection per (router, replica) carries every request, multiplexed by
``rid``. A frame is a 4-byte big-endian length followed by one msgpack-encoded
message. Messages are tagged array-like structs, so a frame is a small array
whose first item is the message tag.

Router -> replica: ``Hello``, ``Generate``, ``Abort``, ``Ping``.
Replica -> router: ``Ready``, ``Deltas`` (one engine step's deltas for all of
the replica's requests in one frame), ``LoadReport``, ``Pong``, ``Refused``.
"""

from __future__ import annotations

import enum
import operator
import struct
from typing import Any

import msgspec

__all__ = [
    "PROTOCOL_VERSION",
    "FinishReason",
    "SamplingParams",
    "UNSET_TEMPERATURE",
    "UNSET_TOP_P",
    "UNSET_TOP_K",
    "UNSET_REPETITION_PENALTY",
    "UNSET_MIN_P",
    "UNSET_PRESENCE_PENALTY",
    "UNSET_FREQUENCY_PENALTY",
    "REFUSED_TEMPLATE_KWARGS",
    "Feature",
    "FEATURES",
    "required_features",
    "Hello",
    "Generate",
    "Abort",
    "Ping",
    "Ready",
    "Delta",
    "Deltas",
    "LoadReport",
    "Pong",
    "Refused",
    "RouterMessage",
    "ReplicaMessage",
    "FrameDecoder",
    "encode_frame",
    "router_decoder",
    "replica_decoder",
    "MAX_FRAME",
]

PROTOCOL_VERSION = 1
MAX_FRAME = 64 * 1024 * 1024
_LEN = struct.Struct(">I")


class FinishReason(enum.IntEnum):
    """Why a generation ended. ``NONE`` means it has not ended yet."""

    NONE = 0
    STOP = 1  # end-of-sequence token or a stop string
    LENGTH = 2  # max_tokens reached
    ABORT = 3  # aborted by the router
    ERROR = 4  # the engine failed this request; ``Delta.error`` says why

    @property
    def openai(self) -> str | None:
        return _OPENAI_FINISH[self]


# SamplingParams.unset: the fields a model's generation config may default
UNSET_TEMPERATURE, UNSET_TOP_P, UNSET_TOP_K, UNSET_REPETITION_PENALTY, UNSET_MIN_P = 1, 2, 4, 8, 16
# (later bits: an older replica reads none of them, and samples with the
# neutral values, as it did before them)
UNSET_PRESENCE_PENALTY, UNSET_FREQUENCY_PENALTY = 32, 64
_UNSET_FIELDS = ((UNSET_TEMPERATURE, "temperature"), (UNSET_TOP_P, "top_p"), (UNSET_TOP_K, "top_k"),
                 (UNSET_REPETITION_PENALTY, "repetition_penalty"), (UNSET_MIN_P, "min_p"),
                 (UNSET_PRESENCE_PENALTY, "presence_penalty"), (UNSET_FREQUENCY_PENALTY, "frequency_penalty"))
_UNSET_BITS = tuple(bit for bit, _ in _UNSET_FIELDS)
# (their values in one call: a getattr each was 7 calls per request)
_unset_values = operator.attrgetter(*(name for _, name in _UNSET_FIELDS))

_OPENAI_FINISH = {
    FinishReason.NONE: None,
    FinishReason.STOP: "stop",
    FinishReason.LENGTH: "length",
    FinishReason.ABORT: "abort",
    FinishReason.ERROR: "error",
}


class SamplingParams(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """What the engine needs to sample. Mirrors the vLLM fields we support."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    # max_tokens is the router's default, not the client's: the replica
    # lowers it to what the model's context leaves after the prompt, as
    # vLLM's OpenAI server does for an unset max_tokens, instead of refusing
    # the request. (Last: an older replica ignores it, msgspec drops
    # trailing array items it does not know.)
    max_tokens_default: bool = False
    # the sampling fields the client left unset (UNSET_* bits; their values
    # above are then the neutral ones): an engine that knows the model's own
    # defaults (vLLM's, from its generation_config.json) uses those, as
    # ``vllm serve`` does, and an upstream is not sent them
    unset: int = 0
    # vLLM's min_p (0: off). After ``unset``, for the reason given at
    # ``max_tokens_default``: an older replica ignores it (and its UNSET bit).
    min_p: float = 0.0
    # vLLM's include_stop_str_in_output: the text ends after the stop string
    # that ended it (and a stop token's text is output). Last, for the reason
    # given at ``max_tokens_default``: an older replica ignores it.
    include_stop_str_in_output: bool = False

    @classmethod
    def from_openai(cls, req, max_tokens: int, stop: list[str], max_tokens_default: bool = False) -> SamplingParams:
        """From an OpenAI-style request object (fields as in the API, None when
        unset); ``max_tokens`` and ``stop`` already resolved by the caller."""
        unset = 0
        for bit, value in zip(_UNSET_BITS, _unset_values(req)):
            if value is None:
                unset |= bit
        return cls(
            unset=unset,
            max_tokens_default=max_tokens_default,
            max_tokens=max_tokens,
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=-1 if req.top_k is None else req.top_k,
            seed=req.seed,
            stop=stop,
            stop_token_ids=list(req.stop_token_ids or []),
            ignore_eos=bool(req.ignore_eos),
            presence_penalty=req.presence_penalty or 0.0,
            frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            min_tokens=req.min_tokens or 0,
            min_p=0.0 if req.min_p is None else req.min_p,
            include_stop_str_in_output=bool(getattr(req, "include_stop_str_in_output", None)),
        )


class Hello(msgspec.Struct, tag=1, array_like=True, gc=False):
    """First frame from the router; ``secret`` must match the replica's.
    ``silence``: the longest the router leaves its connection without a frame
    (it pings every ``health_interval``, each ping waiting up to
    ``health_timeout``); after that the replica takes the router for gone
    (a partition: no FIN, no RST) and aborts its streams. 0: no limit (an
    older router, which sends no such field, or a client that does not ping)."""

    version: int = PROTOCOL_VERSION
    secret: str = ""
    silence: float = 0.0


# Generate.chat_template_kwargs keys vLLM's server refuses
# (resolve_chat_template_kwargs): the template is the model's, and rendering
# to text is the server's choice. The router refuses them up front.
REFUSED_TEMPLATE_KWARGS = frozenset({"chat_template", "tokenize"})


class Generate(msgspec.Struct, tag=2, array_like=True, omit_defaults=True, gc=False):
    """Start request ``rid``.

    Exactly one of ``prompt`` (text), ``messages`` (chat, rendered with the
    model's chat template) or ``prompt_token_ids`` is set. ``prefix_token_ids``
    are completion tokens already delivered to the client by an earlier replica:
    the engine continues after ``prompt + prefix`` and the replica detokenizes
    and checks stop strings as if it had produced the prefix itself, so a
    resumed stream is text-exact even across a split multi-byte character.
    ``chat_template_kwargs`` go to the chat template with ``messages`` (vLLM's
    field of that name).
    """

    rid: int
    params: SamplingParams
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    prompt_token_ids: list[int] | None = None
    prefix_token_ids: list[int] = []
    prefix_text_len: int = 0  # characters of the prefix's text the client already has
    # Last, for the reason given at SamplingParams.max_tokens_default: an
    # older replica ignores it (and renders the template without them).
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's reasoning_effort of a chat: a vllm replica renders the
    # template with it as vLLM's server does (replicas.chat_template), an
    # upstream is sent it. Last, for the same reason.
    reasoning_effort: str | None = None


class Abort(msgspec.Struct, tag=3, array_like=True, gc=False):
    rid: int


class Ping(msgspec.Struct, tag=4, array_like=True, gc=False):
    seq: int


class Ready(msgspec.Struct, tag=10, array_like=True, gc=False):
    """Answer to ``Hello``: the replica is serving ``model``, and takes the
    request fields of ``features``."""

    version: int
    model: str
    engine: str
    max_model_len: int
    pid: int
    # Feature bits. Last: a replica from before features were announced
    # sends none, and reads as 0 (msgspec's default for a missing trailing
    # item); a router from before ignores them.
    features: int = 0


class Feature(enum.IntFlag):
    """Request fields a replica announces it takes (``Ready.features``).

    Fields added to the protocol after its first version are new last items
    of ``SamplingParams`` or ``Generate``, which a replica that does not
    know them drops without a word (msgspec ignores trailing items it has no
    field for). A request that sets one of these goes only to a replica
    that announced it (``replicas.pool``), so that a rolling upgrade cannot
    send it where its field would be lost. (``max_tokens_default`` and
    ``unset`` are not among them: a replica that ignores them samples with
    the neutral values and refuses a prompt longer than the default leaves
    room for, which is what replicas did before them.)
    """

    MIN_P = 1  # SamplingParams.min_p
    INCLUDE_STOP_STR = 2  # SamplingParams.include_stop_str_in_output
    TEMPLATE_KWARGS = 4  # Generate.chat_template_kwargs
    REASONING_EFFORT = 8  # Generate.reasoning_effort

    def fields(self) -> list[str]:
        """The request fields of these bits."""
        return [_FEATURE_FIELDS[f] for f in Feature if f & self]

    def names(self) -> str:
        """``fields`` for a message."""
        return ", ".join(self.fields())


_FEATURE_FIELDS = {Feature.MIN_P: "min_p", Feature.INCLUDE_STOP_STR: "include_stop_str_in_output",
                   Feature.TEMPLATE_KWARGS: "chat_template_kwargs", Feature.REASONING_EFFORT: "reasoning_effort"}

# what a replica of this version takes: all of them
FEATURES = Feature.MIN_P | Feature.INCLUDE_STOP_STR | Feature.TEMPLATE_KWARGS | Feature.REASONING_EFFORT


def required_features(params: SamplingParams, template_kwargs: dict[str, Any] | None,
                      reasoning_effort: str | None = None) -> int:
    """The ``Feature`` bits a request with these params, chat template
    kwargs and reasoning effort needs of its replica (0 for most requests)."""
    needs = Feature.REASONING_EFFORT if reasoning_effort is not None else 0
    if params.min_p:
        needs |= Feature.MIN_P
    if params.include_stop_str_in_output:
        needs |= Feature.INCLUDE_STOP_STR
    if template_kwargs:
        needs |= Feature.TEMPLATE_KWARGS
    return int(needs)


class Delta(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """New output of one request since its previous delta.

    ``prompt_token_ids`` is set on the first delta of a request only. ``text``
    is the detokenization of ``token_ids`` exactly, except that bytes of an
    unfinished multi-byte character are held back until it completes.
    """

    rid: int
    token_ids: list[int] = []
    text: str = ""
    finish: FinishReason = FinishReason.NONE
    prompt_token_ids: list[int] | None = None
    error: str = ""
    # tokens this delta stands for beyond ``token_ids``: set only by an
    # OpenAI-compatible upstream that returns no token ids (one per chunk)
    count: int = 0
    # the prompt's token count where its ids are not known: set only on the
    # finish of such an upstream's stream, from its usage chunk
    prompt_count: int = 0
    # on a finish, vLLM's ``stop_reason``: the stop string that matched, the
    # id of the stop token of ``stop_token_ids`` that ended it, or None (EOS,
    # length, or a replica from before this field)
    stop_reason: str | int | None = None


class Deltas(msgspec.Struct, tag=11, array_like=True, gc=False):
    """One engine step's deltas for all of a replica's requests."""

    items: list[Delta]


class LoadReport(msgspec.Struct, tag=12, array_like=True, gc=False):
    """Scheduler stats as vLLM reports them."""

    running: int
    waiting: int
    kv_usage: float  # 0..1
    steps: int = 0
    tokens_generated: int = 0
    # the engine counts its steps in ``steps`` (sim, vLLM; not an upstream's
    # page): one with requests that takes no step, its first included, is
    # stuck (replicas.health.Progress). Older replicas send no such
    # field; their steps are judged from their first on, as before.
    reports_steps: bool = False


class Pong(msgspec.Struct, tag=13, array_like=True, gc=False):
    seq: int
    load: LoadReport


class Refused(msgspec.Struct, tag=14, array_like=True, gc=False):
    """The replica refuses the connection (bad secret, version) and closes it."""

    reason: str


RouterMessage = Hello | Generate | Abort | Ping
ReplicaMessage = Ready | Deltas | LoadReport | Pong | Refused

_encoder = msgspec.msgpack.Encoder()


def encode_frame(msg: msgspec.Struct) -> bytes:
    """One length-prefixed frame for ``msg``."""
    body = _encoder.encode(msg)
    return _LEN.pack(len(body)) + body


def router_decoder() -> msgspec.msgpack.Decoder:
    """Decoder for messages the router sends (used by replicas)."""
    return msgspec.msgpack.Decoder(RouterMessage)


def replica_decoder() -> msgspec.msgpack.Decoder:
    """Decoder for messages replicas send (used by the router)."""
    return msgspec.msgpack.Decoder(ReplicaMessage)


class FrameDecoder:
    """Splits a byte stream into frames; feed bytes, iterate messages."""

    __slots__ = ("_buf", "_decoder")

    def __init__(self, decoder: msgspec.msgpack.Decoder) -> None:
        self._buf = bytearray()
        self._decoder = decoder

    def feed(self, data: bytes) -> list:
        buf = self._buf
        buf += data
        out = []
        pos = 0
        n = len(buf)
        with memoryview(buf) as view:
            while n - pos >= 4:
                (size,) = _LEN.unpack_from(buf, pos)
                if size > MAX_FRAME:
                    raise ValueError(f"frame of {size} bytes exceeds the {MAX_FRAME} limit")
                if n - pos - 4 < size:
                    break
                start = pos + 4
                out.append(self._decoder.decode(view[start : start + size]))
                pos = start + size
        if pos:
            del buf[:pos]
        return out
