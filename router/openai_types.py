"""OpenAI request bodies, decoded strictly with msgspec.

Every field the official SDK can send is declared, so an unknown field is a
client mistake and gets a 400 naming it (OpenAI does the same). Fields we do
not implement are declared too, and ``unsupported()`` names the first one set
to anything but its neutral value: never a silent ignore.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Iterator
from typing import Annotated, Any, Literal, get_args

import msgspec

from replicas.protocol import REFUSED_TEMPLATE_KWARGS, SamplingParams
from router.entry_keys import LOC as _LOC
from router.entry_keys import key_of_entry
from router.errors import BadRequest, clip
from router.json_parity import FLOAT_FOR_INT, FRACTION, integral_floats, lone_surrogate, without_bom
from router.vllm_noops import CHAT_DEFAULTS, COMPLETION_DEFAULTS, VllmFields, not_default, not_default_message

__all__ = ["ChatRequest", "CompletionRequest", "decode_request", "to_params", "chat_messages", "chat_message_slices",
           "chat_template_kwargs", "MAX_TEMPLATE_KWARGS_BYTES", "usage_options"]

# Stop strings a request may set. OpenAI caps them at 4; vLLM takes any
# number, and agent frameworks written for it send more. Each one costs
# every token of the stream a search wherever stop strings are matched (a
# replica's detokenizer, the router's splice onto an upstream), about 0.2 us
# a token per stop string: 32 add ~6 us a token, 64 would add ~12 us, a
# third of the router's whole per-token cost (README, "Stop sequences").
MAX_STOP = 32

# An integer the replica protocol (msgpack) can carry. A larger one is a 400
# naming its field here, not a failure to encode it after dispatch.
Int = Annotated[int, msgspec.Meta(ge=-(2**63), le=2**63 - 1)]
MAX_TOKEN_ID = 2**32 - 1
# A token id: a prompt's, a stop's (a bool is no int to msgspec)
TokenId = Annotated[int, msgspec.Meta(ge=0, le=MAX_TOKEN_ID)]


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage so far on every chunk too
    include_obfuscation: bool | None = None  # (OpenAI pads chunks against side channels; accepted, no padding)


class _Common(VllmFields, forbid_unknown_fields=True, kw_only=True):
    model: str
    stream: bool | None = False  # (null: false, as OpenAI takes it)
    stream_options: StreamOptions | None = None
    max_tokens: Int | None = None
    temperature: float | None = None
    top_p: float | None = None
    n: Int | None = None
    stop: str | list[str] | None = None
    seed: Int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: Any = None
    user: str | None = None
    # vLLM extensions the router passes on
    top_k: Int | None = None
    min_p: float | None = None
    min_tokens: Int | None = None
    ignore_eos: bool | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool | None = None


# reasoning_effort's values in vLLM 0.32 (another is a 400 there too); it goes to the chat template as vLLM's
# server passes it (replicas.chat_template), and to an upstream as sent
REASONING_EFFORTS = Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"]
# a field's values, listed in its 400 (msgspec names only the value it refused)
_CHOICES = {"reasoning_effort": ", ".join(get_args(REASONING_EFFORTS))}


# gc=False: decoded from JSON, a message is in no reference cycle, and a
# body of 120,000 of them left as many objects for each cycle collection
class ChatMessage(msgspec.Struct, kw_only=True, gc=False):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: Any = None
    tool_call_id: str | None = None
    refusal: Any = None
    # an assistant turn's other parts the SDK sends back (ChatCompletionAssistantMessageParam):
    # none has text the template could show, so one that is set is refused, not dropped
    function_call: Any = None
    audio: Any = None


class ChatRequest(_Common, kw_only=True):
    messages: list[ChatMessage]
    max_completion_tokens: Int | None = None
    top_logprobs: Int | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: Any = None
    function_call: Any = None
    response_format: Any = None
    # accepted and ignored, but typed as OpenAI types them: a client's mistake is a 400, not ignored twice
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    modalities: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    verbosity: Any = None
    moderation: Any = None
    # hints for OpenAI's own service, accepted and ignored as ``user`` is
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: Any = None
    prompt_cache_options: Any = None
    reasoning_effort: REASONING_EFFORTS | None = None
    # vLLM's extension the router passes on, kept as sent (its JSON) by the
    # body's decode: decoded with it, 1.2 MB of nested lists took up to a
    # second of the event loop. ``decode_request`` checks its size, then
    # puts its decoded value (a dict or None) here in place of the JSON.
    chat_template_kwargs: msgspec.Raw = msgspec.Raw()
    # vLLM's chat fields this server lacks, taken at vLLM's default (router.vllm_noops)
    echo: Any = None
    add_generation_prompt: Any = None
    bad_words: Any = None
    continue_final_message: Any = None
    documents: Any = None
    chat_template: Any = None
    mm_processor_kwargs: Any = None
    include_reasoning: Any = None


class CompletionRequest(_Common, kw_only=True):
    prompt: str | list[Any]
    """Text, [text], token ids, or [token ids]; checked by ``router.prompt.completion_prompt``."""
    best_of: Int | None = None
    echo: bool | None = None
    suffix: str | None = None


_UNSUPPORTED_NEUTRAL: dict[str, Any] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "suffix": (None, ""),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "logit_bias": (None, {}),
    "tools": (None,),
    "tool_choice": (None, "none"),
    "parallel_tool_calls": (None, True, False),  # (without tools it asks for nothing)
    "functions": (None,),
    "function_call": (None, "none"),
    "response_format": (None, {"type": "text"}),
    "modalities": (None, ["text"]),
    "audio": (None,),
    "prediction": (None,),
    "web_search_options": (None,),
    "verbosity": (None, "medium"),  # (OpenAI's default)
    "moderation": (None,),
}
# The least value of options an integer sets, supported or not: below it a
# value is invalid anywhere (OpenAI's 400 naming it), not an option this
# server lacks. (vLLM: best_of at least n, so at least 1; a completion's
# logprobs counts logprobs to return.)
_LEAST = {"n": 1, "best_of": 1, "top_logprobs": 0}
_LEAST_COMPLETION = {**_LEAST, "logprobs": 0}


def _fields_of(names, kind: type[_Common]) -> tuple[tuple[str, ...], Any]:
    """Those of ``names`` a request of ``kind`` has, in their order, and the
    getter of their values: one call, where a ``getattr`` each was ~20
    calls per request (a name the kind lacks was None there: never set)."""
    have = tuple(n for n in names if n in kind.__struct_fields__)
    assert len(have) > 1, have  # (attrgetter of one name gives the value, not a tuple)
    return have, operator.attrgetter(*have)


_LEAST_OF = {kind: (least, *_fields_of(least, kind)) for kind, least in
             ((ChatRequest, _LEAST), (CompletionRequest, _LEAST_COMPLETION))}
_UNSUPPORTED_OF = {kind: _fields_of(_UNSUPPORTED_NEUTRAL, kind) for kind in (ChatRequest, CompletionRequest)}


def _check_least(req: _Common) -> None:
    least, names, values = _LEAST_OF[type(req)]
    for name, value in zip(names, values(req)):
        lo = least[name]
        if type(value) is int and value < lo:  # (a bool is no count: a chat's logprobs false)
            raise BadRequest(f"'{name}' must be at least {lo}; got {value}.", param=name)


def _unsupported(req: _Common) -> str | None:
    names, values = _UNSUPPORTED_OF[type(req)]
    for name, value in zip(names, values(req)):
        neutral = _UNSUPPORTED_NEUTRAL[name]
        # (type and value: a completion's logprobs 0 asks for the sampled
        # token's logprob, where a chat's false asks for nothing; 0 == False)
        if value is not None and not any(type(value) is type(n) and value == n for n in neutral):
            return name
    return None


def _unsupported_message(req: _Common, name: str) -> str:
    """Why ``name`` is refused, with the one value of a count taken (n 1):
    n 129 is no more unsupported than 2 (the replicas take n 1, and vLLM
    sets n no maximum), so no range such as OpenAI's 1 to 128 is claimed."""
    value = getattr(req, name)
    most = next((n for n in _UNSUPPORTED_NEUTRAL[name] if type(n) is int), None)
    if type(value) is int and most is not None:
        return f"'{name}' is not supported by this server beyond {most}; got {value}."
    return f"'{name}' is not supported by this server."


