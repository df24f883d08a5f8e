"""Rolling per-class latency windows (TTFT and end-to-end), kept for the longest window
an operator asks about (15 minutes) and summarised as p50/p99 over any shorter one."""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable

import numpy as np

WINDOWS_S = {"1m": 60.0, "5m": 300.0, "15m": 900.0}


class LatencyWindows:
    def __init__(self, horizon_s: float = max(WINDOWS_S.values()), now: Callable[[], float] = time.monotonic):
        self.horizon_s = horizon_s
        self._now = now
        # size class -> (time.monotonic() of the first token, ttft_s, e2e_s), oldest first
        self._samples: dict[str, deque[tuple[float, float, float]]] = {}

    def observe(self, size_class: str, at: float, ttft_s: float, e2e_s: float) -> None:
        self._samples.setdefault(size_class, deque()).append((at, ttft_s, e2e_s))

    def _recent(self, window_s: float) -> dict[str, list[tuple[float, float, float]]]:
        now = self._now()
        out = {}
        for size_class, samples in self._samples.items():
            while samples and samples[0][0] < now - self.horizon_s:
                samples.popleft()
            recent = [s for s in samples if s[0] >= now - window_s]
            if recent:
                out[size_class] = recent
        return out

    def ttft_quantiles(self, window_s: float) -> dict[str, tuple[float, float]]:
        """size class -> (p50, p99) TTFT over the last window_s seconds."""
        return {c: _p50_p99([s[1] for s in samples]) for c, samples in self._recent(window_s).items()}

    def summary(self) -> dict[str, dict[str, dict]]:
        """For each window name (1m, 5m, 15m): size class -> count, TTFT and e2e p50/p99."""
        out = {}
        for name, window_s in WINDOWS_S.items():
            per_class = {}
            for size_class, samples in self._recent(window_s).items():
                ttft, e2e = _p50_p99([s[1] for s in samples]), _p50_p99([s[2] for s in samples])
                per_class[size_class] = {
                    "count": len(samples),
                    "ttft_p50_s": ttft[0],
                    "ttft_p99_s": ttft[1],
                    "e2e_p50_s": e2e[0],
                    "e2e_p99_s": e2e[1],
                }
            out[name] = per_class
        return out


def _p50_p99(values: list[float]) -> tuple[float, float]:
    p50, p99 = np.quantile(values, [0.5, 0.99])
    return float(p50), float(p99)
