"""Queue bounds, disconnects while queued, and SIGTERM drain of a real `headroom serve`."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time

import aiohttp
import httpx
import pytest

from headroom.app.background import BackgroundServer
from headroom.config import CacheConfig, Config, SchedulerConfig, ServerConfig
from headroom.runtime.engine import Engine
from tests.app.test_openai_api import wait_idle

pytestmark = pytest.mark.slow

# One running sequence, one waiting: the third concurrent request is over the bound.
SMALL = Config(
    cache=CacheConfig(num_blocks=128),
    scheduler=SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=256),
    server=ServerConfig(max_queue_len=1),
)
LONG = {"prompt": "Tell me everything about the sea.", "max_tokens": 1000, "ignore_eos": True, "stream": True}


@pytest.fixture(scope="module")
def small_server(default_model):
    srv = BackgroundServer(SMALL, Engine(SMALL, loaded=default_model)).start()
    yield srv
    srv.stop()


def test_queue_full_is_429_with_retry_after(small_server):
    async def run() -> tuple[int, dict, dict]:
        async with aiohttp.ClientSession() as session:
            url = small_server.url + "/v1/completions"
            running = await session.post(url, json=LONG)
            await running.content.readline()
            waiting = asyncio.create_task(session.post(url, json=LONG))
            while small_server.engine.scheduler.num_waiting < 1:
                await asyncio.sleep(0.01)
            async with session.post(url, json={"prompt": "x", "max_tokens": 1}) as third:
                result = third.status, dict(third.headers), await third.json()
            running.close()
            (await waiting).close()
            return result

    status, headers, body = asyncio.run(run())
    assert status == 429 and headers["Retry-After"] == "1"
    assert body["error"]["type"] == "rate_limit_error" and body["error"]["code"] == "queue_full"
    wait_idle(small_server.engine)


def test_disconnect_while_queued_never_runs(small_server):
    engine = small_server.engine
    wait_idle(engine)
    started = engine.stats.requests_started

    async def run() -> None:
        async with aiohttp.ClientSession() as session:
            url = small_server.url + "/v1/completions"
            running = await session.post(url, json=LONG)
            await running.content.readline()
            queued = await session.post(url, json=LONG)  # streaming: headers come at once
            while engine.scheduler.num_waiting < 1:
                await asyncio.sleep(0.01)
            queued.close()  # the client goes away while its request waits for a seat
            for _ in range(1000):  # the abort lands within a step or two; bounded at 10 s
                if engine.scheduler.num_waiting == 0:
                    break
                await asyncio.sleep(0.01)
            assert engine.scheduler.num_waiting == 0
            running.close()

    asyncio.run(run())
    wait_idle(engine)
    assert engine.stats.requests_started == started + 1  # only the running one ever ran


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def status_of(request) -> int:
    async with request as response:
        return response.status


def test_sigterm_drains_aborts_and_exits_zero(tmp_path):
    port = _free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "headroom.app.cli",
            "serve",
            "--port",
            str(port),
            "--drain-timeout",
            "5",
            "--num-kv-blocks",
            "256",
            "--dtype",
            "float32",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.3)
        else:
            pytest.fail("server did not come up")

        async def short_stream(session: aiohttp.ClientSession, admitted: asyncio.Event) -> str | None:
            body = {**LONG, "max_tokens": 6}
            async with session.post(url + "/v1/completions", json=body) as r:
                admitted.set()  # headers come after admission: the server has it in flight
                finish = None
                async for line in r.content:
                    if line.startswith(b"data: {"):
                        finish = json.loads(line[6:])["choices"][0]["finish_reason"] or finish
                return finish

        async def run() -> tuple[list[bytes], int, int]:
            async with aiohttp.ClientSession() as session:
                # Nearly all the KV cache this server has: no CPU decodes them within the
                # 5 s drain, so only the drain can end this stream.
                resp = await session.post(url + "/v1/completions", json={**LONG, "max_tokens": 4000})
                events = [await resp.content.readline()]
                # Under load: short streams in flight when the signal comes finish normally.
                admitted = [asyncio.Event() for _ in range(4)]
                shorts = [asyncio.create_task(short_stream(session, a)) for a in admitted]
                await asyncio.wait_for(asyncio.gather(*(a.wait() for a in admitted)), 60)
                proc.send_signal(signal.SIGTERM)
                # /health turning 503 is the drain beginning; the deadline is a safety net only.
                deadline = time.monotonic() + 60
                while (health_status := await status_of(session.get(url + "/health"))) != 503:
                    assert health_status == 200 and time.monotonic() < deadline, health_status
                    await asyncio.sleep(0.02)
                late_status = await status_of(session.post(url + "/v1/completions", json={"prompt": "x"}))
                async for line in resp.content:
                    events.append(line)
                assert await asyncio.gather(*shorts) == ["length"] * 4
                return events, late_status

        events, late_status = asyncio.run(run())
        assert late_status == 503
        data = [e for e in events if e.startswith(b"data: ")]
        assert len(data) >= 2, events[:5]
        assert data[-1] == b"data: [DONE]\n"
        last = json.loads(data[-2][len(b"data: ") :])
        # Cut by the drain timeout: 5 s leaves the short streams (6 tokens) room on a busy
        # machine, and is far short of the 4,000 tokens the long one asks for.
        assert last["choices"][0]["finish_reason"] == "abort"
        _, err = proc.communicate(timeout=30)
        assert proc.returncode == 0, err.decode()[-2000:]
        assert b"Traceback" not in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
