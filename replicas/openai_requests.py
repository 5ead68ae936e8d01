"""The request bodies of the sim's OpenAI-compatible server
(``replicas.openai_server``), as vLLM's server reads them (unknown fields
are ignored, as vLLM does), and its error bodies in vLLM's shape."""

from __future__ import annotations

from typing import Any

import msgspec
from aiohttp import web

from replicas.protocol import REFUSED_TEMPLATE_KWARGS

__all__ = ["StreamOptions", "Sampling", "CompletionRequest", "ChatRequest", "DetokenizeRequest", "TokenizeRequest",
           "RequestError", "error_json", "error_response", "chat_messages", "template_kwargs", "token_prompt"]

_enc = msgspec.json.encode


class StreamOptions(msgspec.Struct):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class Sampling(msgspec.Struct, kw_only=True):
    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    min_tokens: int | None = 0
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    return_token_ids: bool | None = False
    include_stop_str_in_output: bool | None = False
    n: int | None = 1
    logprobs: Any = None


class CompletionRequest(Sampling, kw_only=True):
    prompt: Any
    max_tokens: int | None = 16
    echo: bool | None = False


class ChatRequest(Sampling, kw_only=True):
    messages: list[dict[str, Any]]
    max_completion_tokens: int | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(msgspec.Struct):
    tokens: list[int]
    model: str | None = None


class TokenizeRequest(msgspec.Struct):
    model: str | None = None
    prompt: str | None = None
    messages: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class RequestError(Exception):
    def __init__(self, message: str, status: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.param = param


def error_json(message: str, status: int, param: str | None = None) -> bytes:
    kind = "BadRequestError" if status < 500 else "InternalServerError"
    if status == 401:
        kind = "AuthenticationError"
    elif status == 404:
        kind = "NotFoundError"
    return _enc({"error": {"message": message, "type": kind, "param": param, "code": status}})


def error_response(message: str, status: int = 400, param: str | None = None) -> web.Response:
    return web.Response(body=error_json(message, status, param), status=status, content_type="application/json")


def message_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if not isinstance(p, dict) or p.get("type") != "text":
                raise RequestError("only text content parts are supported", param="messages")
            parts.append(str(p.get("text", "")))
        return "".join(parts)
    raise RequestError("message content must be a string or a list of text parts", param="messages")


def chat_messages(messages: list[dict[str, Any]]) -> list[dict[str, str]]:
    if not messages:
        raise RequestError("messages must not be empty", param="messages")
    return [{"role": str(m.get("role", "user")), "content": message_text(m.get("content"))} for m in messages]


def template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """A request's ``chat_template_kwargs``, refused as vLLM refuses them."""
    refused = REFUSED_TEMPLATE_KWARGS & (kwargs or {}).keys()
    if refused:
        raise RequestError(f"Found unexpected chat template kwargs from request: {sorted(refused)}",
                          param="chat_template_kwargs")
    return kwargs


def token_prompt(prompt: Any) -> list[int] | str:
    """A completion request's one prompt, as token ids or text."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and all(type(t) is int for t in prompt):
        if any(t < 0 for t in prompt):
            raise RequestError("token ids must not be negative", param="prompt")
        return prompt
    raise RequestError("prompt must be a string or a list of token ids (one prompt per request)", param="prompt")
