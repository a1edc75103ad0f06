"""Authentication, tenant isolation and input caps.

* **API keys.** ``REDUCING_SAVER_API_KEYS`` (``tenant=key`` pairs, for development) or
  ``REDUCING_SAVER_API_KEYS_FILE`` (``tenant sha256-hex`` lines, so the service never holds a plain key).
  The service keeps only SHA-256 digests and compares a presented key's digest with every configured one
  with ``hmac.compare_digest``, without stopping at a match. ``AuthMiddleware`` answers 401 to any request
  without a valid ``Authorization: Bearer`` key, except on ``/healthz``, ``/readyz`` (and ``/metrics``
  with ``metrics_public``), and makes the key's tenant the request's tenant (a contextvar the ops read).
* **Tenants.** With keys configured, every stored thread belongs to a tenant: the thread id stored is
  ``f"{tenant}:{thread_id}"`` (tenant names are ``[A-Za-z0-9_-]+``, so the first ``:`` always splits it
  back and no two tenants' ids can collide), and every memory namespace is stored under
  ``("tenants", tenant, *namespace)``; the fallback ``("memories", thread_id)`` uses the agent's own thread
  id. :class:`TenantScope` maps ids in and out of the ops; another tenant's thread looks exactly like a
  missing one. Without keys (single-tenant mode) nothing is mapped: stored ids are the agent's own.
* **Caps.** :class:`Limits` (settings ``max_*``) are read by the request models' validators
  (``service/schemas.py``) through a contextvar the middleware sets, so the FastAPI routes and the hot
  path enforce the same numbers, and the OpenAPI document shows them. :class:`BodyGuard` refuses JSON
  bodies that are not UTF-8, nest deeper than ``max_nesting_depth`` or repeat a key in an object (orjson
  and pydantic would silently keep the last one) before anything parses them for real.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import re
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from contextvars import ContextVar
from dataclasses import dataclass, fields
from itertools import islice
from pathlib import Path
from typing import Any

import orjson
import ormsgpack
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from reducing_saver.service.asgi import is_msgpack, read_body
from reducing_saver.service.savers import THREAD_PREFIX_KEY

__all__ = [
    "ApiKeys",
    "AuthMiddleware",
    "BodyGuard",
    "Limits",
    "TenantScope",
    "check_exposure",
    "current_limits",
    "current_tenant",
    "load_api_keys",
]

TENANT_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: Prefix of every memory namespace in tenant mode: ``("tenants", tenant, *namespace)``.
TENANTS_LABEL = "tenants"
#: Routes answered without a key (probes must work before anyone holds one).
PUBLIC_PATHS = frozenset({"/healthz", "/readyz"})
#: Characters a thread id may not hold: C0/C1 control characters (NUL included), DEL, and the path
#: separators, since thread ids end up in URL paths (``/threads/{thread_id}`` in LangGraph tooling),
#: file names of exports and log lines.
_BAD_THREAD_CHARS = re.compile(r"[\x00-\x1f\x7f-\x9f/\\]")
#: The same rule as a JSON schema pattern, for the OpenAPI document.
THREAD_ID_SCHEMA_PATTERN = r"^[^\x00-\x1f\x7f-\x9f/\\]+$"
_UUID = re.compile(r"[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}")
UUID_SCHEMA_PATTERN = r"^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$"


# -- limits -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Limits:
    """The input caps of one app (each a setting of the same name)."""

    max_writes_per_call: int = 1000
    max_ids_per_call: int = 1000
    max_list_limit: int = 1000
    max_nesting_depth: int = 32
    max_thread_id_length: int = 256
    max_channels: int = 1000
    max_messages_per_put: int = 10000

    @classmethod
    def from_settings(cls, settings: Any) -> Limits:
        return cls(**{f.name: getattr(settings, f.name) for f in fields(cls)})


_limits: ContextVar[Limits] = ContextVar("reducing_saver_limits", default=Limits())
_tenant: ContextVar[str | None] = ContextVar("reducing_saver_tenant", default=None)


def current_limits() -> Limits:
    """The caps of the app handling the current request (the defaults outside a request)."""
    return _limits.get()


def current_tenant() -> str | None:
    """The tenant of the current request's API key; ``None`` without keys or outside a request."""
    return _tenant.get()


