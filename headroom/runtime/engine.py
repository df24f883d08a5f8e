"""The engine's thread and its inbox: other threads only enqueue commands (add, abort,
control) and read through EngineCore's locked reads; the thread applies the commands at
the start of each step and runs the step (core.py), which alone changes engine state."""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future

import torch

from headroom.config import Config
from headroom.contracts.request import Request, SamplingParams
from headroom.models.loader import LoadedModel
from headroom.runtime import actions
from headroom.runtime.commands import Abort, Add, Command, Control, SetLongLaneFactor, UnloadLora, WarmLora
from headroom.runtime.core import EngineCore
from headroom.runtime.lane import HolFeedback
from headroom.runtime.outputs import OutputSink, SequenceSnapshot

log = logging.getLogger(__name__)


class Engine(EngineCore):
    def __init__(self, config: Config, loaded: LoadedModel | None = None):
        super().__init__(config, loaded)
        # The head-of-line loop's controller: fed the signal by the server, it moves the
        # long lane's factor through the inbox.
        self.hol = HolFeedback(self.set_long_lane_factor, config.scheduler.long_lane)
        self._thread: threading.Thread | None = None
        self._stopping = False

    # ---- called from any thread -------------------------------------------------------

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
        if action not in actions.ACTIONS:
            raise ValueError(f"unknown action {action!r}")
        command = Control(request_id, action, args)
        self._command(command)
        return command.future

    def unload_lora(self, name: str) -> Future[None]:
        """Drop a LoRA adapter at the start of the next step; the future raises LoraInUse
        while sequences run under it, KeyError where none by that name is loaded."""
        command = UnloadLora(name)
        self._command(command)
        return command.future

    def warm_lora(self, uid: int) -> None:
        """Write an adapter just loaded into the slots at the start of the next step."""
        self._command(WarmLora(uid))

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
            engine._steps()

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
        self._thread = threading.Thread(target=self._steps, name="headroom-engine", daemon=True)
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
                self.output_processor.abort(request_id, "shutdown", self.stats)

    # ---- engine thread ----------------------------------------------------------------

    def _steps(self) -> None:
        if self.executor.device.type == "cuda":
            torch.cuda.set_device(self.executor.device)  # the current device is per thread
        try:
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
                            self.output_processor.abort(request_id, "engine_error", self.stats, "internal engine error")
        finally:
            if self.threads is not None:  # torch's count for threads to come is the configured one
                self.threads.release()

    # ---- conveniences for the CLI, tests and benchmarks --------------------------------

    def generate(
        self,
        prompts: list[list[int]],
        sampling: SamplingParams | list[SamplingParams],
        sink: OutputSink | None = None,
        lora: list[str | None] | None = None,
    ) -> list[Request]:
        """Run prompts to completion on the calling thread (the loop must not be running);
        `sink`, where given, sees every output as it is produced; `lora`, where given, names
        each prompt's adapter (None: the base)."""
        assert self._thread is None, "generate() steps the engine itself; stop the loop first"
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        adapters = lora or [None] * len(prompts)
        requests = [self.new_request(p, s, lora=a) for p, s, a in zip(prompts, params, adapters, strict=True)]
        for request in requests:
            self.submit(request, sink or (lambda _: None))
        try:
            while any(not r.is_finished for r in requests):
                self.step()
        finally:
            if self.threads is not None:  # the caller's thread keeps the configured count
                self.threads.release()
        return requests
