"""The engine end to end on the default model (CPU, float32): validation, the threaded
loop, aborts, stop strings, seeded sampling through preemption, resource accounting and
failed steps."""

from __future__ import annotations

import queue
import threading
import time

import pytest

from headroom.config import CacheConfig, Config, ConfigError, ModelConfig, SchedulerConfig, SpeculativeConfig
from headroom.contracts.request import AdmissionRecord, Request, RequestStatus, SamplingParams
from headroom.executor import executor as executor_module
from headroom.executor.device import prepare_model
from headroom.runtime import output_processor
from headroom.runtime.engine import Engine
from headroom.runtime.outputs import RequestOutput

BLOCK_SIZE = 8
TEXTS = ["The capital of France is", "Once upon a time", "def fib(n):", "My favourite colour is"]
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(default_model):
    return default_model  # tests/conftest.py: loaded once per session


@pytest.fixture(scope="module")
def prompts(loaded) -> list[list[int]]:
    return [loaded.tokenizer.encode(t) for t in TEXTS]


def make_engine(
    loaded, num_blocks: int = 64, max_model_len: int | None = None, speculation: str = "ngram", **scheduler
) -> Engine:
    return Engine(
        Config(
            model=ModelConfig(max_model_len=max_model_len),
            cache=CacheConfig(num_blocks=num_blocks, block_size=BLOCK_SIZE),
            scheduler=SchedulerConfig(**scheduler),
            speculative=SpeculativeConfig(method=speculation),
        ),
        loaded=loaded,
    )


class Sink:
    """Collects a request's outputs from whichever thread delivers them."""

    def __init__(self) -> None:
        self.queue: queue.Queue[RequestOutput] = queue.Queue()
        self.outputs: list[RequestOutput] = []

    def __call__(self, output: RequestOutput) -> None:
        self.queue.put(output)

    def wait_finished(self, timeout: float = 60.0) -> list[RequestOutput]:
        deadline = time.monotonic() + timeout
        while not (self.outputs and self.outputs[-1].finished):
            self.outputs.append(self.queue.get(timeout=max(deadline - time.monotonic(), 0.01)))
        return self.outputs

    def wait_for(self, n: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.outputs) < n:
            self.outputs.append(self.queue.get(timeout=max(deadline - time.monotonic(), 0.01)))

    def collected(self) -> list[RequestOutput]:
        while not self.queue.empty():
            self.outputs.append(self.queue.get_nowait())
        return self.outputs

    @property
    def text(self) -> str:
        return "".join(o.text for o in self.outputs)


def run_stepped(engine: Engine, requests: list[Request]) -> list[Sink]:
    """Submit and step the engine on this thread until every request has finished."""
    sinks = [Sink() for _ in requests]
    for request, sink in zip(requests, sinks, strict=True):
        engine.submit(request, sink)
    for _ in range(1000):
        if all(r.is_finished for r in requests):
            break
        engine.step()
    assert all(r.is_finished for r in requests)
    for sink in sinks:
        sink.collected()
    return sinks


def assert_engine_idle(engine: Engine) -> None:
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()
    assert not engine.block_manager.tables
    scheduler = engine.scheduler
    assert not scheduler.requests and not scheduler.waiting and not scheduler.running
    assert (
        not engine.output_processor.sinks and not engine.output_processor.detokenizers and not engine.sampler.generators
    )


def assert_well_formed(sink: Sink, request: Request, tokenizer) -> None:
    """One finished output, last; deltas add up to the request's tokens and text."""
    outputs = sink.outputs
    assert [o.finished for o in outputs] == [False] * (len(outputs) - 1) + [True]
    assert all(o.request_id == request.request_id for o in outputs)
    assert [t for o in outputs for t in o.new_token_ids] == request.output_token_ids
    assert sink.text == tokenizer.decode(request.output_token_ids, skip_special_tokens=True)


# ---- validation ----------------------------------------------------------------------