class LimitError(ValueError):
    """An input is over a cap; the message names the field, the cap and its setting."""


def over_cap(field: str, what: str, count: int, setting: str) -> LimitError:
    cap = getattr(current_limits(), setting)
    return LimitError(f"{field}: {count} {what} is more than the limit of {cap} (setting {setting})")


def check_count(value: Any, field: str, what: str, setting: str) -> Any:
    """``value`` when it is not a list/dict longer than the cap ``setting``; for BeforeValidators."""
    if isinstance(value, (list, dict)) and len(value) > getattr(current_limits(), setting):
        raise over_cap(field, what, len(value), setting)
    return value


def check_thread_id(value: str, field: str = "thread_id") -> str:
    """Refuse thread ids that are too long, hold control characters or path separators, or are ``.``/``..``."""
    cap = current_limits().max_thread_id_length
    if len(value) > cap:
        raise LimitError(
            f"{field}: {len(value)} characters is more than the limit of {cap} (setting max_thread_id_length)"
        )
    if match := _BAD_THREAD_CHARS.search(value):
        raise ValueError(
            f"{field}: character {match.group()!r} at index {match.start()} is not allowed in a thread id "
            "(no control characters, NUL, '/' or '\\')"
        )
    if value in (".", ".."):
        raise ValueError(f"{field}: {value!r} is not a thread id")
    return value


def check_checkpoint_id(value: str, field: str = "checkpoint_id") -> str:
    if not _UUID.fullmatch(value):
        raise ValueError(f"{field}: {value[:64]!r} is not a UUID (checkpoint ids are LangGraph's uuid6 strings)")
    return value


def check_limit(value: int | None) -> int | None:
    cap = current_limits().max_list_limit
    if value is not None and value > cap:
        raise LimitError(f"limit: {value} is more than the limit of {cap} (setting max_list_limit)")
    return value


def check_configurable(configurable: dict[str, Any]) -> dict[str, Any]:
    """The ids of a run config's ``configurable``: thread id rules, checkpoint id a UUID."""
    reserved = sorted(key for key in configurable if key.startswith("__"))
    if reserved:
        raise ValueError(f"configurable.{reserved[0][:64]}: keys starting with '__' are reserved")
    thread_id = configurable.get("thread_id")
    if isinstance(thread_id, str) and thread_id:
        check_thread_id(thread_id, "configurable.thread_id")
    checkpoint_id = configurable.get("checkpoint_id")
    if checkpoint_id is not None and checkpoint_id != "":
        if not isinstance(checkpoint_id, str):
            raise ValueError("configurable.checkpoint_id: must be a string (a UUID)")
        check_checkpoint_id(checkpoint_id, "configurable.checkpoint_id")
    return configurable


def documented(**keywords: str) -> Callable[[dict[str, Any]], None]:
    """A ``json_schema_extra`` that writes the current caps into a schema: ``maxItems="max_channels"``."""

    def extra(schema: dict[str, Any]) -> None:
        limits = current_limits()
        for keyword, setting in keywords.items():
            schema[keyword] = getattr(limits, setting)

    return extra


def check_messages_value(type_: str, raw: bytes, field: str) -> None:
    """Refuse a messages channel blob the service would have to store broken or oversized.

    Only ``msgpack`` blobs are looked at (another serde's bytes, e.g. encrypted ones, are stored as sent;
    so is a DeltaChannel snapshot, ext 7 as the whole value). The bytes must be well-formed msgpack, and a
    top-level list may hold at most ``max_messages_per_put`` entries. Extension payloads are not opened
    here: :class:`~reducing_saver.service.messages_codec.SafeMessagesCodec` does that without importing
    anything.
    """
    if type_ != "msgpack":
        return
    if raw[:1] and raw[0] in (0xD4, 0xD5, 0xD6, 0xD7, 0xD8, 0xC7, 0xC8, 0xC9):
        return  # a top-level extension: the codec decides (snapshots are stored as sent)
    count = _msgpack_array_len(raw)
    cap = current_limits().max_messages_per_put
    if count is not None and count > cap:
        raise over_cap(field, "messages", count, "max_messages_per_put")
    try:
        ormsgpack.unpackb(raw, ext_hook=_skip_ext)
    except Exception as exc:
        raise ValueError(f"{field}: the data is not valid msgpack ({exc})") from None


