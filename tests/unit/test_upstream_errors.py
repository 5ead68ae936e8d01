"""Which 400s make the router ask an upstream again without a field it adds
(``return_token_ids``, ``stream_options``): a refusal of that field, not any
error that quotes a request body containing it (retrying those would send a
bad request three times and stop asking a vLLM upstream for token ids)."""

from __future__ import annotations

import pytest

from replicas.upstream_errors import rejects_field

ECHO = ("1 validation error for CompletionRequest\n  Value error, unknown stop reason [type=value_error, "
        "input_value={'model': 'm', 'return_token_ids': True, 'stream_options': {'include_usage': True}}, "
        "input_type=dict]")


@pytest.mark.parametrize("message,field,refused", [
    ("Unrecognized request argument supplied: return_token_ids", "return_token_ids", True),  # api.openai.com
    ("Unrecognized request argument supplied: stream_options", "return_token_ids", False),
    ("Unknown parameter: 'stream_options.include_usage'.", "stream_options", True),
    ("[{'type': 'extra_forbidden', 'loc': ('body', 'stream_options'), 'msg': 'Extra inputs are not permitted', "
     "'input': {'include_usage': True}}]", "stream_options", True),  # pydantic, extra="forbid"
    ("stream_options: extra fields not permitted", "stream_options", True),
    (ECHO, "stream_options", False),
    (ECHO, "return_token_ids", False),
    ('{"model": "m", "prompt": "unknown words", "return_token_ids": true}', "return_token_ids", False),
    ("This model's maximum context length is 2048 tokens", "stream_options", False),
])
def test_a_refused_field_is_told_from_a_quoted_body(message, field, refused):
    assert rejects_field(message, field) is refused
