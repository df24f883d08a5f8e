"""The head-of-line monitor on hand-built snapshots: when it fires, and whom it names."""

from __future__ import annotations

import logging
from collections import Counter

import pytest

from headroom.config import ObservabilityConfig
from headroom.observability.hol import HolMonitor
from headroom.observability.windows import LatencyWindows
from headroom.runtime.outputs import EngineSnapshot, EngineStats, SequenceSnapshot


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def seq(rid: str, size_class: str, device_s: float, blocks: int, tenant: str = "t") -> SequenceSnapshot:
    return SequenceSnapshot(
        rid,
        tenant,
        "standard",
        size_class,
        "running",
        0,
        5.0,
        100,
        10,
        500,
        50.0,
        blocks,
        blocks / 100,
        device_s,
        0.0,
        0.0,
        110,
        0,
        None,
    )


def snapshot(*sequences: SequenceSnapshot, busy: float = 0.0) -> EngineSnapshot:
    return EngineSnapshot(0.0, busy, 1, 100, sum(s.blocks_held for s in sequences), sequences)


def stats(busy: float, **by_class: float) -> EngineStats:
    return EngineStats(step_time_s=busy, device_time_by_class=Counter(by_class))


CONFIG = ObservabilityConfig(ttft_window_s=30, hol_short_ttft_p99_s=1.0, hol_long_share=0.5)


def test_rolling_quantiles_forget_what_left_the_window():
    clock = Clock()
    monitor = HolMonitor(CONFIG, LatencyWindows(now=clock))
    for i in range(100):
        monitor.windows.observe("short", clock.t - 40, 0.1 + 0.01 * i, 1.0)  # outside the window
    for _ in range(10):
        monitor.windows.observe("short", clock.t - 1, 0.2, 1.0)
    assert monitor.windows.ttft_quantiles(30) == {"short": (pytest.approx(0.2), pytest.approx(0.2))}


def test_fires_when_short_is_slow_and_long_dominates_and_names_the_offenders(caplog):
    clock = Clock()
    monitor = HolMonitor(CONFIG, LatencyWindows(now=clock))
    # Interval 1, the baseline: no short request has finished yet, so nothing fires.
    first = monitor.update(
        snapshot(seq("long-a", "long", 1.0, 10), seq("short-b", "short", 1.0, 2), busy=2.0), stats(2.0, long=1.0)
    )
    assert not first.coupled and first.short_ttft_p99_s is None
    for ttft in [0.2] * 90 + [3.0] * 10:
        monitor.windows.observe("short", clock.t, ttft, 1.0)
    # Interval 2: 10 s busy, 8 s of it on long-a, 1.5 s on long-c, 0.5 s on short-b.
    with caplog.at_level(logging.WARNING, logger="headroom.hol"):
        state = monitor.update(
            snapshot(
                seq("long-a", "long", 9.0, 30),
                seq("short-b", "short", 1.5, 2),
                seq("long-c", "long", 1.5, 5),
                busy=12.0,
            ),
            stats(12.0, long=10.5, short=1.5),
        )
    assert state.coupled
    assert state.long_device_share == pytest.approx(0.95)
    assert state.long_kv_share == pytest.approx(0.35)
    assert state.short_ttft_p99_s > 1.0
    assert [o.request_id for o in state.offenders] == ["long-a", "long-c", "short-b"]
    assert state.offenders[0].device_share == pytest.approx(0.8)
    [record] = caplog.records
    assert "head-of-line coupling" in record.getMessage()
    assert "long-a (tenant t, long, 80% of engine time, 30% of KV)" in record.getMessage()
    assert record.hol_offenders == ["long-a", "long-c", "short-b"]
    # Still coupled on the next interval: no second warning.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="headroom.hol"):
        again = monitor.update(snapshot(seq("long-a", "long", 17.0, 30), busy=20.0), stats(20.0, long=18.5, short=1.5))
    assert again.coupled and caplog.records == []


@pytest.mark.parametrize(
    "short_ttfts,long_share,coupled",
    [
        ([0.2] * 100, 0.9, False),  # short is fast: long may use the engine as it likes
        ([3.0] * 100, 0.2, False),  # short is slow, but not because of long sequences
        ([3.0] * 100, 0.6, True),
    ],
)
def test_needs_both_halves(short_ttfts, long_share, coupled):
    clock = Clock()
    monitor = HolMonitor(CONFIG, LatencyWindows(now=clock))
    for ttft in short_ttfts:
        monitor.windows.observe("short", clock.t, ttft, 1.0)
    state = monitor.update(snapshot(), stats(10.0, long=10.0 * long_share))
    assert state.coupled is coupled