def _skip_ext(code: int, data: bytes) -> None:
    return None


def _msgpack_array_len(data: bytes) -> int | None:
    if not data:
        return None
    head = data[0]
    if 0x90 <= head <= 0x9F:
        return head & 0x0F
    if head == 0xDC and len(data) >= 3:
        return int.from_bytes(data[1:3], "big")
    if head == 0xDD and len(data) >= 5:
        return int.from_bytes(data[1:5], "big")
    return None


# -- API keys ---------------------------------------------------------------------------------------


class ApiKeys:
    """SHA-256 digests of the configured keys and their tenants; never a plain key."""

    def __init__(self, entries: Sequence[tuple[str, bytes]]) -> None:
        self._entries = tuple(entries)
        self.tenants = frozenset(tenant for tenant, _ in entries)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._entries)} keys for tenants {sorted(self.tenants)})"

    def __len__(self) -> int:
        return len(self._entries)

    def tenant_for(self, key: str | bytes) -> str | None:
        """The tenant of ``key``, or ``None``. Compares with every digest, in constant time each."""
        digest = hashlib.sha256(key if isinstance(key, bytes) else key.encode()).digest()
        found = None
        for tenant, expected in self._entries:
            if hmac.compare_digest(digest, expected):
                found = tenant
        return found


def _check_tenant(tenant: str, where: str) -> None:
    if not TENANT_PATTERN.fullmatch(tenant):
        raise ValueError(f"{where}: tenant name {tenant[:64]!r} must be 1 to 64 of A-Z a-z 0-9 _ -")


def parse_api_keys(text: str) -> list[tuple[str, bytes]]:
    """``tenant=key,tenant=key`` as ``(tenant, sha256 digest)`` pairs. Errors never quote a key."""
    entries = []
    for index, pair in enumerate(part.strip() for part in text.split(",")):
        if not pair:
            continue
        tenant, sep, key = pair.partition("=")
        tenant, key = tenant.strip(), key.strip()
        if not sep or not key:
            raise ValueError(f"api_keys: entry {index + 1} is not tenant=key")
        _check_tenant(tenant, f"api_keys: entry {index + 1}")
        entries.append((tenant, hashlib.sha256(key.encode()).digest()))
    return entries


