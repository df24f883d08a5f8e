"""The remediation ladder: a sequence that keeps violating a policy climbs it one step at
a time (deprioritize, cap, abort), no sooner than ladder_step_s apart, a tenant's ladder
before the server's; a loop the engine's detector flags is a violation once a ladder is
set. End to end: a planted loop on the real server climbs the whole ladder, and each step
is in /admin/sequences, the log, /metrics and the span."""

from __future__ import annotations

import logging

import httpx
import pytest

from headroom.admin.policies import Ladder, Violation, enabled, violations
from headroom.app.background import BackgroundServer
from headroom.config import AdminConfig, TenantConfig
from headroom.runtime.engine import Engine
from tests.admin.conftest import ADMIN_TOKEN, admin, admin_config, start_stream, wait_until
from tests.admin.test_policies import seq, snap
from tests.observability.test_tracing_otlp import Collected, GrpcReceiver, attributes

LADDER = ("deprioritize", "cap", "abort")


def looping(rid: str, ladder: tuple[str, ...] | None = None, policy: str | None = None):
    s = seq(rid, output=60)
    return s.__class__(
        **{**s.__dict__, "loop_period": 8, "loop_detected_at": 40, "ladder": ladder, "loop_policy": policy}
    )


def test_each_violation_climbs_one_step_no_sooner_than_the_step_interval():
    config = AdminConfig(max_age_s=10, ladder=LADDER, ladder_step_s=5)
    ladder = Ladder(config)
    s = seq("a", age=11)
    v = Violation("a", "ran 11.0s, over the 10s budget")
    taken = []
    for now in (0.0, 1.0, 4.9, 5.0, 6.0, 10.0, 15.0, 60.0):
        action = ladder.next_action(v, s, now)
        if action is not None:
            ladder.took("a", now)
            taken.append((now, action))
    assert taken == [(0.0, "deprioritize"), (5.0, "cap"), (10.0, "abort")]


def test_without_a_ladder_the_policy_action_is_taken_once():
    ladder = Ladder(AdminConfig(max_age_s=10, policy_action="cap"))
    s, v = seq("a", age=11), Violation("a", "late")
    assert ladder.next_action(v, s, 0.0) == "cap"
    ladder.took("a", 0.0)
    assert ladder.next_action(v, s, 100.0) is None


def test_a_tenants_ladder_comes_before_the_servers_and_finished_sequences_are_forgotten():
    ladder = Ladder(AdminConfig(ladder=LADDER))
    mine = looping("t", ladder=("abort",))
    assert ladder.next_action(Violation("t", "loops"), mine, 0.0) == "abort"
    ladder.took("t", 0.0)
    ladder.took("gone", 0.0)
    ladder.forget_all_but({"t"})
    assert set(ladder.taken) == {"t"}


def test_a_flagged_loop_is_a_violation_only_where_a_ladder_acts_on_it():
    rule = "loops: a 8-token pattern repeating since 40 output tokens"
    flagging = AdminConfig(loop_policy="flag", ladder=LADDER)
    assert violations(flagging, snap(looping("x"), seq("fine"))) == [Violation("x", rule)]
    assert violations(AdminConfig(loop_policy="flag"), snap(looping("x"))) == []  # no ladder: flagged only
    assert violations(AdminConfig(loop_policy="flag"), snap(looping("x", ladder=("cap",)))) == [Violation("x", rule)]
    # Where the engine caps or stops loops itself, the ladder does not act on them too.
    assert violations(AdminConfig(loop_policy="cap", ladder=LADDER), snap(looping("x"))) == []
    assert violations(flagging, snap(looping("x", policy="stop"))) == []


def test_a_ladder_anywhere_turns_the_policy_loop_on():
    assert not enabled(AdminConfig())
    assert enabled(AdminConfig(ladder=("cap",)))
    assert enabled(AdminConfig(), (TenantConfig("default"), TenantConfig("batch", ladder=("abort",))))
    assert not enabled(AdminConfig(), (TenantConfig("default"), TenantConfig("batch", ladder=())))


def metric(text: str, name: str) -> dict[str, float]:
    """{action: value} of one labelled counter in a /metrics page."""
    found = {}
    for line in text.splitlines():
        if line.startswith(name + "{"):
            label, value = line[len(name) + 1 :].split("} ")
            found[label.split('"')[1]] = float(value)
    return found


@pytest.mark.slow
def test_a_planted_loop_climbs_the_whole_ladder_on_the_real_server(monkeypatch, default_model, caplog):
    collected = Collected()
    receiver = GrpcReceiver(collected)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", f"http://127.0.0.1:{receiver.port}")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "100")
    # The engine flags the loop; the ladder acts on it. The cap leaves room, so that the
    # ladder reaches its last step while the loop still runs.
    config = admin_config(
        loop_policy="flag",
        loop_max_pattern_size=8,
        loop_min_pattern_size=1,
        loop_min_count=4,
        ladder=LADDER,
        ladder_step_s=0.5,
        policy_interval_s=0.1,
        cap_tokens=3000,
    )
    server = BackgroundServer(config, Engine(config, loaded=default_model)).start()
    caplog.set_level(logging.WARNING, logger="headroom.admin")
    try:
        the = server.engine.tokenizer.encode(" the")[-1]
        stream = start_stream(
            server,
            {"prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0, "logit_bias": {str(the): 100}},
            request_id="loops",
        )
        rid = "cmpl-loops"
        seen: list[dict] = []

        def capped() -> bool:
            r = admin(server, "GET", f"/sequences/{rid}")
            if r.status_code == 200:
                seen.append(r.json())
            return r.status_code == 200 and len(r.json()["admin_actions"]) >= 3

        assert wait_until(capped, timeout=120), seen[-1:] if seen else "never seen"
        assert stream.wait(120).finish_reason == "abort"
        # With auth on, /metrics is the operator's: the admin token reads it.
        metrics = httpx.get(
            server.url + "/metrics", headers={"Authorization": f"Bearer {ADMIN_TOKEN}"}, timeout=30
        ).text
    finally:
        server.stop()
        receiver.stop()
    last = seen[-1]
    flag = "flag by loop detector: a 1-token pattern repeated 4 times at 4 output tokens"
    rule = "loops: a 1-token pattern repeating since 4 output tokens"
    [deprioritized, cap] = last["admin_actions"][1:3]
    assert last["admin_actions"][0] == flag
    assert deprioritized == f"deprioritize by policy: {rule}"
    assert cap.startswith("cap by policy at ") and cap.endswith(" tokens")
    assert (last["deprioritized"], last["loop_period"], last["loop_detected_at"]) == (True, 1, 4)
    assert stream.final_choice["stop_reason"] == f"aborted by policy: {rule}"
    assert [r.getMessage() for r in caplog.records if r.name == "headroom.admin" and rid in r.getMessage()] == [
        f"policy {action} on {rid}: {rule}" for action in LADDER
    ]
    assert metric(metrics, "headroom:policy_actions_total") == {"deprioritize": 1.0, "cap": 1.0, "abort": 1.0}
    assert metric(metrics, "headroom:loops_detected_total") == {"flag": 1.0, "cap": 0.0, "stop": 0.0, "close": 0.0}
    [span] = [s for _, s in collected.spans if s.name == "POST /v1/completions"]
    assert attributes(span.attributes)["headroom.admin_actions"] == [
        flag,
        deprioritized,
        cap,
        f"abort by policy: {rule}",
    ]
