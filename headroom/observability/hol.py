"""The head-of-line signal: is the short class slow *because* long sequences dominate?

Every interval the monitor reads an engine snapshot and the engine's per-class device
time, takes the TTFT quantiles per size class over the rolling window, and raises the signal when the
short class's p99 TTFT is above its threshold while long-class sequences took at least
`hol_long_share` of the engine's time in the last interval or hold that share of the KV
pool. When it rises, a warning names the sequences that took the most engine time.

The runtime closes the loop with it (HolFeedback in runtime/lane.py), wired by the server.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from headroom.config import ObservabilityConfig
from headroom.contracts.request import SizeClass
from headroom.observability.windows import LatencyWindows
from headroom.runtime.outputs import EngineSnapshot, EngineStats

log = logging.getLogger("headroom.hol")


@dataclass(frozen=True)
class Offender:
    request_id: str
    tenant: str | None
    size_class: str | None
    device_share: float  # of the engine's time in the last interval
    kv_share: float
    age_s: float


@dataclass(frozen=True)
class HolState:
    coupled: bool
    short_ttft_p99_s: float | None
    long_device_share: float
    long_kv_share: float
    ttft_s: dict[str, tuple[float, float]] = field(default_factory=dict)  # class -> (p50, p99) over the window
    offenders: tuple[Offender, ...] = ()


class HolMonitor:
    def __init__(self, config: ObservabilityConfig, windows: LatencyWindows):
        self.config = config
        self.windows = windows
        self._busy = 0.0
        self._long_busy = 0.0
        self._live_busy = 0.0
        self._device: dict[str, float] = {}
        self.state = HolState(False, None, 0.0, 0.0)

    def update(self, snapshot: EngineSnapshot, stats: EngineStats) -> HolState:
        busy = stats.step_time_s - self._busy
        long_busy = stats.device_time_by_class.get(SizeClass.LONG, 0.0) - self._long_busy
        self._busy, self._long_busy = stats.step_time_s, stats.device_time_by_class.get(SizeClass.LONG, 0.0)
        # No step finished in this interval (one long prefill step can outlast it): the
        # last interval's share still describes what the engine is doing.
        long_device_share = long_busy / busy if busy > 0 else self.state.long_device_share
        long_blocks = sum(s.blocks_held for s in snapshot.sequences if s.size_class == SizeClass.LONG)
        long_kv_share = long_blocks / snapshot.num_blocks

        # Offenders by the snapshot's live numbers (which count the step running now).
        offenders = []
        live_busy, self._live_busy = snapshot.busy_s - self._live_busy, snapshot.busy_s
        device = {s.request_id: s.device_time_s for s in snapshot.sequences}
        for s in snapshot.sequences:
            used = s.device_time_s - self._device.get(s.request_id, 0.0)
            if live_busy > 0 and used > 0:
                offenders.append(Offender(s.request_id, s.tenant, s.size_class, used / live_busy, s.kv_share, s.age_s))
        self._device = device
        offenders.sort(key=lambda o: (o.device_share, o.kv_share), reverse=True)

        quantiles = self.windows.ttft_quantiles(self.config.ttft_window_s)
        short_p99 = quantiles[SizeClass.SHORT][1] if SizeClass.SHORT in quantiles else None
        dominated = max(long_device_share, long_kv_share) >= self.config.hol_long_share
        coupled = short_p99 is not None and short_p99 > self.config.hol_short_ttft_p99_s and dominated
        state = HolState(coupled, short_p99, long_device_share, long_kv_share, quantiles, tuple(offenders[:5]))
        if coupled and not self.state.coupled:
            named = ", ".join(
                f"{o.request_id} (tenant {o.tenant}, {o.size_class}, {o.device_share:.0%} of engine "
                f"time, {o.kv_share:.0%} of KV)"
                for o in state.offenders[:3]
            )
            log.warning(
                "head-of-line coupling: short p99 TTFT %.2fs > %.2fs while long sequences take %.0f%% of engine "
                "time and %.0f%% of KV; dominant: %s",
                short_p99,
                self.config.hol_short_ttft_p99_s,
                100 * long_device_share,
                100 * long_kv_share,
                named or "none running",
                extra={"hol_offenders": [o.request_id for o in state.offenders[:3]]},
            )
        elif self.state.coupled and not coupled:
            log.info("head-of-line coupling cleared")
        self.state = state
        return state
