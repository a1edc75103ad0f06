"""API keys: parsed once from the settings, kept as SHA-256 digests, compared in constant time; and the
refusal to listen beyond loopback without them."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TENANT_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")
#: The attribute a line of the keys file may carry after the digest: the tenant's conversations are never
#: sent to the summarizer (running summaries), whatever ``summarize_tenants`` says.
NO_SUMMARY = "no-summary"
KEY_ATTRIBUTES = frozenset({NO_SUMMARY})

# -- API keys ---------------------------------------------------------------------------------------


class ApiKeys:
    """SHA-256 digests of the configured keys and their tenants; never a plain key."""

    def __init__(
        self, entries: Sequence[tuple[str, bytes]], *, no_summary: frozenset[str] = frozenset()
    ) -> None:
        self._entries = tuple(entries)
        self.tenants = frozenset(tenant for tenant, _ in entries)
        #: Tenants whose keys carry ``no-summary``: never summarized.
        self.no_summary = frozenset(no_summary)

    def __repr__(self) -> str:
        return f"ApiKeys({len(self._entries)} keys for tenants {sorted(self.tenants)})"

    def __len__(self) -> int:
        return len(self._entries)

    def owner_of(self, digest: bytes) -> str | None:
        """The tenant whose key has this SHA-256 digest, or ``None``."""
        return next(
            (tenant for tenant, expected in self._entries if hmac.compare_digest(digest, expected)), None
        )

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
    """Lines ``tenant sha256-hex [attribute ...]`` (blank lines and ``#`` comments skipped)."""
    return [(tenant, digest) for tenant, digest, _ in parse_api_keys_file_lines(path)]


def parse_api_keys_file_lines(path: str) -> list[tuple[str, bytes, frozenset[str]]]:
    """Lines ``tenant sha256-hex [attribute ...]`` as ``(tenant, digest, attributes)``; the only attribute is
    ``no-summary``, any other word is refused with its line number."""
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
        if len(parts) < 2 or not re.fullmatch(r"[0-9a-fA-F]{64}", parts[1]):
            raise ValueError(
                f"api_keys_file {path}, line {number}: expected `tenant sha256-hex-of-key [{NO_SUMMARY}]`"
            )
        _check_tenant(parts[0], f"api_keys_file {path}, line {number}")
        attributes = parts[2:]
        for attribute in attributes:
            if attribute not in KEY_ATTRIBUTES:
                raise ValueError(
                    f"api_keys_file {path}, line {number}: unknown attribute {attribute[:64]!r} "
                    f"(known: {', '.join(sorted(KEY_ATTRIBUTES))})"
                )
        if len(set(attributes)) != len(attributes):
            raise ValueError(f"api_keys_file {path}, line {number}: an attribute is given twice")
        entries.append((parts[0], bytes.fromhex(parts[1]), frozenset(attributes)))
    return entries


def load_api_keys(settings: Any) -> ApiKeys | None:
    """The configured keys (both sources together), or ``None`` when none is: single-tenant mode.

    Raises:
        ValueError: A malformed pair or line, one key given to two tenants, or a tenant with keys that
            disagree on ``no-summary`` (the attribute is the tenant's: every key of it carries it, or none).
    """
    lines: list[tuple[str, bytes, frozenset[str]]] = []
    if settings.api_keys is not None:
        lines += [(t, d, frozenset()) for t, d in parse_api_keys(settings.api_keys.get_secret_value())]
    if settings.api_keys_file:
        lines += parse_api_keys_file_lines(settings.api_keys_file)
    entries = [(tenant, digest) for tenant, digest, _ in lines]
    if not entries:
        if settings.api_keys is not None or settings.api_keys_file:
            raise ValueError("api_keys / api_keys_file are set but hold no key")
        return None
    owners: dict[bytes, str] = {}
    for tenant, digest in entries:
        if owners.setdefault(digest, tenant) != tenant:
            raise ValueError(f"api keys: one key is given to two tenants ({owners[digest]!r} and {tenant!r})")
    opted_out = {tenant for tenant, _, attributes in lines if NO_SUMMARY in attributes}
    for tenant in sorted(opted_out):
        if any(t == tenant and NO_SUMMARY not in attributes for t, _, attributes in lines):
            raise ValueError(
                f"api keys: tenant {tenant!r} has keys with and without {NO_SUMMARY}; "
                "the attribute is the tenant's, give it on every key of the tenant"
            )
    return ApiKeys(entries, no_summary=frozenset(opted_out))


#: What the metrics scraper's keys are filed under (:func:`load_metrics_keys`): not a tenant.
METRICS_SCRAPER = "metrics scraper"


def load_metrics_keys(settings: Any, tenants: ApiKeys | None) -> ApiKeys | None:
    """The keys ``/metrics`` answers, or ``None`` when none is configured: ``metrics_key`` (plain) and the
    ``sha256-hex`` lines of ``metrics_key_file`` (blank lines and ``#`` comments skipped; several lines
    let a key be rotated).

    Raises:
        ValueError: A malformed line, a file that cannot be read or holds no key, or a metrics key that is
            also a tenant's API key (``/metrics`` holds every tenant's figures: the scraper is no tenant).
    """
    digests: list[bytes] = []
    if settings.metrics_key is not None:
        digests.append(hashlib.sha256(settings.metrics_key.get_secret_value().encode()).digest())
    if settings.metrics_key_file:
        path = settings.metrics_key_file
        try:
            text = Path(path).read_text()
        except OSError as exc:
            raise ValueError(f"metrics_key_file: cannot read {path}: {exc.strerror or exc}") from None
        for number, line in enumerate(text.splitlines(), 1):
            line = line.split("#", 1)[0].strip()
            if not line:
                continue
            if not re.fullmatch(r"[0-9a-fA-F]{64}", line):
                raise ValueError(f"metrics_key_file {path}, line {number}: expected the sha256-hex of a key")
            digests.append(bytes.fromhex(line))
        if not digests:
            raise ValueError(f"metrics_key_file {path} holds no key")
    for digest in digests:
        if tenants is not None and (tenant := tenants.owner_of(digest)) is not None:
            raise ValueError(
                f"the metrics key is also tenant {tenant!r}'s API key: give the scraper a key of its own, since "
                "/metrics shows every tenant's figures"
            )
    return ApiKeys([(METRICS_SCRAPER, digest) for digest in digests]) if digests else None


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
    if is_loopback(settings.host) or settings.insecure or settings.api_key_set is not None:
        return None
    return (
        f"refusing to listen on {settings.host} without API keys: anyone who can reach it could read and "
        "write every thread. Configure keys (REDUCING_SAVER_API_KEYS_FILE or REDUCING_SAVER_API_KEYS), "
        "listen on 127.0.0.1, or pass --insecure (REDUCING_SAVER_INSECURE=true) if the network is yours alone."
    )
