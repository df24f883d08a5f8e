"""Automatic policies: which sequences break which rule (pure), and the loop acting on
the real engine through the same command as the admin API."""

from __future__ import annotations

import re

import httpx
import pytest

from headroom.admin.policies import Violation, enabled, violations
from headroom.config import AdminConfig, ConfigError
from headroom.runtime.outputs import EngineSnapshot, SequenceSnapshot


def seq(
    rid: str,
    *,
    age: float = 1.0,
    kv_share: float = 0.01,
    output: int = 10,
    predicted: float | None = 50.0,
    deprioritized: bool = False,
    runaway: float | None = None,
) -> SequenceSnapshot:
    return SequenceSnapshot(
        rid,
        "t",
        "standard",
        "short",
        "running",
        0,
        age,
        100,
        output,
        1000,
        predicted,
        int(kv_share * 100),
        kv_share,
        0.1,
        0.1,
        0.0,
        110,
        0,
        0.1,
        deprioritized=deprioritized,
        runaway_probability=runaway,
    )


def snap(*sequences: SequenceSnapshot) -> EngineSnapshot:
    return EngineSnapshot(0.0, 1.0, 10, 100, 0, sequences)


def test_off_by_default():
    assert not enabled(AdminConfig())
    assert violations(AdminConfig(), snap(seq("a", age=1e6, kv_share=1.0, output=10**6))) == []


def test_each_rule_names_what_was_broken():
    config = AdminConfig(max_age_s=30, max_kv_share=0.25, max_predicted_ratio=4, policy_action="abort")
    found = violations(
        config,
        snap(
            seq("old", age=31.5),
            seq("fat", kv_share=0.5),
            seq("overrun", output=201, predicted=50.0),
            seq("fine", age=29, kv_share=0.25, output=200, predicted=50.0),
            seq("unpredicted", output=10**5, predicted=None),
        ),
    )
    assert found == [
        Violation("old", "ran 31.5s, over the 30s budget"),
        Violation("fat", "holds 50% of the KV pool, over 25%"),
        Violation("overrun", "201 output tokens, over 4x the predicted 50"),
    ]


def test_the_runaway_rule_reads_the_probe_estimate():
    config = AdminConfig(max_runaway_probability=0.9)
    assert enabled(config)
    found = violations(
        config,
        snap(
            seq("loops", runaway=0.93, output=64),
            seq("fine", runaway=0.89),
            seq("unseen", runaway=None, output=10**5, predicted=None),
        ),
    )
    assert found == [Violation("loops", "predicted to run to its 1000-token cap (p=0.93 at 64 tokens)", runaway=True)]
    assert violations(config, snap(seq("loops", runaway=0.99, deprioritized=True))) == []


def test_deprioritize_acts_once():
    config = AdminConfig(max_age_s=10)  # action: deprioritize
    assert violations(config, snap(seq("a", age=11, deprioritized=True))) == []
    assert [v.request_id for v in violations(config, snap(seq("a", age=11)))] == ["a"]
    aborting = AdminConfig(max_age_s=10, policy_action="abort")
    assert [v.request_id for v in violations(aborting, snap(seq("a", age=11, deprioritized=True)))] == ["a"]


@pytest.mark.parametrize(
    "kwargs,message",
    [
        ({"policy_action": "kill"}, "admin.policy_action must be one of deprioritize, cap, abort, got 'kill'"),
        ({"max_kv_share": 1.5}, "admin.max_kv_share must be in (0, 1], got 1.5"),
        ({"max_runaway_probability": 0}, "admin.max_runaway_probability must be in (0, 1], got 0"),
        ({"max_age_s": 0}, "admin.max_age_s must be > 0, got 0"),
        ({"token": "short"}, "admin token must be at least 16 characters"),
    ],
)
def test_bad_settings_are_refused(kwargs, message):
    with pytest.raises(ConfigError) as exc:
        AdminConfig(**kwargs)
    assert str(exc.value) == message


@pytest.mark.slow
def test_the_policy_loop_aborts_a_runaway_on_the_real_server(default_model):
    from headroom.app.background import BackgroundServer
    from headroom.runtime.engine import Engine
    from tests.admin.conftest import admin_config, plant_runaway, wait_until
    from tests.app.test_openai_api import wait_idle

    config = admin_config(max_age_s=1.5, policy_action="abort", policy_interval_s=0.1)
    server = BackgroundServer(config, Engine(config, loaded=default_model)).start()
    try:
        runaway = plant_runaway(server, "too-slow")
        runaway.wait(60)
        assert runaway.finish_reason == "abort"
        stop = runaway.final_choice["stop_reason"]
        assert stop.startswith("aborted by policy: ran ") and stop.endswith("s, over the 1.5s budget")
        assert wait_until(lambda: server.engine.counters().aborts["policy"] == 1, timeout=5)
        wait_idle(server.engine)
    finally:
        server.stop()


