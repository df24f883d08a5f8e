"""A real server with the admin API on, and a runaway request to plant in it."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass, field

import httpx
import pytest

from headroom.app.background import BackgroundServer
from headroom.config import AdminConfig, CacheConfig, Config, SchedulerConfig
from headroom.runtime.engine import Engine

ADMIN_TOKEN = "admin-token-for-tests-0123456789"
TENANT_KEY = "tenant-key-abc"


def admin_config(**admin) -> Config:
    from headroom.config import AdmissionConfig, TenantConfig

    return Config(
        cache=CacheConfig(num_blocks=512),
        scheduler=SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512),
        admission=AdmissionConfig(
            tenants=(
                TenantConfig("default"),
                TenantConfig(
                    "acme",
                    api_keys=(TENANT_KEY,),
                    rate_tokens_per_s=1e6,
                    burst_tokens=10**6,
                    max_in_flight_tokens=10**6,
                ),
            )
        ),
        admin=AdminConfig(token=ADMIN_TOKEN, **admin),
    )


@pytest.fixture(scope="module")
def admin_server(default_model):
    config = admin_config()
    server = BackgroundServer(config, Engine(config, loaded=default_model)).start()
    yield server
    server.stop()


def admin(server, method: str, path: str, token: str | None = ADMIN_TOKEN, **kwargs) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.request(method, server.url + "/admin" + path, headers=headers, timeout=60, **kwargs)


@dataclass
class Stream:
    """A streaming completion running in a thread; records what its client saw."""

    id: str | None = None
    chunks: list[dict] = field(default_factory=list)
    started: threading.Event = field(default_factory=threading.Event)
    done: threading.Event = field(default_factory=threading.Event)
    thread: threading.Thread | None = None

    @property
    def finish_reason(self) -> str | None:
        for chunk in reversed(self.chunks):
            if chunk.get("choices") and chunk["choices"][0].get("finish_reason"):
                return chunk["choices"][0]["finish_reason"]
        return None

    @property
    def text(self) -> str:
        return "".join(c["choices"][0].get("text") or "" for c in self.chunks if c.get("choices"))

    @property
    def final_choice(self) -> dict | None:
        for chunk in reversed(self.chunks):
            if chunk.get("choices") and chunk["choices"][0].get("finish_reason"):
                return chunk["choices"][0]
        return None

    def wait(self, timeout: float = 60) -> Stream:
        assert self.done.wait(timeout), "stream did not end"
        return self


def start_stream(server, body: dict, request_id: str | None = None, api_key: str | None = None) -> Stream:
    stream = Stream()
    headers = {"X-Request-Id": request_id} if request_id else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"

    def run() -> None:
        try:
            with httpx.stream(
                "POST", server.url + "/v1/completions", json={**body, "stream": True}, headers=headers, timeout=300
            ) as r:
                stream.id = r.headers.get("X-Request-Id")
                stream.started.set()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        stream.chunks.append(json.loads(line[len("data: ") :]))
        finally:
            stream.started.set()
            stream.done.set()

    stream.thread = threading.Thread(target=run, name="headroom-test-stream", daemon=True)
    stream.thread.start()
    assert stream.started.wait(60)
    return stream


RUNAWAY_PROMPT = [(13 * i) % 30000 + 100 for i in range(1500)]


def plant_runaway(server, request_id: str = "runaway", api_key: str | None = None) -> Stream:
    """A long prompt that never stops on its own: ignore_eos and a large max_tokens."""
    return start_stream(
        server,
        {"prompt": RUNAWAY_PROMPT, "max_tokens": 4000, "ignore_eos": True},
        request_id=request_id,
        api_key=api_key,
    )


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.05):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(interval)
