"""The runtime's control, delivery and accounting without a model: the scheduler is driven
by hand (a fake model samples scripted tokens) and its outputs go through the real
OutputProcessor, actions and StepAccounting to recording sinks."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from headroom.contracts.request import AdmissionRecord, Priority, Request, RequestStatus, SamplingParams, SizeClass
from headroom.contracts.schedule import SchedulerOutput
from headroom.executor.model_runner import StepTimer
from headroom.executor.sampler import Sampler
from headroom.runtime import actions
from headroom.runtime.output_processor import OutputProcessor
from headroom.runtime.outputs import EngineStats, RequestOutput, SequenceFinished, UnknownSequence
from headroom.runtime.stats import StepAccounting, engine_counters, engine_snapshot
from headroom.runtime.step_cost import StepCostModel
from tests.runtime.factories import EOS, create_request, create_scheduler

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def hf() -> PreTrainedTokenizerFast:
    """A byte-level tokenizer (one token per UTF-8 byte, no merges) built in memory: the
    decoding of SmolLM2's, without the ~10 s of reading its GGUF. Ids 0-2 are specials,
    2 being the scheduler's EOS."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<unk>": 0, "<s>": 1, "</s>": EOS} | {c: i + 3 for i, c in enumerate(alphabet)}
    tokenizer = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


class Rig:
    """What the engine core wires together, and a recording sink per request."""

    def __init__(self, hf: PreTrainedTokenizerFast, **scheduler) -> None:
        self.hf = hf
        self.scheduler = create_scheduler(**scheduler)
        self.block_manager = self.scheduler.block_manager
        self.sampler = Sampler({EOS}, seed=0, device=CPU)
        self.processor = OutputProcessor(hf, self.scheduler, self.sampler)
        self.stats = EngineStats()
        self.outputs: dict[str, list[RequestOutput]] = {}
        self.script: dict[str, list[int]] = {}  # request id -> the tokens the "model" samples

    def encode(self, text: str) -> list[int]:
        return self.hf.encode(text, add_special_tokens=False)

    def add(self, prompt: str, output: str = "", **sampling) -> Request:
        request = create_request(prompt=self.encode(prompt), seed=5, **sampling)
        self.outputs[request.request_id] = sink = []
        self.script[request.request_id] = self.encode(output)
        self.sampler.add(request)
        self.processor.add(request, sink.append)
        self.scheduler.add_request(request)
        return request

    def step(self) -> SchedulerOutput:
        """schedule, sample the scripted token where a prefill completes, update, deliver."""
        out = self.scheduler.schedule()
        sampled = [
            self.script[r.request_id].pop(0) if r.num_computed_tokens + n == r.num_tokens else None
            for r, n in zip(out.requests, out.num_scheduled_tokens, strict=True)
        ]
        for request, new in self.scheduler.update_from_output(out, sampled).tokens:
            self.processor.tokens(request, new, [None] * new, self.stats)
        return out

    def gone(self, request: Request) -> bool:
        """Nothing left of it anywhere: sink, detokenizer, generator, scheduler, blocks."""
        rid = request.request_id
        return (
            rid not in self.processor
            and rid not in self.processor.detokenizers
            and rid not in self.sampler.generators
            and rid not in self.scheduler.requests
            and request not in self.scheduler.running + self.scheduler.waiting
            and not self.block_manager.block_table(rid)
        )


def test_each_token_is_delivered_with_its_text_and_the_last_closes_the_request(hf):
    rig = Rig(hf)
    r = rig.add("Say:", output=" café", max_tokens=6)  # é is two byte tokens
    assert r.request_id in rig.processor and r.request_id in rig.sampler.generators
    rig.step()
    assert rig.block_manager.num_used_blocks == 1  # the 4 prompt tokens, in blocks of 4
    for _ in range(5):
        rig.step()
    sent = rig.outputs[r.request_id]
    assert [o.new_token_ids for o in sent] == [[t] for t in rig.encode(" café")]
    # The first byte of é is held back until the character is whole.
    assert [o.text for o in sent] == [" ", "c", "a", "f", "", "é"]
    assert [o.finished for o in sent] == [False] * 5 + [True]
    assert sent[-1].finish_reason == "length" and sent[-1].stop_reason is None and sent[-1].error is None
    assert all(o.request is r for o in sent)
    assert r.status == RequestStatus.FINISHED_LENGTH
    assert rig.stats.generated_tokens == 6 and rig.stats.finished == Counter(length=1)
    assert rig.processor.finished == {r.request_id: "length"}
    assert rig.gone(r) and rig.block_manager.num_used_blocks == 0
    rig.block_manager.check_invariants()


