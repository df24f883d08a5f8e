"""The engine: owns the scheduler, cache and model, and runs the step loop on its own
thread; a step's outputs go out through output_processor.py and its cost is counted in
stats.py. Other threads only enqueue commands (add, abort); every piece of engine state
is changed by the engine thread alone. The one exception is snapshot(), which reads
that state from another thread under `_state_lock`; the engine holds the lock while it
changes state, but not while the model runs, so a snapshot waits at most for the
bookkeeping half of a step."""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from typing import assert_never

import torch

from headroom.config import Config
from headroom.models.loader import LoadedModel
from headroom.runtime import actions
from headroom.runtime.attention import select_backend
from headroom.runtime.block_manager import BlockManager
from headroom.runtime.commands import Abort, Add, Command, Control, SetLongLaneFactor
from headroom.runtime.cuda_graphs import graph_plan
from headroom.runtime.detokenizer import IncrementalDetokenizer
from headroom.runtime.device import prepare_model, resolve_kv_dtype
from headroom.runtime.grammar import Grammars
from headroom.runtime.inflight import InflightRefiner, LengthProbe
from headroom.runtime.loops import LoopPolicy
from headroom.runtime.model_runner import ModelOutput, ModelRunner, kv_block_bytes
from headroom.runtime.output_processor import OutputProcessor
from headroom.runtime.outputs import (
    EngineSnapshot,
    EngineStats,
    LongLaneState,
    OutputSink,
    SequenceFinished,
    SequenceSnapshot,
    UnknownSequence,
)
from headroom.runtime.request import Request, RequestStatus, SamplingParams
from headroom.runtime.sampler import Sampler, SampleResult, TokenLogprob
from headroom.runtime.scheduler import Scheduler, SchedulerOutput
from headroom.runtime.stats import (
    StepAccounting,
    engine_counters,
    engine_snapshot,
    long_lane_state,
    sequence_snapshot,
)
from headroom.runtime.warmup import measure_step_cost

log = logging.getLogger(__name__)