def test_new_request_rejects_too_long_for_the_model(loaded, prompts):
    engine = make_engine(loaded, max_model_len=32)
    prompt = (prompts[0] * 5)[:20]
    with pytest.raises(ValueError) as info:
        engine.new_request(prompt, SamplingParams(max_tokens=13))
    message = str(info.value)
    # The API's words (contracts.completion_limit): one check, one message, wherever it runs.
    assert "you requested 33 tokens (20 in the prompt, 13 for the completion)" in message
    assert "maximum context length is 32 tokens" in message
    assert engine.new_request(prompt, SamplingParams(max_tokens=12)).num_prompt_tokens == 20


def test_new_request_rejects_token_ids_outside_the_vocabulary(loaded, prompts):
    engine = make_engine(loaded)
    vocab = loaded.args.vocab_size
    for bad in ([*prompts[0], vocab], [-1, *prompts[0]]):
        with pytest.raises(ValueError, match=rf"prompt token ids must be in \[0, {vocab}\)"):
            engine.new_request(bad, GREEDY)
    assert engine.new_request([0, vocab - 1], GREEDY).prompt_token_ids == [0, vocab - 1]
    with pytest.raises(ValueError, match="at least one prompt token"):
        engine.new_request([], GREEDY)


def test_new_request_rejects_more_than_the_whole_kv_pool(loaded, prompts):
    engine = make_engine(loaded, num_blocks=4)  # 32 tokens
    prompt = (prompts[1] * 3)[:10]
    with pytest.raises(ValueError, match="= 33 tokens exceeds the KV cache of 32 tokens"):
        engine.new_request(prompt, SamplingParams(max_tokens=23))
    engine.new_request(prompt, SamplingParams(max_tokens=22))
    assert_engine_idle(engine)


# ---- the threaded loop ---------------------------------------------------------------


def test_threaded_outputs_stream_the_same_tokens_as_stepping(loaded, prompts):
    stepped = make_engine(loaded).generate(prompts[:2], GREEDY)
    engine = make_engine(loaded)
    engine.start()
    thread = engine._thread
    try:
        requests = [engine.new_request(p, GREEDY) for p in prompts[:2]]
        sinks = [Sink() for _ in requests]
        for request, sink in zip(requests, sinks, strict=True):
            engine.submit(request, sink)
        for request, sink, reference in zip(requests, sinks, stepped, strict=True):
            outputs = sink.wait_finished()
            assert_well_formed(sink, request, loaded.tokenizer)
            assert len(outputs) == GREEDY.max_tokens  # one output per token
            assert outputs[-1].finish_reason == "length" and outputs[-1].stop_reason is None
            assert request.output_token_ids == reference.output_token_ids
            assert sink.text.strip()
    finally:
        engine.stop()
    assert engine._thread is None and not thread.is_alive()
    assert all(s.queue.empty() for s in sinks)  # nothing after the finished output
    assert_engine_idle(engine)


def test_started_engine_is_built_on_the_thread_that_steps_it(loaded, prompts, monkeypatch):
    stepped = make_engine(loaded).generate(prompts[:2], GREEDY)
    built_on = []

    def recording(model_config):
        built_on.append(threading.get_ident())
        return prepare_model(model_config)

    monkeypatch.setattr(executor_module, "prepare_model", recording)
    engine = Engine.started(
        Config(model=ModelConfig(quantization="none"), cache=CacheConfig(num_blocks=64, block_size=BLOCK_SIZE))
    )
    thread = engine._thread
    try:
        assert engine.running and built_on == [thread.ident] != [threading.get_ident()]
        requests = [engine.new_request(p, GREEDY) for p in prompts[:2]]
        sinks = [Sink() for _ in requests]
        for request, sink in zip(requests, sinks, strict=True):
            engine.submit(request, sink)
        for request, sink, reference in zip(requests, sinks, stepped, strict=True):
            sink.wait_finished()
            assert request.output_token_ids == reference.output_token_ids
    finally:
        engine.stop()
    assert not engine.running and not thread.is_alive()
    assert_engine_idle(engine)


def test_started_engine_raises_what_its_build_raised(monkeypatch):
    def failing(model_config):
        raise ConfigError("quantization int4 runs on the CPU with dtype float32 only")

    monkeypatch.setattr(executor_module, "prepare_model", failing)
    before = threading.active_count()
    with pytest.raises(ConfigError, match="float32 only"):
        Engine.started(Config())
    deadline = time.monotonic() + 5
    while threading.active_count() > before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert threading.active_count() == before  # the build thread ended with its error


