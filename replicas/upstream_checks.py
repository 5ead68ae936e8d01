"""An upstream's health checks: what its ``GET /models`` lists, and whether
one whose generation requests got no response head answers them again.

That check, ``GET /models``, may pass all along (a proxy or balancer
that black-holes the POSTs, a front end whose generation route hangs), so
the check alone would put it back in dispatch and every request sent there
would wait out the head timeout again. While it is ``stalling`` each health
check also POSTs a request with no prompt to its completions endpoint, on the
connections generation requests use: an OpenAI server answers it at once
(400, generating nothing); an answer within the head timeout, any status
below 500, shows its generation requests are answered again."""

from __future__ import annotations

import logging

import msgspec

from replicas.http11 import HttpError, HttpPool

__all__ = ["ModelCard", "ModelList", "answers_post"]

log = logging.getLogger("fairstream.upstream")


class ModelCard(msgspec.Struct):
    id: str
    max_model_len: int | None = None


class ModelList(msgspec.Struct):
    data: list[ModelCard]


async def answers_post(http: HttpPool, name: str, model: str, head_timeout: float) -> bool:
    """Whether upstream ``name`` answers a POST within ``head_timeout`` s (0: no limit)."""
    try:
        resp = await http.request("POST", "/completions", msgspec.json.encode({"model": model}), None, head_timeout)
        try:
            await resp.read()
        finally:
            resp.close()
    except (HttpError, OSError) as e:
        log.debug("upstream %s: its generation endpoint still does not answer: %s", name, e)
        return False
    if resp.status >= 500:  # (a proxy's 502/503: no server behind it takes them yet)
        return False
    log.info("upstream %s answers generation requests again: chosen again", name)
    return True
