"""``AuthMiddleware``: the request's caps and tenant; 401 without a valid key; the key in OpenAPI."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from starlette.routing import BaseRoute, Match
from starlette.types import ASGIApp, Receive, Scope, Send

from reducing_saver.service.http.errors import send_error
from reducing_saver.service.security.keys import ApiKeys
from reducing_saver.service.security.limits import Limits, _limits
from reducing_saver.service.security.tenancy import UNAUTHORIZED, _tenant
from reducing_saver.wire import HEALTH_PATH, METRICS_PATH, READY_PATH

#: Routes answered without a key (probes must work before anyone holds one).
PUBLIC_PATHS = frozenset({HEALTH_PATH, READY_PATH})
#: The answer to a tenant's key on ``/metrics``.
METRICS_FORBIDDEN = (
    f"{METRICS_PATH} shows every tenant's figures: it answers the metrics scraper's key only "
    "(REDUCING_SAVER_METRICS_KEY, or --metrics-key-file), never a tenant's API key"
)
METRICS_UNAUTHORIZED = (
    "the metrics scraper's key is required: send `Authorization: Bearer <key>` or `x-api-key: <key>`"
)


class AmbiguousCredentials(Exception):
    """The request carries more than one credential: which one a proxy in front checked cannot be told."""


AMBIGUOUS = (
    "ambiguous credentials: send one key, once, as `Authorization: Bearer <key>` or `x-api-key: <key>` "
    "(the same key in both is one key)"
)


def _bearer(scope: Scope) -> bytes | None:
    """The key of ``Authorization: Bearer <key>``, else of ``x-api-key`` (what langgraph_sdk sends).

    Raises:
        AmbiguousCredentials: Two ``Authorization`` headers, two ``x-api-key`` headers, or a bearer key
            and an ``x-api-key`` that differ. A proxy or another server may read the first and this one
            the last: the request would be authorized by a key nobody checked (request smuggling).
    """
    authorization: list[bytes] = []
    api_keys: list[bytes] = []
    for name, value in scope["headers"]:
        if name == b"authorization":
            authorization.append(value)
        elif name == b"x-api-key":
            api_keys.append(value.strip())
    if len(authorization) > 1 or len(api_keys) > 1:
        raise AmbiguousCredentials
    if authorization:
        scheme, _, token = authorization[0].partition(b" ")
        token = token.strip()
        if scheme.lower() != b"bearer" or not token:
            return None
        if api_keys and api_keys[0] != token:
            raise AmbiguousCredentials
        return token
    return api_keys[0] if api_keys and api_keys[0] else None


def route_matcher(routes: list[BaseRoute]) -> Callable[[Scope], bool]:
    """Whether one of ``routes`` that the API description documents serves a request's method at its path
    (the router's own matching; a route that only answers 405 is left out)."""
    documented = [route for route in routes if getattr(route, "include_in_schema", True)]

    def serves(scope: Scope) -> bool:
        return any(route.matches(scope)[0] == Match.FULL for route in documented)

    return serves


class AuthMiddleware:
    """Sets the request's caps and tenant; with keys configured, 401 without a valid key (``Authorization:
    Bearer <key>``, or ``x-api-key: <key>`` as langgraph_sdk sends it), 400 for more than one (two
    ``Authorization`` headers, or two keys that differ).

    ``/metrics`` (unless public) answers the metrics scraper's keys (``metrics_keys``) only: it shows every
    tenant's figures, so a tenant's key gets 403 there, and so does every key while no scraper key is
    configured but tenant keys are. Without any key configured it is open, as every route is then.

    The header is read here and nowhere else; it is never logged (the access log has method, path,
    status and duration only) and a 401 never echoes what was sent. A request with ambiguous credentials
    that no route serves (``serves``: an undeclared method, an unknown path) goes on without a tenant to
    the router, whose 404 or 405 says more than a 400 would; no endpoint runs for it.
    """

    def __init__(
        self,
        app: ASGIApp,
        keys: ApiKeys | None,
        limits: Limits,
        public: frozenset[str],
        metrics_keys: ApiKeys | None = None,
        serves: Callable[[Scope], bool] = lambda scope: True,
    ) -> None:
        self.app = app
        self.keys = keys
        self.limits = limits
        self.public = public
        self.metrics_keys = metrics_keys
        self.serves = serves

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tenant = None
        if scope["path"] == METRICS_PATH and METRICS_PATH not in self.public:
            if self.keys is not None or self.metrics_keys is not None:
                try:
                    token = _bearer(scope)
                except AmbiguousCredentials:
                    if self.serves(scope):
                        await send_error(send, 400, AMBIGUOUS)
                    else:
                        await self.app(scope, receive, send)
                    return
                if not token or self.metrics_keys is None or self.metrics_keys.tenant_for(token) is None:
                    if token and self.keys is not None and self.keys.tenant_for(token) is not None:
                        await send_error(send, 403, METRICS_FORBIDDEN)
                    else:
                        await send_error(send, 401, METRICS_UNAUTHORIZED)
                    return
        elif self.keys is not None and scope["path"] not in self.public:
            try:
                token = _bearer(scope)
            except AmbiguousCredentials:
                if self.serves(scope):
                    await send_error(send, 400, AMBIGUOUS)
                    return
                await self.app(scope, receive, send)  # the router's 404 or 405, and nothing else, answers
                return
            tenant = self.keys.tenant_for(token) if token else None
            if tenant is None:
                await send_error(send, 401, UNAUTHORIZED)
                return
            scope.setdefault("state", {})["tenant"] = tenant
        limits_token = _limits.set(self.limits)
        tenant_token = _tenant.set(tenant)
        try:
            await self.app(scope, receive, send)
        finally:
            _tenant.reset(tenant_token)
            _limits.reset(limits_token)


def document_auth(
    app: Any, public: frozenset[str] | set[str], *, tenants: bool = True, metrics: bool = False
) -> None:
    """Declare the keys in ``app``'s OpenAPI document: security schemes for a tenant's key (a bearer token,
    or the ``x-api-key`` header) and the metrics scraper's, and on every operation but the public ones,
    ``security`` (either scheme), a 400 response (ambiguous credentials) and a 401; ``/metrics`` (not public) takes the scraper's key, and a
    403 for a tenant's. ``tenants``: tenant keys are configured; ``metrics``: a scraper key is."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        schema = original()
        components = schema.setdefault("components", {})
        components.setdefault("securitySchemes", {})["apiKey"] = {
            "type": "http",
            "scheme": "bearer",
            "description": "An API key of REDUCING_SAVER_API_KEYS / REDUCING_SAVER_API_KEYS_FILE; its tenant "
            "owns every thread the request touches.",
        }
        components["securitySchemes"]["apiKeyHeader"] = {
            "type": "apiKey",
            "in": "header",
            "name": "x-api-key",
            "description": "The same key in the header langgraph_sdk's get_client(api_key=...) sends.",
        }
        unauthorized = {
            "description": "No valid API key.",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}},
        }
        components["securitySchemes"]["metricsKey"] = {
            "type": "http",
            "scheme": "bearer",
            "description": "The metrics scraper's key (REDUCING_SAVER_METRICS_KEY / --metrics-key-file): "
            "/metrics shows every tenant's figures and answers no tenant's key.",
        }
        components["securitySchemes"]["metricsKeyHeader"] = {
            "type": "apiKey",
            "in": "header",
            "name": "x-api-key",
            "description": "The metrics scraper's key in the x-api-key header.",
        }
        error = {"content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}}
        ambiguous = {
            **error,
            "description": "More than one credential: two keys, or a bearer key and an x-api-key that differ.",
        }
        for path, operations in schema.get("paths", {}).items():
            if path in public:
                continue
            for operation in operations.values():
                responses = operation.setdefault("responses", {})
                if path == METRICS_PATH:
                    operation["security"] = [{"metricsKey": []}, {"metricsKeyHeader": []}]
                    responses["400"] = ambiguous
                    responses["401"] = {**error, "description": "No metrics scraper's key."}
                    if tenants:
                        responses["403"] = {
                            **error,
                            "description": "A tenant's key: /metrics is not a tenant's.",
                        }
                elif tenants:
                    operation["security"] = [{"apiKey": []}, {"apiKeyHeader": []}]
                    responses.setdefault("400", ambiguous)
                    responses["401"] = unauthorized
        if not metrics:  # no scraper key configured: /metrics answers none
            components["securitySchemes"]["metricsKey"]["description"] += " None is configured."
        return schema

    app.openapi = openapi