def _invalid(e: msgspec.ValidationError | msgspec.DecodeError | RecursionError, at: str = "",
             body: bytes | None = None, kind: type[_Common] | None = None) -> BadRequest:
    """The 400 of a body msgspec refused (``body``, decoded as ``kind``: a
    dict entry's error is named by its key), or of its field ``at`` (decoded
    on its own, ``_template_kwargs``: msgspec's location in it is relative)."""
    if isinstance(e, RecursionError):
        return BadRequest("The request body is nested too deeply.", param=at or None, code="invalid_json")
    text = str(e)
    if isinstance(e, msgspec.DecodeError) and not isinstance(e, msgspec.ValidationError):
        if text == "Input data was truncated":  # (msgspec's words for an unpaired surrogate escape too)
            text += " (it ends early, or a string holds an unpaired surrogate escape such as \\ud800)"
        return BadRequest(f"The request body is not valid JSON: {text}", param=at or None, code="invalid_json")
    m = _LOC.search(text)
    param = (at + m.group(1)).lstrip(".") if m else at
    reason = text[: m.start()] if m else text
    if FLOAT_FOR_INT.match(reason):  # (one integral_floats did not make whole: 3.5)
        reason = FRACTION
    if body is not None and kind is not None and "[...]" in param:
        param = key_of_entry(body, kind, param, reason)
    if not param and reason.startswith("Expected `object`"):
        return BadRequest("The request body must be a JSON object.", code="invalid_json")
    unknown = re.match(r"Object contains unknown field `([^`]+)`", reason)
    if unknown:
        name = (param + "." if param else "") + unknown.group(1)
        return BadRequest(f"Unrecognized request argument supplied: {clip(name)}", param=name,
                          code="unknown_parameter")
    missing = re.match(r"Object missing required field `([^`]+)`", reason)
    if missing:
        name = (param + "." if param else "") + missing.group(1)
        return BadRequest(f"Missing required parameter: '{clip(name)}'.", param=name)
    if param in _CHOICES:
        reason = reason.removeprefix("Invalid enum value ")
        return BadRequest(f"Invalid value for '{param}': {clip(reason, 300)}; expected one of {_CHOICES[param]}.",
                          param=param)
    return BadRequest(f"Invalid value for '{clip(param)}': {clip(reason, 300)}.", param=param or None)


