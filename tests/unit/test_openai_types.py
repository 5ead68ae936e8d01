"""Request decoding: what is refused as unsupported, and what asks for nothing."""

import json

import pytest

from router.errors import BadRequest
from router.prompt import completion_prompt
from router.openai_types import (
    MAX_STOP,
    ChatRequest,
    CompletionRequest,
    StreamOptions,
    chat_messages,
    chat_template_kwargs,
    decode_request,
    max_tokens_param,
    to_params,
)

MSG = [{"role": "user", "content": "hi"}]


def chat(**kw):
    return decode_request(json.dumps({"model": "m", "messages": MSG, **kw}).encode(), ChatRequest)


def completion(**kw):
    return decode_request(json.dumps({"model": "m", "prompt": "hi", **kw}).encode(), CompletionRequest)


@pytest.mark.parametrize("kw", [
    {"stream": None}, {"logit_bias": {}}, {"parallel_tool_calls": False}, {"parallel_tool_calls": True},
    {"logprobs": False}, {"top_logprobs": 0}, {"n": 1}, {"tools": None}, {"tool_choice": "none"},
    {"response_format": {"type": "text"}}, {"verbosity": "medium"},
    # OpenAI's service hints: nothing this server does changes with them
    {"safety_identifier": "u-1"}, {"prompt_cache_key": "k"}, {"prompt_cache_retention": "24h"},
    {"prompt_cache_options": {"ttl": "24h"}},
    {"stream": True, "stream_options": {"include_usage": True, "include_obfuscation": False}},
], ids=lambda kw: json.dumps(kw))
def test_values_that_ask_for_nothing_are_accepted(kw):
    # (OpenAI takes them; SDKs and frameworks send some of them by default)
    assert isinstance(chat(**kw), ChatRequest)


def test_a_null_stream_does_not_stream():
    assert chat(stream=None).stream is False
    assert completion(stream=None).stream is False


