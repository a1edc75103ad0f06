"""What a connection to the service is set up from, checked before any request: the API key, extra headers,
credentials in the URL, the environment's proxy; and the set-up mistakes that no retry can fix.
"""

from __future__ import annotations

import base64
import os
import re
import socket
import ssl
import urllib.request
from collections.abc import Mapping

import httpx

#: The environment variable holding the API key when none is given.
API_KEY_ENV = "REDUCING_SAVER_API_KEY"

#: ``getaddrinfo`` errors that say the name does not exist (a temporary failure, ``EAI_AGAIN``, may pass).
_NO_SUCH_HOST = frozenset(
    getattr(socket, name) for name in ("EAI_NONAME", "EAI_NODATA", "EAI_FAIL") if hasattr(socket, name)
)


def unfixable_cause(exc: BaseException) -> str | None:
    """What makes a connection fail whatever the service does (one line), or ``None``.

    An unknown host, ``https://`` against a service that speaks plain HTTP, and a TLS certificate that
    does not verify are mistakes of the URL or of the set-up: waiting for the service cannot fix them,
    so no retry (nor ``startup_timeout``) waits on them. Looks through the chain of causes that
    ``http.client``, aiohttp and httpx transports leave (``__cause__``, aiohttp's ``os_error`` and
    ``certificate_error``).
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        # aiohttp's wrappers subclass the ssl errors without their attributes: theirs are further down.
        if isinstance(current, ssl.SSLCertVerificationError) and hasattr(current, "verify_message"):
            return (
                f"its TLS certificate does not verify (CERTIFICATE_VERIFY_FAILED: {current.verify_message}); "
                "to trust a CA of your own, set SSL_CERT_FILE"
            )
        if isinstance(current, ssl.SSLError) and getattr(current, "reason", None) == "WRONG_VERSION_NUMBER":
            return "the service answers in plain HTTP, not TLS (WRONG_VERSION_NUMBER): use an http:// URL"
        if isinstance(current, socket.gaierror) and current.errno in _NO_SUCH_HOST:
            return f"no such host ({current.strerror})"
        pending += [
            current.__cause__,
            current.__context__,
            getattr(current, "os_error", None),
            getattr(current, "certificate_error", None),
        ]
    return None


#: What an HTTP header value may hold (RFC 9110 field-vchar and inner spaces); h11 (under an httpx
#: transport) refuses anything else at send time with an error that quotes the value.
_HEADER_VALUE = re.compile(r"[\x21-\x7e]+(?:[ \t]+[\x21-\x7e]+)*")
#: What an HTTP header name may be (an RFC 9110 token). http.client sends some names that are not (one
#: holding a space), which the server then refuses with a 400.
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


def clean_api_key(api_key: str | None) -> str | None:
    """The API key to send: the argument, else ``REDUCING_SAVER_API_KEY``, without surrounding whitespace.

    A key read from a secret file usually ends with a newline, which is not part of the key; it is
    stripped. A key that still holds a character no header may carry is refused here, naming where it
    came from but never the key (http.client or h11 would refuse it on the first request, quoting it).
    """
    source = "api_key"
    if api_key is None:
        api_key, source = os.environ.get(API_KEY_ENV), API_KEY_ENV
    if api_key is None:
        return None
    api_key = api_key.strip()
    if api_key and not _HEADER_VALUE.fullmatch(api_key):
        raise ValueError(
            f"{source} holds a character an HTTP header cannot carry (a control character, an inner line "
            "break or a non-ASCII character); the key is not shown"
        )
    return api_key


def environment_proxy(url: httpx.URL) -> httpx.URL | None:
    """The proxy the environment names for ``url``, as httpx's ``trust_env`` reads it, or ``None``.

    ``HTTPS_PROXY``/``HTTP_PROXY`` by the URL's scheme, else ``ALL_PROXY`` (upper or lower case);
    ``NO_PROXY`` (host names, domains, ``*``) leaves hosts out. The proxy must be an ``http://`` URL
    (credentials in it are sent as ``Proxy-Authorization``); ``https://`` targets go through a
    ``CONNECT`` tunnel, ``http://`` ones as absolute-form requests.

    Raises:
        ValueError: If the variable names a proxy of another scheme (``socks5://``, ``https://``).
    """
    proxies = urllib.request.getproxies_environment()
    name, proxy = url.scheme, proxies.get(url.scheme) or proxies.get("all")
    # proxy_bypass_environment: the standard library's NO_PROXY rule, undocumented and left out of typeshed.
    if not proxy or urllib.request.proxy_bypass_environment(url.host, proxies):  # type: ignore[attr-defined]
        return None
    if "://" not in proxy:  # "proxy:3128", as curl and httpx accept it
        proxy = f"http://{proxy}"
    parsed = httpx.URL(proxy)
    if parsed.scheme != "http":
        raise ValueError(
            f"the environment's proxy for {name}:// URLs is a {parsed.scheme}:// URL; the client speaks to "
            "http:// proxies only (pass trust_env=False to ignore HTTP_PROXY/HTTPS_PROXY/ALL_PROXY)"
        )
    return parsed


def _basic_auth(url: httpx.URL, api_key: str | None, headers: Mapping[str, str] | None) -> str:
    """The ``Authorization`` header for the credentials of ``http://user:password@host``.

    Both transports send them, as Basic auth (for a reverse proxy that asks for it). A request carries
    one ``Authorization`` header, so credentials in the URL together with an API key or an
    ``Authorization`` header of ``headers`` are refused, naming both.
    """
    other = "an api_key (or REDUCING_SAVER_API_KEY)" if api_key else None
    if any(name.lower() == "authorization" for name in headers or ()):
        other = "headers['Authorization']"
    if other:
        raise ValueError(
            f"the URL holds credentials (user:password@, sent as Basic auth) and {other} is given: a "
            "request carries one Authorization header; keep one of them"
        )
    credentials = f"{url.username}:{url.password}".encode()
    return "Basic " + base64.b64encode(credentials).decode("ascii")


def check_headers(headers: Mapping[str, str]) -> None:
    """Refuse, by name, a header that http.client, h11 or aiohttp would refuse at send time quoting the value
    (maybe a secret)."""
    for name, value in headers.items():
        if not _HEADER_NAME.fullmatch(name):
            raise ValueError(f"headers[{name!r}]: not a valid HTTP header name")
        if value and not _HEADER_VALUE.fullmatch(value):
            raise ValueError(
                f"headers[{name!r}] holds a character an HTTP header cannot carry (a control character, "
                "a line break or a non-ASCII character); the value is not shown"
            )


def authorization(url: httpx.URL, api_key: str | None, headers: Mapping[str, str] | None) -> str | None:
    """The ``Authorization`` header to send: Basic auth for credentials in ``url``, else ``Bearer`` and the
    API key (:func:`clean_api_key`), else ``None``."""
    api_key = clean_api_key(api_key)
    if url.userinfo:
        return _basic_auth(url, api_key, headers)
    return f"Bearer {api_key}" if api_key else None
