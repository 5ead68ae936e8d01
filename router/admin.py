"""``/admin`` endpoints (admin key only): policy reload and tenant view."""

from __future__ import annotations

import msgspec
from litestar import Request, Response, get, post

from replicas.protocol import FEATURES, Feature
from router.auth import authorization
from router.errors import error_body
from router.service import RouterService
from router.state import StoreUnavailable
from router.tenants import Timeouts, TenantPolicy

__all__ = ["admin_routes"]

_JSON = "application/json"


def _admin_svc(request: Request) -> RouterService:
    svc: RouterService = request.app.state.service
    svc.check_admin(authorization(request.headers))
    return svc


@post("/admin/reload", status_code=200)
async def reload_policy(request: Request) -> Response:
    """Re-read tenants.yaml now. 200 with the new version, or 422 with the
    errors (the old policy stays in force), or 500 when the new version is
    in force but applying it failed part way (``changed``; reload again once
    fixed): OpenAI's error shape, whose message lists them all, beside the
    result's own fields."""
    result = await _admin_svc(request).policy.reload()
    if result.ok:
        return Response(msgspec.json.encode(result), media_type=_JSON)
    if result.changed:
        message, status = "\n".join(result.errors), 500
        body = msgspec.json.decode(error_body(message, "server_error", code="reload_incomplete"))
    else:
        message, status = (f"the tenants file was not loaded; version {result.version} stays in force:\n"
                           + "\n".join(result.errors)), 422
        body = msgspec.json.decode(error_body(message, "invalid_request_error", code="invalid_config"))
    body.update(msgspec.to_builtins(result))
    return Response(msgspec.json.encode(body), media_type=_JSON, status_code=status)


def policy_view(pol: TenantPolicy, keys: int) -> dict:
    """A tenant's effective policy in the shape of tenants.yaml: the router
    holds limits and timeouts in one resolved struct, which an admin
    looking for ``timeouts.queue_wait``, as the file has it, would not find
    (it showed the timeouts under ``limits``)."""
    policy = msgspec.to_builtins(pol)
    limits = policy["limits"]
    policy["timeouts"] = {k: limits.pop(k) for k in Timeouts.__struct_fields__}
    policy["keys"] = keys
    return policy


@get("/admin/tenants")
async def tenants(request: Request) -> Response:
    """Effective policy and live usage per tenant (no key material)."""
    svc = _admin_svc(request)
    snap = svc.policy.current
    out = {}
    for name, pol in snap.tenants.items():
        lim = pol.limits
        try:
            usage = await svc.store.usage(name, rpm=lim.requests_per_minute, tpm=lim.tokens_per_minute)
            live = msgspec.structs.asdict(usage)
            # (a limit of 0 is "no limit": nothing to count down, not "none left")
            if not lim.requests_per_minute:
                live["requests_available"] = None
            if not lim.tokens_per_minute:
                live["tokens_available"] = None
        except StoreUnavailable as e:
            live = {"error": str(e)}
        live["waiting_for_limits"] = svc.admission.queued(name)
        live["queued"] = svc.scheduler.queued(name)
        live["virtual_counter"] = round(svc.scheduler.counters.get(name), 3)
        out[name] = {"policy": policy_view(pol, keys=len(snap.file.tenants[name].keys)), "usage": live}
    body = {
        "version": snap.version,
        "digest": snap.digest,
        "loaded_at": snap.loaded_at,
        "last_reload_errors": svc.policy.last_errors,
        "tenants": out,
    }
    return Response(msgspec.json.encode(body), media_type=_JSON)


@get("/admin/replicas")
async def replicas(request: Request) -> Response:
    """Each replica's state, process id (local ones), restarts or reconnects, load and cap."""
    svc = _admin_svc(request)
    out = []
    for slot in svc.pool.slots:
        client = slot.client
        load = client.load if client is not None and slot.usable else None
        out.append({
            "name": slot.name,
            "state": slot.status,
            "ready": slot.ready,  # (new requests may go to it: not a "stalled" one, whose load is still shown)
            "local": slot.spec.local,
            # (None for a replica with no process of its own here: a url: upstream)
            "pid": (client.ready.pid if client is not None and slot.usable else slot.pid) or None,
            # (restarts of its process by the router, as fairstream_replica_restarts_total; for a
            # replica it does not start, its attempts to connect again after a loss, failure or refusal)
            "restarts": slot.restarts,
            "reconnects": slot.reconnects,
            # (why it last failed, as the log says, and when; kept once it is back)
            "last_error": slot.last_error,
            "last_error_at": slot.last_error_at,
            "inflight": slot.inflight,
            "cap": slot.cap,
            "served": slot.served,
            "model": client.model if client is not None else None,
            # (the request fields it takes beyond the first protocol's: replicas.protocol.Feature)
            "features": (Feature(client.ready.features & FEATURES).fields()
                         if client is not None and slot.usable else None),
            # (by name: the replica protocol's struct is an array)
            "load": {f: getattr(load, f) for f in load.__struct_fields__} if load is not None else None,
        })
    return Response(msgspec.json.encode({"replicas": out}), media_type=_JSON)


admin_routes = [reload_policy, tenants, replicas]
