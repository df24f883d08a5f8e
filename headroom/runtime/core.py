"""One step of the engine, in EngineCore's shape: apply the commands other threads sent,
schedule, execute, sample, update_from_output, deliver outputs (output_processor.py) and
count the step's cost (stats.py). Only the engine thread changes this state; engine.py
runs the step there and takes the commands in. Other threads read the state only through
counters(), long_lane() and snapshot(), under `_state_lock`: the step holds that lock
while it changes state, but not while the model runs, so a reader waits at most for the
bookkeeping half of a step."""

from __future__ import annotations

import functools
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import assert_never

import torch

from headroom.config import Config
from headroom.contracts.request import Priority, Request, SamplingParams, check_fits
from headroom.contracts.schedule import SchedulerOutput
from headroom.executor.executor import Executor
from headroom.executor.grammar import Grammars
from headroom.executor.model_runner import ModelOutput
from headroom.executor.sampler import Sampler, SampleResult, TokenLogprob
from headroom.models.loader import LoadedModel
from headroom.models.lora import LoraInUse
from headroom.runtime import actions
from headroom.runtime.block_manager import BlockManager
from headroom.runtime.commands import Abort, Add, Command, Control, SetLongLaneFactor, UnloadLora, WarmLora
from headroom.runtime.drafter import Drafter
from headroom.runtime.loops import LoopWatch
from headroom.runtime.output_processor import OutputProcessor
from headroom.runtime.outputs import (
    EngineSnapshot,
    EngineStats,
    LongLaneState,
    OutputSink,
    SequenceFinished,
    UnknownSequence,
)
from headroom.runtime.probe import LengthProbe, ProbeRefiner
from headroom.runtime.scheduler import Scheduler
from headroom.runtime.stats import StepAccounting, engine_counters, engine_snapshot, long_lane_state
from headroom.runtime.threads import ThreadTuner
from headroom.runtime.warmup import measure_step_cost

log = logging.getLogger(__name__)

HiddenHook = Callable[[list[Request], dict[int, torch.Tensor]], None]


