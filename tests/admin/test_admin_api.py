"""Every admin endpoint on the real server: exact status codes and exact effects."""

from __future__ import annotations

import threading

import httpx
import pytest

from headroom.app import keys
from tests.admin.conftest import (
    ADMIN_TOKEN,
    TENANT_KEY,
    admin,
    plant_runaway,
    start_stream,
    wait_until,
)
from tests.app.test_openai_api import wait_idle

pytestmark = pytest.mark.slow


def error(r) -> dict:
    return r.json()["error"]


@pytest.mark.parametrize(
    "method,path",
    [
        ("GET", "/sequences"),
        ("GET", "/sequences/x"),
        ("POST", "/sequences/x/abort"),
        ("POST", "/sequences/x/deprioritize"),
        ("POST", "/sequences/x/cap"),
        ("GET", "/tenants"),
        ("PATCH", "/tenants/default"),
        ("POST", "/predictor/reload"),
        ("GET", "/stats"),
    ],
)
def test_every_endpoint_needs_the_admin_token(admin_server, method, path):
    r = admin(admin_server, method, path, token=None)
    assert r.status_code == 401 and error(r)["code"] == "invalid_admin_token"
    r = admin(admin_server, method, path, token="wrong-token-wrong-token")
    assert r.status_code == 401 and error(r)["code"] == "invalid_admin_token"
    r = admin(admin_server, method, path, token=TENANT_KEY)
    assert r.status_code == 403
    assert error(r) == {
        "message": "tenant API keys cannot use the admin API",
        "type": "permission_error",
        "param": None,
        "code": "admin_forbidden",
    }


def test_unknown_sequence_is_404_everywhere(admin_server):
    for method, path in [
        ("GET", "/sequences/nope"),
        ("POST", "/sequences/nope/abort"),
        ("POST", "/sequences/nope/deprioritize"),
    ]:
        r = admin(admin_server, method, path)
        assert r.status_code == 404 and error(r)["code"] == "sequence_not_found", path
    r = admin(admin_server, "POST", "/sequences/nope/cap", json={"max_tokens": 3})
    assert r.status_code == 404


def test_bad_bodies_are_422(admin_server):
    cases = [
        ("/sequences/x/cap", {}, "max_tokens: Field required"),
        ("/sequences/x/cap", {"max_tokens": 0}, "max_tokens: Input should be greater than or equal to 1"),
        ("/sequences/x/cap", {"max_tokens": "5"}, "max_tokens: Input should be a valid integer"),
        ("/sequences/x/abort", {"why": "x"}, "why: Extra inputs are not permitted"),
        ("/sequences/x/deprioritize", {"long_lane": "yes"}, "long_lane: Input should be a valid boolean"),
    ]
    for path, body, message in cases:
        r = admin(admin_server, "POST", path, json=body)
        assert r.status_code == 422, (path, body, r.text)
        assert error(r)["message"] == message and error(r)["code"] == "invalid_body"
    r = admin(admin_server, "POST", "/sequences/x/cap", content=b"{not json")
    assert r.status_code == 422 and error(r)["code"] == "invalid_body"
    r = admin(admin_server, "PATCH", "/tenants/default", json={"rate_tokens_per_s": -1})
    assert r.status_code == 422
    r = admin(admin_server, "PATCH", "/tenants/default", json={"tier": "platinum"})
    assert r.status_code == 422 and "platinum" in error(r)["message"]
    r = admin(admin_server, "GET", "/sequences?sort=weight")
    assert r.status_code == 400 and error(r)["param"] == "sort"


def test_abort_ends_the_stream_frees_blocks_and_settles_tokens(admin_server):
    engine = admin_server.engine
    gate = admin_server.app[keys.GATE]
    runaway = plant_runaway(admin_server, "abort-me")
    rid = "cmpl-abort-me"
    assert wait_until(lambda: any(s.request_id == rid and s.blocks_held > 0 for s in engine.snapshot().sequences))
    r = admin(admin_server, "GET", f"/sequences/{rid}")
    assert r.status_code == 200 and r.json()["id"] == rid and r.json()["tenant"] == "default"
    held = r.json()["kv_blocks"]
    assert held > 0
    r = admin(admin_server, "POST", f"/sequences/{rid}/abort", json={"reason": "runaway"})
    assert r.status_code == 200
    assert r.json()["action"] == "abort" and r.json()["sequence"]["id"] == rid
    # The action has taken effect when the answer comes: the blocks are free already.
    assert all(s.request_id != rid for s in engine.snapshot().sequences)
    runaway.wait()
    assert runaway.id == rid
    final = runaway.final_choice
    assert final["finish_reason"] == "abort"
    assert final["stop_reason"] == "aborted by admin: runaway"
    wait_idle(engine)
    engine.block_manager.check_invariants()
    assert wait_until(lambda: gate.registry.get("default").bucket.in_flight == 0, timeout=5)
    # Too late now: it has finished.
    r = admin(admin_server, "POST", f"/sequences/{rid}/abort")
    assert r.status_code == 409 and error(r)["code"] == "sequence_finished"
    assert "has already finished (abort)" in error(r)["message"]
    assert admin(admin_server, "GET", f"/sequences/{rid}").status_code == 404