def parse_api_keys_file(path: str) -> list[tuple[str, bytes]]:
    """Lines ``tenant sha256-hex`` (blank lines and ``#`` comments skipped)."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise ValueError(f"api_keys_file: cannot read {path}: {exc.strerror or exc}") from None
    entries = []
    for number, line in enumerate(text.splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 2 or not re.fullmatch(r"[0-9a-fA-F]{64}", parts[1]):
            raise ValueError(f"api_keys_file {path}, line {number}: expected `tenant sha256-hex-of-key`")
        _check_tenant(parts[0], f"api_keys_file {path}, line {number}")
        entries.append((parts[0], bytes.fromhex(parts[1])))
    return entries


def load_api_keys(settings: Any) -> ApiKeys | None:
    """The configured keys (both sources together), or ``None`` when none is: single-tenant mode.

    Raises:
        ValueError: A malformed pair or line, or one key given to two tenants.
    """
    entries: list[tuple[str, bytes]] = []
    if settings.api_keys is not None:
        entries += parse_api_keys(settings.api_keys.get_secret_value())
    if settings.api_keys_file:
        entries += parse_api_keys_file(settings.api_keys_file)
    if not entries:
        if settings.api_keys is not None or settings.api_keys_file:
            raise ValueError("api_keys / api_keys_file are set but hold no key")
        return None
    owners: dict[bytes, str] = {}
    for tenant, digest in entries:
        if owners.setdefault(digest, tenant) != tenant:
            raise ValueError(f"api keys: one key is given to two tenants ({owners[digest]!r} and {tenant!r})")
    return ApiKeys(entries)


def hash_key(key: str) -> str:
    """The ``sha256-hex`` of a key, as ``api_keys_file`` lines hold it."""
    return hashlib.sha256(key.encode()).hexdigest()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(settings: Any) -> str | None:
    """Why the service must not start as configured, or ``None``: a non-loopback address with no API
    key is refused unless ``insecure`` is set."""
    if is_loopback(settings.host) or settings.insecure or load_api_keys(settings) is not None:
        return None
    return (
        f"refusing to listen on {settings.host} without API keys: anyone who can reach it could read and "
        "write every thread. Configure keys (REDUCING_SAVER_API_KEYS_FILE or REDUCING_SAVER_API_KEYS), "
        "listen on 127.0.0.1, or pass --insecure (REDUCING_SAVER_INSECURE=true) if the network is yours alone."
    )


# -- the middlewares ---------------------------------------------------------------------------------


async def _reply(send: Send, status: int, detail: Any, headers: Sequence[tuple[bytes, bytes]] = ()) -> None:
    body = orjson.dumps({"detail": detail})
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


def _bearer(scope: Scope) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


class AuthMiddleware:
    """Sets the request's caps and tenant; with keys configured, 401 without a valid bearer key.

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
                detail = "a valid API key is required: send `Authorization: Bearer <key>`"
                await _reply(send, 401, detail, [(b"www-authenticate", b'Bearer realm="reducing-saver"')])
                return
            scope.setdefault("state", {})["tenant"] = tenant
        limits_token = _limits.set(self.limits)
        tenant_token = _tenant.set(tenant)
        try:
            await self.app(scope, receive, send)
        finally:
            _tenant.reset(tenant_token)
            _limits.reset(limits_token)


class BodyGuard:
    """Refuse JSON bodies that are not UTF-8, nest too deep, or repeat a key, with 422, before parsing.

    Runs inside the body size limit. It parses with orjson (fast, refuses invalid UTF-8), walks the
    containers of the result once for depth, the number of object keys and huge numbers, and counts
    ``":`` in the raw bytes: in compact JSON every key has one, so equal counts prove there is no
    duplicate; only when they differ does an exact check run. The body is then replayed unchanged.

    An ``application/msgpack`` body passes untouched to the paths in ``msgpack_paths`` (whose handler
    checks it as it decodes: ``service/msgpack_body.py``); any other path answers it 415.
    """


    def __init__(self, app: ASGIApp, limits: Limits, msgpack_paths: frozenset[str] = frozenset()) -> None:
        self.app = app
        self.limits = limits
        self.msgpack_paths = msgpack_paths

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] not in ("POST", "PUT", "PATCH"):
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-type":
                if is_msgpack(value):
                    if scope["path"] in self.msgpack_paths:
                        await self.app(scope, receive, send)
                    else:
                        await _reply(send, 415, self._msgpack_elsewhere())
                    return
                break
        body = await read_body(receive)
        if body is None:
            return
        problem = self.problem(body) if body else None
        if problem is not None:
            await _reply(send, 422, [{"type": "body_refused", "loc": ["body"], "msg": problem}])
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    def problem(self, body: bytes) -> str | None:
        """Why ``body`` is refused, or ``None``."""
        try:
            value = orjson.loads(body)
        except orjson.JSONDecodeError as exc:
            if b"\x00" not in body:
                try:
                    body.decode("utf-8")
                except UnicodeDecodeError as err:
                    return f"the body is not UTF-8 (invalid byte at {err.start}); JSON bodies must be UTF-8"
            if "recursion" in str(exc).lower() or "depth limit" in str(exc).lower():
                return self._too_deep(">1024")
            return f"the body is not valid JSON: {exc}"
        depth, keys, huge = _shape(value)
        if depth > self.limits.max_nesting_depth:
            return self._too_deep(str(depth))
        # Compact JSON (what clients send) has one `":` per key, plus any inside string values: equal
        # counts prove there is no duplicate. Otherwise (a duplicate, `"a" : 1` spacing, a string holding
        # `":`) the exact check decides.
        if keys and body.count(b'":') != keys:
            duplicate = _first_duplicate_key(body)
            if duplicate is not None:
                return f"the body repeats the key {duplicate[:100]!r} in one object; send each key once"
        # orjson reads an integer beyond 64 bits as a float, pydantic as an exact int that msgpack and
        # orjson then fail to write (a 500): only a float that large can be one, so only then look exactly.
        if huge and (number := _out_of_range_int(body)) is not None:
            return f"the body holds the integer {number[:40]}, outside the 64-bit range"
        return None

    def _msgpack_elsewhere(self) -> str:
        paths = ", ".join(sorted(self.msgpack_paths)) or "no path"
        return f"application/msgpack bodies are accepted on {paths}; send this request as application/json"

    def _too_deep(self, depth: str) -> str:
        return (
            f"the body nests {depth} levels of arrays and objects, more than the limit of "
            f"{self.limits.max_nesting_depth} (setting max_nesting_depth)"
        )