def test_abort_mid_generation_frees_everything(loaded, prompts):
    engine = make_engine(loaded)
    engine.start()
    try:
        params = SamplingParams(max_tokens=200, temperature=0.8, seed=7, ignore_eos=True)
        request = engine.new_request(prompts[0], params)
        sink = Sink()
        engine.submit(request, sink)
        sink.wait_for(2)
        assert request.request_id in engine.sampler.generators
        assert engine.block_manager.num_used_blocks > 0
        engine.abort(request.request_id)
        outputs = sink.wait_finished()
        assert outputs[-1].finish_reason == "abort" and outputs[-1].new_token_ids == []
        assert request.status == RequestStatus.FINISHED_ABORTED
        assert 2 <= request.num_output_tokens < 200
        assert_well_formed(sink, request, loaded.tokenizer)
        deadline = time.monotonic() + 5
        while engine.block_manager.num_used_blocks and time.monotonic() < deadline:
            time.sleep(0.01)
        assert_engine_idle(engine)
        # Aborting a finished or unknown id is a no-op, and the engine keeps serving.
        engine.abort(request.request_id)
        engine.abort("no-such-request")
        follow_up = engine.new_request(prompts[1], GREEDY)
        follow_sink = Sink()
        engine.submit(follow_up, follow_sink)
        assert follow_sink.wait_finished()[-1].finish_reason == "length"
        assert follow_up.num_output_tokens == GREEDY.max_tokens
    finally:
        engine.stop()
    assert_engine_idle(engine)


def test_stop_aborts_running_and_waiting_requests(loaded, prompts):
    engine = make_engine(loaded, max_num_seqs=1)  # one runs, the others wait
    engine.start()
    params = SamplingParams(max_tokens=200, ignore_eos=True, seed=3)
    requests = [engine.new_request(p, params) for p in prompts[:3]]
    sinks = [Sink() for _ in requests]
    for request, sink in zip(requests, sinks, strict=True):
        engine.submit(request, sink)
    sinks[0].wait_for(1)
    engine.stop()
    assert engine._thread is None
    for request, sink in zip(requests, sinks, strict=True):
        outputs = sink.collected()
        assert outputs[-1].finish_reason == "abort"
        assert request.status == RequestStatus.FINISHED_ABORTED
        assert request.finished_time is not None
        assert_well_formed(sink, request, loaded.tokenizer)
    assert requests[0].num_output_tokens >= 1
    assert requests[1].output_token_ids == [] and requests[2].output_token_ids == []
    assert_engine_idle(engine)


# ---- stop strings and stop tokens ----------------------------------------------------


@pytest.fixture(scope="module")
def free_run(loaded, prompts) -> list[int]:
    """Greedy tokens of prompt 0 with no stop condition but the length."""
    params = SamplingParams(max_tokens=16, temperature=0.0)
    (request,) = make_engine(loaded).generate(prompts[:1], params)
    assert request.status == RequestStatus.FINISHED_LENGTH
    return request.output_token_ids


def test_stop_string_ends_the_request_before_the_string(loaded, prompts, free_run):
    decode = loaded.tokenizer.decode
    full = decode(free_run)
    ends = [len(decode(free_run[: i + 1])) for i in range(len(free_run))]
    stop = full[ends[2] : ends[5]]  # exactly tokens 3, 4 and 5
    assert stop.strip()
    at = full.index(stop)
    completing = next(i for i in range(len(free_run)) if stop in decode(free_run[: i + 1]))

    engine = make_engine(loaded)
    params = SamplingParams(max_tokens=16, temperature=0.0, stop=("never-in-output", stop))
    request = engine.new_request(prompts[0], params)
    (sink,) = run_stepped(engine, [request])
    final = sink.outputs[-1]
    assert (final.finish_reason, final.stop_reason, request.stop_reason) == ("stop", stop, stop)
    assert request.status == RequestStatus.FINISHED_STOPPED
    # Generation stops at the token that completes the string; the text ends before it.
    assert request.output_token_ids == free_run[: completing + 1]
    assert sink.text == full[:at]
    assert stop not in sink.text
    assert [t for o in sink.outputs for t in o.new_token_ids] == request.output_token_ids
    assert_engine_idle(engine)


