"""What one request costs the client: the HTTP layers RemoteReducingSaver could use, same server, same run.

    .venv/bin/python -m benchmarks.http_clients

Starts a bare ASGI app under uvicorn (so the server's cost is the same for every client) and sends the
same 4 KB POST through each client, printing wall time and client CPU per request. The client uses the
two cheapest that are not hand-written: httpx's transport directly (sync) and aiohttp (async).
"""

from __future__ import annotations

import asyncio
import time

import aiohttp
import httpx
import httpx_aiohttp

from benchmarks.floors import BODY, HEADERS, bare_server

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
            response = transport.handle_request(httpx.Request("POST", request_url, headers=headers, content=BODY))
            response.read()
            response.close()

        measure_sync("httpx.HTTPTransport (sync client)", direct)
        transport.close()
        asyncio.run(async_clients(url))


if __name__ == "__main__":
    main()