@pytest.mark.parametrize("make, kw, name", [
    (chat, {"n": 2}, "n"),
    (chat, {"logprobs": True}, "logprobs"),
    (chat, {"logit_bias": {"50256": -100}}, "logit_bias"),
    (chat, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
    (chat, {"tools": [{"type": "function", "function": {"name": "f"}}], "parallel_tool_calls": False}, "tools"),
    (completion, {"logprobs": 0}, "logprobs"),  # the sampled token's logprob: not a silent ignore
    (completion, {"logprobs": 3}, "logprobs"),
    (completion, {"echo": True}, "echo"),
    (completion, {"best_of": 2}, "best_of"),
    (chat, {"verbosity": "low"}, "verbosity"),
    (chat, {"moderation": {"model": "omni-moderation-latest"}}, "moderation"),
], ids=lambda v: json.dumps(v) if isinstance(v, dict) else getattr(v, "__name__", str(v)))
def test_options_this_server_cannot_honour_are_a_400_naming_them(make, kw, name):
    with pytest.raises(BadRequest) as info:
        make(**kw)
    assert info.value.param == name and info.value.code == "unsupported_parameter", info.value


def test_an_assistant_message_with_no_tool_calls_is_a_message():
    req = chat(messages=[*MSG, {"role": "assistant", "content": "hello", "tool_calls": []},
                         {"role": "user", "content": "again"}])
    assert [m["content"] for m in chat_messages(req)] == ["hi", "hello", "again"]
    req = chat(messages=[*MSG, {"role": "assistant", "content": None,
                                "tool_calls": [{"id": "c", "type": "function",
                                                "function": {"name": "f", "arguments": "{}"}}]}])
    with pytest.raises(BadRequest) as info:
        chat_messages(req)
    assert info.value.param == "messages[1].tool_calls"


@pytest.mark.parametrize("key, value", [
    ("function_call", {"name": "get_weather", "arguments": "{}"}),
    ("refusal", "I can't help with that."),
    ("audio", {"id": "audio_abc123"}),
])
def test_an_assistant_turn_the_template_cannot_show_is_refused_not_dropped(key, value):
    # (dropped, the model saw an empty assistant turn where the client sent a call or a refusal)
    req = chat(messages=[*MSG, {"role": "assistant", "content": None, key: value}, {"role": "user", "content": "so?"}])
    with pytest.raises(BadRequest) as info:
        chat_messages(req)
    assert info.value.param == f"messages[1].{key}"
    # null, as the SDK's message objects carry them back, asks for nothing
    req = chat(messages=[*MSG, {"role": "assistant", "content": "hello", key: None}])
    assert [m["content"] for m in chat_messages(req)] == ["hi", "hello"]


@pytest.mark.parametrize("kw, name", [
    ({"store": "true"}, "store"), ({"metadata": "x"}, "metadata"), ({"metadata": {"a": 1}}, "metadata.a"),
    ({"metadata": {"a": "b", "c": None}}, "metadata.c"),
    ({"service_tier": 5}, "service_tier"), ({"reasoning_effort": ["low"]}, "reasoning_effort"),
])
def test_ignored_fields_of_the_wrong_type_are_a_400(kw, name):
    with pytest.raises(BadRequest) as info:
        chat(**kw)
    assert info.value.param == name, info.value
    chat(store=True, metadata={"a": "b"}, service_tier="auto", reasoning_effort="low")
    chat(store=None, metadata=None, service_tier=None, reasoning_effort=None)


@pytest.mark.parametrize("make, kw, most", [
    (chat, {"n": 2}, 1), (chat, {"n": 129}, 1), (completion, {"n": 2**63 - 1}, 1),
    (completion, {"best_of": 21}, 1), (chat, {"top_logprobs": 21}, 0), (chat, {"top_logprobs": 3}, 0),
], ids=lambda v: json.dumps(v) if isinstance(v, dict) else getattr(v, "__name__", str(v)))
def test_a_count_above_what_this_server_takes_is_unsupported_and_says_what_it_takes(make, kw, most):
    # (the replicas take n 1 and no logprobs: 129 is no more unsupported
    # than 2, and vLLM sets n no maximum, so no range of 1 to 128 is
    # claimed; the message says the most this server takes)
    (name, value), = kw.items()
    with pytest.raises(BadRequest) as info:
        make(**kw)
    assert info.value.param == name and info.value.code == "unsupported_parameter", info.value
    assert str(info.value) == f"'{name}' is not supported by this server beyond {most}; got {value}.", info.value


@pytest.mark.parametrize("make, kw, name, least", [
    (chat, {"n": 0}, "n", 1), (chat, {"n": -2}, "n", 1), (completion, {"n": 0}, "n", 1),
    (completion, {"best_of": 0}, "best_of", 1), (chat, {"top_logprobs": -1}, "top_logprobs", 0),
    (completion, {"logprobs": -1}, "logprobs", 0),
], ids=lambda v: json.dumps(v) if isinstance(v, dict) else getattr(v, "__name__", str(v)))
def test_an_option_below_its_least_value_is_an_invalid_value_not_an_unsupported_one(make, kw, name, least):
    # ('n': 0 was "'n' is not supported by this server": no value of n is
    # below 1 at OpenAI, whatever a server supports)
    with pytest.raises(BadRequest) as info:
        make(**kw)
    assert info.value.param == name and info.value.code is None, info.value
    assert str(info.value) == f"'{name}' must be at least {least}; got {kw[name]}.", info.value


@pytest.mark.parametrize("kw, name, reason", [
    ({"metadata": {"a": 1}}, "metadata.a", "Expected `str`, got `int`"),
    ({"metadata": {"ok": "x", "b.c": ["y"]}}, "metadata.b.c", "Expected `str`, got `array`"),
    ({"logit_bias": {"50256": "x"}}, "logit_bias.50256", "Expected `float`, got `str`"),
])
def test_a_bad_dict_entry_is_named_by_its_key(kw, name, reason):
    # (msgspec says `metadata[...]`; the config's errors name the key: so do these)
    with pytest.raises(BadRequest) as info:
        chat(messages=MSG * 3, **kw)
    assert info.value.param == name, info.value
    assert str(info.value) == f"Invalid value for '{name}': {reason}.", info.value


@pytest.mark.parametrize("field, raw, name, reason", [
    ("metadata", '{"a": 1, "a": "x"}', "metadata.a", "Expected `str`, got `int`"),
    ("metadata", '{"a": "x", "a": 1}', "metadata.a", "Expected `str`, got `int`"),
    ("metadata", '{"b": 1, "a": "x", "b": "y"}', "metadata.b", "Expected `str`, got `int`"),
    ("logit_bias", '{"1": "x", "1": 2.0}', "logit_bias.1", "Expected `float`, got `str`"),
    ("logit_bias", '{"1" : 2.0 ,\n "2":3, "1":\t"x"}', "logit_bias.1", "Expected `float`, got `str`"),
])
def test_a_bad_entry_of_a_key_sent_twice_is_named_by_its_key_wherever_it_stands(field, raw, name, reason):
    # The body's decode judges every occurrence of a key, as it does a
    # top-level field sent twice ('"n": "x", "n": 1' is a 400): a bad
    # one is refused even where a later one is good. Its key was looked
    # for among the last values only, so a bad first one was `metadata[...]`.
    body = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "' + field.encode() + b'": '
    with pytest.raises(BadRequest) as info:
        decode_request(body + raw.encode() + b"}", ChatRequest)
    assert info.value.param == name, info.value
    assert str(info.value) == f"Invalid value for '{name}': {reason}.", info.value
    # (good values sent twice: the last is kept, as JSON decoders do)
    good = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "metadata": {"a": "x", "a": "y"}}'
    assert decode_request(good, ChatRequest).metadata == {"a": "y"}


