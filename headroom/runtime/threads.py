"""The engine's CPU thread count, chosen by measuring.

On a shared VM another process may hold one of the cores for seconds at a time. Every
parallel region of a step then waits for the thread that shares a core with it, often
for a whole scheduler slice, and a step of many small regions (decode, the long lane's
small chunks) slows far more than the lost core explains: beside one busy core, two
threads ran the server 3-4x slower than one thread did (bench/RESULTS.md). No count is
right on every machine at every minute, so the engine measures.

Every so often (from FIRST_TRIAL_S, doubling up to LAST_TRIAL_S while the count holds)
it times TRIAL_STEPS steps at the count it runs, then TRIAL_STEPS at the other one
(one thread, or back to the configured count), each against the step-cost model's
prediction for that step, so that steps of any shape compare. It keeps the other count
where its median ratio is under MARGIN times the current one's: a switch needs a clear
win, so noise does not flip it back and forth. A trial whose first LOSING_STEPS steps
all lose by as much ends there, so a quiet machine pays two slow steps a trial.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

TRIAL_STEPS = 6
LOSING_STEPS = 2  # a trial whose first steps all cost over 1 / MARGIN the current's ends there
FIRST_TRIAL_S = 5.0
LAST_TRIAL_S = 60.0
MARGIN = 0.8


class ThreadTuner:
    def __init__(
        self, most: int, set_threads: Callable[[int], None], now: Callable[[], float] = time.monotonic
    ) -> None:
        """most: the configured count; set_threads applies a count (torch.set_num_threads,
        on the thread that runs the steps)."""
        self.most = most
        self.current = most  # the count the engine keeps
        self.switches = 0
        self._set = set_threads
        self._now = now
        self._every = FIRST_TRIAL_S
        self._due = now() + FIRST_TRIAL_S
        self._held: list[float] = []  # ratios of steps at the current count, just before a trial
        self._tried: list[float] = []  # ratios of the trial's steps at the other count

    @property
    def enabled(self) -> bool:
        return self.most > 1

    @property
    def other(self) -> int:
        return 1 if self.current == self.most else self.most

    @property
    def trying(self) -> bool:
        """Does the next step run at the trial's count?"""
        return len(self._held) == TRIAL_STEPS

    def measuring(self) -> bool:
        """Does the next step count (the caller then predicts its cost)?"""
        return self.enabled and (bool(self._held) or self._now() >= self._due)

    def step_done(self, elapsed_s: float, predicted_s: float) -> None:
        """A step measured while measuring(): its wall time and the model's prediction."""
        if predicted_s <= 0 or elapsed_s <= 0:
            return
        if len(self._held) < TRIAL_STEPS:
            self._held.append(elapsed_s / predicted_s)
            if len(self._held) == TRIAL_STEPS:
                self._set(self.other)  # the trial's steps run at the other count
            return
        self._tried.append(elapsed_s / predicted_s)
        held = statistics.median(self._held)
        # A trial whose first steps all lose clearly is over: its steps are the slow ones.
        lost = len(self._tried) >= LOSING_STEPS and min(self._tried) * MARGIN > held
        if len(self._tried) < TRIAL_STEPS and not lost:
            return
        if not lost and statistics.median(self._tried) < MARGIN * held:
            self.current = self.other  # already set
            self.switches += 1
            self._every = FIRST_TRIAL_S
        else:
            self._set(self.current)
            self._every = min(LAST_TRIAL_S, 2 * self._every)
        self._held, self._tried = [], []
        self._due = self._now() + self._every
