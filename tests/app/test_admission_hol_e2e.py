"""With no config, long requests do not hold a short one in admission: the default
tenant may have what the KV cache holds in flight, so reservations past the old fixed
cap (16,000 tokens, which six reasoning requests filled) leave a short request to be
admitted at once, on the real server."""

from __future__ import annotations

import httpx
import pytest

from headroom.app import keys
from headroom.app.background import BackgroundServer
from headroom.config import Config
from headroom.runtime.engine import Engine
from tests.admin.conftest import start_stream, wait_until

pytestmark = pytest.mark.slow

OLD_CAP = 16_000
LONG = {"prompt": "Write a long essay about the history of the sea.", "max_tokens": 6000, "ignore_eos": True}


def test_with_no_config_a_short_request_is_admitted_beside_long_reservations(default_model):
    config = Config()  # as `headroom serve` has it
    engine = Engine(config, loaded=default_model)
    server = BackgroundServer(config, engine).start()
    streams = []
    try:
        gate = server.app[keys.GATE]
        tenant = gate.registry.default
        pool = engine.block_manager.num_blocks * engine.block_manager.block_size
        assert tenant.max_in_flight_tokens == tenant.bucket.max_in_flight_tokens == pool > OLD_CAP
        while tenant.bucket.in_flight <= OLD_CAP:
            assert len(streams) < 20, f"20 long requests reserve only {tenant.bucket.in_flight} tokens"
            before = tenant.bucket.in_flight
            streams.append(start_stream(server, LONG))
            assert wait_until(lambda: tenant.bucket.in_flight > before, timeout=60)  # noqa: B023
        # A long one may have waited for the bucket's refill (2,000 tokens/s), never for the cap.
        decisions = dict(gate.admission.decisions)
        r = httpx.post(
            server.url + "/v1/completions", json={"prompt": "Say hi.", "max_tokens": 4, "ignore_eos": True}, timeout=120
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        assert gate.admission.decisions["admit"] == decisions["admit"] + 1  # at once, not queued
        assert gate.admission.decisions.get("wait", 0) == decisions.get("wait", 0)
    finally:
        server.stop()  # aborts the long streams
    for stream in streams:
        stream.wait(30)
        assert stream.finish_reason == "abort"
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
