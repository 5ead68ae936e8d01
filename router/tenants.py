"""Tenant policy: who may call, and as which tenant.

configs/tenants.yaml holds API keys only as SHA-256 hex digests (``fairstream
hash-key KEY`` prints one), so the file can be shared with people who must
not see the keys.
"""

from __future__ import annotations

import re
from typing import Literal

import msgspec

from router.configfile import Located

__all__ = ["Tenant", "TenantsFile", "PRIORITIES"]

PRIORITIES = ("high", "normal", "low")
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class Tenant(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """One team sharing the cluster."""

    keys: list[str]
    """SHA-256 hex digests of the tenant's API keys (several, for rotation)."""
    priority: Literal["high", "normal", "low"] = "normal"
    """Priority class; used as a metrics label."""


class TenantsFile(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The whole tenants.yaml."""

    admin_keys: list[str] = []
    """SHA-256 hex digests of keys that may call /admin endpoints."""
    tenants: dict[str, Tenant]
    """Tenants by name."""

    def validate(self, located: Located) -> list[str]:
        errors: list[str] = []
        owner: dict[str, tuple] = {}
        for i, digest in enumerate(self.admin_keys):
            at = ("admin_keys", i)
            if not _SHA256.match(digest):
                errors.append(located.error(at, "must be a SHA-256 hex digest (64 lowercase hex chars)"))
            elif digest in owner:
                errors.append(located.error(at, "duplicate key"))
            owner[digest] = at
        for name, tenant in self.tenants.items():
            if not re.match(r"^[A-Za-z0-9_.-]{1,64}$", name):
                errors.append(located.error(("tenants", name), "tenant names use letters, digits, _ . - (1-64)"))
            if not tenant.keys:
                errors.append(located.error(("tenants", name, "keys"), "a tenant needs at least one key"))
            for i, digest in enumerate(tenant.keys):
                at = ("tenants", name, "keys", i)
                if not _SHA256.match(digest):
                    errors.append(located.error(at, "must be a SHA-256 hex digest (64 lowercase hex chars)"))
                elif digest in owner:
                    other = ".".join(str(p) for p in owner[digest])
                    errors.append(located.error(at, f"duplicate key (also at {other})"))
                owner[digest] = at
        return errors
