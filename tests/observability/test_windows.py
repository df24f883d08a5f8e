"""Per-class latency windows over 1, 5 and 15 minutes."""

from __future__ import annotations

import pytest

from headroom.observability.windows import LatencyWindows


def test_each_window_sees_only_its_own_span_of_time():
    clock = [10_000.0]
    windows = LatencyWindows(now=lambda: clock[0])
    for i in range(10):
        windows.observe("short", clock[0] - 30, 0.1, 1.0)  # in every window
    for i in range(10):
        windows.observe("short", clock[0] - 200, 1.0, 5.0)  # 5m and 15m only
    windows.observe("long", clock[0] - 600, 9.0, 90.0)  # 15m only
    windows.observe("long", clock[0] - 1000, 99.0, 999.0)  # too old for any
    summary = windows.summary()
    assert summary["1m"] == {
        "short": {"count": 10, "ttft_p50_s": 0.1, "ttft_p99_s": 0.1, "e2e_p50_s": 1.0, "e2e_p99_s": 1.0}
    }
    five = summary["5m"]["short"]
    assert five["count"] == 20 and five["ttft_p50_s"] == pytest.approx(0.55)
    assert five["ttft_p99_s"] == pytest.approx(1.0)
    assert set(summary["5m"]) == {"short"}
    assert summary["15m"]["long"] == {
        "count": 1,
        "ttft_p50_s": 9.0,
        "ttft_p99_s": 9.0,
        "e2e_p50_s": 90.0,
        "e2e_p99_s": 90.0,
    }
    assert windows.ttft_quantiles(60) == {"short": (0.1, 0.1)}
