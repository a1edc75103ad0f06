"""What one request costs the client: the HTTP layers RemoteReducingSaver could use, same server, same run.

    .venv/bin/python -m benchmarks.http_clients

Starts a bare ASGI app under uvicorn (so the server's cost is the same for every client) and sends the
same 4 KB POST through each client, printing wall time and client CPU per request. The client uses the
two cheapest that are not hand-written: the standard library's ``http.client`` over its own connection
pool (sync, ``reducing_saver.client._stdlib_http``; a bare kept-alive ``HTTPConnection`` shows what the
pool adds) and aiohttp (async). httpx's transport (what the sync client used before, and still uses for
a ``transport`` passed to it) and a urllib3 pool are measured beside them.
"""

from __future__ import annotations

import asyncio
import http.client
import time

import aiohttp
import httpx
import httpx_aiohttp
import urllib3

from benchmarks.floors import BODY, HEADERS, bare_server
from reducing_saver.client._stdlib_http import ConnectionPool

N = 2000


def report(name: str, wall: float, cpu: float) -> None:
    print(f"{name:34} {wall / N * 1e3:6.3f} ms wall  {cpu / N * 1e6:6.0f} us client CPU")


def measure_sync(name: str, send) -> None:
    for _ in range(200):
        send()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(N):
        send()
    report(name, time.perf_counter() - wall, time.process_time() - cpu)


async def measure_async(name: str, send) -> None:
    for _ in range(200):
        await send()
    wall, cpu = time.perf_counter(), time.process_time()
    for _ in range(N):
        await send()
    report(name, time.perf_counter() - wall, time.process_time() - cpu)


async def async_clients(url: str) -> None:
    async with httpx.AsyncClient(headers=HEADERS) as client:
        await measure_async("httpx.AsyncClient", lambda: client.post(url, content=BODY))
    async with httpx.AsyncClient(headers=HEADERS, transport=httpx_aiohttp.AiohttpTransport()) as client:
        await measure_async("httpx.AsyncClient + AiohttpTransport", lambda: client.post(url, content=BODY))
    async with aiohttp.ClientSession(headers=HEADERS) as session:

        async def post() -> None:
            async with session.post(url, data=BODY) as answer:
                await answer.read()

        await measure_async("aiohttp.ClientSession (async client)", post)


def main() -> None:
    with bare_server() as (url, _server):
        with httpx.Client(headers=HEADERS) as client:
            measure_sync("httpx.Client", lambda: client.post(url, content=BODY))
        transport = httpx.HTTPTransport()
        request_url, headers = httpx.URL(url), httpx.Headers(HEADERS)

        def direct() -> None:
            response = transport.handle_request(
                httpx.Request("POST", request_url, headers=headers, content=BODY)
            )
            response.read()
            response.close()

        measure_sync("httpx.HTTPTransport", direct)
        transport.close()
        with urllib3.PoolManager(headers=HEADERS) as manager:
            measure_sync("urllib3.PoolManager", lambda: manager.request("POST", url, body=BODY).data)
        target = request_url.raw_path.decode()
        connection = http.client.HTTPConnection(request_url.host, request_url.port)

        def kept_alive() -> None:
            connection.request("POST", target, BODY, HEADERS)
            connection.getresponse().read()

        measure_sync("http.client.HTTPConnection", kept_alive)
        connection.close()
        pool = ConnectionPool(
            request_url, httpx.Timeout(30.0), max_connections=100, max_idle=20, keepalive_expiry=5.0
        )
        measure_sync("http.client pool (sync client)", lambda: pool.request("POST", target, BODY, HEADERS))
        pool.close()
        asyncio.run(async_clients(url))


if __name__ == "__main__":
    main()
