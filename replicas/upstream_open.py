"""Connecting to an OpenAI-compatible upstream (``replicas.upstream``): list
its models, pick the one to serve, and make its ``UpstreamClient`` with the
aiohttp session for control calls (health checks, ``/metrics``,
``/detokenize``) and the ``HttpPool`` its generation streams go through."""

from __future__ import annotations

import asyncio
import os

import aiohttp
import msgspec

from replicas.client import KeyRefused, ReplicaDead, ReplicaRefused
from replicas.http11 import HttpPool
from replicas.spec import ReplicaSpec
from replicas.upstream import ModelCard, ModelList, UpstreamClient
from replicas.upstream_credentials import refusal
from replicas.upstream_errors import error_text

__all__ = ["open_upstream"]


def _auth(spec: ReplicaSpec) -> dict[str, str]:
    key = os.environ.get(spec.api_key_env, "") if spec.api_key_env else ""
    return {"authorization": f"Bearer {key}"} if key else {}


def _session(spec: ReplicaSpec) -> aiohttp.ClientSession:
    """The aiohttp session for control calls (generation streams use ``HttpPool``)."""
    connector = aiohttp.TCPConnector(limit=4, keepalive_timeout=30)
    return aiohttp.ClientSession(
        connector=connector, headers=_auth(spec),
        timeout=aiohttp.ClientTimeout(total=None, sock_connect=10), auto_decompress=False,
    )


async def open_upstream(name: str, spec: ReplicaSpec, *, timeout: float = 10.0,
                        head_timeout: float = 0.0, stalling: str | None = None) -> UpstreamClient:
    """Connect to ``spec.url``: list its models, pick the one to serve (``stalling``: why its last
    connection's generation requests got no response head, kept until a probe is answered)."""
    session = _session(spec)
    url = (spec.url or "").rstrip("/")
    try:
        async with asyncio.timeout(timeout):
            async with session.get(url + "/models") as r:
                raw = await r.read()
                if r.status in (401, 403):  # (its /models needs the key: vllm serve --api-key)
                    raise KeyRefused(refusal(name, spec.api_key_env, r.status, error_text(raw)))
                if r.status != 200:
                    raise ReplicaDead(f"upstream {name}: GET /models: HTTP {r.status}"
                                      f"{' (no OpenAI-compatible API at this url?)' if r.status == 404 else ''}"
                                      f": {error_text(raw, 200)}")
        models = msgspec.json.decode(raw, type=ModelList).data
        if spec.upstream_model is not None:
            found = [m for m in models if m.id == spec.upstream_model]
            if models and not found:
                raise ReplicaRefused(f"upstream {name} does not serve {spec.upstream_model!r} "
                                     f"(it lists {[m.id for m in models]})")
            card = found[0] if found else ModelCard(spec.upstream_model)
        elif models:
            card = models[0]
        else:
            raise ReplicaDead(f"upstream {name} lists no models")
        model = str(spec.config.get("model") or card.id)
        http = HttpPool(url, _auth(spec), limit=spec.max_concurrency or 0)
        return UpstreamClient(name, spec, session, http, model, card.id, card.max_model_len or 0, head_timeout,
                              stalling)
    except aiohttp.ServerDisconnectedError as e:
        await session.close()
        # (closed before any answer: a tunnel or proxy whose upstream is down;
        # the supervisor retries it as unreachable, as a refused connect)
        raise ConnectionResetError(f"upstream {name} closed the connection before answering GET /models") from e
    except BaseException:
        await session.close()
        raise
