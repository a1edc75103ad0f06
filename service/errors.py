"""The service's own errors: what an operation raises on purpose, and the detail its answer names.

They know nothing of HTTP: ``http/errors.py`` holds the one table that turns them, and what the layers
below raise, into statuses.
"""

from __future__ import annotations

from typing import Any


class ServiceError(Exception):
    """An error an operation raises on purpose: ``detail`` is the answer; its class, the status."""

    def __init__(self, detail: Any) -> None:
        super().__init__(detail if isinstance(detail, str) else repr(detail))
        self.detail = detail


class BadRequest(ServiceError):
    """The request's content is refused (a field, a value, a cap)."""


class Unauthorized(ServiceError):
    """No valid API key."""


class NotFound(ServiceError):
    """What the request names does not exist (or belongs to another tenant, which looks the same)."""


class Conflict(ServiceError):
    """The request conflicts with what is stored."""


class Untransportable(ServiceError):
    """A stored value the wire cannot carry: this call fails, naming the field; nothing else is affected."""


class Unavailable(ServiceError):
    """The service or its database cannot serve now; the same call may succeed later."""