def test_a_bad_entry_is_named_among_thousands_and_a_field_past_the_bound_keeps_msgspecs_words():
    # (the key was found by decoding the whole field to Python objects and
    # walking it: 330,000 entries of logit_bias held the loop for 1.5 s)
    with pytest.raises(BadRequest) as info:
        chat(messages=MSG, logit_bias={**{str(i): 1.0 for i in range(4000)}, "z": "x"})
    assert info.value.param == "logit_bias.z", info.value
    with pytest.raises(BadRequest) as info:
        chat(messages=MSG, logit_bias={str(i): "x" for i in range(20000)})
    assert info.value.param == "logit_bias[...]", info.value


def _sdk_keys(params) -> set[str]:
    keys: set[str] = set()
    for base in params.__mro__:
        keys |= set(getattr(base, "__annotations__", {}))
    return keys


def test_every_argument_of_the_installed_sdk_is_a_declared_field():
    # An argument the SDK sends that is not declared is a 400 "Unrecognized
    # request argument" for every client that uses it (safety_identifier,
    # verbosity, prompt_cache_key and stream_options.include_obfuscation were).
    from openai.types import completion_create_params as completion_params
    from openai.types.chat import ChatCompletionStreamOptionsParam
    from openai.types.chat import completion_create_params as chat_params

    for params, kind in ((chat_params.CompletionCreateParamsBase, ChatRequest),
                         (completion_params.CompletionCreateParamsBase, CompletionRequest),
                         (ChatCompletionStreamOptionsParam, StreamOptions)):
        assert not _sdk_keys(params) - set(kind.__struct_fields__), (kind.__name__, _sdk_keys(params))


# vLLM's extensions the router takes (README, "vLLM sampling extras"): declared,
# so the SDK's extra_body with them is no 400 for an unknown field
VLLM_EXTRAS = {"top_k", "min_p", "min_tokens", "ignore_eos", "repetition_penalty", "stop_token_ids",
               "include_stop_str_in_output"}
VLLM_CHAT_EXTRAS = {"chat_template_kwargs"}


def test_the_vllm_extensions_taken_are_declared_fields():
    assert VLLM_EXTRAS <= set(CompletionRequest.__struct_fields__)
    assert VLLM_EXTRAS | VLLM_CHAT_EXTRAS <= set(ChatRequest.__struct_fields__)


@pytest.mark.parametrize("make, kw, name", [
    (chat, {"guided_json": {"type": "object"}}, "guided_json"),
    (completion, {"chat_template_kwargs": {"enable_thinking": False}}, "chat_template_kwargs"),  # (chat only, as vLLM)
    (completion, {"add_generation_prompt": True}, "add_generation_prompt"),  # (chat only, as vLLM)
    (completion, {"bad_words": ["x"]}, "bad_words"),  # (chat only, as vLLM)
    (chat, {"frobnicate": 1}, "frobnicate"),
    (chat, {"stream_options": {"include_usage": True, "frobnicate": 1}}, "stream_options.frobnicate"),
], ids=lambda v: json.dumps(v) if isinstance(v, dict) else getattr(v, "__name__", str(v)))
def test_unknown_arguments_are_a_400_naming_them_with_a_code(make, kw, name):
    with pytest.raises(BadRequest) as info:
        make(**kw)
    e = info.value
    assert e.param == name and "Unrecognized request argument" in e.message and e.code == "unknown_parameter", e


