"""The thread tuner at unit level, with scripted step costs: it keeps the configured count
on a quiet machine (trying one thread less and less often), moves to one thread beside a
busy core, and back once the neighbour leaves."""

from __future__ import annotations

from headroom.runtime.threads import FIRST_TRIAL_S, LAST_TRIAL_S, TRIAL_STEPS, ThreadTuner


class Machine:
    """A step's cost by the thread count it runs at: `cost[n]` seconds per predicted second."""

    def __init__(self, cost: dict[int, float]):
        self.cost = cost
        self.threads = 2
        self.now = 0.0
        self.applied: list[int] = []

    def set_threads(self, n: int) -> None:
        self.threads = n
        self.applied.append(n)

    def run(self, tuner: ThreadTuner, seconds: float, step_s: float = 0.05) -> list[int]:
        """Steps of step_s predicted seconds each, for `seconds` of the clock; returns the
        thread count of each step measured."""
        end, measured = self.now + seconds, []
        while self.now < end:
            elapsed = step_s * self.cost[self.threads]
            if tuner.measuring():
                measured.append(self.threads)
                tuner.step_done(elapsed, step_s)
            self.now += elapsed
        return measured


def tuner_on(machine: Machine) -> ThreadTuner:
    return ThreadTuner(2, machine.set_threads, now=lambda: machine.now)


def test_a_quiet_machine_keeps_every_thread_and_tries_one_less_and_less_often():
    machine = Machine({2: 1.0, 1: 1.8})
    tuner = tuner_on(machine)
    measured = machine.run(tuner, 200.0)
    assert tuner.current == 2 and tuner.switches == 0 and machine.threads == 2
    # Each trial runs one thread and puts both back: 5 + 10 + 20 + 40 + 60 + 60 s apart,
    # after two steps (their losing is clear).
    trials = machine.applied.count(1)
    assert machine.applied == [1, 2] * trials and measured.count(1) == 2 * trials
    waits, due = [], FIRST_TRIAL_S
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
