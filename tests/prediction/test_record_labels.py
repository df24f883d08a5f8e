"""What a finished request teaches the predictors (`records.label`): its own end where it
had one, a run to its requested max_tokens where the loop detector cut it, and nothing
where a cap, a budget, an abort or its own repetition test hid its natural end."""

from __future__ import annotations

import pytest

from headroom.contracts.request import Request, RequestStatus, SamplingParams
from headroom.prediction.records import label


def finished(
    status: RequestStatus,
    output: int,
    *,
    loop_at: int | None = None,
    cap: int | None = None,
    stop_reason: str | None = None,
) -> Request:
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=200))
    for _ in range(output):
        request.append_output(7)
    request.status, request.loop_detected_at, request.max_tokens_cap = status, loop_at, cap
    request.stop_reason = stop_reason
    return request


@pytest.mark.parametrize(
    "request_, expected",
    [
        (finished(RequestStatus.FINISHED_STOPPED, 40), (40, "stop")),
        (finished(RequestStatus.FINISHED_LENGTH, 200), (200, "length")),
        # The loop detector capped it 32 tokens on, or stopped it: a run to the requested 200.
        (finished(RequestStatus.FINISHED_LENGTH, 96, loop_at=64, cap=96, stop_reason="loop_detected"), (200, "length")),
        (finished(RequestStatus.FINISHED_REPETITION, 64, loop_at=64, stop_reason="loop_detected"), (200, "length")),
        # ... unless it then ended on its own within the cap.
        (finished(RequestStatus.FINISHED_STOPPED, 80, loop_at=64, cap=96), (80, "stop")),
        # Flagged only: it ran to its own end.
        (finished(RequestStatus.FINISHED_LENGTH, 200, loop_at=64), (200, "length")),
        # Natural end unknown.
        (finished(RequestStatus.FINISHED_LENGTH, 50, cap=50), None),  # an operator's cap
        (finished(RequestStatus.FINISHED_LENGTH, 120, stop_reason="wall_clock_budget"), None),
        (finished(RequestStatus.FINISHED_ABORTED, 30), None),
        (finished(RequestStatus.FINISHED_REPETITION, 12, stop_reason="repetition_detected"), None),  # its own test
    ],
)
def test_the_label_a_finished_request_teaches(request_, expected):
    assert label(request_) == expected


@pytest.mark.slow
def test_the_servers_record_log_writes_those_labels(default_model, tmp_path):
    import json

    import httpx

    from headroom.app.background import BackgroundServer
    from headroom.config import AdminConfig, AdmissionConfig, CacheConfig, Config, SchedulerConfig
    from headroom.runtime.engine import Engine

    path = tmp_path / "records.jsonl"
    config = Config(
        cache=CacheConfig(num_blocks=128),
        scheduler=SchedulerConfig(max_num_seqs=4),
        admission=AdmissionConfig(record_log_path=str(path)),
        admin=AdminConfig(
            loop_policy="cap", loop_max_pattern_size=8, loop_min_pattern_size=1, loop_min_count=4, cap_tokens=4
        ),
    )
    server = BackgroundServer(config, Engine(config, loaded=default_model)).start()
    try:
        the = server.engine.tokenizer.encode(" the")[-1]
        looping = httpx.post(
            server.url + "/v1/completions",
            timeout=120,
            json={"prompt": "Once upon a time", "max_tokens": 100, "temperature": 0, "logit_bias": {str(the): 100}},
        )
        answer = httpx.post(
            server.url + "/v1/chat/completions",
            timeout=120,
            json={"messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 100, "temperature": 0},
        )
    finally:
        server.stop()
    assert looping.json()["choices"][0]["finish_reason"] == "length"
    assert looping.json()["usage"]["completion_tokens"] == 4 + 4  # found at the 4th token, 4 more
    assert answer.json()["choices"][0]["finish_reason"] == "stop"
    records = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["output_tokens"], r["finish_reason"]) for r in records] == [
        (100, "length"),  # the loop, as the run to its cap it would have been
        (answer.json()["usage"]["completion_tokens"], "stop"),
    ]
