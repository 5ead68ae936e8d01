"""The prompt of a ``/v1/completions`` request: one text or one list of
token ids (a batch of several is refused: the replicas run one prompt a
request, as they run ``n`` 1 only)."""

from __future__ import annotations

from typing import Any

import msgspec

from router.errors import BadRequest
from router.openai_types import MAX_TOKEN_ID, CompletionRequest, TokenId

__all__ = ["completion_prompt"]


def completion_prompt(req: CompletionRequest) -> str | list[int]:
    """The one prompt of a completions request, as text or token ids."""
    prompt: Any = req.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    elif isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        raise BadRequest("Batched prompts are unsupported; send one request per prompt.", param="prompt",
                         code="unsupported_parameter")
    if not prompt:  # "" or []
        raise BadRequest("'prompt' must not be empty.", param="prompt")
    if isinstance(prompt, str):
        return prompt
    try:
        return msgspec.convert(prompt, list[TokenId])  # (a generator over 400,000 ids took 0.3-1 s of the loop)
    except msgspec.ValidationError:
        raise BadRequest("'prompt' must be a string or a list of token ids (integers from 0 to "
                         f"{MAX_TOKEN_ID}).", param="prompt") from None

