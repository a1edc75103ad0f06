"""Security: authentication, tenant isolation and input caps, one module each.

* **API keys.** ``REDUCING_SAVER_API_KEYS`` (``tenant=key`` pairs, for development) or
  ``REDUCING_SAVER_API_KEYS_FILE`` (``tenant sha256-hex`` lines, so the service never holds a plain key).
  The service keeps only SHA-256 digests and compares a presented key's digest with every configured one
  with ``hmac.compare_digest``, without stopping at a match. ``AuthMiddleware`` (``http/auth.py``)
  answers 401 to any request without a valid ``Authorization: Bearer`` key, except on ``/healthz``,
  ``/readyz``, the API description (``/docs``, ``/redoc``, ``/openapi.json`` with ``docs_public``, the
  default) and ``/metrics`` with ``metrics_public``, and makes the key's tenant the request's tenant (a
  contextvar the ops read).
* **Tenants.** With keys configured, every stored thread belongs to a tenant: the thread id stored is
  ``f"{tenant}:{thread_id}"`` (tenant names are ``[A-Za-z0-9_-]+``, so the first ``:`` always splits it
  back and no two tenants' ids can collide), and every memory namespace is stored under
  ``("tenants", tenant, *namespace)``; the fallback ``("memories", thread_id)`` uses the agent's own thread
  id. :class:`TenantScope` maps ids in and out of the ops; another tenant's thread looks exactly like a
  missing one. Without keys (single-tenant mode) nothing is mapped: stored ids are the agent's own.
* **Caps.** :class:`Limits` (settings ``max_*``) are read by the request bodies' validators
  (``service/http/schemas.py``) through a contextvar the middleware sets, so the FastAPI routes and the hot
  path enforce the same numbers, and the OpenAPI document shows them. :func:`json_body_problem` refuses
  JSON bodies that are not UTF-8, nest deeper than ``max_nesting_depth`` or repeat a key in an object
  (orjson and pydantic would silently keep the last one) before anything parses them for real
  (``BodyGuard``, ``http/guard.py``).

The middleware that applies these to requests lives in ``http/``; this package knows no HTTP.
"""

from reducing_saver.service.security.bodies import json_body_problem, nesting_depth
from reducing_saver.service.security.keys import (
    TENANT_PATTERN,
    ApiKeys,
    check_exposure,
    hash_key,
    is_loopback,
    load_api_keys,
)
from reducing_saver.service.security.limits import (
    THREAD_ID_SCHEMA_PATTERN,
    UUID_SCHEMA_PATTERN,
    LimitError,
    Limits,
    check_checkpoint_id,
    check_configurable,
    check_count,
    check_filter_keys,
    check_limit,
    check_messages_value,
    check_thread_id,
    current_limits,
    documented,
    over_cap,
)
from reducing_saver.service.security.tenancy import (
    TENANTS_LABEL,
    TenantScope,
    current_tenant,
    list_checkpoints,
    stored_thread_to_agent,
)

__all__ = [
    "TENANTS_LABEL",
    "TENANT_PATTERN",
    "THREAD_ID_SCHEMA_PATTERN",
    "UUID_SCHEMA_PATTERN",
    "ApiKeys",
    "LimitError",
    "Limits",
    "TenantScope",
    "check_checkpoint_id",
    "check_configurable",
    "check_count",
    "check_exposure",
    "check_filter_keys",
    "check_limit",
    "check_messages_value",
    "check_thread_id",
    "current_limits",
    "current_tenant",
    "documented",
    "hash_key",
    "is_loopback",
    "json_body_problem",
    "list_checkpoints",
    "load_api_keys",
    "nesting_depth",
    "over_cap",
    "stored_thread_to_agent",
]
