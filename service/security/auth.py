"""``AuthMiddleware``: the request's caps and tenant; 401 without a valid key; the key in OpenAPI."""

from __future__ import annotations

from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from reducing_saver.service.http.errors import send_error
from reducing_saver.service.security.keys import ApiKeys
from reducing_saver.service.security.limits import Limits, _limits
from reducing_saver.service.security.tenancy import UNAUTHORIZED, _tenant
from reducing_saver.wire import HEALTH_PATH, READY_PATH

#: Routes answered without a key (probes must work before anyone holds one).
PUBLIC_PATHS = frozenset({HEALTH_PATH, READY_PATH})


def _bearer(scope: Scope) -> bytes | None:
    """The key of ``Authorization: Bearer <key>``, else of ``x-api-key`` (what langgraph_sdk sends)."""
    api_key = None
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
        if name == b"x-api-key" and api_key is None and value.strip():
            api_key = value.strip()
    return api_key


class AuthMiddleware:
    """Sets the request's caps and tenant; with keys configured, 401 without a valid key (``Authorization:
    Bearer <key>``, or ``x-api-key: <key>`` as langgraph_sdk sends it).

    The header is read here and nowhere else; it is never logged (the access log has method, path,
    status and duration only) and a 401 never echoes what was sent.
    """

    def __init__(self, app: ASGIApp, keys: ApiKeys | None, limits: Limits, public: frozenset[str]) -> None:
        self.app = app
        self.keys = keys
        self.limits = limits
        self.public = public

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        tenant = None
        if self.keys is not None and scope["path"] not in self.public:
            token = _bearer(scope)
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


def document_auth(app: Any, public: frozenset[str] | set[str]) -> None:
    """Declare the key in ``app``'s OpenAPI document: two security schemes (a bearer token, or the
    ``x-api-key`` header), and on every operation but the public ones, ``security`` (either scheme) and a
    401 response (call it only when keys are configured)."""
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
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
        }
        for path, operations in schema.get("paths", {}).items():
            if path in public:
                continue
            for operation in operations.values():
                operation["security"] = [{"apiKey": []}, {"apiKeyHeader": []}]
                operation.setdefault("responses", {})["401"] = unauthorized
        return schema

    app.openapi = openapi