# vLLM request fields the router does not implement, each at vLLM's default
# (vllm/entrypoints/openai/.../protocol.py): asking for nothing, accepted
VLLM_DEFAULTS_BOTH = {"skip_special_tokens": True, "spaces_between_special_tokens": True, "priority": 0,
                      "truncate_prompt_tokens": None, "use_beam_search": False, "length_penalty": 1.0,
                      "prompt_logprobs": None, "allowed_token_ids": None,
                      "return_tokens_as_token_ids": False, "cache_salt": None, "structured_outputs": None,
                      "vllm_xargs": None, "kv_transfer_params": None, "logits_processors": None}
VLLM_DEFAULTS_CHAT = {**VLLM_DEFAULTS_BOTH, "echo": False, "add_generation_prompt": True, "bad_words": [],
                      "continue_final_message": False, "add_special_tokens": False, "documents": None,
                      "chat_template": None, "mm_processor_kwargs": None, "include_reasoning": True}
VLLM_DEFAULTS_COMPLETION = {**VLLM_DEFAULTS_BOTH, "add_special_tokens": True}


@pytest.mark.parametrize("make, defaults", [(chat, VLLM_DEFAULTS_CHAT), (completion, VLLM_DEFAULTS_COMPLETION)],
                         ids=["chat", "completion"])
def test_vllm_fields_not_implemented_are_accepted_at_vllms_default(make, defaults):
    # (they were a 400 "Unrecognized request argument", code null, whatever
    # the value: a client sending vLLM's defaults explicitly was refused)
    req = make(**defaults)
    assert to_params(req, 16) == to_params(make(), 16)
    make(**{name: None for name in defaults})  # (unset: as absent)
    make(length_penalty=1, priority=0)  # (a number, as vLLM's pydantic takes it)


@pytest.mark.parametrize("make, kw, default", [
    (chat, {"skip_special_tokens": False}, "true"),
    (chat, {"add_generation_prompt": False}, "true"),
    (chat, {"echo": True}, "false"),
    (chat, {"priority": 5}, "0"),
    (completion, {"priority": -1}, "0"),
    (chat, {"truncate_prompt_tokens": 100}, "null"),
    (completion, {"add_special_tokens": False}, "true"),
    (chat, {"add_special_tokens": True}, "false"),
    (chat, {"bad_words": ["x"]}, "[]"),
    (chat, {"skip_special_tokens": 1}, "true"),  # (1 is no bool)
], ids=lambda v: json.dumps(v) if isinstance(v, dict) else getattr(v, "__name__", str(v)))
def test_vllm_fields_not_implemented_are_refused_at_other_values_naming_them(make, kw, default):
    ((name, _),) = kw.items()
    with pytest.raises(BadRequest) as info:
        make(**kw)
    e = info.value
    assert e.param == name and e.code == "unsupported_parameter", e
    assert e.message == f"'{name}' is not supported by this server; only vLLM's default ({default}) is taken.", e


def test_include_stop_str_in_output_reaches_the_replica():
    # (vLLM's extension, sent as the openai SDK's extra_body; it was a 400 as an unknown field)
    assert to_params(chat(include_stop_str_in_output=True, stop=["x"]), 16).include_stop_str_in_output is True
    assert to_params(completion(include_stop_str_in_output=True), 16).include_stop_str_in_output is True
    for kw in ({}, {"include_stop_str_in_output": False}, {"include_stop_str_in_output": None}):
        assert to_params(chat(**kw), 16).include_stop_str_in_output is False, kw
    for bad in ("true", 1, [True]):
        with pytest.raises(BadRequest) as info:
            chat(include_stop_str_in_output=bad)
        assert info.value.param == "include_stop_str_in_output", bad


def test_chat_template_kwargs_are_passed_on_as_sent():
    kwargs = {"enable_thinking": False, "documents": [{"title": "t", "text": "x" * 3}], "n": 2**64 - 1}
    assert chat_template_kwargs(chat(chat_template_kwargs=kwargs)) == kwargs
    for empty in ({}, None):
        assert chat_template_kwargs(chat(chat_template_kwargs=empty)) is None
    assert chat_template_kwargs(chat()) is None