class EngineCore:
    def __init__(self, config: Config, loaded: LoadedModel | None = None):
        self.config = config
        self.executor = Executor.build(config, loaded)
        self.loaded, self.runner = self.executor.loaded, self.executor.runner
        self.tokenizer, self.max_model_len = self.loaded.tokenizer, self.executor.max_model_len
        self.block_manager = BlockManager(
            self.executor.num_blocks, self.executor.block_size, config.cache.enable_prefix_caching
        )
        eos = self.tokenizer.eos_token_ids
        self.scheduler = Scheduler(config.scheduler, self.block_manager, eos, speculative=config.speculative)
        if config.speculative.method == "draft_model":
            self.scheduler.speculator.drafter = Drafter.build(config, self.executor)
        self.sampler = Sampler(eos, seed=config.seed, device=self.executor.device)
        self.loops = LoopWatch.of(config.admin)
        if config.scheduler.long_lane:
            self.scheduler.cost.prime(measure_step_cost(self.runner, self.block_manager))
        self.stats = EngineStats()
        log.info("engine ready: %s", self.executor.describe())

        self.output_processor = OutputProcessor(self.tokenizer.hf, self.scheduler, self.sampler)
        self.accounting = StepAccounting(self.scheduler.cost)
        # On the CPU, the thread count the steps run at is measured and chosen (threads.py).
        self.threads = (
            ThreadTuner(torch.get_num_threads(), torch.set_num_threads)
            if config.model.tune_threads and self.executor.device.type == "cpu"
            else None
        )
        self._inbox: list[Command] = []
        self._wakeup = threading.Condition()
        self._state_lock = threading.Lock()
        # (out, perf_counter start) while the model runs
        self._running_step: tuple[SchedulerOutput, float] | None = None
        # Set with watch_hidden: called on the engine thread after each forward pass with the
        # sequences that sample (before this step's token is appended) and their rows.
        self.hidden_hook: HiddenHook | None = None
        self.hidden_due: Callable[[SchedulerOutput], bool] | None = None
        self.refiner: ProbeRefiner | None = None  # see use_probe
        self._ids = itertools.count()

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
        priority: Priority | None = None,
        lora: str | None = None,
    ) -> Request:
        """Validate and build a request (not yet submitted); raises ValueError. `lora` names
        a loaded adapter to run it under (None: the base model)."""
        adapter = None
        if lora is not None:
            adapter = self.executor.loras.ref(lora)
            if adapter is None:
                raise ValueError(f"no LoRA adapter named {lora!r} is loaded")
        request = Request(
            request_id or f"req-{next(self._ids)}",
            list(prompt_token_ids),
            sampling,
            priority or Priority(),
            lora=adapter,
        )
        cache_tokens = self.block_manager.num_blocks * self.block_manager.block_size
        check_fits(request, self.max_model_len, cache_tokens, self.loaded.args.vocab_size)
        return request

    # ---- engine thread ----------------------------------------------------------------

    def _drain_inbox(self) -> None:
        with self._wakeup:
            commands, self._inbox = self._inbox, []
        for command in commands:
            match command:
                case Add(request, sink):
                    self._add(request, sink)
                case Abort(request_id, cause):
                    self.output_processor.abort(request_id, cause, self.stats)
                case Control(request_id, action, args, future):
                    try:
                        future.set_result(
                            actions.apply(request_id, action, args, self.scheduler, self.output_processor, self.stats)
                        )
                    except (UnknownSequence, SequenceFinished) as exc:
                        future.set_exception(exc)
                case UnloadLora(name, future):
                    self._unload_lora(name, future)
                case WarmLora(uid):
                    self.executor.loras.warm_loaded(uid)
                case SetLongLaneFactor(factor):
                    self.scheduler.lane.factor = factor
                case _:
                    assert_never(command)

    def _unload_lora(self, name: str, future) -> None:
        users = sorted(r.request_id for r in self.scheduler.requests.values() if r.lora and r.lora.name == name)
        if users:
            shown = ", ".join(users[:5]) + (f" and {len(users) - 5} more" if len(users) > 5 else "")
            future.set_exception(LoraInUse(f"the LoRA adapter {name!r} is in use by {len(users)} sequences: {shown}"))
            return
        try:
            self.executor.loras.unload(name)
        except KeyError:
            future.set_exception(KeyError(name))
            return
        future.set_result(None)

    def _add(self, request: Request, sink: OutputSink) -> None:
        # Weights that left memory (max_cpu_loras) are read again at the request's first step,
        # off the state lock; a folder gone by then fails that adapter's sequences alone, and
        # for a few seconds after, its requests at entry.
        if request.lora is not None and not self.executor.loras.registered(request.lora.uid):
            # Built under an adapter that was unloaded while it waited (in admission).
            self.output_processor.reject(request, sink, f"the LoRA adapter {request.lora.name!r} was unloaded")
            return
        if request.lora is not None and (unreadable := self.executor.loras.unreadable(request.lora.uid)):
            self.output_processor.reject(request, sink, f"the LoRA adapter could not be read: {unreadable}")
            return
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
        request.resources.busy_at_arrival = self.stats.step_time_s
        self.loops.attach(request)
        self.scheduler.add_request(request)
        self.stats.prompt_tokens += request.num_prompt_tokens

    def step(self) -> None:
        """One iteration: schedule, run the model, sample, update the scheduler, deliver outputs."""
        with self._state_lock:
            self._drain_inbox()
            if not self.scheduler.has_work():
                return
            actions.enforce_deadlines(self.scheduler, self.output_processor, self.stats)
            started = time.perf_counter()
            out = self.scheduler.schedule()
            if self.executor.loras.refs:
                self.executor.loras.running = frozenset(r.lora.uid for r in self.scheduler.running if r.lora)
            self.stats.preemptions += len(out.preempted)
            if out.is_empty:
                return
            self._running_step = (out, started)
            predicted = None
            if self.threads is not None:
                self.threads.begin_step()
                if self.threads.enabled:  # a trial's step priced afresh, the others by the last fit
                    cost = self.scheduler.cost
                    price = cost.predict if self.threads.measuring() else cost.predict_last
                    predicted = price(out.total_tokens, out.attention_pairs, out.decode_pairs)
        try:
            model_out = self.runner.execute(
                out, self.block_manager, keep_hidden=self.hidden_due is None or self.hidden_due(out)
            )
            sampling = [out.requests[i] for i in model_out.sample_indices]
            drafts = [out.drafts.get(r.request_id, []) for r in sampling] if out.drafts else None
            samples = self.sampler(model_out.logits, sampling, drafts)
        except Exception as exc:  # a failed step fails its own sequences, not the engine
            log.exception("engine step failed; failing %d sequences", len(out.requests))
            with self._state_lock:
                self._running_step = None
                for request in out.requests:
                    self.output_processor.abort(request.request_id, "engine_error", self.stats, f"engine error: {exc}")
            return
        with self._state_lock:
            try:
                self._complete_step(out, model_out, samples, started, predicted)
            except Exception:
                self.output_processor.close_finished(out.requests, self.stats)
                raise

    def _complete_step(
        self,
        out: SchedulerOutput,
        model_out: ModelOutput,
        samples: SampleResult,
        started: float,
        predicted: float | None = None,
    ) -> None:
        """predicted: the step's cost as the model predicted it, where the thread tuner has a count to try."""
        self._running_step = None
        # Blocks each request held for this step, read before anything below frees them.
        held = [len(self.block_manager.block_table(r.request_id)) for r in out.requests]
        failed = self._withdraw_unread_adapters(out, model_out.lora_failed)
        self._observe_hidden(out, model_out, bool(failed))
        # The tokens exist from here on; update_from_output stamps finished_time later.
        sampled_time = time.monotonic()
        sampled: list[int | list[int] | None] = [None] * len(out.requests)
        logprobs: dict[str, list[TokenLogprob | None]] = {}
        for row, i in enumerate(model_out.sample_indices):
            more = samples.more.get(row)
            first = samples.token_ids[row]
            sampled[i] = first if more is None else [first, *(t for t, _ in more)]
            logprobs[out.requests[i].request_id] = [samples.logprobs[row], *(lp for _, lp in more or [])]
        loops: list = []
        update = self.scheduler.update_from_output(out, sampled, actions.loop_check(self.loops, loops))
        self.stats.count_guesses(out.drafts, update.accepted)
        actions.act_on_loops(loops, self.loops, self.scheduler, self.stats)

        elapsed = time.perf_counter() - started
        # A trial step at another thread count would teach the cost model a price not in use.
        trial = predicted is not None and self.threads.trying
        self.accounting.step_done(self.stats, out, held, elapsed, model_out.timer, learn=not trial)
        if predicted is not None:
            self.threads.step_done(elapsed, predicted)
        for request, error in failed:  # after step_done: their last output carries the step they cost
            self.output_processor.finish(request, self.stats, error)
        for request, new in update.tokens:
            if request.first_token_time is None:
                request.first_token_time = sampled_time
            self.output_processor.tokens(request, new, logprobs.get(request.request_id, []), self.stats)

    def _withdraw_unread_adapters(self, out: SchedulerOutput, failed: dict[int, str]) -> list[tuple[Request, str]]:
        """The sequences whose adapter could not be read for the step ran as the base model:
        abort them before the update, which then keeps none of their tokens or blocks."""
        if not failed:  # every step but one whose read failed
            return []
        withdrawn = []
        for request in out.requests:
            if request.lora is None or request.lora.uid not in failed or request.is_finished:
                continue
            error = f"the LoRA adapter could not be read: {failed[request.lora.uid]}"
            log.warning("failing %s: %s", request.request_id, error)
            self.output_processor.withdraw(request.request_id, "engine_error", self.stats)
            withdrawn.append((request, error))
        return withdrawn

    def _observe_hidden(self, out: SchedulerOutput, model_out: ModelOutput, withdrawn: bool) -> None:
        """withdrawn: some of the step's sequences were withdrawn (their rows ran as the base)."""
        if self.hidden_hook is None or not model_out.hidden:
            return
        rows = [out.requests[i] for i in model_out.sample_indices]
        kept = [j for j, request in enumerate(rows) if not request.is_finished] if withdrawn else range(len(rows))
        if not kept:
            return
        try:
            hidden = model_out.hidden
            if len(kept) < len(rows):
                index = torch.tensor(kept, device=next(iter(hidden.values())).device)
                rows, hidden = [rows[j] for j in kept], {layer: states[index] for layer, states in hidden.items()}
            self.hidden_hook(rows, hidden)
        except Exception:  # an estimate is advice: losing one must not lose the step's tokens
            log.exception("length probe failed; this step's sequences keep their estimates")

    # ---- called from any thread: observability ----------------------------------------

    def counters(self) -> EngineStats:
        """A consistent copy of the engine's counters."""
        with self._state_lock:
            return engine_counters(self.stats, self.scheduler, self.refiner)

    def use_probe(self, probe: LengthProbe, every: int, runaway_threshold: float, long_min_output: int) -> ProbeRefiner:
        """Estimate each running sequence's remaining length with `probe`, from
        the hidden state its forward pass computes anyway (runtime/probe.py)."""
        refiner = ProbeRefiner(probe, self.scheduler.policy, every, runaway_threshold, long_min_output)
        self.watch_hidden(frozenset({probe.layer}), refiner.observe, refiner.due, refiner)
        return refiner

    def watch_hidden(
        self,
        layers: frozenset[int],
        hook: HiddenHook | None,
        due: Callable[[SchedulerOutput], bool] | None = None,
        refiner: ProbeRefiner | None = None,
    ) -> None:
        """Keep the rows of `layers` for the sequences that sample and pass them to `hook`
        after each forward pass (when `due` says the step needs them); empty layers: stop.
        `refiner`: the refiner the hook belongs to, whose estimates counters() reports."""
        with self._state_lock:  # the engine may be stepping already
            self.runner.hidden_layers = layers
            self.hidden_hook, self.hidden_due, self.refiner = hook, due, refiner

    def long_lane(self) -> LongLaneState:
        """The long lane's settings and what the engine has learned of its own step cost."""
        with self._state_lock:
            return long_lane_state(self.config.scheduler, self.scheduler, time.monotonic())

    def snapshot(self) -> EngineSnapshot:
        """Every live sequence's cost, and the pool's, at one consistent instant."""
        with self._state_lock:
            return engine_snapshot(self.stats, self.scheduler, self.block_manager, self._running_step, time.monotonic())