def test_stop_string_on_the_last_allowed_token_is_a_stop(loaded, prompts, free_run):
    decode = loaded.tokenizer.decode
    full = decode(free_run)
    ends = [len(decode(free_run[: i + 1])) for i in range(len(free_run))]
    stop = full[ends[3] : ends[5]]
    completing = next(i for i in range(len(free_run)) if stop in decode(free_run[: i + 1]))

    engine = make_engine(loaded)
    # max_tokens is reached by the very token that completes the stop string.
    params = SamplingParams(max_tokens=completing + 1, temperature=0.0, stop=(stop,))
    request = engine.new_request(prompts[0], params)
    (sink,) = run_stepped(engine, [request])
    final = sink.outputs[-1]
    assert (final.finish_reason, final.stop_reason) == ("stop", stop)
    assert request.status == RequestStatus.FINISHED_STOPPED
    assert sink.text == full[: full.index(stop)]
    assert_engine_idle(engine)


def test_stop_token_id_ends_the_request_with_that_token(loaded, prompts, free_run):
    stop_token = free_run[4]
    first = free_run.index(stop_token)
    engine = make_engine(loaded)
    params = SamplingParams(max_tokens=16, temperature=0.0, stop_token_ids=(stop_token,))
    request = engine.new_request(prompts[0], params)
    (sink,) = run_stepped(engine, [request])
    assert (sink.outputs[-1].finish_reason, sink.outputs[-1].stop_reason) == ("stop", stop_token)
    assert request.output_token_ids == free_run[: first + 1]


# ---- seeded sampling and preemption --------------------------------------------------

SEEDED = SamplingParams(max_tokens=16, temperature=0.8, seed=123, ignore_eos=True)


def seeded_outputs(engine: Engine, prompts: list[list[int]]) -> list[list[int]]:
    other_seed = SamplingParams(max_tokens=16, temperature=0.8, seed=124, ignore_eos=True)
    params = [SEEDED] * len(prompts) + [other_seed]
    requests = engine.generate([*prompts, prompts[0]], params)
    generated = sum(r.num_output_tokens for r in requests)
    assert engine.stats.generated_tokens == generated == 16 * len(requests)
    assert_engine_idle(engine)
    return [r.output_token_ids for r in requests]


def test_seeded_sampling_is_reproducible_through_preemption(loaded, prompts):
    first = seeded_outputs(make_engine(loaded), prompts)
    assert first[-1] != first[0]  # another seed, another sample of the same prompt
    second = seeded_outputs(make_engine(loaded), prompts)
    assert second == first
    # 5 requests of up to 22 tokens need 15 blocks of 8; 7 force preemption by recompute.
    small = make_engine(loaded, num_blocks=7)
    assert seeded_outputs(small, prompts) == first
    assert small.stats.preemptions > 0
    greedy_params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    greedy = make_engine(loaded).generate(prompts[:1], greedy_params)
    assert greedy[0].output_token_ids != first[0]  # really sampled


# ---- resource accounting --------------------------------------------------------------


def test_resource_accounting(loaded, prompts):
    engine = make_engine(loaded, speculation="off")  # one token a step: the steps are counted below
    blocks_needed = engine.block_manager.blocks_needed
    # One request that ends in its first step, one whose last step opens a new block.
    opens_block = next(m for m in range(3, 20) if (len(prompts[1]) + m - 2) % BLOCK_SIZE == 0)
    params = [
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=opens_block, temperature=0.0, ignore_eos=True),
        SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
    ]
    requests = engine.generate(prompts[:3], params)
    assert [r.num_output_tokens for r in requests] == [1, opens_block, 8]
    for r in requests:
        assert r.num_cached_tokens == 0 and r.num_preemptions == 0
        # The K/V of every token but the last sampled one was held at the end.
        assert r.resources.peak_blocks == r.resources.num_blocks_held == blocks_needed(r.num_tokens - 1)
        assert r.resources.device_time_s > 0
        assert r.resources.kv_block_seconds > 0
        assert r.resources.num_processed_tokens == r.num_prompt_tokens + r.num_output_tokens - 1
        assert r.arrival_time <= r.first_scheduled_time <= r.first_token_time <= r.finished_time
    # Each step's time is split among its requests by their share of its tokens.
    device_time = sum(r.resources.device_time_s for r in requests)
    assert device_time == pytest.approx(engine.stats.step_time_s, rel=1e-9)
    assert engine.stats.generated_tokens == sum(r.num_output_tokens for r in requests)
    assert engine.stats.prompt_tokens == sum(r.num_prompt_tokens for r in requests)
    # One step of prefill for all three, then decodes.
    assert engine.stats.steps == max(r.num_output_tokens for r in requests)
    assert_engine_idle(engine)