def test_cap_stops_a_running_sequence_at_the_new_limit(admin_server):
    stream = start_stream(
        admin_server, {"prompt": "Count slowly:", "max_tokens": 3000, "ignore_eos": True}, request_id="cap-me"
    )
    rid = "cmpl-cap-me"
    assert wait_until(
        lambda: any(s.request_id == rid and s.output_tokens >= 2 for s in admin_server.engine.snapshot().sequences)
    )
    r = admin(admin_server, "POST", f"/sequences/{rid}/cap", json={"max_tokens": 40})
    assert r.status_code == 200 and r.json()["sequence"]["max_tokens"] == 40
    stream.wait()
    assert stream.finish_reason == "length"
    assert sum(1 for c in stream.chunks if c["choices"] and c["choices"][0]["text"]) <= 40
    # A cap below what it already produced finishes it at once.
    stream2 = start_stream(
        admin_server, {"prompt": "Count:", "max_tokens": 3000, "ignore_eos": True}, request_id="cap-now"
    )
    assert wait_until(
        lambda: any(
            s.request_id == "cmpl-cap-now" and s.output_tokens >= 5 for s in admin_server.engine.snapshot().sequences
        )
    )
    r = admin(admin_server, "POST", "/sequences/cmpl-cap-now/cap", json={"max_tokens": 1})
    assert r.status_code == 200
    stream2.wait()
    assert stream2.finish_reason == "length" and stream2.final_choice["stop_reason"] == "capped by admin at 1 tokens"


def test_deprioritize_drops_it_below_every_tier(admin_server):
    stream = start_stream(
        admin_server, {"prompt": "Go on:", "max_tokens": 3000, "ignore_eos": True}, request_id="slow-me"
    )
    rid = "cmpl-slow-me"
    assert wait_until(lambda: any(s.request_id == rid for s in admin_server.engine.snapshot().sequences))
    r = admin(admin_server, "POST", f"/sequences/{rid}/deprioritize", json={"long_lane": True})
    assert r.status_code == 200
    seq = admin(admin_server, "GET", f"/sequences/{rid}").json()
    assert (
        seq["deprioritized"] is True
        and (seq["priority"], seq["tier_priority"]) == (0, 1)
        and seq["size_class"] == "long"
    )
    assert seq["admin_actions"] == ["deprioritize by admin to the long lane"]
    assert admin(admin_server, "POST", f"/sequences/{rid}/abort").status_code == 200
    stream.wait()
    assert stream.finish_reason == "abort"


def test_tenants_list_and_live_patch(admin_server):
    r = admin(admin_server, "GET", "/tenants")
    assert r.status_code == 200
    acme = {t["name"]: t for t in r.json()["data"]}["acme"]
    assert acme["tier"] == "standard" and acme["max_in_flight_tokens"] == 10**6
    r = admin(
        admin_server,
        "PATCH",
        "/tenants/acme",
        json={"tier": "premium", "max_in_flight_tokens": 5000, "rate_tokens_per_s": 250.0},
    )
    assert r.status_code == 200
    assert (
        r.json()["tier"],
        r.json()["priority"],
        r.json()["max_in_flight_tokens"],
        r.json()["rate_tokens_per_s"],
    ) == ("premium", 2, 5000, 250.0)
    tenant = admin_server.app[keys.GATE].registry.get("acme")
    assert tenant.bucket.max_in_flight_tokens == 5000 and tenant.priority == 2
    assert admin(admin_server, "PATCH", "/tenants/nobody", json={"tier": "batch"}).status_code == 404


