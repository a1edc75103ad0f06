"""The async client's transport: aiohttp, one session per event loop.

aiohttp costs a quarter of httpx.AsyncClient's CPU per call (``benchmarks/http_clients.py``), and building
httpx objects around it would cost as much again, so a success makes none. aiohttp's errors become the
client's transport errors (:mod:`._transport`) here, with aiohttp's as their cause.
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import AsyncIterator
from typing import Any

import httpx

from reducing_saver.client._transport import (
    Answer,
    ConnectError,
    NetworkError,
    ReadTimeout,
    RemoteProtocolError,
    Request,
    WriteError,
)


async def _close_at_loop_shutdown(session: Any) -> AsyncIterator[None]:
    try:
        yield
    finally:
        await session.close()


class AiohttpTransport:
    """Requests through an aiohttp session of the running loop's own (redirects never followed).

    Args:
        timeout: ``connect`` and ``read`` apply (aiohttp has no write timeout).
        max_connections: At most this many connections at once.
        ssl_context: Verifies ``https://`` services (the client's, shared with the sync transport).
        proxy: The ``http://`` proxy every request goes through, or ``None``.
    """

    def __init__(
        self,
        timeout: httpx.Timeout,
        *,
        max_connections: int,
        ssl_context: ssl.SSLContext | None,
        proxy: str | None,
    ) -> None:
        self._timeout = timeout
        self._max_connections = max_connections
        self._ssl_context = ssl_context
        self._proxy = proxy
        self._session: Any = None  # aiohttp.ClientSession of self._session_loop
        self._session_loop: asyncio.AbstractEventLoop | None = None
        self._session_closer: AsyncIterator[None] | None = None

    async def exchange(self, request: Request) -> Answer:
        import aiohttp

        session = await self._aiohttp_session()
        try:
            async with session.request(
                request.method,
                request.url,
                data=request.body,
                headers=request.headers,
                allow_redirects=False,
                proxy=self._proxy,
            ) as answer:
                return Answer(answer.status, answer.headers, await answer.read())
        except TimeoutError as exc:
            raise ReadTimeout(f"no answer within the timeout ({exc})") from exc
        except aiohttp.ServerDisconnectedError as exc:
            raise RemoteProtocolError(str(exc)) from exc
        except aiohttp.ClientConnectorError as exc:
            raise ConnectError(str(exc)) from exc
        except (aiohttp.ClientOSError, aiohttp.ClientPayloadError) as exc:
            raise WriteError(str(exc)) from exc
        except aiohttp.ClientError as exc:
            raise NetworkError(str(exc)) from exc

    async def _aiohttp_session(self) -> Any:
        import aiohttp

        loop = asyncio.get_running_loop()
        # Pooled connections belong to the loop that opened them; a client used under a new loop (a second
        # asyncio.run, a per-test loop) gets a fresh session instead of sockets of a dead loop.
        if self._session is None or self._session_loop is not loop or self._session.closed:
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(
                    limit=self._max_connections, ssl=self._ssl_context if self._ssl_context else True
                ),
                timeout=aiohttp.ClientTimeout(
                    total=None, connect=self._timeout.connect, sock_read=self._timeout.read
                ),
                skip_auto_headers=("User-Agent", "Content-Type", "Accept-Encoding"),
            )
            self._session_loop = loop
            # Close the session on its own loop when that loop shuts down (asyncio.run and pytest finalize
            # async generators then), so a client used from several asyncio.run calls leaks nothing.
            self._session_closer = _close_at_loop_shutdown(self._session)
            await self._session_closer.__anext__()
        return self._session

    async def aclose(self) -> None:
        session, self._session = self._session, None
        if session is not None and self._session_loop is asyncio.get_running_loop():
            await session.close()