@pytest.mark.parametrize("value, says", [
    ([{"enable_thinking": False}], "Expected `object | null`, got `array`"),
    ("enable_thinking=false", "Expected `object | null`, got `str`"),
    (True, "Expected `object | null`, got `bool`"),
    ({"tokenize": True}, "must not set tokenize"),  # (vLLM refuses both)
    ({"chat_template": "{{ 'x' }}", "tokenize": False}, "must not set chat_template, tokenize"),
    ({"seed": 2**64}, "out of the 64-bit range"),  # (the replica protocol could not carry it)
    ({"a": [[[{"b": -(2**63) - 1}]]]}, "out of the 64-bit range"),
    ({"a": json.loads("[" * 40 + "]" * 40)}, "nested more than 32 levels"),
], ids=lambda v: json.dumps(v)[:40] if not isinstance(v, str) else v[:40])
def test_chat_template_kwargs_that_no_replica_takes_are_a_400_naming_the_field(value, says):
    with pytest.raises(BadRequest) as info:
        chat_template_kwargs(chat(chat_template_kwargs=value))
    err = json.loads(info.value.body())["error"]
    assert (err["param"], err["type"], info.value.status) == ("chat_template_kwargs", "invalid_request_error", 400)
    assert says in err["message"], err


def test_text_parts_are_joined_as_vllm_joins_them():
    req = chat(messages=[{"role": "user", "content": [{"type": "text", "text": "ab"}, {"type": "text", "text": "cd"}]}])
    assert chat_messages(req)[0]["content"] == "ab\ncd"


@pytest.mark.parametrize("kw, name", [
    ({"top_k": -5}, "top_k"), ({"min_p": -0.1}, "min_p"), ({"min_p": 1.5}, "min_p"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"), ({"min_tokens": -1}, "min_tokens"),
    ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"), ({"max_tokens": 0}, "max_tokens"),
], ids=lambda v: json.dumps(v) if isinstance(v, dict) else v)
def test_out_of_range_values_are_a_400_naming_the_field_the_client_set(kw, name):
    # (vLLM's SamplingParams refuses these; they reached the engines as sent)
    with pytest.raises(BadRequest) as info:
        to_params(chat(**kw), 16)
    assert info.value.param == name, info.value


@pytest.mark.parametrize("kw", [{"top_k": -1}, {"top_k": 0}, {"top_k": 5}, {"repetition_penalty": 1.2},
                                {"min_tokens": 8, "max_tokens": 8}, {"min_p": 0}, {"min_p": 0.05}, {"min_p": 1}],
                         ids=json.dumps)
def test_in_range_vllm_extensions_pass(kw):
    assert to_params(chat(**kw), 16).max_tokens in (8, 16)


@pytest.mark.parametrize("value", [1e10, 1e300])
def test_repetition_penalty_has_no_upper_limit_as_in_vllm(value):
    # (vLLM takes any value over 0; a hidden limit of 1e6 refused these with
    # a message that said only "must be greater than 0". JSON cannot carry
    # inf or nan: msgspec refuses a number out of a float's range.)
    assert to_params(chat(repetition_penalty=value), 16).repetition_penalty == value
    with pytest.raises(BadRequest) as info:
        to_params(chat(repetition_penalty=0.0), 16)
    assert "greater than 0" in str(info.value) and info.value.param == "repetition_penalty"


def test_min_p_reaches_the_replica_and_its_range_is_vllms():
    # (vLLM's extension, sent as the openai SDK's extra_body; it was a 400 as
    # an unknown field)
    assert to_params(chat(min_p=0.05), 16).min_p == 0.05
    assert to_params(completion(min_p=0.05), 16).min_p == 0.05
    assert to_params(chat(), 16).min_p == 0.0
    with pytest.raises(BadRequest) as info:
        to_params(chat(min_p=1.5), 16)
    assert (str(info.value), info.value.param) == ("'min_p' must be in [0, 1]; got 1.5.", "min_p")
    for raw in (b"1e999", b'"0.1"', b"true"):  # (not a finite number: JSON has no NaN)
        with pytest.raises(BadRequest) as info:
            decode_request(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], "min_p": ' + raw + b"}",
                           ChatRequest)
        assert info.value.param == "min_p", raw


def test_an_unset_max_tokens_is_never_below_min_tokens():
    # (vLLM takes an unset max_tokens as the context's remainder: min_tokens
    # 300 with no max_tokens is fine there; the router's default was a 400)
    p = to_params(chat(min_tokens=300), 16)
    assert p.max_tokens == 300 and p.min_tokens == 300 and p.max_tokens_default


