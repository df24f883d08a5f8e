"""The thread tuner at unit level, with scripted step costs: it keeps the configured count
on a quiet machine (trying one thread less and less often), moves to one thread beside a
busy core, and back once the neighbour leaves."""

from __future__ import annotations

import pytest
import torch

from headroom.config import CacheConfig, Config, SpeculativeConfig
from headroom.contracts.request import SamplingParams
from headroom.runtime import threads
from headroom.runtime.engine import Engine
from headroom.runtime.threads import LAST_TRIAL_S, STALE_S, TRIAL_STEPS, ThreadTuner

# As threads.py ships them; tests/conftest.py sets all three to inf for the other tests.
START_TRIAL_S, FIRST_TRIAL_S, SLOW = 0.0, 5.0, 2.0


@pytest.fixture(autouse=True)
def trials(monkeypatch):
    """tests/conftest.py turns trials (and the watch) off for the engines of the other tests."""
    monkeypatch.setattr(threads, "START_TRIAL_S", START_TRIAL_S)
    monkeypatch.setattr(threads, "FIRST_TRIAL_S", FIRST_TRIAL_S)
    monkeypatch.setattr(threads, "SLOW", SLOW)


class Machine:
    """A step's cost by the thread count it runs at: `cost[n]` seconds per predicted second."""

    def __init__(self, cost: dict[int, float]):
        self.cost = cost
        self.threads = 2
        self.now = 0.0
        self.applied: list[int] = []
        self.stale = 1.0  # what the cost model's last fit prices a watched step at, against a fresh fit

    def set_threads(self, n: int) -> None:
        self.threads = n
        self.applied.append(n)

    def run(self, tuner: ThreadTuner, seconds: float, step_s: float = 0.05) -> list[int]:
        """Steps of step_s predicted seconds each, for `seconds` of the clock, each told to
        the tuner as the engine does; returns the thread count of each trial step."""
        end, measured = self.now + seconds, []
        while self.now < end:
            elapsed = step_s * self.cost[self.threads]
            trial = tuner.measuring()
            if trial:
                measured.append(self.threads)
            self.now += elapsed
            if tuner.enabled:
                tuner.step_done(elapsed, step_s if trial else step_s * self.stale)
        return measured


def tuner_on(machine: Machine) -> ThreadTuner:
    return ThreadTuner(2, machine.set_threads, now=lambda: machine.now)


def test_a_quiet_machine_keeps_every_thread_and_tries_one_less_and_less_often():
    machine = Machine({2: 1.0, 1: 1.8})
    tuner = tuner_on(machine)
    measured = machine.run(tuner, 200.0)
    assert tuner.current == 2 and tuner.switches == 0 and machine.threads == 2
    # Each trial runs one thread and puts both back: at once, then 10 + 20 + 40 + 60 + 60 s
    # apart, after three steps (the first pays for the change; the next two lose clearly).
    trials = machine.applied.count(1)
    assert machine.applied == [1, 2] * trials and measured.count(1) == 3 * trials
    waits, due = [START_TRIAL_S], 2 * FIRST_TRIAL_S
    while sum(waits) + due <= 200.0:
        waits.append(due)
        due = min(LAST_TRIAL_S, 2 * due)
    assert trials == len(waits) == 6


def test_beside_a_busy_core_it_moves_to_one_thread_and_back_when_the_core_is_free():
    machine = Machine({2: 3.0, 1: 1.1})
    tuner = tuner_on(machine)
    machine.run(tuner, FIRST_TRIAL_S + 2.0)  # the trial's twelve steps take ~1.2 s here
    assert tuner.current == 1 and machine.threads == 1 and tuner.switches == 1
    machine.run(tuner, 30.0)
    assert tuner.current == 1  # two threads still lose at every trial
    machine.cost = {2: 1.0, 1: 1.8}  # the neighbour left
    machine.run(tuner, LAST_TRIAL_S + 1.0)
    assert tuner.current == 2 and machine.threads == 2 and tuner.switches == 2


def test_a_server_that_starts_beside_a_busy_core_moves_at_its_first_steps():
    # The watch's first baseline is taken on steps already slow, so it sees no change: only
    # the first trial can find the neighbour, and it comes at the first steps, not 5 s on.
    machine = Machine({2: 3.0, 1: 1.1})
    tuner = tuner_on(machine)
    machine.run(tuner, 1.4)  # six steps of 0.15 s at two threads, the change, six of 0.055 s
    assert tuner.current == 1 and machine.applied == [1] and tuner.switches == 1


