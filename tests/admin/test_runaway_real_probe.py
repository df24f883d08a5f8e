"""A real runaway, caught by the real length probe: no ignore_eos, so nothing but the
probe's reading of the model's own hidden state says it will run to its cap.

The prompt is a held-out (`test` split) row of data/calibration that ran to its 128-token
cap at temperature 0 in calibration. Greedy, the default model answers it with one
sentence over and over ("It's a game-changer in education."); the probe gives it 0.85
after prefill (flagged at the default runaway_threshold, 0.8) and 0.95 or more once the
loop shows (64 tokens on), where the policy's 0.9 acts.
"""

from __future__ import annotations

import re
from collections import Counter
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from headroom.app.background import BackgroundServer
from headroom.runtime.engine import Engine
from tests.admin.conftest import admin, admin_config, wait_until

pytestmark = pytest.mark.slow

LOOPING_PROMPT = "create a multiple choice assessment with scoring based upon the answers"  # CxOmCiY_0#0
CAP = 128


def repeats(text: str) -> int:
    """How often the most frequent sentence of at least 20 characters occurs."""
    sentences = [s.strip() for s in re.split(r"(?<=[.!?])\s+", text) if len(s.strip()) >= 20]
    return max(Counter(sentences).values(), default=0)


def test_the_probe_catches_a_looping_sequence_and_the_policy_moves_it(default_model):
    # The probe is under test, not the loop detector (which would cap the loop first).
    config = admin_config(max_runaway_probability=0.9, policy_interval_s=0.1, loop_policy="off")
    assert config.admission.probe and config.admission.runaway_threshold == 0.8  # the defaults
    server = BackgroundServer(config, Engine(config, loaded=default_model)).start()
    rid = "chatcmpl-loops"
    body = {"messages": [{"role": "user", "content": LOOPING_PROMPT}], "max_tokens": CAP, "temperature": 0}
    try:
        assert server.engine.refiner is not None, "the packaged probe is not in use"
        with ThreadPoolExecutor(1) as pool:
            reply = pool.submit(
                httpx.post,
                server.url + "/v1/chat/completions",
                json=body,
                headers={"X-Request-Id": "loops"},
                timeout=300,
            )

            def acted_on() -> dict | None:
                seq = admin(server, "GET", f"/sequences/{rid}").json()
                return seq if seq.get("deprioritized") else None

            seq = wait_until(acted_on, timeout=120)
            assert seq, "the runaway policy never acted"
            response = reply.result(timeout=300)

        [action] = seq["admin_actions"]
        found = re.fullmatch(
            r"deprioritize by policy to the long lane: predicted to run to its 128-token cap "
            r"\(p=(0\.9\d|1\.00) at (\d+) tokens\)",
            action,
        )
        assert found, action
        acted_at = int(found.group(2))
        # Flagged by the default threshold before the policy's higher one was reached.
        assert seq["runaway_flagged_at"] is not None and 0 <= seq["runaway_flagged_at"] < acted_at
        assert (seq["size_class"], seq["deprioritized"]) == ("long", True)
        assert 0.8 <= seq["runaway_probability"] < 1.0  # ignore_eos would make it exactly 1

        assert response.status_code == 200
        out = response.json()
        choice = out["choices"][0]
        assert (choice["finish_reason"], out["usage"]["completion_tokens"]) == ("length", CAP)
        assert repeats(choice["message"]["content"]) >= 4, choice["message"]["content"]

        counters = server.engine.counters()
        assert counters.probe_estimates == CAP // 16  # after prefill, then every 16 tokens up to 112
        # The policy acted once; the probe alone moved nothing, as 128 tokens is not long work.
        assert (counters.probe_decisions["policy"], counters.probe_decisions["long_lane"]) == (1, 0)
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert 'headroom:probe_decisions_total{decision="policy"} 1.0' in metrics
    finally:
        server.stop()