def _lax(body: bytes, kind: type[_Common], e: msgspec.DecodeError | RecursionError) -> _Common:
    """The request of a body msgspec refused with ``e`` that vLLM takes
    (whole numbers written as floats, ``router.json_parity``), or its 400."""
    fixed = integral_floats(body, kind, str(e)) if isinstance(e, msgspec.ValidationError) else None
    refused = body
    if fixed is not None:
        try:
            return msgspec.json.decode(fixed, type=kind)
        except (msgspec.DecodeError, RecursionError) as again:
            e, refused = again, fixed
    if isinstance(e, msgspec.DecodeError) and not isinstance(e, msgspec.ValidationError):
        lone = lone_surrogate(refused, str(e))  # (msgspec's words say where: a few bytes read)
        if lone is not None:
            raise BadRequest(lone[0], param=lone[1], code="invalid_json") from e
    raise _invalid(e, body=body, kind=kind) from e


def decode_request(body: bytes, kind: type[ChatRequest] | type[CompletionRequest]):
    """Decode and check a request body; ``BadRequest`` names the faulty field.
    A chat's ``chat_template_kwargs`` are decoded here too, after their size
    is checked (``_template_kwargs``): what the body's decode would have
    refused in them is refused with it, before any other check."""
    if not body:
        raise BadRequest("The request body is empty; send a JSON object.", code="invalid_json")
    body = without_bom(body)  # (vLLM takes it: router.json_parity)
    try:
        req = msgspec.json.decode(body, type=kind)
    except (msgspec.DecodeError, RecursionError) as e:  # (ValidationError is a DecodeError)
        req = _lax(body, kind, e)
    if isinstance(req, ChatRequest):
        req.chat_template_kwargs = _template_kwargs(req.chat_template_kwargs)
    _check_least(req)
    bad = _unsupported(req)
    if bad is not None:
        raise BadRequest(_unsupported_message(req, bad), param=bad, code="unsupported_parameter")
    defaults = CHAT_DEFAULTS if isinstance(req, ChatRequest) else COMPLETION_DEFAULTS
    bad = not_default(req, defaults)  # (vLLM's fields this server lacks: router.vllm_noops)
    if bad is not None:
        raise BadRequest(not_default_message(bad, defaults), param=bad, code="unsupported_parameter")
    if req.stream is None:
        req.stream = False
    return req