def test_a_small_win_is_no_reason_to_switch():
    machine = Machine({2: 1.0, 1: 0.9})  # within the margin: noise, not a neighbour
    tuner = tuner_on(machine)
    machine.run(tuner, 100.0)
    assert tuner.current == 2 and tuner.switches == 0


def test_steps_it_cannot_price_do_not_count_and_one_thread_is_left_alone():
    machine = Machine({2: 3.0, 1: 1.0})
    tuner = tuner_on(machine)
    machine.now = FIRST_TRIAL_S
    for _ in range(10 * TRIAL_STEPS):
        tuner.step_done(0.1, 0.0)  # the cost model knows nothing yet
    assert tuner.measuring() and machine.applied == []
    single = ThreadTuner(1, machine.set_threads, now=lambda: machine.now)
    assert not single.enabled and not single.measuring()


def test_after_a_switch_the_next_trial_comes_soon():
    machine = Machine({2: 1.0, 1: 1.8})
    tuner = tuner_on(machine)
    machine.run(tuner, 40.0)  # three trials lost: the next is 40 s away (the watch starts it sooner)
    machine.cost = {2: 3.0, 1: 1.1}  # a neighbour came
    while tuner.current == 2:
        machine.run(tuner, 0.1)
    switched = machine.now
    machine.cost = {2: 1.0, 1: 1.8}  # and left at once
    while tuner.current == 1:
        machine.run(tuner, 0.1)
    assert machine.now - switched < FIRST_TRIAL_S + 2.0  # not after the 40 s the quiet trials had reached


def test_a_neighbour_that_comes_between_trials_starts_one_at_once():
    machine = Machine({2: 1.0, 1: 1.8})
    tuner = tuner_on(machine)
    machine.run(tuner, 40.0)  # three trials lost: the next is due at 75 s
    assert machine.applied == [1, 2] * 3
    machine.cost = {2: 3.0, 1: 1.1}  # a neighbour came
    came = machine.now
    while tuner.current == 2:
        machine.run(tuner, 0.01)
    # Six steps over twice the last trial's measure, six more priced afresh, the change,
    # six at one thread: 2.2 s, where the trial due was 35 s away.
    assert machine.now - came < 2.3
    assert machine.applied == [1, 2] * 3 + [1] and tuner.switches == 1


def test_a_watched_trial_that_loses_raises_the_bar_for_the_next():
    machine = Machine({2: 1.0, 1: 1.8})
    tuner = tuner_on(machine)
    machine.run(tuner, 40.0)
    machine.cost = {2: 3.0, 1: 5.4}  # slower at both counts: one thread still loses
    machine.run(tuner, 30.0)
    # One trial at once, lost after two steps; then three times the old measure is the
    # watch's new baseline, and no step is twice that: the next trial waits for its due.
    assert machine.applied == [1, 2] * 4 and tuner.current == 2 and tuner.switches == 0


def test_a_stale_fit_that_prices_every_watched_step_low_starts_no_trial():
    # The last fit prices the watched steps at a third of a fresh fit's, on a quiet machine:
    # every one costs three times its price, but so did the baseline's, priced alike.
    machine = Machine({2: 1.0, 1: 1.8})
    machine.stale = 1 / 3
    tuner = tuner_on(machine)
    machine.run(tuner, 40.0)
    assert machine.applied == [1, 2] * 3  # the trials due at 5, 15 and 35 s, no more
    machine.cost = {2: 3.0, 1: 1.1}  # a neighbour: the watch still sees it
    came = machine.now
    while tuner.current == 2:
        machine.run(tuner, 0.01)
    assert machine.now - came < 2.3


def test_one_slow_step_does_not_end_a_trial_that_wins():
    """Early end needs every one of the first steps to lose: one that loses (a hiccup)
    beside one that wins lets the trial run its course."""
    machine = Machine({2: 3.0, 1: 1.1})
    tuner = tuner_on(machine)
    machine.now = FIRST_TRIAL_S + 1.0  # the steps begin after the trial is due
    for _ in range(TRIAL_STEPS):
        tuner.step_done(0.3, 0.1)  # at two threads: ratio 3
    assert machine.threads == 1
    for ratio in (1.0, 9.0, 1.0, 1.0, 1.0, 1.0, 1.0):  # the change, a hiccup, then wins
        tuner.step_done(0.1 * ratio, 0.1)
    assert tuner.current == 1 and tuner.switches == 1


