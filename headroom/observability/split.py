"""The pool-split signal: how far apart the requests one pool serves are. Over a sliding
window of finished requests, the largest against the median, by size (prompt + output
tokens) and by engine time. Past about 10x it is time to plan a split; past 50x the pool
is two services in one (the seeds' rule of thumb). Crossing either line, up or down, is
logged once, naming the classes and tenants of the requests that drive it."""

from __future__ import annotations

import logging
import statistics
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger("headroom.split")

LEVELS = (10.0, 50.0)  # plan a split; two services in one pool
MIN_REQUESTS = 20  # fewer say nothing about a pool's spread


@dataclass(frozen=True)
class SplitState:
    requests: int
    max_tokens: int
    median_tokens: float
    tokens_ratio: float
    max_device_s: float
    median_device_s: float
    device_ratio: float
    level: float  # the highest of LEVELS the tokens ratio is at or over (0: under all)
    # Of the requests over 10x the median size: their classes and tenants, most first.
    drivers_by_class: tuple[tuple[str, int], ...] = ()
    drivers_by_tenant: tuple[tuple[str, int], ...] = ()


class SplitSignal:
    def __init__(self, window_s: float = 600.0, now: Callable[[], float] = time.monotonic):
        self.window_s = window_s
        self._now = now
        self._samples: deque[tuple[float, int, float, str, str]] = deque()  # at, tokens, device_s, class, tenant
        self._level = 0.0

    def observe(self, tokens: int, device_s: float, size_class: str, tenant: str) -> None:
        self._samples.append((self._now(), tokens, device_s, size_class, tenant))

    def state(self) -> SplitState | None:
        """The window's spread, and a log line if it crossed a level since the last call
        (None: too few requests in the window to say)."""
        now = self._now()
        while self._samples and self._samples[0][0] < now - self.window_s:
            self._samples.popleft()
        if len(self._samples) < MIN_REQUESTS:
            return None
        tokens = [s[1] for s in self._samples]
        device = [s[2] for s in self._samples]
        median_tokens, median_device = statistics.median(tokens), statistics.median(device)
        ratio = max(tokens) / median_tokens if median_tokens > 0 else 0.0
        over = [s for s in self._samples if s[1] >= LEVELS[0] * median_tokens]
        state = SplitState(
            requests=len(tokens),
            max_tokens=max(tokens),
            median_tokens=median_tokens,
            tokens_ratio=ratio,
            max_device_s=max(device),
            median_device_s=median_device,
            device_ratio=max(device) / median_device if median_device > 0 else 0.0,
            level=max((level for level in LEVELS if ratio >= level), default=0.0),
            drivers_by_class=tuple(Counter(s[3] for s in over).most_common()),
            drivers_by_tenant=tuple(Counter(s[4] for s in over).most_common()),
        )
        if state.level != self._level:
            self._log_crossing(state)
            self._level = state.level
        return state

    def _log_crossing(self, state: SplitState) -> None:
        classes = ", ".join(f"{name} ({n})" for name, n in state.drivers_by_class) or "none"
        tenants = ", ".join(f"{name} ({n})" for name, n in state.drivers_by_tenant) or "none"
        what = {0.0: "back under 10x", 10.0: "over 10x: plan a split", 50.0: "over 50x: two services on one pool"}[
            state.level
        ]
        log.warning(
            "pool split signal %s: largest request %d tokens, median %.0f (%.1fx) over the last %d "
            "requests; over 10x the median: classes %s; tenants %s",
            what,
            state.max_tokens,
            state.median_tokens,
            state.tokens_ratio,
            state.requests,
            classes,
            tenants,
            extra={"split_ratio": round(state.tokens_ratio, 2), "split_level": state.level},
        )