@pytest.mark.parametrize("body", [
    {"model": "m", "messages": MSG, "k" * 1_000_000: 1},
    {"model": "m", "messages": [{"role": "r" * 1_000_000, "content": "hi"}]},
    {"model": "m", "messages": [{"role": "user", "content": [{"type": "t" * 1_000_000}]}]},
    {"model": "m", "messages": MSG, "stream_options": {"k" * 1_000_000: True}},
], ids=["top-level field", "role", "content part type", "nested field"])
def test_an_error_echoes_at_most_a_clip_of_what_the_client_sent(body):
    # (a 1 MB field name came back whole in the message and the param, and
    # in the request's log line: a 2 MB answer and a 1 MB log line each)
    with pytest.raises(BadRequest) as e:
        chat_messages(decode_request(json.dumps(body).encode(), ChatRequest))
    assert len(e.value.message) < 1000 and len(e.value.param or "") < 300, (len(e.value.message), e.value.param)
    assert len(e.value.body()) < 2000


@pytest.mark.parametrize("prompt, ok", [
    ([0, 5, 2**32 - 1], True), ([[1, 2]], True),
    ([1, True], False), ([1, -1], False), ([1, 2**32], False), ([1, "a"], False), ([1, 2.0], False),
    ([1, None], False),
])
def test_a_token_id_prompt_takes_integers_from_0_to_the_largest_id_and_no_bools(prompt, ok) -> None:
    req = CompletionRequest(model="m", prompt=prompt)
    if ok:
        assert completion_prompt(req) == (prompt[0] if isinstance(prompt[0], list) else prompt)
    else:
        with pytest.raises(BadRequest) as e:
            completion_prompt(req)
        assert e.value.param == "prompt" and "list of token ids" in e.value.message


@pytest.mark.parametrize("prompt", [["a", "b"], [[1, 2], [3]]])
def test_several_prompts_are_refused_as_an_unsupported_parameter(prompt) -> None:
    # (vLLM serves a batch of prompts, a choice each; the replicas take one
    # prompt a request, so a batch is refused as n > 1 is: its code was null)
    with pytest.raises(BadRequest) as e:
        completion_prompt(CompletionRequest(model="m", prompt=prompt))
    assert (e.value.param, e.value.code) == ("prompt", "unsupported_parameter"), e.value
    assert "one request per prompt" in e.value.message