def nesting_depth(value: Any) -> int:
    """How deeply ``value`` (parsed JSON or msgpack) nests lists and dicts (a scalar: 0)."""
    return _shape(value)[0]


def _shape(value: Any) -> tuple[int, int, bool]:
    """``(nesting depth, number of object keys, holds a float of 64-bit magnitude)`` of parsed JSON."""
    if type(value) is not dict and type(value) is not list:
        return 0, 0, type(value) is float and abs(value) >= _BIG
    depth = keys = 0
    huge = False
    stack = [(value, 1)]
    push, pop = stack.append, stack.pop
    while stack:
        item, level = pop()
        depth = max(depth, level)
        if type(item) is dict:
            keys += len(item)
            item = item.values()
        for child in item:
            kind = type(child)
            if kind is dict or kind is list:
                push((child, level + 1))
            elif kind is float and (child >= _BIG or child <= -_BIG):
                huge = True
    return depth, keys, huge


_BIG = float(2**63)


class _Duplicate(Exception):
    def __init__(self, key: str) -> None:
        self.key = key


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    seen: dict[str, Any] = {}
    for key, value in pairs:
        if key in seen:
            raise _Duplicate(key)
        seen[key] = value
    return seen


class _BigInt(Exception):
    def __init__(self, text: str) -> None:
        self.text = text


def _checked_int(text: str) -> int:
    value = int(text)
    if not -(2**63) <= value < 2**64:
        raise _BigInt(text)
    return value


def _out_of_range_int(body: bytes) -> str | None:
    try:
        json.loads(body, parse_int=_checked_int)
    except _BigInt as big:
        return big.text
    except (ValueError, RecursionError):
        return None
    return None


def _first_duplicate_key(body: bytes) -> str | None:
    try:
        json.loads(body, object_pairs_hook=_no_duplicates)
    except _Duplicate as dup:
        return dup.key
    except (ValueError, RecursionError):
        return None
    return None


def document_auth(app: Any, public: frozenset[str] | set[str]) -> None:
    """Declare the bearer key in ``app``'s OpenAPI document: a security scheme, and on every operation
    but the public ones, ``security`` and a 401 response (call it only when keys are configured)."""
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
        unauthorized = {
            "description": "No valid API key.",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorResponse"}}},
        }
        for path, operations in schema.get("paths", {}).items():
            if path in public:
                continue
            for operation in operations.values():
                operation["security"] = [{"apiKey": []}]
                operation.setdefault("responses", {})["401"] = unauthorized
        return schema

    app.openapi = openapi


# -- tenant scoping ----------------------------------------------------------------------------------


