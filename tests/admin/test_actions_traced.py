"""An admin action is recorded on the affected sequence's span and in the log."""

from __future__ import annotations

import logging

import pytest

from headroom.app.background import BackgroundServer
from headroom.runtime.engine import Engine
from tests.admin.conftest import admin, admin_config, plant_runaway, wait_until
from tests.observability.test_tracing_otlp import Collected, GrpcReceiver, attributes

pytestmark = pytest.mark.slow


def test_abort_is_on_the_span_and_in_the_log(monkeypatch, default_model, caplog):
    collected = Collected()
    receiver = GrpcReceiver(collected)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    config = admin_config()
    server = BackgroundServer(config, Engine(config, loaded=default_model)).start()
    try:
        runaway = plant_runaway(server, "traced")
        rid = "cmpl-traced"
        assert wait_until(lambda: any(s.request_id == rid for s in server.engine.snapshot().sequences))
        with caplog.at_level(logging.INFO, logger="headroom.admin"):
            assert admin(server, "POST", f"/sequences/{rid}/abort", json={"reason": "too big"}).status_code == 200
        assert runaway.wait().finish_reason == "abort"
    finally:
        server.stop()
        receiver.stop()
    [span] = [s for _, s in collected.spans if s.name == "POST /v1/completions"]
    attrs = attributes(span.attributes)
    assert attrs["gen_ai.response.id"] == rid
    assert attrs["headroom.admin_actions"] == ["abort by admin: too big"]
    assert attrs["headroom.abort_cause"] == "admin"
    assert attrs["gen_ai.response.finish_reasons"] == ["abort"]
    [line] = [r for r in caplog.records if r.getMessage() == "admin action"]
    assert (line.action, line.sequence, line.action_args) == ("abort", rid, {"reason": "too big"})