def test_a_patch_that_raises_a_limit_admits_the_waiter_within_the_patch(admin_server):
    """The PATCH pumps admission before it answers: its own reply already shows the waiter
    admitted (without the pump it would still be queued until the next tick)."""

    def acme() -> dict:
        return {t["name"]: t for t in admin(admin_server, "GET", "/tenants").json()["data"]}["acme"]

    before = acme()
    auth = {"Authorization": f"Bearer {TENANT_KEY}"}
    roomy = {"max_in_flight_tokens": 10**6, "rate_tokens_per_s": 1e6}
    assert admin(admin_server, "PATCH", "/tenants/acme", json=roomy).status_code == 200
    first = start_stream(
        admin_server, {"prompt": "Once upon a time", "max_tokens": 4000, "ignore_eos": True}, "patch-first", TENANT_KEY
    )
    answers: list[httpx.Response] = []
    second = threading.Thread(
        target=lambda: answers.append(
            httpx.post(
                admin_server.url + "/v1/completions",
                json={"prompt": "Hello", "max_tokens": 4},
                headers=auth,
                timeout=120,
            )
        )
    )
    try:
        held = acme()["in_flight_tokens"]
        assert held > 0
        # Full: acme's next request waits in admission.
        full = admin(admin_server, "PATCH", "/tenants/acme", json={"max_in_flight_tokens": held})
        assert full.status_code == 200
        second.start()
        assert wait_until(lambda: acme()["waiting"] == 1), acme()
        raised = admin(admin_server, "PATCH", "/tenants/acme", json={"max_in_flight_tokens": 10**6})
        assert raised.status_code == 200
        assert raised.json()["waiting"] == 0 and raised.json()["in_flight_tokens"] > held, raised.json()
        second.join(120)
        assert [a.status_code for a in answers] == [200]
    finally:
        admin(admin_server, "POST", f"/sequences/{first.id}/abort")
        first.wait()
        if second.ident is not None:  # started
            second.join(120)
        keep = ("tier", "max_in_flight_tokens", "rate_tokens_per_s")
        admin(admin_server, "PATCH", "/tenants/acme", json={k: before[k] for k in keep})
    assert first.finish_reason == "abort"
    wait_idle(admin_server.engine)


def test_predictor_reload_swaps_the_model(admin_server):
    gate = admin_server.app[keys.GATE]
    old = gate.predictor
    r = admin(admin_server, "POST", "/predictor/reload")
    assert r.status_code == 200 and r.json()["fallback"] is False
    reloaded = gate.predictor
    assert reloaded is not old
    r = admin(admin_server, "POST", "/predictor/reload", json={"path": "/nonexistent/predictor"})
    assert r.status_code == 422 and error(r)["code"] == "predictor_load_failed"
    assert gate.predictor is reloaded  # a failed reload keeps the model the last good one installed


def test_stats_reports_windows_kv_and_the_hol_signal(admin_server):
    r = admin(admin_server, "GET", "/stats")
    assert r.status_code == 200
    body = r.json()
    assert set(body["latency"]) == {"1m", "5m", "15m"}
    assert body["kv_blocks_total"] == 512 and 0 <= body["kv_usage"] <= 1
    assert set(body["hol"]) == {"coupled", "short_ttft_p99_s", "long_device_share", "long_kv_share", "offenders"}
    assert body["admission_store"] == {"kind": "embedded"}


def test_no_token_no_admin_api_and_the_env_var_turns_it_on(monkeypatch, default_model):
    from headroom.app.background import BackgroundServer
    from headroom.config import CacheConfig, Config
    from headroom.runtime.engine import Engine

    monkeypatch.delenv("HEADROOM_ADMIN_TOKEN", raising=False)
    config = Config(cache=CacheConfig(num_blocks=64))
    server = BackgroundServer(config, Engine(config, loaded=default_model)).start()
    try:
        assert admin(server, "GET", "/sequences").status_code == 404
    finally:
        server.stop()
    monkeypatch.setenv("HEADROOM_ADMIN_TOKEN", ADMIN_TOKEN)
    server = BackgroundServer(config, Engine(config, loaded=default_model)).start()
    try:
        r = admin(server, "GET", "/sequences")
        assert r.status_code == 200 and r.json()["data"] == [] and r.json()["kv_blocks_total"] == 64
        assert admin(server, "GET", "/sequences", token="x" * 32).status_code == 401
    finally:
        server.stop()
