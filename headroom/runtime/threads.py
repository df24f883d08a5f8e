"""The engine's CPU thread count, chosen by measuring.

On a shared VM another process may hold one of the cores for seconds at a time. Every
parallel region of a step then waits for the thread that shares a core with it, often
for a whole scheduler slice, and a step of many small regions (decode, the long lane's
small chunks) slows far more than the lost core explains: beside one busy core, two
threads ran the server 3-4x slower than one thread did (bench/RESULTS.md). No count is
right on every machine at every minute, so the engine measures.

At its first steps, then every so often (from FIRST_TRIAL_S, doubling up to LAST_TRIAL_S
while the count holds), it times TRIAL_STEPS steps at the count it runs, then TRIAL_STEPS
at the other one (one thread fewer than configured, or back to all of them), each against
the step-cost model's prediction for that step, so that steps of any shape compare. It keeps the other count
where its median ratio is under MARGIN times the current one's: a switch needs a clear
win, so noise does not flip it back and forth. A trial whose first LOSING_STEPS steps
all lose by as much ends there, so a quiet machine pays two slow steps a trial. The
first step at a new count is not scored (it pays for the change), and a trial whose steps
come more than STALE_S apart (the engine idled) is dropped.

Between trials it watches, each step priced by the cost model's last fit: the first
TRIAL_STEPS after a trial (or the start) set a baseline, their median ratio or 1 where
that is less, and where TRIAL_STEPS in a row later each cost over SLOW times it, a
neighbour has likely come, and the trial starts at once. Waiting for the trial due (up
to LAST_TRIAL_S away) left a fresh server's first steps beside a busy core at 3-5x their
price for seconds (bench/RESULTS.md: the noisy neighbour). A trial the watch started and
lost says the last fit misprices some steps rather than that a neighbour came (a shape
the baseline's steps did not have): the watch then starts none for FIRST_TRIAL_S, twice
that after the next such loss, up to LAST_TRIAL_S, until a trial wins.

torch.set_num_threads also sets the count every thread started later begins with, so the
engine gives the configured count back (release) when it stops stepping on a thread, and
puts its own in force again at the next step (begin_step).
"""

from __future__ import annotations

import statistics
import time
from collections import deque
from collections.abc import Callable

TRIAL_STEPS = 6
# The first trial comes this long after the start: at once. A fresh server's first
# requests may already share a core, and beside one its first long prompt crawled at two
# threads until the trial due at FIRST_TRIAL_S (bench/RESULTS.md: the noisy neighbour),
# since the watch's first baseline was taken on steps already slow. On a quiet machine
# the trial costs two steps at one thread.
START_TRIAL_S = 0.0
LOSING_STEPS = 2  # a trial whose first steps all cost over 1 / MARGIN the current's ends there
FIRST_TRIAL_S = 5.0
LAST_TRIAL_S = 60.0
STALE_S = 1.0
MARGIN = 0.8
SLOW = 2.0


class ThreadTuner:
    def __init__(
        self, most: int, set_threads: Callable[[int], None], now: Callable[[], float] = time.monotonic
    ) -> None:
        """most: the configured count, in force on the stepping thread now; set_threads
        applies a count there (torch.set_num_threads)."""
        self.most = most
        self.current = most  # the count the engine keeps
        self.switches = 0
        self._set = set_threads
        self._now = now
        self._every = FIRST_TRIAL_S
        self._due = now() + START_TRIAL_S
        self._held: list[float] = []  # ratios of steps at the current count, just before a trial
        self._watched: deque[float] = deque(maxlen=TRIAL_STEPS)  # ratios of the last steps between trials
        self._baseline: float | None = None  # the watch's measure of the kept count (None: being taken)
        self._cool = FIRST_TRIAL_S  # how long the watch waits after a trial it started is lost
        self._calm = float("-inf")  # the watch starts no trial before this
        self._watch_started = False  # the trial under way (or due) is the watch's
        self._tried: list[float] = []  # ratios of the trial's steps at the other count
        self._fresh = False  # the next step is the first at the trial's count
        self._last = float("-inf")  # when the last step ended
        self._applied = True  # `current` is in force on the stepping thread

    @property
    def enabled(self) -> bool:
        return self.most > 1

    @property
    def other(self) -> int:
        return self.most - 1 if self.current == self.most else self.most

    @property
    def trying(self) -> bool:
        """Does the next step run at the trial's count?"""
        return len(self._held) == TRIAL_STEPS

    def begin_step(self) -> None:
        """Before each step: the kept count in force on this thread (after a release, or on
        a thread that has not stepped before)."""
        if not self._applied:
            self._set(self.current)
            self._applied = True

    def release(self) -> None:
        """The steps stop on this thread: the configured count back, a trial dropped."""
        if self.enabled and (self.current != self.most or self.trying):
            self._set(self.most)
        self._clear()
        self._applied = self.current == self.most

    def measuring(self) -> bool:
        """Is the next step a trial's (the caller then predicts its cost afresh)? The others
        are watched, priced by the cost model's last fit: a fit each step would cost more
        than a small model's step."""
        return self.enabled and (bool(self._held) or self._now() >= self._due)

    def step_done(self, elapsed_s: float, predicted_s: float) -> None:
        """A step's wall time and the model's prediction (afresh where measuring())."""
        now, last = self._now(), self._last
        self._last = now
        if now - elapsed_s - last > STALE_S:  # idle since: the trial (or the watch) compares nothing
            if self.trying:
                self._set(self.current)
            self._clear()
        if predicted_s <= 0 or elapsed_s <= 0:
            return
        # A step that began before the trial was due was priced as a watched one (measuring()).
        if not self._held and now - elapsed_s < self._due:
            self._watch(elapsed_s / predicted_s, now)
            return
        if len(self._held) < TRIAL_STEPS:
            self._held.append(elapsed_s / predicted_s)
            if len(self._held) == TRIAL_STEPS:
                self._set(self.other)  # the trial's steps run at the other count
                self._fresh = True
            return
        if self._fresh:  # the first step at a new count pays for the change
            self._fresh = False
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
            self._every = self._cool = FIRST_TRIAL_S
        else:
            self._set(self.current)
            self._every = min(LAST_TRIAL_S, 2 * self._every)
            if self._watch_started:
                self._calm = now + self._cool
                self._cool = min(LAST_TRIAL_S, 2 * self._cool)
        self._watch_started = False  # kept through a trial dropped and begun again (_clear)
        self._clear()
        self._baseline = None  # the kept count, measured afresh the watch's way
        self._due = now + self._every

    def _clear(self) -> None:
        """A trial, and the watch's window, start over."""
        self._held, self._tried = [], []
        self._watched.clear()

    def _watch(self, ratio: float, now: float) -> None:
        """A step between trials. The baseline and the steps compared with it are priced
        alike (the last fit); a trial's ratios are not, so they set no baseline. Where the
        watch makes the trial due, its steps are priced afresh, the current count's too:
        against the last fit's prices, which may be stale, the other count's fresh ones
        could win on a quiet machine."""
        self._watched.append(ratio)
        if len(self._watched) < TRIAL_STEPS:
            return
        if self._baseline is None:
            self._baseline = max(1.0, statistics.median(self._watched))
            self._watched.clear()
        elif min(self._watched) > SLOW * self._baseline and now >= self._calm:
            self._due = now
            self._watch_started = True
            self._watched.clear()