class TenantScope:
    """Maps an agent's thread ids and memory namespaces to stored ones and back, for one tenant.

    ``TenantScope(None)`` (single-tenant mode) maps nothing.
    """

    def __init__(self, tenant: str | None) -> None:
        self.tenant = tenant
        self.prefix = f"{tenant}:" if tenant is not None else ""

    @classmethod
    def for_request(cls, tenant_mode: bool) -> TenantScope:
        tenant = current_tenant()
        if tenant_mode and tenant is None:
            # Never fall back to unscoped access: a request that got here without a tenant is a bug.
            from fastapi import HTTPException

            raise HTTPException(401, "a valid API key is required: send `Authorization: Bearer <key>`")
        return cls(tenant)

    # thread ids
    def thread(self, thread_id: str) -> str:
        return self.prefix + thread_id

    def threads(self, thread_ids: Sequence[str]) -> list[str]:
        return [self.prefix + t for t in thread_ids]

    def unthread(self, stored: str) -> str:
        return stored.removeprefix(self.prefix)

    def owns(self, stored: str) -> bool:
        return stored.startswith(self.prefix)

    def text(self, message: str) -> str:
        """An error message with stored ids turned back into the agent's."""
        return message.replace(self.prefix, "") if self.prefix else message

    # configs
    def config_in(self, config: dict[str, Any], namespace_key: str, *, namespace: bool = False) -> dict[str, Any]:
        """``config`` with its thread id stored; with ``namespace``, the memory namespace made explicit
        under ``("tenants", tenant)`` (the fallback from the agent's own thread id)."""
        if self.tenant is None:
            return config
        from reducing_saver.service.memory import store_namespace

        configurable = dict(config["configurable"])
        if namespace:
            configurable[namespace_key] = list(self.namespace(store_namespace(config, namespace_key)))
        else:
            configurable.pop(namespace_key, None)
        if configurable.get("thread_id") is not None:
            configurable["thread_id"] = self.thread(str(configurable["thread_id"]))
        return {**config, "configurable": configurable}

    def config_out(self, config: Any) -> Any:
        if self.tenant is None or not isinstance(config, dict):
            return config
        configurable = config.get("configurable")
        if not isinstance(configurable, dict) or not isinstance(configurable.get("thread_id"), str):
            return config
        return {**config, "configurable": {**configurable, "thread_id": self.unthread(configurable["thread_id"])}}

    def tuple_out(self, item: dict[str, Any]) -> dict[str, Any]:
        if self.tenant is None:
            return item
        return {**item, "config": self.config_out(item["config"]), "parent_config": self.config_out(item["parent_config"])}

    # memory namespaces
    @property
    def namespace_prefix(self) -> tuple[str, ...] | None:
        return (TENANTS_LABEL, self.tenant) if self.tenant is not None else None

    def namespace(self, namespace: Sequence[str]) -> tuple[str, ...]:
        return (*self.namespace_prefix, *namespace) if self.tenant is not None else tuple(namespace)

    def unnamespace(self, namespace: Sequence[str]) -> list[str]:
        labels = list(namespace)
        return labels[2:] if self.tenant is not None and tuple(labels[:2]) == self.namespace_prefix else labels


def stored_thread_to_agent(stored: str, tenant_mode: bool) -> str:
    """The agent's thread id of a stored one (tenant mode strips ``tenant:``)."""
    return stored.split(":", 1)[1] if tenant_mode and ":" in stored else stored


def list_checkpoints(
    saver: Any,
    backend_kind: str,
    scope: TenantScope,
    config: dict[str, Any] | None,
    *,
    filter: dict[str, Any] | None,
    before: dict[str, Any] | None,
    limit: int | None,
) -> Iterator[Any]:
    """``saver.list`` seen by one tenant.

    With a thread in ``config`` the thread id is already the stored one. Across threads (``config`` is
    ``None``) a tenant sees only its own: PostgreSQL filters in the query (``thread_id LIKE 'tenant:%'``,
    before ``ORDER BY`` and ``LIMIT``); SQLite and memory filter the saver's ordered results and stop after
    ``limit``. ``before`` and ``filter`` mean what they mean to the saver.
    """
    if scope.tenant is None or config is not None:
        yield from saver.list(config, filter=filter, before=before, limit=limit)
        return
    if backend_kind == "postgres":
        prefixed = {"configurable": {THREAD_PREFIX_KEY: scope.prefix}}
        for item in saver.list(prefixed, filter=filter, before=before, limit=limit):
            if scope.owns(item.config["configurable"]["thread_id"]):
                yield item
        return
    with closing(saver.list(None, filter=filter, before=before, limit=None)) as items:
        own = (item for item in items if scope.owns(item.config["configurable"]["thread_id"]))
        yield from (own if limit is None else islice(own, limit))
