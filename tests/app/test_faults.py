"""Faults on the real server: a model step that raises, and hundreds of clients that
hang up at random points. Afterwards nothing is left: no KV block, no reserved tenant
token, no engine sequence, no stray asyncio task."""

from __future__ import annotations

import asyncio
import json
import random

import aiohttp
import httpx
import pytest

from headroom.app import keys
from headroom.app.background import BackgroundServer
from headroom.config import CacheConfig, Config, SchedulerConfig, ServerConfig
from headroom.contracts.request import Request, RequestStatus
from headroom.runtime.engine import Engine
from tests.admin.conftest import wait_until
from tests.app.test_openai_api import wait_idle
from tests.steps import before_each_step

pytestmark = pytest.mark.slow


@pytest.fixture
def server(default_model):
    config = Config(
        cache=CacheConfig(num_blocks=512),
        scheduler=SchedulerConfig(max_num_seqs=1),
        server=ServerConfig(max_queue_len=1024),
    )
    srv = BackgroundServer(config, Engine(config, loaded=default_model)).start()
    yield srv
    srv.stop()


def events(text: str) -> list[dict]:
    return [json.loads(line[len("data: ") :]) for line in text.splitlines() if line.startswith("data: {")]


def fail_step(request_id: str, nth: int):
    """An engine fault hook that raises in the nth step whose batch carries request_id."""
    steps = 0

    def fault(out) -> None:
        nonlocal steps
        if any(r.request_id == request_id for r in out.requests):
            steps += 1
            if steps == nth:
                raise RuntimeError("injected device fault")

    return fault


def fail_step_beside(engine, request_id: str, waiting: str):
    """A fault in the first step of request_id taken while `waiting` is in the engine's
    scheduler (queued behind it: max_num_seqs=1), so a fault path that failed every
    sequence the engine holds would fail that one too."""
    fired = False

    def fault(out) -> None:
        nonlocal fired
        if not fired and any(r.request_id == request_id for r in out.requests) and waiting in engine.scheduler.requests:
            fired = True
            raise RuntimeError("injected device fault")

    return fault


def test_a_failing_step_fails_only_its_sequences(server):
    engine = server.engine
    with before_each_step(engine, fail_step_beside(engine, "cmpl-victim", "cmpl-bystander")):
        body = {"prompt": "Once upon a time", "max_tokens": 20, "ignore_eos": True, "stream": True}

        async def both() -> tuple[str, str]:
            async with aiohttp.ClientSession() as session:

                async def one(rid: str, max_tokens: int) -> str:
                    async with session.post(
                        server.url + "/v1/completions",
                        json={**body, "max_tokens": max_tokens},
                        headers={"X-Request-Id": rid},
                    ) as r:
                        assert r.status == 200
                        return await r.text()

                # The victim runs until the fault: long enough that the bystander is queued
                # in the scheduler beside it (max_num_seqs=1 keeps it out of the victim's steps).
                victim = asyncio.create_task(one("victim", 4000))
                await asyncio.sleep(0.2)
                bystander = asyncio.create_task(one("bystander", 20))
                return await victim, await bystander

        victim, bystander = server.call(both())
        [error] = [e for e in events(victim) if "error" in e]
        assert error["error"] == {
            "message": "engine error: injected device fault",
            "type": "server_error",
            "param": None,
            "code": "engine_error",
        }
        assert victim.rstrip().endswith("data: [DONE]")
        chunks = events(bystander)
        assert chunks[-1]["choices"][0]["finish_reason"] == "length"
        assert sum(1 for c in chunks if c["choices"][0]["text"]) >= 1
        # The engine keeps serving, the victim's blocks are free, and its abort is counted.
        r = httpx.post(
            server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 3, "ignore_eos": True}, timeout=60
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
        wait_idle(engine)
        engine.block_manager.check_invariants()
        assert engine.counters().aborts["engine_error"] == 1


def test_a_failing_step_is_a_500_engine_error_for_a_non_streaming_request(server):
    engine = server.engine
    with before_each_step(engine, fail_step("cmpl-plain", 2)):
        r = httpx.post(
            server.url + "/v1/completions",
            timeout=60,
            headers={"X-Request-Id": "plain"},
            json={"prompt": "Once upon a time", "max_tokens": 20, "ignore_eos": True},
        )
        assert r.status_code == 500 and r.headers["Content-Type"].startswith("application/json")
        assert r.json() == {
            "error": {
                "message": "engine error: injected device fault",
                "type": "server_error",
                "param": None,
                "code": "engine_error",
            }
        }
        wait_idle(engine)
        engine.block_manager.check_invariants()
        assert engine.counters().aborts["engine_error"] == 1
        assert server.app[keys.ENGINE].submitted == {}