class Engine:
    def __init__(self, config: Config, loaded: LoadedModel | None = None):
        self.config = config
        if loaded is None:
            loaded, self.quantization_reason = prepare_model(config.model)
        else:
            self.quantization_reason = "as the caller loaded it"
        weight = loaded.model.embed_tokens.weight  # the model's device and dtype decide the engine's
        self.device, self.dtype = weight.device, weight.dtype
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # cuda:N: kernels, streams and graphs on card N
        self.loaded = loaded
        self.tokenizer = self.loaded.tokenizer
        args = self.loaded.args
        self.max_model_len = config.model.max_model_len or args.max_position_embeddings
        self.backend = select_backend(config.attention_backend, self.device)
        self.block_size = config.cache.block_size or self.backend.block_size
        self.kv_dtype, self.kv_dtype_reason = resolve_kv_dtype(config.cache.kv_cache_dtype, self.device, self.dtype,
                                                               loaded.quantization)
        num_blocks = config.cache.num_blocks or int(
            config.cache.kv_cache_memory_gib * 2**30 // kv_block_bytes(args, self.block_size, self.kv_dtype)
        )
        self.block_manager = BlockManager(num_blocks, self.block_size, config.cache.enable_prefix_caching)
        eos = self.tokenizer.eos_token_ids
        self.scheduler = Scheduler(config.scheduler, self.block_manager, eos)
        self.sampler = Sampler(eos, seed=config.seed, device=self.device)
        self.loops = LoopPolicy.of(config.admin)
        graph_sizes, self.cuda_graphs = graph_plan(config, self.device, self.backend)
        self.runner = ModelRunner(self.loaded.model, self.backend, num_blocks, self.block_size, self.device,
                                  self.kv_dtype, graph_sizes=graph_sizes, max_model_len=self.max_model_len)
        self.cuda_graphs = self.runner.capture_graphs() or self.cuda_graphs
        if config.scheduler.long_lane:
            samples = measure_step_cost(self.runner, self.block_manager)
            self.scheduler.policy.cost.prime(samples)
            log.info("step cost at start: %s", ", ".join(
                f"{s.num_tokens} tokens/{s.pairs} pairs {s.seconds * 1e3:.1f} ms" for s in samples))
        self.stats = EngineStats()
        log.info(
            "engine ready: model=%s device=%s dtype=%s quantization=%s (%s) kv_cache_dtype=%s (%s) backend=%s "
            "block_size=%d kv_blocks=%d (%d tokens) cuda_graphs=%s",
            self.loaded.name, self.device, str(self.dtype).removeprefix("torch."), self.loaded.quantization,
            self.quantization_reason, str(self.kv_dtype).removeprefix("torch."), self.kv_dtype_reason,
            self.backend.name,
            self.block_size, num_blocks, num_blocks * self.block_size, self.cuda_graphs,
        )

        self.output_processor = OutputProcessor(self.tokenizer.hf, self.scheduler, self.sampler)
        self.accounting = StepAccounting(self.scheduler.policy.cost)
        self._inbox: list[Command] = []
        self._wakeup = threading.Condition()
        self._state_lock = threading.Lock()
        self._running_step: tuple[SchedulerOutput, float] | None = None  # (out, perf_counter start) while the model runs
        # Tests set this to inject a fault into a step (it may raise); never set in serving.
        self.fault_hook: Callable[[SchedulerOutput], None] | None = None
        # Called on the engine thread after each forward pass with the sequences that sample
        # (before this step's token is appended) and the model's probe rows for them (layer ->
        # (S, hidden)); set with runner.probe_layers (`predictor calibrate --probe-layers`).
        # probe_due, when set, says whether a step needs the rows at all.
        self.probe_hook: Callable[[list[Request], dict[int, torch.Tensor]], None] | None = None
        self.probe_due: Callable[[SchedulerOutput], bool] | None = None
        self.inflight: InflightRefiner | None = None  # see use_inflight
        self._ids = itertools.count()
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ---- called from any thread -------------------------------------------------------

    @functools.cached_property
    def grammars(self) -> Grammars:
        """The structured-output compiler for this model's tokenizer, built on first use."""
        return Grammars(self.tokenizer.hf, self.loaded.args.vocab_size, self.tokenizer.eos_token_ids)

    def new_request(
        self,
        prompt_token_ids: list[int],
        sampling: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
    ) -> Request:
        """Validate and build a request (not yet submitted); raises ValueError."""
        request = Request(request_id or f"req-{next(self._ids)}", list(prompt_token_ids), sampling, priority)
        total = request.num_prompt_tokens + sampling.max_tokens
        if total > self.max_model_len:
            raise ValueError(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({sampling.max_tokens}) = {total} "
                f"exceeds the model's context length of {self.max_model_len} tokens"
            )
        if self.block_manager.blocks_needed(total) > self.block_manager.num_blocks:
            raise ValueError(
                f"prompt + max_tokens = {total} tokens exceeds the KV cache of "
                f"{self.block_manager.num_blocks * self.block_size} tokens"
            )
        vocab = self.loaded.args.vocab_size
        if any(not 0 <= t < vocab for t in request.prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        if any(not 0 <= t < vocab for t, _ in sampling.logit_bias):
            raise ValueError(f"logit_bias: token ids must be in [0, {vocab})")
        return request

    def submit(self, request: Request, sink: OutputSink) -> None:
        """Queue a request; sink receives its outputs on the engine thread."""
        self._command(Add(request, sink))

    def abort(self, request_id: str, cause: str = "client_disconnect") -> None:
        self._command(Abort(request_id, cause))

    def control(self, request_id: str, action: str, **args) -> Future[SequenceSnapshot]:
        """An operator's action on a live sequence, applied at the start of the next step:
        abort (reason), deprioritize (long_lane) or cap (max_tokens). The future holds the
        sequence as it was when the action took effect, or UnknownSequence /
        SequenceFinished."""
        if action not in ("abort", "deprioritize", "cap"):
            raise ValueError(f"unknown action {action!r}")
        command = Control(request_id, action, args)
        self._command(command)
        return command.future

    def set_long_lane_factor(self, factor: float) -> None:
        """Scale the long lane's per-step prefill allowance (the head-of-line loop's lever)."""
        if not 0 < factor <= 1:
            raise ValueError(f"long lane factor must be in (0, 1], got {factor}")
        self._command(SetLongLaneFactor(factor))

    def _command(self, command: Command) -> None:
        with self._wakeup:
            self._inbox.append(command)
            self._wakeup.notify()

    @classmethod
    def started(cls, config: Config) -> Engine:
        """Build an engine on a new thread and run its step loop on that same thread.

        Serving builds it this way because of how OpenMP (torch's CPU threads) behaves: once
        one thread has run parallel regions, every region started from another thread
        costs ~50 us more on a 2-core machine (measured: a 128-token prefill 105 -> 140
        ms). The thread that loads and warms the model is therefore the one that steps it,
        and the caller's thread never runs a region."""
        built: Future[Engine] = Future()

        def home() -> None:
            try:
                engine = cls(config)
            except BaseException as exc:  # noqa: BLE001 - not swallowed: the caller's result() raises it
                built.set_exception(exc)
                return
            built.set_result(engine)
            engine._loop()

        thread = threading.Thread(target=home, name="headroom-engine", daemon=True)
        thread.start()
        engine = built.result()
        engine._thread = thread
        return engine

    @property
    def running(self) -> bool:
        return self._thread is not None

    def start(self) -> None:
        assert self._thread is None, "engine already started"
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="headroom-engine", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the loop and abort whatever is still queued or running."""
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._state_lock:
            self._drain_inbox()
            for request_id in list(self.scheduler.requests):
                self._abort(request_id, "shutdown")

    # ---- engine thread ----------------------------------------------------------------

    def _loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread
        while True:
            with self._wakeup:
                while not (self._inbox or self.scheduler.has_work() or self._stopping):
                    self._wakeup.wait()
                if self._stopping:
                    return
            try:
                self.step()
            except Exception:  # a bug outside the model call: fail what is in flight, keep serving
                log.exception("engine step crashed; failing %d requests", len(self.scheduler.requests))
                with self._state_lock:
                    for request_id in list(self.scheduler.requests):
                        self._abort(request_id, "engine_error", error="internal engine error")

    def _drain_inbox(self) -> None:
        with self._wakeup:
            commands, self._inbox = self._inbox, []
        for command in commands:
            match command:
                case Add(request, sink):
                    self._add(request, sink)
                case Abort(request_id, cause):
                    self._abort(request_id, cause)
                case Control(request_id, action, args, future):
                    try:
                        future.set_result(self._control(request_id, action, **args))
                    except (UnknownSequence, SequenceFinished) as exc:
                        future.set_exception(exc)
                case SetLongLaneFactor(factor):
                    self.scheduler.policy.long_lane_factor = factor
                case _:
                    assert_never(command)

    def _add(self, request: Request, sink: OutputSink) -> None:
        if request.request_id in self.output_processor:
            # Never let a duplicate id replace a live request's sink and detokenizer
            # (the scheduler would then raise here and end the engine thread).
            self.output_processor.reject(request, sink, f"request id {request.request_id!r} is already in use")
            return
        try:
            self.sampler.add(request)
        except Exception as exc:  # one request the engine cannot take fails alone, at once
            log.exception("engine could not take %s", request.request_id)
            self.output_processor.reject(request, sink, f"engine error: {exc}")
            return
        self.output_processor.add(request, sink)
        request.busy_at_arrival = self.stats.step_time_s
        self.loops.attach(request)
        self.scheduler.add_request(request)
        self.stats.prompt_tokens += request.num_prompt_tokens

    def _control(self, request_id: str, action: str, **args) -> SequenceSnapshot:
        request = self.scheduler.requests.get(request_id)
        if request is None:
            finished = self.output_processor.finished
            if request_id in finished:
                raise SequenceFinished(request_id, finished[request_id])
            raise UnknownSequence(request_id)
        by = args.get("by", "admin")
        if args.get("inflight"):
            self.scheduler.policy.inflight_decisions["policy"] += 1
        if by == "policy":
            self.stats.policy_actions[action] += 1
        if action == "abort":
            actions.abort(request, by, args.get("reason"))
            snapshot = self._sequence_snapshot(request)
            self._abort(request_id, by)
        elif action == "deprioritize":
            actions.deprioritize(request, by, args.get("reason"), bool(args.get("long_lane")))
            snapshot = self._sequence_snapshot(request)
        else:
            limit = int(args["max_tokens"])
            reached = actions.cap(request, limit, f"cap by {by} at {limit} tokens")
            snapshot = self._sequence_snapshot(request)
            if reached:
                request.stop_reason = f"capped by {by} at {limit} tokens"
                self._finish(request_id, RequestStatus.FINISHED_LENGTH)
        log.info("%s on %s: %s", action, request_id, request.admin_actions[-1])
        return snapshot

    def step(self) -> None:
        """One iteration: schedule, run the model, sample, update the scheduler, deliver outputs."""
        with self._state_lock:
            self._drain_inbox()
            if not self.scheduler.has_work():
                return
            self._enforce_deadlines()
            started = time.perf_counter()
            out = self.scheduler.schedule()
            self.stats.preemptions += len(out.preempted)
            if out.is_empty:
                return
            self._running_step = (out, started)
        try:
            if self.fault_hook is not None:
                self.fault_hook(out)
            model_out = self.runner.execute(out, self.block_manager,
                                            probe=self.probe_due is None or self.probe_due(out))
            sampling = [out.requests[i] for i in model_out.sample_indices]
            samples = self.sampler(model_out.logits, sampling)
        except Exception as exc:  # a failed step fails its own sequences, not the engine
            log.exception("engine step failed; failing %d sequences", len(out.requests))
            with self._state_lock:
                self._running_step = None
                for request in out.requests:
                    self._abort(request.request_id, "engine_error", error=f"engine error: {exc}")
            return
        with self._state_lock:
            try:
                self._complete_step(out, model_out, samples, started)
            except Exception:
                self._close_finished(out)
                raise

    def _close_finished(self, out: SchedulerOutput) -> None:
        """After a crash past the scheduler's update, close the step's requests it finished:
        they have left the scheduler, so the loop's handler, which fails what the scheduler
        holds, would leave their clients waiting."""
        for request in out.requests:
            if request.is_finished and request.request_id in self.output_processor:
                request.abort_cause = "engine_error"
                self.stats.aborts["engine_error"] += 1
                self.output_processor.finish(request, self.stats, "internal engine error")

    def _complete_step(self, out: SchedulerOutput, model_out: ModelOutput, samples: SampleResult,
                       started: float) -> None:
        self._running_step = None
        self._observe_probes(out, model_out)
        # The tokens exist from here on; update_from_output stamps finished_time later.
        sampled_time = time.monotonic()
        sampled: list[int | None] = [None] * len(out.requests)
        logprobs: dict[str, TokenLogprob | None] = {}
        for row, i in enumerate(model_out.sample_indices):
            sampled[i] = samples.token_ids[row]
            logprobs[out.requests[i].request_id] = samples.logprobs[row]
        # Blocks each request held for this step, read before update_from_output frees
        # those of the requests that finish in it.
        held = [len(self.block_manager.block_table(r.request_id)) for r in out.requests]
        with_token = self.scheduler.update_from_output(out, sampled)
        self._act_on_loops(with_token)

        elapsed = time.perf_counter() - started
        self.accounting.step_done(self.stats, out, held, elapsed, model_out.timer)
        for request in with_token:
            if request.first_token_time is None:
                request.first_token_time = sampled_time
            self.output_processor.token(request, logprobs.get(request.request_id), self.stats)

    def _observe_probes(self, out: SchedulerOutput, model_out: ModelOutput) -> None:
        if self.probe_hook is not None and model_out.probes:
            try:
                self.probe_hook([out.requests[i] for i in model_out.sample_indices], model_out.probes)
            except Exception:  # an estimate is advice: losing one must not lose the step's tokens
                log.exception("in-flight length probe failed; this step's sequences keep their estimates")

    def _act_on_loops(self, requests: list[Request]) -> None:
        for request in requests:
            finding = None if request.is_finished else self.loops.check(request)
            if finding is None:
                continue
            self.stats.loops[finding.action] += 1
            status = actions.on_loop(request, finding, self.loops.cap_tokens)
            if status is not None:
                self.scheduler.finish_request(request.request_id, status)
            log.warning("loop %s on %s: %s", finding.action, request.request_id, finding.what,
                        extra={"sequence": request.request_id, "action": finding.action})

    def _enforce_deadlines(self) -> None:
        now = time.monotonic()
        late = [r for r in self.scheduler.requests.values() if r.deadline is not None and now > r.deadline]
        for request in late:
            log.warning(
                "request %s exceeded its wall-clock budget after %.1fs (%d output tokens); finishing it as length",
                request.request_id, now - request.arrival_time, request.num_output_tokens,
            )
            request.stop_reason = request.abort_cause = "wall_clock_budget"
            self.stats.aborts["wall_clock_budget"] += 1
            self._finish(request.request_id, RequestStatus.FINISHED_LENGTH)

    def _abort(self, request_id: str, cause: str, error: str | None = None) -> None:
        request = self.scheduler.requests.get(request_id)
        if request is None:
            return  # finished already, or never known
        request.abort_cause = cause
        self.stats.aborts[cause] += 1
        self._finish(request_id, RequestStatus.FINISHED_ABORTED, error=error)

    def _finish(self, request_id: str, status: RequestStatus, error: str | None = None) -> None:
        request = self.scheduler.finish_request(request_id, status)
        if request is not None:
            self.output_processor.finish(request, self.stats, error)

    # ---- called from any thread: observability ----------------------------------------

    def counters(self) -> EngineStats:
        """A consistent copy of the engine's counters."""
        with self._state_lock:
            return engine_counters(self.stats, self.scheduler, self.inflight)

    def use_inflight(self, probe: LengthProbe, every: int, runaway_threshold: float,
                     long_min_output: int) -> InflightRefiner:
        """Estimate each running sequence's remaining length in flight with `probe`, from
        the hidden state its forward pass computes anyway (runtime/inflight.py)."""
        refiner = InflightRefiner(probe, self.scheduler.policy, every, runaway_threshold, long_min_output)
        with self._state_lock:  # the engine may be stepping already
            self.runner.probe_layers = frozenset({probe.layer})
            self.probe_due = refiner.due
            self.probe_hook = refiner.observe
            self.inflight = refiner
        return refiner

    def long_lane(self) -> LongLaneState:
        """The long lane's settings and what the engine has learned of its own step cost."""
        with self._state_lock:
            return long_lane_state(self.config.scheduler, self.scheduler, time.monotonic())

    def snapshot(self) -> EngineSnapshot:
        """Every live sequence's cost, and the pool's, at one consistent instant."""
        with self._state_lock:
            return engine_snapshot(self.stats, self.scheduler, self.block_manager, self._running_step,
                                   time.monotonic())

    def _sequence_snapshot(self, request: Request) -> SequenceSnapshot:
        return sequence_snapshot(request, time.monotonic(), self.stats.step_time_s, self.block_manager)

    # ---- conveniences for the CLI, tests and benchmarks --------------------------------

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | list[SamplingParams]) -> list[Request]:
        """Run prompts to completion on the calling thread (the loop must not be running)."""
        assert self._thread is None, "generate() steps the engine itself; stop the loop first"
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        requests = [self.new_request(p, s) for p, s in zip(prompts, params, strict=True)]
        for request in requests:
            self.submit(request, lambda _: None)
        while any(not r.is_finished for r in requests):
            self.step()
        return requests

    # The tests check that a finished request leaves nothing behind in either.
    @property
    def _sinks(self) -> dict[str, OutputSink]:
        return self.output_processor.sinks

    @property
    def _detokenizers(self) -> dict[str, IncrementalDetokenizer]:
        return self.output_processor.detokenizers