def test_a_stop_string_ends_the_text_before_it_and_finishes_as_stop(hf):
    rig = Rig(hf)
    r = rig.add("Q", output="ok. more", max_tokens=16, stop=(". ",))
    for _ in range(5):
        rig.step()
    sent = rig.outputs[r.request_id]
    assert [o.text for o in sent] == ["", "o", "k", ""]  # one character held back: it may start ". "
    assert sent[-1].finished and sent[-1].new_token_ids == rig.encode(" ")
    assert sent[-1].finish_reason == "stop" and sent[-1].stop_reason == ". "
    assert rig.gone(r) and rig.block_manager.num_used_blocks == 0


def test_abort_closes_a_running_request_and_counts_its_cause(hf):
    rig = Rig(hf)
    r = rig.add("Hello", output="abc", max_tokens=8)
    other = rig.add("World", output="xyz", max_tokens=8)
    rig.step()
    assert rig.block_manager.num_used_blocks == 4  # 5 prompt tokens each, blocks of 4
    rig.processor.abort(r.request_id, "client_disconnect", rig.stats)
    last = rig.outputs[r.request_id][-1]
    assert len(rig.outputs[r.request_id]) == 2 and last.finished
    assert (last.finish_reason, last.new_token_ids, last.text, last.error) == ("abort", [], "", None)
    assert r.status == RequestStatus.FINISHED_ABORTED and r.abort_cause == "client_disconnect"
    assert rig.stats.aborts == Counter(client_disconnect=1) and rig.stats.finished == Counter(abort=1)
    assert rig.gone(r) and rig.block_manager.num_used_blocks == 2
    counters = engine_counters(rig.stats, rig.scheduler, None)
    assert (counters.num_running, counters.num_waiting, counters.kv_blocks_used, counters.kv_blocks_total) == (
        1,
        0,
        2,
        64,
    )
    # An id that is unknown, or was finished already, is left be: nothing sent, nothing counted.
    before = rig.stats.copy()
    rig.processor.abort("no-such-id", "client_disconnect", rig.stats)
    rig.processor.abort(r.request_id, "client_disconnect", rig.stats)
    assert rig.stats == before and len(rig.outputs[r.request_id]) == 2
    # With an error, the finish reason is "error".
    rig.processor.abort(other.request_id, "engine_error", rig.stats, "internal engine error")
    last = rig.outputs[other.request_id][-1]
    assert (last.finish_reason, last.error) == ("error", "internal engine error")
    assert rig.stats.aborts == Counter(client_disconnect=1, engine_error=1)
    assert rig.stats.finished == Counter(abort=1, error=1)
    assert rig.gone(other) and rig.block_manager.num_used_blocks == 0
    rig.block_manager.check_invariants()


def test_reject_sends_one_error_and_leaves_the_live_request_alone(hf):
    rig = Rig(hf)
    live = rig.add("Hi", output="yo", max_tokens=4)
    rig.step()
    dup = Request(live.request_id, rig.encode("Other"), SamplingParams(max_tokens=4))
    sent: list[RequestOutput] = []
    error = f"request id {live.request_id!r} is already in use"
    rig.processor.reject(dup, sent.append, error)
    assert len(sent) == 1
    out = sent[0]
    assert (out.request_id, out.new_token_ids, out.text, out.error) == (live.request_id, [], "", error)
    assert out.finished and out.finish_reason == "error" and out.request is dup
    assert dup.status == RequestStatus.FINISHED_ABORTED and dup.finished_time is not None
    # Nothing of the rejected one was kept, nor counted; the live one is untouched.
    assert rig.stats.finished == Counter() and rig.processor.finished == {}
    assert live.status == RequestStatus.RUNNING and rig.scheduler.requests == {live.request_id: live}
    assert rig.processor.sinks[live.request_id].__self__ is rig.outputs[live.request_id]
    assert len(rig.outputs[live.request_id]) == 1
    with pytest.raises(UnknownSequence):
        actions.apply("never-taken", "cap", {"max_tokens": 1}, rig.scheduler, rig.processor, rig.stats)