def _nested(size: int) -> dict:
    """``chat_template_kwargs`` of about ``size`` bytes, nested 30 levels
    deep (within MAX_TEMPLATE_DEPTH): a shape whose decode and checks cost
    the most per byte."""
    leaf = [0]
    for _ in range(29):
        leaf = [leaf]
    return {"x": [leaf] * (size // 62)}


@pytest.mark.parametrize("size", [20_000, 1_200_000])
def test_chat_template_kwargs_over_the_size_limit_are_a_400_naming_the_field_and_the_limit(size):
    from router.openai_types import MAX_TEMPLATE_KWARGS_BYTES

    with pytest.raises(BadRequest) as info:
        chat_template_kwargs(chat(chat_template_kwargs=_nested(size)))
    err = json.loads(info.value.body())["error"]
    assert (err["param"], err["type"], info.value.status) == ("chat_template_kwargs", "invalid_request_error", 400)
    assert f"at most {MAX_TEMPLATE_KWARGS_BYTES:,} bytes" in err["message"], err


def test_chat_template_kwargs_up_to_the_size_limit_are_taken_whatever_their_spacing():
    from router.openai_types import MAX_TEMPLATE_KWARGS_BYTES

    # (the limit is on the field as sent: spacing counts)
    kwargs = {"text": "x" * (MAX_TEMPLATE_KWARGS_BYTES - len('{"text": ""}'))}
    body = json.dumps({"model": "m", "messages": MSG, "chat_template_kwargs": kwargs}).encode()
    assert chat_template_kwargs(decode_request(body, ChatRequest)) == kwargs
    kwargs["text"] += "x"
    with pytest.raises(BadRequest, match="chat_template_kwargs"):
        chat_template_kwargs(decode_request(json.dumps({"model": "m", "messages": MSG,
                                                        "chat_template_kwargs": kwargs}).encode(), ChatRequest))


def test_chat_template_kwargs_over_the_size_limit_have_a_code_of_their_own():
    from router.openai_types import MAX_TEMPLATE_KWARGS_BYTES

    with pytest.raises(BadRequest) as info:
        chat(chat_template_kwargs={"text": "x" * MAX_TEMPLATE_KWARGS_BYTES})
    assert info.value.code == "chat_template_kwargs_too_large"


def test_chat_template_kwargs_nested_too_deep_have_a_code_of_their_own():
    # (as past the size limit: a client can tell this limit of the server
    # from a value vLLM would refuse too; it had no code)
    from router.openai_types import MAX_TEMPLATE_DEPTH

    deep: list = []
    for _ in range(MAX_TEMPLATE_DEPTH - 1):
        deep = [deep]  # ({"a": deep}: one level more than the limit)
    with pytest.raises(BadRequest) as info:
        chat_template_kwargs(chat(chat_template_kwargs={"a": deep}))
    err = json.loads(info.value.body())["error"]
    assert (err["param"], err["code"]) == ("chat_template_kwargs", "chat_template_kwargs_too_deep"), err
    assert err["message"] == f"'chat_template_kwargs' is nested more than {MAX_TEMPLATE_DEPTH} levels deep.", err
    assert chat_template_kwargs(chat(chat_template_kwargs={"a": deep[0]})) == {"a": deep[0]}  # (at the limit)


def test_chat_template_kwargs_that_are_not_valid_json_are_invalid_json_naming_the_field():
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":{"a":"\xff"}}'
    with pytest.raises(BadRequest) as info:
        decode_request(body, ChatRequest)  # (msgspec.DecodeError: not an uncaught 500)
    err = json.loads(info.value.body())["error"]
    assert (err["code"], err["param"]) == ("invalid_json", "chat_template_kwargs"), err
    assert err["message"] == "The request body is not valid JSON: Invalid UTF-8 encoded string", err


@pytest.mark.parametrize("raw, param", [
    (b'{"a":1e400}', "chat_template_kwargs[...]"),
    (b'{"a":[1, 1e400]}', "chat_template_kwargs[...][1]"),
])
def test_a_number_out_of_range_in_chat_template_kwargs_is_named_by_where_it_is(raw, param):
    body = b'{"model":"m","messages":[{"role":"user","content":"hi"}],"chat_template_kwargs":' + raw + b"}"
    with pytest.raises(BadRequest) as info:
        decode_request(body, ChatRequest)
    err = json.loads(info.value.body())["error"]
    assert err["param"] == param and err["message"] == f"Invalid value for '{param}': Number out of range.", err


@pytest.mark.parametrize("kwargs", [[1], "s", {"text": "x" * 20_000}], ids=["array", "string", "too-large"])
def test_chat_template_kwargs_that_cannot_be_decoded_are_refused_with_the_body(kwargs):
    # (before the request's other checks, as a malformed body is: here its
    # unsupported parameter and, in router.completions, its model)
    body = json.dumps({"model": "m", "messages": MSG, "n": 2, "chat_template_kwargs": kwargs}).encode()
    with pytest.raises(BadRequest) as info:
        decode_request(body, ChatRequest)
    assert info.value.param.startswith("chat_template_kwargs"), info.value.body()


_BODY = b'{"model": "m", "messages": [{"role": "user", "content": "hi"}], '


def _occurrences_read(monkeypatch) -> list[str]:
    """The keys the second pass (``_occurrences``, each entry of the field
    as sent) reads, as the real one yields them."""
    from router import entry_keys

    read: list[str] = []
    real = entry_keys._occurrences

    def counted(*args, **kwargs):
        for key, value in real(*args, **kwargs):
            read.append(key)
            yield key, value

    monkeypatch.setattr(entry_keys, "_occurrences", counted)
    return read


@pytest.mark.parametrize("last", [
    b'{' + b','.join([b'"":""'] * 10_000) + b'}',  # (one key, 10,000 times: good)
    b'{' + b','.join([b'"%c%c":""' % (a, b) for a in range(35, 125) for b in range(35, 125)
                      if 92 not in (a, b)][:7_700]) + b'}',  # (7,700 keys, each once: good)
], ids=["one-key-repeated", "distinct-keys"])
def test_a_field_sent_twice_whose_last_object_is_good_is_not_read_entry_by_entry(monkeypatch, last):
    # (the bad entry is in the first `metadata`, which the key is not looked
    # for in: the second pass read each of the last one's entries in Python,
    # 19 to 55 ms of the event loop for a 65 KB body that took 1 ms before it)
    from router import entry_keys

    assert len(last) < entry_keys._KEYED_BYTES  # (a larger field is not looked in)
    read = _occurrences_read(monkeypatch)
    with pytest.raises(BadRequest) as info:
        decode_request(_BODY + b'"metadata": {"a": 1}, "metadata": ' + last + b"}", ChatRequest)
    assert info.value.param == "metadata[...]", info.value
    assert read == []


def test_the_second_pass_reads_a_bounded_part_of_a_field():
    from router import entry_keys

    # a key sent twice, its bad first value past the bound: msgspec's words
    # (the entries before it, up to the bound, are read)
    filler = b','.join([b'"":""'] * 10_000)
    body = _BODY + b'"metadata": {' + filler + b', "x": 1, "x": ""}}'
    assert entry_keys._OCCURRENCE_BYTES < len(body) < entry_keys._KEYED_BYTES
    with pytest.raises(BadRequest) as info:
        decode_request(body, ChatRequest)
    assert info.value.param == "metadata[...]", info.value
    # within the bound: named
    body = _BODY + b'"metadata": {' + filler[:599] + b', "x": 1, "x": ""}}'
    with pytest.raises(BadRequest) as info:
        decode_request(body, ChatRequest)
    assert info.value.param == "metadata.x", info.value


def test_the_second_pass_reads_no_more_than_its_bound(monkeypatch):
    from router import entry_keys

    read = _occurrences_read(monkeypatch)
    filler = b','.join([b'"":""'] * 10_000)
    with pytest.raises(BadRequest):
        decode_request(_BODY + b'"metadata": {' + filler + b', "x": 1, "x": ""}}', ChatRequest)
    assert 0 < len(read) <= entry_keys._OCCURRENCE_BYTES // len(b'"":"",') + 1, len(read)


@pytest.mark.parametrize("raw", [b'{"a": 1, "b": "\xff"}', b'{"a": 1, "a": "x", "b": "\xff"}',
                                 b'{"a": ["\xff"], "a": "x"}'])
def test_invalid_utf_8_after_the_bad_entry_does_not_hide_its_key(raw):
    # (msgspec stops at the bad entry: the bytes after it were never read, and
    # the field was decoded as UTF-8 whole, before its entries were tried:
    # `metadata[...]`, where `{"a": 1, "b": "\xff"}` was named `metadata.a`)
    with pytest.raises(BadRequest) as info:
        decode_request(_BODY + b'"metadata": ' + raw + b"}", ChatRequest)
    assert info.value.param == "metadata.a", info.value


def test_an_error_names_min_tokens_only_where_it_set_the_limit():
    # (only min_tokens set: the limit is the default, 1024, unless min_tokens
    # raised it; a message naming min_tokens gave it the default's value, "min_tokens=1024")
    assert max_tokens_param(chat(min_tokens=5), 1024) == "max_tokens"
    assert max_tokens_param(chat(min_tokens=2000), 1024) == "min_tokens"
    assert max_tokens_param(chat(min_tokens=2000, max_completion_tokens=3000), 1024) == "max_completion_tokens"
    assert max_tokens_param(completion(min_tokens=2000, max_tokens=3000), 16) == "max_tokens"


def test_stop_takes_up_to_max_stop_sequences_as_vllm_does_more_than_openais_four():
    # ('stop' was capped at OpenAI's 4; vLLM takes any number, and agent
    # frameworks send more to it. The cap left bounds the per-token cost of
    # stop matching: README, "Stop sequences".)
    many = [f"<stop{i}>" for i in range(32)]
    for make in (chat, completion):
        assert to_params(make(stop=many[:5]), 16).stop == many[:5]
        assert to_params(make(stop=many), 16).stop == many
        with pytest.raises(BadRequest) as info:
            to_params(make(stop=[*many, "one more"]), 16)
        assert info.value.param == "stop" and f"at most {MAX_STOP}" in info.value.message, info.value
    assert MAX_STOP == len(many)


@pytest.mark.parametrize("make, kw, named", [
    (chat, {"include_reasoning": False, "skip_special_tokens": False}, "skip_special_tokens"),
    (chat, {"bad_words": ["x"], "add_special_tokens": True}, "add_special_tokens"),
    (completion, {"echo": True, "priority": 2}, "priority"),
], ids=["chat-both", "chat-own", "completion"])
def test_of_several_vllm_fields_not_at_their_default_the_first_in_vllms_order_is_named(make, kw, named):
    # (vllm_noops reads an endpoint's fields in one call: the order of the check stays the defaults')
    with pytest.raises(BadRequest) as info:
        make(**kw)
    assert info.value.param == named, info.value