def usage_options(req: ChatRequest | CompletionRequest) -> tuple[bool, bool]:
    """(a usage chunk before ``[DONE]``, the usage so far on every chunk too)
    as ``stream_options`` asks; as in vLLM, ``continuous_usage_stats`` counts
    only together with ``include_usage``."""
    so = req.stream_options
    if so is None or not so.include_usage:
        return False, False
    return True, so.continuous_usage_stats


def _check_range(name: str, value: float | int | None, lo: float, hi: float) -> None:
    if value is not None and not (lo <= value <= hi):
        raise BadRequest(f"'{name}' must be between {lo} and {hi}; got {value}.", param=name)


def to_params(req: ChatRequest | CompletionRequest, default_max_tokens: int) -> SamplingParams:
    """Sampling parameters for the replica; ``BadRequest`` on out-of-range values."""
    max_tokens, name = req.max_tokens, max_tokens_param(req, default_max_tokens)
    if name == "max_completion_tokens":
        max_tokens = req.max_completion_tokens  # type: ignore[union-attr]
    defaulted = max_tokens is None
    if defaulted:
        # (never below the client's min_tokens: vLLM's unset max_tokens is the context's remainder)
        max_tokens = max(default_max_tokens, req.min_tokens or 0)
    if max_tokens < 1:
        raise BadRequest(f"'{name}' must be at least 1; got {max_tokens}.", param=name)
    _check_range("temperature", req.temperature, 0.0, 2.0)
    _check_range("top_p", req.top_p, 0.0, 1.0)
    _check_range("presence_penalty", req.presence_penalty, -2.0, 2.0)
    _check_range("frequency_penalty", req.frequency_penalty, -2.0, 2.0)
    if req.top_p is not None and req.top_p == 0.0:
        raise BadRequest("'top_p' must be greater than 0.", param="top_p")
    # vLLM's own checks of its extensions (SamplingParams._verify_args)
    if req.top_k is not None and req.top_k < -1:
        raise BadRequest(f"'top_k' must be -1 or 0 (no limit) or at least 1; got {req.top_k}.", param="top_k")
    if req.min_p is not None and not 0.0 <= req.min_p <= 1.0:
        raise BadRequest(f"'min_p' must be in [0, 1]; got {req.min_p}.", param="min_p")
    if req.repetition_penalty is not None and not 0.0 < req.repetition_penalty:  # (vLLM's only bound)
        raise BadRequest(f"'repetition_penalty' must be greater than 0; got {req.repetition_penalty}.",
                         param="repetition_penalty")
    if req.min_tokens is not None and not 0 <= req.min_tokens <= max_tokens:
        # (named as the client sent it: a chat's limit may be max_completion_tokens)
        raise BadRequest(f"'min_tokens' must be between 0 and {name} ({max_tokens}); got {req.min_tokens}.",
                         param="min_tokens")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stop) > MAX_STOP:
        raise BadRequest(f"'stop' takes at most {MAX_STOP} sequences.", param="stop")
    if any(not s for s in stop):
        raise BadRequest("'stop' sequences must not be empty.", param="stop")
    return SamplingParams.from_openai(req, max_tokens, stop, defaulted)