def test_apply_cap_lowers_max_tokens_and_closes_a_request_that_reached_it(hf):
    rig = Rig(hf)
    r = rig.add("Caps", output="abcdef", max_tokens=10)  # 4 prompt tokens: a 2nd block at step 2
    rig.step()
    rig.step()
    snap = actions.apply(r.request_id, "cap", {"max_tokens": 5}, rig.scheduler, rig.processor, rig.stats)
    assert (snap.request_id, snap.status, snap.output_tokens, snap.max_tokens) == (r.request_id, "running", 2, 5)
    assert snap.blocks_held == 2 and snap.kv_share == 2 / 64 and snap.admin_actions == ("cap by admin at 5 tokens",)
    assert r.max_tokens == 5 and not r.is_finished and len(rig.outputs[r.request_id]) == 2
    actions.apply(r.request_id, "cap", {"max_tokens": 9}, rig.scheduler, rig.processor, rig.stats)
    assert r.max_tokens == 5  # a cap never raises it
    actions.apply(r.request_id, "cap", {"max_tokens": 2, "by": "policy"}, rig.scheduler, rig.processor, rig.stats)
    last = rig.outputs[r.request_id][-1]
    assert last.finished and last.finish_reason == "length" and last.stop_reason == "capped by policy at 2 tokens"
    assert rig.stats.policy_actions == Counter(cap=1) and rig.stats.finished == Counter(length=1)
    assert rig.gone(r) and rig.block_manager.num_used_blocks == 0
    with pytest.raises(SequenceFinished) as finished:
        actions.apply(r.request_id, "cap", {"max_tokens": 1}, rig.scheduler, rig.processor, rig.stats)
    assert finished.value.finish_reason == "length"
    with pytest.raises(UnknownSequence):
        actions.apply("no-such-id", "abort", {}, rig.scheduler, rig.processor, rig.stats)


def test_apply_deprioritize_and_abort(hf):
    rig = Rig(hf)
    short, lane = rig.add("One", output="aaaa"), rig.add("Two", output="bbbb")
    rig.step()
    snap = actions.apply(short.request_id, "deprioritize", {}, rig.scheduler, rig.processor, rig.stats)
    assert short.priority == Priority(kept=0) == snap.priority and snap.deprioritized
    assert short.size_class is None and short.admin_actions == ["deprioritize by admin"]
    args = {"by": "policy", "long_lane": True, "reason": "runaway"}
    snap = actions.apply(lane.request_id, "deprioritize", args, rig.scheduler, rig.processor, rig.stats)
    assert lane.size_class == snap.size_class == "long" and lane.deprioritized
    assert lane.admin_actions == ["deprioritize by policy to the long lane: runaway"]
    assert rig.stats.policy_actions == Counter(deprioritize=1)
    assert lane.request_id in rig.processor and not lane.is_finished
    snap = actions.apply(lane.request_id, "abort", {"reason": "operator"}, rig.scheduler, rig.processor, rig.stats)
    assert snap.status == "running" and snap.blocks_held == 1  # as it was before it closed
    last = rig.outputs[lane.request_id][-1]
    assert last.finished and last.finish_reason == "abort" and last.stop_reason == "aborted by admin: operator"
    assert lane.abort_cause == "admin" and rig.stats.aborts == Counter(admin=1)
    assert rig.gone(lane) and rig.block_manager.num_used_blocks == 1
    with pytest.raises(SequenceFinished) as finished:
        actions.apply(lane.request_id, "deprioritize", {}, rig.scheduler, rig.processor, rig.stats)
    assert finished.value.finish_reason == "abort"


