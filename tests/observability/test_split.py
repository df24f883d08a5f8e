"""The pool-split signal: max against median over a sliding window, the 10x and 50x
lines, one log line per crossing naming who drives it, and the gauge at refresh."""

from __future__ import annotations

import logging

from headroom.observability.split import MIN_REQUESTS, SplitSignal


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def fill(
    signal: SplitSignal, n: int, tokens: int, device_s: float, size_class: str = "short", tenant: str = "chat"
) -> None:
    for _ in range(n):
        signal.observe(tokens, device_s, size_class, tenant)


def test_says_nothing_under_the_minimum_of_requests():
    signal = SplitSignal(now=Clock())
    fill(signal, MIN_REQUESTS - 1, 100, 0.1)
    assert signal.state() is None


def test_the_lines_the_log_and_the_drivers(caplog):
    clock = Clock()
    signal = SplitSignal(window_s=600, now=clock)
    caplog.set_level(logging.WARNING, logger="headroom.split")
    fill(signal, 30, 100, 0.1)
    state = signal.state()
    assert (state.requests, state.max_tokens, state.median_tokens, state.tokens_ratio, state.level) == (
        30,
        100,
        100,
        1.0,
        0.0,
    )
    assert caplog.records == []
    fill(signal, 2, 2000, 4.0, "long", "batch")  # 20x the median
    fill(signal, 1, 1500, 1.0, "medium", "chat")  # 15x
    state = signal.state()
    assert (state.max_tokens, state.median_tokens, state.tokens_ratio, state.level) == (2000, 100, 20.0, 10.0)
    assert state.device_ratio == 40.0
    assert state.drivers_by_class == (("long", 2), ("medium", 1))
    assert state.drivers_by_tenant == (("batch", 2), ("chat", 1))
    assert [r.getMessage() for r in caplog.records] == [
        (
            "pool split signal over 10x: plan a split: largest request 2000 tokens, median 100 (20.0x) over the last "
            "33 requests; over 10x the median: classes long (2), medium (1); tenants batch (2), chat (1)"
        )
    ]
    signal.state()  # the same level again: no second line
    assert len(caplog.records) == 1
    fill(signal, 1, 6000, 9.0, "long", "batch")
    assert signal.state().level == 50.0
    assert (
        caplog.records[-1]
        .getMessage()
        .startswith(
            "pool split signal over 50x: two services on one pool: largest request 6000 tokens, median 100 (60.0x)"
        )
    )
    clock.t = 601  # the window moves past all of them
    fill(signal, 25, 100, 0.1)
    state = signal.state()
    assert (state.requests, state.tokens_ratio, state.level) == (25, 1.0, 0.0)
    assert caplog.records[-1].getMessage().startswith("pool split signal back under 10x")
    assert len(caplog.records) == 3