def max_tokens_param(req: ChatRequest | CompletionRequest, default: int) -> str:
    """The field the request's token limit came from, for errors to name:
    ``min_tokens`` when only that raised an unset limit over ``default`` (the
    request's default ``max_tokens``), else the field the limit is (an unset
    one's too: a message naming ``min_tokens`` would give it the default's value)."""
    if isinstance(req, ChatRequest) and req.max_completion_tokens is not None:
        return "max_completion_tokens"
    if req.max_tokens is None and (req.min_tokens or 0) > default:
        return "min_tokens"
    return "max_tokens"


_ROLES = ("system", "developer", "user", "assistant", "tool")


def chat_messages(req: ChatRequest) -> list[dict[str, str]]:
    """Messages for the model's chat template: role, content (text), and a
    message's ``name`` and a tool message's ``tool_call_id``, as vLLM's server has them."""
    return [m for part in chat_message_slices(req, 0) for m in part]


def chat_message_slices(req: ChatRequest, work: int) -> Iterator[list[dict[str, str]]]:
    """``chat_messages`` a slice at a time (a large body's are checked with
    a loop turn between two slices, ``router.largebody``): each slice is at
    most ``work`` units of work, a message or one of its content parts
    being one unit (0: one slice), and gives the messages it completed,
    none while one message's parts fill it."""
    if not req.messages:
        raise BadRequest("'messages' must contain at least one message.", param="messages")
    out: list[dict[str, str]] = []
    left = work or -1  # (never 0 when unsliced)
    for i, m in enumerate(req.messages):
        if not left:
            yield out
            out, left = [], work
        left -= 1
        if m.role not in _ROLES:
            raise BadRequest(
                f"Invalid value for 'messages[{i}].role': {clip(repr(m.role))}; expected one of {', '.join(_ROLES)}.",
                param=f"messages[{i}].role",
            )
        if m.tool_calls:  # (an empty list asks for nothing)
            raise BadRequest("Tool calls are not supported by this server.", param=f"messages[{i}].tool_calls")
        # (null, as the SDK's own message objects send them back, asks for nothing)
        for key in ("function_call", "audio", "refusal"):
            if getattr(m, key):
                raise BadRequest(f"'messages[{i}].{key}' is not supported by this server (the model would not "
                                 "see it).", param=f"messages[{i}].{key}")
        content = m.content
        if content is None and m.role != "assistant":  # an assistant turn may be all tool calls
            raise BadRequest(f"Missing required parameter: 'messages[{i}].content'.", param=f"messages[{i}].content")
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if not left:
                    yield out
                    out, left = [], work
                left -= 1
                if part.get("type") != "text":
                    at = f"messages[{i}].content[{j}]"
                    raise BadRequest(f"Only text content parts are supported; '{at}' has type "
                                     f"{clip(repr(part.get('type')))}.", param=f"{at}.type")
                text = part.get("text")
                if not isinstance(text, str):
                    at = f"messages[{i}].content[{j}]"
                    raise BadRequest(f"Missing required parameter: '{at}.text' (a string).", param=f"{at}.text")
                parts.append(text)
            content = "\n".join(parts)  # (as vLLM joins a message's text parts)
        out.append(msg := {"role": m.role, "content": content or ""})
        if m.role == "tool" and m.tool_call_id is not None:
            msg["tool_call_id"] = m.tool_call_id
        if m.name is not None:
            msg["name"] = m.name
    yield out