async def hang_up(url: str, rng: random.Random, prompt: list[int], rid: str) -> tuple[str, int]:
    """One client that leaves at a random point. Returns where it left, as the client saw
    it, and how many text chunks it had read by then."""
    where = rng.choice(["mid_body", "before_headers", "after_headers", "mid_decode"])
    host, port = url.removeprefix("http://").split(":")
    if where == "mid_body":
        _, writer = await asyncio.open_connection(host, int(port))
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"X-Request-Id: " + rid.encode() + b"\r\n"
            b'Content-Length: 500\r\n\r\n{"prompt": "half a bo'
        )
        await writer.drain()
        await asyncio.sleep(rng.uniform(0, 0.05))
        writer.close()
        return where, 0
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
    async with aiohttp.ClientSession() as session:
        task = asyncio.create_task(session.post(url + "/v1/completions", json=body, headers={"X-Request-Id": rid}))
        if where == "before_headers":
            await asyncio.sleep(rng.uniform(0.0, 0.2))
            if task.cancel():
                try:
                    await task
                except (asyncio.CancelledError, aiohttp.ClientError):
                    return where, 0
            where = "after_headers"  # the headers came first
        response = await task
        async with response:
            assert response.status == 200
            want = rng.randint(1, 6) if where == "mid_decode" else 0
            read = 0
            async for line in response.content:
                if read == want:
                    break
                if line.startswith(b"data: {") and json.loads(line[len(b"data: ") :])["choices"][0]["text"]:
                    read += 1
    return where, read


MAX_TOKENS = 24


def test_500_clients_that_hang_up_leave_nothing_behind(default_model):
    config = Config(
        cache=CacheConfig(num_blocks=512),
        scheduler=SchedulerConfig(max_num_seqs=32),
        server=ServerConfig(max_queue_len=1024),
    )
    server = BackgroundServer(config, Engine(config, loaded=default_model)).start()
    engine = server.engine
    submitted: dict[str, Request] = {}
    submit = engine.submit

    def record(request: Request, sink) -> None:
        submitted[request.request_id] = request
        submit(request, sink)

    engine.submit = record
    try:
        idle_tasks = server.call(_task_count())
        rng = random.Random(7)
        prompts = [[rng.randrange(100, 40000) for _ in range(rng.randint(8, 300))] for _ in range(50)]

        async def crowd() -> list[tuple[str, str, int]]:
            left = []
            for wave in range(10):  # 10 waves of 50 concurrent clients
                rids = [f"w{wave}-{i}" for i in range(50)]
                wheres = await asyncio.gather(*(hang_up(server.url, rng, prompts[i], rids[i]) for i in range(50)))
                left += [(f"cmpl-{rid}", where, read) for rid, (where, read) in zip(rids, wheres, strict=True)]
            return left

        left = asyncio.run(crowd())
        client = server.app[keys.ENGINE]
        gate = server.app[keys.GATE]
        wait_idle(engine, timeout=60)
        assert wait_until(lambda: not client.submitted, timeout=30)

        # What the engine saw of each client, by where the client left.
        by_label: dict[str, list[Request | None]] = {}
        for rid, where, _ in left:
            by_label.setdefault(where, []).append(submitted.get(rid))
        assert set(by_label) == {"mid_body", "before_headers", "after_headers", "mid_decode"}, {
            k: len(v) for k, v in by_label.items()
        }
        assert all(r is None for r in by_label["mid_body"])  # a half body never reaches the engine
        for request in submitted.values():  # everything that reached it was cut short by its client
            assert request.status is RequestStatus.FINISHED_ABORTED, (request.request_id, request.status)
            assert request.abort_cause == "client_disconnect"
            assert request.num_output_tokens < MAX_TOKENS
        for rid, where, read in left:
            if where in ("after_headers", "mid_decode"):  # headers come after admission: it was submitted
                assert submitted[rid].num_output_tokens >= read, (rid, where, read)
        assert engine.counters().aborts["client_disconnect"] == len(submitted)
        # Engine-side progress at the abort: some left before their first token (waiting or
        # mid-prefill), some mid-decode.
        outputs = [r.num_output_tokens for r in submitted.values()]
        assert sum(1 for n in outputs if n == 0) >= 1 and sum(1 for n in outputs if n > 0) >= 1

        assert engine.scheduler.requests == {}
        assert engine.block_manager.num_used_blocks == 0
        engine.block_manager.check_invariants()
        assert all(t.bucket.in_flight == 0 for t in gate.registry)
        assert gate.admission.in_flight_seqs == 0
        assert wait_until(lambda: server.call(_task_count()) <= idle_tasks, timeout=30), (
            f"{server.call(_task_count())} tasks left, {idle_tasks} when idle"
        )
        # And it still serves.
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
        assert r.status_code == 200
    finally:
        server.stop()


async def _task_count() -> int:
    return len(asyncio.all_tasks()) - 1  # not counting the task asking
