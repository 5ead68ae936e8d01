"""router.yaml ``scheduler`` settings (kept apart so config imports no scheduler code)."""

from __future__ import annotations

from typing import Literal

import msgspec

__all__ = ["SchedulerSettings"]


class SchedulerSettings(msgspec.Struct, forbid_unknown_fields=True, kw_only=True, frozen=True):
    """router.yaml ``scheduler``."""

    policy: Literal["fair", "fifo"] = "fair"
    """``fair``: priority classes with aging, then weighted VTC between
    tenants. ``fifo``: one global first-come queue (for comparison)."""
    aging: float = 10.0
    """Seconds of waiting that lift a request by one priority class. 0: no aging (strict classes)."""