# How deep ``chat_template_kwargs`` may nest: far more than a template takes
# (tools, documents), and shallow enough for the replica protocol to encode.
MAX_TEMPLATE_DEPTH = 32
# How large ``chat_template_kwargs`` may be, as sent (README, "Request
# limits"): they are a template's switches ({"enable_thinking": false}),
# and this bounds the router's work on them (decode, checks, estimate, the
# frame to the replica) to about 2 ms, whatever their shape (1.2 MB of
# nested lists took 0.5-1.4 s: the decode, as the collector walked its
# objects more than once, and the check of their depth).
# A constant, not a setting: it protects the event loop every tenant's
# streams share, as LARGE_BODY and SLICE do, and no template needs more.
MAX_TEMPLATE_KWARGS_BYTES = 16 * 1024


def _template_kwargs(raw: msgspec.Raw) -> dict[str, Any] | None:
    """``chat_template_kwargs`` as sent (``raw``), decoded. A 400 naming the
    field past ``MAX_TEMPLATE_KWARGS_BYTES`` (decided on their length, before
    any decode), and for what the body's decode refused in them before they
    were kept raw, in the same words: invalid UTF-8 (``invalid_json``),
    anything but an object or null, a number no float holds."""
    name = "chat_template_kwargs"
    if len(raw) > MAX_TEMPLATE_KWARGS_BYTES:
        raise BadRequest(f"'{name}' is {len(raw):,} bytes; it may be at most {MAX_TEMPLATE_KWARGS_BYTES:,} bytes "
                         "(a chat template's switches, such as {\"enable_thinking\": false}).", param=name,
                         code="chat_template_kwargs_too_large")
    if not raw:
        return None
    try:
        return msgspec.json.decode(raw, type=dict[str, Any] | None)
    except (msgspec.DecodeError, RecursionError) as e:  # (RecursionError: at msgspec's limit, as for the body)
        raise _invalid(e, name) from e


def chat_template_kwargs(req: ChatRequest) -> dict[str, Any] | None:
    """vLLM's ``chat_template_kwargs``: extra variables for the model's chat
    template (``{"enable_thinking": false}``), passed on as sent; None when
    there are none. ``decode_request`` decoded them (and refused them past
    ``MAX_TEMPLATE_KWARGS_BYTES`` or as anything but an object); here a
    400 naming the field for what no replica should take: the keys vLLM
    refuses (``chat_template``, ``tokenize``), an integer the replica
    protocol cannot carry, nesting past ``MAX_TEMPLATE_DEPTH``."""
    kwargs: dict[str, Any] | None = req.chat_template_kwargs  # type: ignore[assignment]
    name = "chat_template_kwargs"
    if not kwargs:
        return None
    refused = REFUSED_TEMPLATE_KWARGS & kwargs.keys()
    if refused:
        raise BadRequest(f"'{name}' must not set {', '.join(sorted(refused))} (vLLM refuses them too).", param=name)
    # (a level at a time: each value is looked at once, with no tuple or generator per value)
    level: list[Any] = [kwargs]
    depth = 1
    while level:
        below: list[Any] = []
        for value in level:
            kind = type(value)
            if kind is dict or kind is list:
                if depth > MAX_TEMPLATE_DEPTH:
                    raise BadRequest(f"'{name}' is nested more than {MAX_TEMPLATE_DEPTH} levels deep.", param=name,
                                     code="chat_template_kwargs_too_deep")
                below.extend(value.values() if kind is dict else value)
            elif kind is int and not -(2**63) <= value <= 2**64 - 1:
                raise BadRequest(f"'{name}' holds an integer out of the 64-bit range.", param=name)
        level = below
        depth += 1
    return kwargs