def test_resource_accounting_counts_recomputation(loaded, prompts):
    engine = make_engine(loaded, num_blocks=7)
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    requests = engine.generate(prompts, params)
    assert engine.stats.preemptions == sum(r.num_preemptions for r in requests) > 0
    for r in requests:
        assert r.resources.num_processed_tokens >= r.num_prompt_tokens + r.num_output_tokens - 1
        assert r.resources.peak_blocks >= engine.block_manager.blocks_needed(r.num_tokens - 1)
        assert r.first_scheduled_time <= r.first_token_time <= r.finished_time
    assert engine.stats.generated_tokens == 16 * len(requests)


# ---- failures -------------------------------------------------------------------------


def test_failed_step_fails_only_its_sequences(loaded, prompts, monkeypatch):
    engine = make_engine(loaded, max_num_seqs=1)  # the second request waits its turn
    references = [r.output_token_ids for r in engine.generate(prompts[:2], GREEDY)]
    execute = engine.runner.execute
    calls = []

    def flaky(out, block_manager, **kwargs):
        calls.append([r.request_id for r in out.requests])
        if len(calls) == 3:
            raise RuntimeError("boom")
        return execute(out, block_manager, **kwargs)

    monkeypatch.setattr(engine.runner, "execute", flaky)
    failing, waiting = (engine.new_request(p, GREEDY) for p in prompts[:2])
    sink_failing, sink_waiting = run_stepped(engine, [failing, waiting])
    assert calls[2] == [failing.request_id]
    final = sink_failing.outputs[-1]
    assert final.finish_reason == "error" and "boom" in final.error
    assert failing.output_token_ids == references[0][:2]  # streamed before the failure
    assert_well_formed(sink_failing, failing, loaded.tokenizer)
    final_waiting = sink_waiting.outputs[-1]
    assert final_waiting.finish_reason == "length" and final_waiting.error is None
    assert waiting.output_token_ids == references[1]
    assert_engine_idle(engine)
    # Later requests are served as before.
    assert [r.output_token_ids for r in engine.generate(prompts[:2], GREEDY)] == references


def test_a_crash_after_the_update_closes_the_requests_that_step_finished(loaded, prompts, monkeypatch):
    # A bug that raises after the scheduler's update (here in the step's accounting) used
    # to leave the requests that step finished without a last output: the loop's handler
    # fails what the scheduler holds, and they had left it, so their clients hung.
    engine = make_engine(loaded)
    step_done = engine.accounting.step_done

    def crash(stats, out, *args, **kwargs):
        if any(r.is_finished for r in out.requests):
            raise RuntimeError("bug in the accounting")
        step_done(stats, out, *args, **kwargs)

    monkeypatch.setattr(engine.accounting, "step_done", crash)
    short = engine.new_request(prompts[0], SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    long = engine.new_request(prompts[1], SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True))
    sink_short, sink_long = Sink(), Sink()
    engine.submit(long, sink_long)
    engine.submit(short, sink_short)
    engine.start()
    try:
        outputs_short = sink_short.wait_finished(timeout=30)
        outputs_long = sink_long.wait_finished(timeout=30)
    finally:
        engine.stop()
    assert (outputs_short[-1].finish_reason, outputs_short[-1].error) == ("error", "internal engine error")
    assert short.status == RequestStatus.FINISHED_LENGTH and short.num_output_tokens == 2
    assert (outputs_long[-1].finish_reason, outputs_long[-1].error) == ("error", "internal engine error")
    assert long.status == RequestStatus.FINISHED_ABORTED and long.num_output_tokens == 2
    assert engine.stats.aborts["engine_error"] == 2
    assert_engine_idle(engine)