def test_a_trial_across_an_idle_spell_is_dropped():
    machine = Machine({2: 1.0, 1: 0.5})
    tuner = tuner_on(machine)
    machine.now = FIRST_TRIAL_S
    for _ in range(TRIAL_STEPS):
        machine.now += 0.1
        tuner.step_done(0.1, 0.1)
    assert tuner.trying and machine.threads == 1
    machine.now += STALE_S + 5.0  # nothing to step for a while
    tuner.step_done(0.05, 0.1)
    assert not tuner.trying and machine.threads == 2 and tuner.switches == 0


def test_release_gives_the_configured_count_back_and_the_next_step_takes_its_own_again():
    machine = Machine({2: 3.0, 1: 1.1})
    tuner = tuner_on(machine)
    machine.run(tuner, FIRST_TRIAL_S + 2.0)
    assert tuner.current == 1 and machine.threads == 1
    tuner.release()  # the engine stops stepping on this thread
    assert machine.threads == 2
    tuner.begin_step()
    assert machine.threads == 1
    tuner.begin_step()
    assert machine.applied[-2:] == [2, 1]  # once each, not at every step


@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one thread: there is no other count to try")
def test_an_engine_runs_its_trials_on_its_own_thread_learns_nothing_from_them_and_gives_the_count_back(
    default_model, monkeypatch
):
    # Trials back to back, two steps each way, none cut short: generate() ends inside one.
    for name, value in (("FIRST_TRIAL_S", 0.0), ("LAST_TRIAL_S", 0.0), ("TRIAL_STEPS", 2), ("LOSING_STEPS", 10**6)):
        monkeypatch.setattr(threads, name, value)
    most = torch.get_num_threads()
    # One token a step, so the steps are counted in tokens below (n-gram guesses would keep
    # several of this repeated prompt's tokens a step).
    config = Config(cache=CacheConfig(num_blocks=128), speculative=SpeculativeConfig(method="off"))
    engine = Engine(config, loaded=default_model)
    tuner = engine.threads
    assert tuner.most == most and tuner.enabled
    seen = []  # (threads in force, a trial step?) of each step
    execute, release = engine.runner.execute, tuner.release
    ended = []  # the threads in force when generate() gave them back

    def counted(*args, **kwargs):
        seen.append((torch.get_num_threads(), tuner.trying))
        return execute(*args, **kwargs)

    def released():
        ended.append((torch.get_num_threads(), tuner.trying, tuner.other))
        release()

    monkeypatch.setattr(engine.runner, "execute", counted)
    monkeypatch.setattr(tuner, "release", released)
    learned = engine.scheduler.cost.num_steps
    prompts = [[1, 504, 3575, 282, 4649, 314] * (1 + i) for i in range(4)]
    engine.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    trial = [n for n, trying in seen if trying]
    assert {n for n, _ in seen} == {most, most - 1} and len(trial) >= 3  # the steps ran where the tuner said
    # Every step but the trial's taught the cost model.
    assert engine.scheduler.cost.num_steps - learned == len(seen) - len(trial)
    # It ended inside a trial (24 steps: four trials of five, and four steps), at the trial's
    # count (one thread fewer, or all of them where one fewer had won), and gave the
    # caller's thread the configured count back.
    ((count, trying, other),) = ended
    assert trying and count == other and torch.get_num_threads() == most


def test_a_fit_that_misprices_some_steps_cannot_start_a_trial_every_few_steps():
    # The last fit prices one shape of step right and another at a third of its cost, the
    # two alternating every twelve steps on a quiet machine: each time the baseline is
    # taken on the first shape, the second looks three times slower and the watch starts
    # a trial, which loses. After each lost trial the watch waits, twice as long each time
    # (from FIRST_TRIAL_S, up to LAST_TRIAL_S), so in 120 s it starts at most a handful.
    machine = Machine({2: 1.0, 1: 1.8})
    tuner = tuner_on(machine)
    while machine.now < 120.0:
        machine.stale = 1.0 if int(machine.now / 0.6) % 2 == 0 else 1 / 3
        machine.run(tuner, 0.6)
    trials = machine.applied.count(1)
    assert tuner.current == 2 and machine.applied == [1, 2] * trials
    # Scheduled ones at 5, 15, 35, 75 s (each loss doubles the wait) and the watch's after
    # waits of 5, 10, 20, 40 s (with the 12-step windows between): at most eight.
    assert trials <= 8