class RecordedProbe:
    """The length probe as the engine calls it, keeping every estimate it gives."""

    def __init__(self, probe):
        self.probe, self.layer, self.last_point = probe, probe.layer, probe.last_point
        self.estimates: dict[str, list[tuple[int, float, float]]] = {}  # id -> (at tokens, remaining, p)

    def predict(self, requests, states):
        remaining, p_cap = self.probe.predict(requests, states)
        for request, left, p in zip(requests, remaining.tolist(), p_cap.tolist(), strict=True):
            self.estimates.setdefault(request.request_id, []).append((request.num_output_tokens, left, p))
        return remaining, p_cap


@pytest.mark.slow
def test_the_runaway_policy_moves_a_probed_runaway_to_the_long_lane(default_model):
    """No ignore_eos: only the length probe says this loop runs to its 4,000-token cap.
    Its probe is trained on rows where running to the cap is written in the loop signal, so
    it sees nothing at prefill and the loop from 16 tokens on; the policy acts on its
    estimate, once, and says why."""
    from headroom.app.background import BackgroundServer
    from headroom.prediction.probe_model import ProbeModel
    from headroom.runtime.engine import Engine
    from tests.admin.conftest import admin, admin_config, start_stream, wait_until
    from tests.runtime.test_probe_engine import LAYER, loop_rows

    # The planted loop is the probe's to catch here, not the loop detector's (it would cap it).
    config = admin_config(max_runaway_probability=0.95, policy_interval_s=0.1, loop_policy="off")
    engine = Engine(config, loaded=default_model)
    probe = RecordedProbe(ProbeModel.train(loop_rows(300, default_model.args.hidden_size), LAYER))
    a = config.admission
    engine.use_probe(probe, a.probe_every, a.runaway_threshold, a.long_min_output_tokens)
    server = BackgroundServer(config, engine).start()  # it keeps the engine's probe
    try:
        the = engine.tokenizer.encode(" the")[-1]
        runaway = start_stream(
            server,
            {"prompt": "Once upon a time", "max_tokens": 4000, "temperature": 0, "logit_bias": {str(the): 100}},
            request_id="loops",
        )
        rid = "cmpl-loops"

        def sequence() -> dict:
            return admin(server, "GET", f"/sequences/{rid}").json()

        assert wait_until(lambda: sequence().get("deprioritized"), timeout=120)
        # One estimate for each multiple of probe_every up to the last point, made on the step
        # that starts at or past it: n-gram guesses (on by default, and kept in this loop) move
        # a row up to `most` tokens a step. Past the last point's step the estimate no longer
        # changes: read it from there on.
        most = 1 + config.speculative.num_speculative_tokens
        assert wait_until(lambda: sequence()["output_tokens"] > probe.last_point + most, timeout=120)
        seq = sequence()
        estimates = probe.estimates[rid]
        ats = [at for at, _, _ in estimates]
        assert [at // a.probe_every for at in ats] == list(range(probe.last_point // a.probe_every + 1))
        assert ats[0] == 0 and all(at % a.probe_every < most for at in ats), ats
        assert estimates[0][2] < a.runaway_threshold <= estimates[1][2]  # no loop at prefill, one from 16
        at, remaining, p = estimates[-1]
        assert (seq["size_class"], seq["deprioritized"], seq["runaway_probability"], seq["runaway_flagged_at"]) == (
            "long",
            True,
            p,
            ats[1],
        )
        assert seq["predicted_remaining_tokens"] == pytest.approx(
            min(remaining - (seq["output_tokens"] - at), 4000 - seq["output_tokens"]), rel=1e-9
        )
        [action] = seq["admin_actions"]
        acted = re.fullmatch(
            r"deprioritize by policy to the long lane: predicted to run to its 4000-token cap "
            r"\(p=(\d\.\d\d) at (\d+) tokens\)",
            action,
        )
        assert acted, action
        # The estimate in force when the policy read it: the last made before that token count.
        in_force = [q for made_at, _, q in estimates if made_at < int(acted[2])][-1]
        assert in_force >= 0.95 and acted[1] == f"{in_force:.2f}"
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert 'headroom:probe_decisions_total{decision="policy"} 1.0' in metrics
        assert admin(server, "POST", f"/sequences/{rid}/abort").status_code == 200
        runaway.wait(60)
    finally:
        server.stop()
