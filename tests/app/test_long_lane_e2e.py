"""Head-of-line protection out of the box: a server with the default config (admission
on, one tenant, no long-lane settings) lets a short request that arrives during a long
prompt's prefill start before that prefill ends. Under FCFS the running prefill takes
the whole token budget of every step, so the short one would wait for all of it."""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from headroom.app.background import BackgroundServer
from headroom.config import AdminConfig, Config, ObservabilityConfig
from headroom.runtime.engine import Engine
from tests.app.test_openai_api import wait_idle

pytestmark = pytest.mark.slow

ADMIN_TOKEN = "admin-token-for-long-lane-tests"
LONG_PROMPT = [(31 * i) % 20000 + 300 for i in range(1800)]  # classed long by its prompt alone


@pytest.fixture(scope="module")
def server(default_model):
    config = Config(admin=AdminConfig(token=ADMIN_TOKEN))  # everything else as `headroom serve` has it
    srv = BackgroundServer(config, Engine(config, loaded=default_model)).start()
    yield srv
    srv.stop()


class Stream:
    """A streaming completion in a thread, with the monotonic time of its first token."""

    def __init__(self, server, body: dict):
        self.first_token_at: float | None = None
        self.chunks: list[dict] = []
        self.error: Exception | None = None
        self.thread = threading.Thread(target=self._run, args=(server, body), name="headroom-test-stream", daemon=True)
        self.thread.start()

    def _run(self, server, body: dict) -> None:
        try:
            with httpx.stream("POST", server.url + "/v1/completions", json={**body, "stream": True}, timeout=300) as r:
                assert r.status_code == 200, r.read()
                for line in r.iter_lines():
                    if line.startswith("data: {"):
                        chunk = json.loads(line[len("data: ") :])
                        if chunk["choices"] and self.first_token_at is None:
                            self.first_token_at = time.monotonic()
                        self.chunks.append(chunk)
        except (httpx.HTTPError, AssertionError, ValueError) as exc:  # reported by join()
            self.error = exc

    def join(self) -> Stream:
        self.thread.join(300)
        assert not self.thread.is_alive(), "stream did not end"
        if self.error is not None:
            raise self.error
        return self

    @property
    def finish_reason(self) -> str | None:
        return next(
            (
                c["choices"][0]["finish_reason"]
                for c in reversed(self.chunks)
                if c["choices"] and c["choices"][0].get("finish_reason")
            ),
            None,
        )


def long_sequence(engine: Engine):
    return next((s for s in engine.snapshot().sequences if s.size_class == "long"), None)


def test_a_short_request_starts_during_a_long_prefill_with_default_settings(server):
    engine = server.engine
    # A short request decoding throughout: the long lane protects running short work too.
    background = Stream(server, {"prompt": "Count to one hundred:", "max_tokens": 120, "ignore_eos": True})
    deadline = time.monotonic() + 60
    while background.first_token_at is None and time.monotonic() < deadline:
        time.sleep(0.01)
    long = Stream(server, {"prompt": LONG_PROMPT, "max_tokens": 4, "ignore_eos": True})
    # Send the second short request once the long prefill is under way but not done.
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        seq = long_sequence(engine)
        if seq is not None and seq.tokens_processed > 0:
            break
        time.sleep(0.005)
    seq = long_sequence(engine)
    assert seq is not None and 0 < seq.tokens_processed < len(LONG_PROMPT), seq
    short = Stream(server, {"prompt": "Say hi.", "max_tokens": 8, "ignore_eos": True})

    short.join()
    long.join()
    assert short.first_token_at is not None and long.first_token_at is not None
    assert short.first_token_at < long.first_token_at, "the short request waited for the whole long prefill"
    assert short.finish_reason == "length" and long.finish_reason == "length"

    background.join()
    wait_idle(engine)
    stats = httpx.get(
        server.url + "/admin/stats", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
    ).json()["long_lane"]
    assert stats["enabled"] is True and stats["factor"] == 1.0
    assert stats["short_ttft_target_s"] == engine.config.scheduler.short_ttft_target_s
    assert stats["allowance_s"] is None  # idle: no long prompt left to size a chunk for
    assert stats["steps_observed"] > 0 and stats["step_cost"] is not None, stats
    assert stats["step_cost"]["per_token_s"] > 0, stats
    assert stats["chunk_tokens"]["0"] >= stats["chunk_tokens"]["4096"] > 0, stats
    assert stats["actions"] == {"tighten": 0, "relax": 0}


@pytest.fixture(scope="module")
def sensitive(default_model):
    """A server whose head-of-line monitor calls any short first token beside a long
    prompt a coupling: the real signal, thresholds low enough to trip. Its interval (0.5 s)
    outlasts any step, so a tightened factor reaches the scheduler before a relax can."""
    config = Config(
        admin=AdminConfig(token=ADMIN_TOKEN),
        observability=ObservabilityConfig(monitor_interval_s=0.5, hol_short_ttft_p99_s=0.001, hol_long_share=0.01),
    )
    srv = BackgroundServer(config, Engine(config, loaded=default_model)).start()
    yield srv
    srv.stop()


def test_the_head_of_line_signal_reaches_the_long_lane_through_the_server(sensitive):
    # The wiring end to end: observability measures coupling, the server's control task
    # hands it to the engine, the scheduler's long lane narrows, /admin/stats and
    # /metrics say so. Any break in that chain leaves the scheduler's factor at 1.0. The
    # factor is watched as it runs: once the long prompt is done the loop relaxes it again.
    admin = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
    lane_factors: set[float] = set()
    watching = threading.Event()

    def watch() -> None:
        while not watching.wait(0.002):
            lane_factors.add(sensitive.engine.scheduler.lane.factor)

    watcher = threading.Thread(target=watch, name="headroom-test-lane-watch", daemon=True)
    watcher.start()
    long = Stream(sensitive, {"prompt": LONG_PROMPT * 2, "max_tokens": 64, "ignore_eos": True})
    lane, deadline = None, time.monotonic() + 120
    try:
        while time.monotonic() < deadline:
            short = Stream(sensitive, {"prompt": "Say hi.", "max_tokens": 2, "ignore_eos": True}).join()
            assert short.finish_reason == "length"
            lane = httpx.get(sensitive.url + "/admin/stats", headers=admin, timeout=30).json()["long_lane"]
            if lane["actions"]["tighten"] > 0:
                break
        assert lane is not None and lane["actions"]["tighten"] > 0, lane
        while min(lane_factors) == 1.0 and time.monotonic() < deadline:
            time.sleep(0.01)  # the tighten crosses the engine's inbox at its next step
        assert min(lane_factors) < 1.0, (lane_factors, lane)
    finally:
        watching.set()
        watcher.join()
        long.join()
    metrics = httpx.get(sensitive.url + "/metrics", headers=admin, timeout=30).text
    tightened = [
        line for line in metrics.splitlines() if line.startswith('headroom:hol_actions_total{action="tighten"}')
    ]
    assert tightened and float(tightened[0].split()[-1]) >= 1, tightened