def test_step_done_charges_steps_tokens_and_time(hf):
    rig = Rig(hf, block_size=4)
    accounting = StepAccounting(StepCostModel())
    a, b = rig.add("abcdef", output="xy"), rig.add("0123456789", output="zw")
    out = rig.scheduler.schedule()
    assert out.num_scheduled_tokens == [6, 10]
    timer = StepTimer(CPU).stop()
    accounting.step_done(rig.stats, out, [2, 3], 0.5, timer)
    s = rig.stats
    assert (s.steps, s.step_time_s, s.forward_time_s) == (1, 0.5, timer.elapsed_s())
    assert (s.requests_started, s.prefix_cache_queries, s.prefix_cache_hits) == (2, 16, 0)
    ua, ub = a.resources, b.resources
    assert (ua.device_time_s, ub.device_time_s, s.device_time_by_class) == (0.1875, 0.3125, Counter(none=0.5))
    processed = (ua.num_processed_tokens, ub.num_processed_tokens)
    assert (ua.kv_block_seconds, ub.kv_block_seconds, *processed) == (1, 1.5, 6, 10)
    assert (ua.num_blocks_held, ua.peak_blocks) == (2, 2) and accounting.cost.num_steps == 1
    rig.scheduler.update_from_output(out, [7, 8])
    c = rig.add("abcdef", output="q")  # a's first block is in the prefix cache
    out = rig.scheduler.schedule()
    c.moved_to = SizeClass.LONG  # moved to the long lane by the probe: charged there
    assert out.requests == [a, b, c] and out.num_scheduled_tokens == [1, 1, 2]
    second = StepTimer(CPU).stop()
    accounting.step_done(rig.stats, out, [2, 3, 2], 0.25, second)
    assert (s.steps, s.step_time_s, s.forward_time_s) == (2, 0.75, timer.elapsed_s() + second.elapsed_s())
    assert (s.requests_started, s.prefix_cache_queries, s.prefix_cache_hits) == (3, 22, 4)
    assert (ua.device_time_s, c.resources.device_time_s) == (0.25, 0.125)
    assert s.device_time_by_class == Counter(none=0.625, long=0.125)
    assert (ua.num_processed_tokens, c.resources.num_processed_tokens, ub.kv_block_seconds) == (7, 2, 2.25)
    snapshot = engine_snapshot(s, rig.scheduler, rig.block_manager, None, time.monotonic())
    assert (snapshot.steps, snapshot.busy_s, snapshot.running, snapshot.used_blocks) == (2, 0.75, 3, 6)
    assert [q.tokens_processed for q in snapshot.sequences] == [7, 11, 2]


def test_enforce_deadlines_finishes_late_requests_as_length(hf):
    rig = Rig(hf)
    late, on_time = rig.add("Late", output="aaaa"), rig.add("Fine", output="bbbb")
    rig.step()
    late.admission = AdmissionRecord(deadline=time.monotonic() - 1.0)
    on_time.admission = AdmissionRecord(deadline=time.monotonic() + 3600.0)
    actions.enforce_deadlines(rig.scheduler, rig.processor, rig.stats)
    last = rig.outputs[late.request_id][-1]
    assert len(rig.outputs[late.request_id]) == 2 and last.finished
    assert (last.finish_reason, last.stop_reason) == ("length", "wall_clock_budget")
    assert late.status == RequestStatus.FINISHED_LENGTH and late.abort_cause == "wall_clock_budget"
    assert rig.stats.aborts == Counter(wall_clock_budget=1) and rig.stats.finished == Counter(length=1)
    assert rig.gone(late) and rig.block_manager.num_used_blocks == 1
    assert on_time.status == RequestStatus.RUNNING and on_time.request_id in rig.processor
    assert len(rig.outputs[on_time.request_id]) == 1
    actions.enforce_deadlines(rig.scheduler, rig.processor, rig.stats)  # nothing more is late
    assert rig.stats.aborts == Counter(wall_clock_budget=1) and len(rig.outputs[on_time.request_id]) == 1


def test_the_live_request_submitted_again_is_refused_and_runs_on(hf):
    rig = Rig(hf)
    live = rig.add("Hi", output="yo", max_tokens=2)
    rig.step()
    sent: list[RequestOutput] = []
    rig.processor.reject(live, sent.append, "request id 'x' is already in use")
    assert [o.finish_reason for o in sent] == ["error"]
    # It was not marked finished while still running, so it still steps, finishes and frees.
    assert live.status == RequestStatus.RUNNING and live.finished_time is None
    rig.step()
    assert [o.finish_reason for o in rig.outputs[live.request_id]] == [None, "length"]
    assert rig.gone(live) and rig.block_manager.num_used_blocks == 0


def test_apply_refuses_an_unknown_action_before_it_touches_anything(hf):
    rig = Rig(hf)
    live = rig.add("Hi", output="yo", max_tokens=4)
    rig.step()
    with pytest.raises(ValueError, match="unknown action 'pause'"):
        actions.apply(live.request_id, "pause", {"by": "policy"}, rig.scheduler, rig.processor, rig.stats)
    assert rig.stats.policy_actions == Counter() and live.admin_actions == []
    assert live.status == RequestStatus.RUNNING
