"""LoRA adapters in the scheduler and the step's accounting: no step holds more distinct
adapters than max_loras, a request whose adapter finds no slot never blocks those behind
it, one passed over for LORA_PATIENCE_S gets the next slot that frees, and a row under an
adapter is charged its adapter's arithmetic."""

from __future__ import annotations

import torch

from headroom.contracts.request import AdapterRef
from headroom.contracts.schedule import SchedulerOutput
from headroom.executor.model_runner import StepTimer
from headroom.runtime.outputs import EngineStats
from headroom.runtime.scheduler import LORA_PATIENCE_S
from headroom.runtime.stats import StepAccounting
from headroom.runtime.step_cost import StepCostModel
from tests.runtime.factories import create_request, create_scheduler, run_step

A, B, C = AdapterRef("a", 1), AdapterRef("b", 2), AdapterRef("c", 3)


def under(adapter, **kwargs):
    request = create_request(**kwargs)
    request.lora = adapter
    return request


def adapters(out) -> set[str]:
    return {r.lora.name for r in out.requests if r.lora is not None}


def test_a_request_without_a_slot_waits_and_blocks_no_one_behind_it():
    now = [0.0]
    s = create_scheduler(max_loras=2, max_num_batched_tokens=64, clock=lambda: now[0])
    a, b, c, base, a2 = (
        under(A, arrival=0),
        under(B, arrival=0),
        under(C, arrival=0),
        under(None, arrival=0),
        under(A, arrival=0),
    )
    for r in (a, b, c, base, a2):
        s.add_request(r)
    out, _ = run_step(s)
    assert out.requests == [a, b, base, a2] and adapters(out) == {"a", "b"}
    assert s.waiting == [c]
    while a.status.name == "RUNNING" or b.status.name == "RUNNING":
        out, _ = run_step(s)
        assert len(adapters(out)) <= 2
    # Once every sequence under one adapter has finished, c takes its slot.
    out, _ = run_step(s)
    assert c in out.requests and len(adapters(out)) <= 2


def test_a_request_passed_over_too_long_reserves_the_next_slot():
    now = [0.0]
    s = create_scheduler(max_loras=1, max_num_batched_tokens=64, max_num_seqs=8, clock=lambda: now[0])
    first = under(A, arrival=0, max_tokens=3)
    s.add_request(first)
    run_step(s)
    starving = under(B, arrival=0, max_tokens=2)
    s.add_request(starving)
    steps = 0
    # A steady stream under adapter a would keep its slot forever, were b not reserved.
    while starving.first_scheduled_time is None:
        steps += 1
        assert steps < 50, "b never got a slot"
        s.add_request(under(A, arrival=now[0], max_tokens=3))
        out, _ = run_step(s)
        assert len(adapters(out)) <= 1
        now[0] += 0.5
    assert starving.first_scheduled_time >= LORA_PATIENCE_S  # passed over until patient long enough
    # From the reservation on, a's new requests waited: b ran within the few steps a's running
    # sequences (3 tokens each) took to finish.
    assert starving.first_scheduled_time <= LORA_PATIENCE_S + 3 * 0.5 + 0.5
    assert all(r.lora == A for r in s.waiting)


def test_a_row_under_an_adapter_is_charged_its_adapters_arithmetic():
    base, heavy, light = under(None), under(AdapterRef("h", 4, cost=1.0)), under(AdapterRef("l", 5, cost=0.25))
    out = SchedulerOutput(requests=[base, heavy, light], num_scheduled_tokens=[4, 4, 8])
    StepAccounting(StepCostModel()).step_done(EngineStats(), out, [1, 1, 2], 1.0, StepTimer(torch.device("cpu")).stop())
    # Weights 4, 4 * 2 and 8 * 1.25: 4 / 22, 8 / 22 and 10 / 22 of the step's second.
    shares = [r.resources.device_time_s for r in (base, heavy, light)]
    assert shares == [4 / 22, 8 / 22, 10 / 22]
