"""Structured logs on the real server: one JSON line per finished request, the request id
bound for every line its handler logs, and no prompt text unless asked for."""

from __future__ import annotations

import dataclasses
import io
import json
import logging
import time

import httpx
import pytest

from headroom.app.background import BackgroundServer
from headroom.config import CacheConfig, Config, ObservabilityConfig
from headroom.observability.logs import configure_logging
from headroom.runtime.engine import Engine

pytestmark = pytest.mark.slow

SECRET = "my password is hunter2"


@pytest.fixture
def json_log():
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    stream = io.StringIO()
    configure_logging("json", "INFO", stream=stream)
    yield stream
    root.handlers, _ = saved
    root.setLevel(saved[1])


def lines(stream: io.StringIO) -> list[dict]:
    return [json.loads(line) for line in stream.getvalue().splitlines() if line.strip()]


def finished_lines(stream: io.StringIO, count: int, timeout: float = 10.0) -> list[dict]:
    deadline = time.monotonic() + timeout
    while True:
        found = [x for x in lines(stream) if x["event"] == "request finished"]
        if len(found) >= count or time.monotonic() > deadline:
            return found
        time.sleep(0.02)


def serve(default_model, log_prompts: bool) -> BackgroundServer:
    config = Config(cache=CacheConfig(num_blocks=128), observability=ObservabilityConfig(log_prompts=log_prompts))
    return BackgroundServer(config, Engine(config, loaded=default_model)).start()


def test_one_json_line_per_request_without_the_prompt(default_model, json_log):
    server = serve(default_model, log_prompts=False)
    try:
        body = {"messages": [{"role": "user", "content": SECRET}], "max_tokens": 3, "ignore_eos": True}
        r = httpx.post(server.url + "/v1/chat/completions", json=body, headers={"X-Request-Id": "abc123"}, timeout=60)
        assert r.status_code == 200
        # Too long for the context: fails after the request id is bound.
        huge = {"prompt": [5] * 8000, "max_tokens": 500}
        r2 = httpx.post(server.url + "/v1/completions", json=huge, headers={"X-Request-Id": "big1"}, timeout=60)
        assert r2.status_code == 400
        done = finished_lines(json_log, 2)
    finally:
        server.stop()
    assert SECRET not in json_log.getvalue()
    ok, failed = done
    usage = r.json()["usage"]
    assert ok["request_id"] == "chatcmpl-abc123" and ok["level"] == "info" and ok["logger"] == "headroom.requests"
    assert ok["http_status"] == 200 and ok["finish_reason"] == "length"
    assert ok["tenant"] == "default" and ok["tier"] == "standard" and ok["size_class"] == "short"
    assert ok["prompt_tokens"] == usage["prompt_tokens"] and ok["output_tokens"] == usage["completion_tokens"] == 3
    assert 0 <= ok["queue_wait_s"] <= ok["ttft_s"] <= ok["e2e_s"]
    assert ok["device_time_s"] > 0 and ok["admission_decision"] == "admit"
    assert ok["trace_id"] is None  # tracing is off in this test
    assert "prompt" not in ok
    assert failed["request_id"] == "cmpl-big1" and failed["http_status"] == 400 and failed["ran"] is False
    assert failed["error"].startswith("context_length_exceeded: This model's maximum context length is")
    # The error middleware's own line carries the bound request id.
    [error_line] = [x for x in lines(json_log) if x["event"].startswith("request failed")]
    assert error_line["request_id"] == "cmpl-big1"


def test_prompt_logging_is_opt_in(default_model, json_log):
    server = serve(default_model, log_prompts=True)
    try:
        body = {"messages": [{"role": "user", "content": SECRET}], "max_tokens": 2}
        assert httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).status_code == 200
        [line] = finished_lines(json_log, 1)
    finally:
        server.stop()
    assert line["prompt"] == [{"role": "user", "content": SECRET}]


def test_every_field_of_a_finished_request_can_be_logged():
    from headroom.observability.finished import FinishedRequest

    names = {f.name for f in dataclasses.fields(FinishedRequest)}
    # LogRecord attributes cannot be passed as `extra`; a clash would raise at log time.
    reserved = set(vars(logging.LogRecord("n", 0, "p", 0, "m", None, None)))
    assert not names & reserved