def test_a_reused_id_is_remembered_from_its_latest_finish(loaded, prompts, monkeypatch):
    monkeypatch.setattr(output_processor, "RECENTLY_FINISHED", 2)
    engine = make_engine(loaded)
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for rid in ("a", "b", "a", "c"):
        run_stepped(engine, [engine.new_request(prompts[0], one, request_id=rid)])
    assert list(engine.output_processor.finished) == ["a", "c"]  # b is the oldest finish


def test_duplicate_request_id_is_rejected_without_disturbing_the_first(loaded, prompts):
    engine = make_engine(loaded)
    first = engine.new_request(prompts[0], GREEDY, request_id="same")
    duplicate = engine.new_request(prompts[1], GREEDY, request_id="same")
    sink_first, sink_duplicate = run_stepped(engine, [first, duplicate])
    assert [(o.finished, o.finish_reason) for o in sink_duplicate.outputs] == [(True, "error")]
    assert "already in use" in sink_duplicate.outputs[0].error
    assert duplicate.output_token_ids == []
    assert sink_first.outputs[-1].finish_reason == "length"
    assert_well_formed(sink_first, first, loaded.tokenizer)
    assert first.num_output_tokens == GREEDY.max_tokens
    assert_engine_idle(engine)


def test_a_request_the_engine_cannot_take_fails_alone_and_at_once(loaded, prompts, monkeypatch):
    # Before, the error escaped the inbox: this request never got an output (its client
    # hung) and the commands after it in the same batch were lost.
    engine = make_engine(loaded)
    bad = engine.new_request(prompts[0], GREEDY, request_id="bad")
    good = engine.new_request(prompts[1], GREEDY, request_id="good")
    add = engine.sampler.add

    def failing_add(request):
        if request.request_id == "bad":
            raise RuntimeError("Overflow when unpacking long")
        add(request)

    monkeypatch.setattr(engine.sampler, "add", failing_add)
    sink_bad, sink_good = run_stepped(engine, [bad, good])
    assert [(o.finished, o.finish_reason) for o in sink_bad.outputs] == [(True, "error")]
    assert sink_bad.outputs[0].error == "engine error: Overflow when unpacking long"
    assert sink_good.outputs[-1].finish_reason == "length" and good.num_output_tokens == GREEDY.max_tokens
    assert_engine_idle(engine)


def test_wall_clock_budget_finishes_as_length_and_frees_blocks(loaded, prompts):
    engine = make_engine(loaded)
    late = engine.new_request(prompts[0], SamplingParams(max_tokens=50, temperature=0.0, ignore_eos=True))
    on_time = engine.new_request(prompts[1], GREEDY)
    sink_late, sink_on_time = Sink(), Sink()
    engine.submit(late, sink_late)
    engine.submit(on_time, sink_on_time)
    engine.step()
    engine.step()
    late.admission = AdmissionRecord(deadline=time.monotonic() - 0.001)  # its budget has just run out
    while not on_time.is_finished:
        engine.step()
    final = sink_late.wait_finished()[-1]
    assert final.finish_reason == "length" and final.stop_reason == "wall_clock_budget"
    assert 2 <= late.num_output_tokens < 50
    assert on_time.num_output_tokens == GREEDY.max_tokens
    assert engine.block_manager.num_used_blocks == 0
    engine.block_manager.check_invariants()


def test_a_command_the_engine_does_not_know_fails_loudly_instead_of_acting(loaded, prompts):
    # The inbox once dispatched on strings and treated anything unknown as an abort.
    engine = make_engine(loaded)
    request = engine.new_request(prompts[0], SamplingParams(max_tokens=4, temperature=0.0))
    engine.submit(request, lambda _: None)
    engine._command(("abort", (request.request_id, "admin")))  # the old shape: no longer a command
    with pytest.raises(AssertionError):
        engine.step()
    assert request.status is not RequestStatus.FINISHED_ABORTED  # added, never aborted
