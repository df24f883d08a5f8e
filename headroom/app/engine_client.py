"""The event loop's one way to the engine: the handlers, the admin API and the policies
ask it, and never reach the engine behind it (runtime/core.py's threading contract says
what may be called from the loop; this is that list).

Outputs cross from the engine thread with loop.call_soon_threadsafe, which never
blocks either side. Every stream ends in one `finally:` that aborts the sequence if it
did not finish, so a cancelled handler (client gone) frees its KV blocks at the next
engine step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from headroom.app.errors import NotFound
from headroom.contracts.request import Priority, Request, SamplingParams
from headroom.openmp import in_passing_thread
from headroom.runtime.engine import Engine
from headroom.runtime.outputs import EngineSnapshot, LongLaneState, RequestOutput, SequenceSnapshot


@dataclass(frozen=True)
class ServedModel:
    """What the API says about the model: the names it answers to, the file they name."""

    names: tuple[str, ...]
    root: str
    max_model_len: int
    vocab_size: int


class AsyncEngine:
    def __init__(self, engine: Engine, max_submitted: int):
        self._engine = engine
        self.max_submitted = max_submitted
        self.submitted: dict[str, Request] = {}
        # Called on the loop once the engine is done with a request, also one whose client
        # left first (the engine finishes it a step later): where its cost is final.
        self.on_closed: Callable[[Request], None] | None = None
        loaded = engine.loaded
        self.model = ServedModel(tuple(loaded.names), loaded.name, engine.max_model_len, loaded.args.vocab_size)
        self.tokenizer = engine.tokenizer

    @property
    def is_full(self) -> bool:
        return len(self.submitted) >= self.max_submitted

    def is_submitted(self, request_id: str) -> bool:
        return request_id in self.submitted

    def new_request(
        self,
        prompt_ids: list[int],
        sampling: SamplingParams,
        request_id: str,
        priority: Priority,
        lora: str | None = None,
    ) -> Request:
        """Raises ValueError where the request can never run (engine.new_request)."""
        return self._engine.new_request(prompt_ids, sampling, request_id=request_id, priority=priority, lora=lora)

    def loras(self) -> dict[str, str]:
        """The LoRA adapters loaded: name -> folder."""
        return self._engine.executor.loras.loaded()

    async def load_lora(self, name: str, path: str) -> None:
        """Read and check an adapter off the loop; raises LoraError."""
        # On a thread that ends with the load: torch's work there starts OpenMP workers, and
        # a lasting thread that has them slows every later step of the engine (openmp.py).
        registry = self._engine.executor.loras
        ref = await asyncio.get_running_loop().run_in_executor(None, in_passing_thread, registry.load, name, path)
        self._engine.warm_lora(ref.uid)

    async def unload_lora(self, name: str) -> None:
        """Raises LoraInUse while sequences run under it, KeyError where it is not loaded."""
        await asyncio.wrap_future(self._engine.unload_lora(name))

    async def grammars(self):
        """The grammar compiler; the first call builds the vocabulary's table, off the loop."""
        return await asyncio.get_running_loop().run_in_executor(None, lambda: self._engine.grammars)

    def snapshot(self) -> EngineSnapshot:
        return self._engine.snapshot()

    def long_lane(self) -> LongLaneState:
        return self._engine.long_lane()

    def hol_actions(self) -> dict[str, int]:
        """How often the head-of-line loop tightened and relaxed the long lane."""
        actions = self._engine.hol.actions
        return {"tighten": actions["tighten"], "relax": actions["relax"]}

    def hol_update(
        self, coupled: bool, short_ttft_p99_s: float | None, long_device_share: float
    ) -> tuple[str | None, float]:
        """Feed the head-of-line signal to the long lane; returns (action, factor)."""
        hol = self._engine.hol
        return hol.update(coupled, short_ttft_p99_s, long_device_share), hol.factor

    async def control(self, request_id: str, action: str, **args) -> SequenceSnapshot:
        """An admin or policy action on a live sequence, applied between two steps."""
        return await asyncio.wrap_future(self._engine.control(request_id, action, **args))

    def health(self) -> dict:
        """The runtime's parts as /health reports them: attention backend, CUDA graphs, weights,
        speculation."""
        ex, speculative = self._engine.executor, self._engine.config.speculative
        return {
            "attention_backend": {
                "name": ex.backend.name,
                "reason": getattr(ex.backend, "reason", None),
                "block_size": ex.block_size,
                "arithmetic": {
                    "dtype": str(ex.attention_dtype).removeprefix("torch."),
                    "reason": ex.attention_dtype_reason,
                },
            },
            "cuda_graphs": ex.cuda_graphs,
            "threads": self.threads(),
            "weights": {
                "dtype": str(ex.dtype).removeprefix("torch."),
                "quantization": ex.loaded.quantization,
                "reason": ex.quantization_reason,
                "kv_cache": {"dtype": str(ex.kv_dtype).removeprefix("torch."), "reason": ex.kv_dtype_reason},
            },
            "speculative": {"method": speculative.method, "num_speculative_tokens": speculative.num_speculative_tokens},
        }

    def threads(self) -> dict | None:
        """The CPU thread count the steps run at, as the engine measured and chose it (None on a GPU)."""
        tuner = self._engine.threads
        if tuner is None:
            return None
        return {"current": tuner.current, "configured": tuner.most, "tuned": tuner.enabled, "switches": tuner.switches}

    def start(self) -> None:
        if not self._engine.running:  # `headroom serve` hands over an engine already stepping (Engine.started)
            self._engine.start()

    async def stop(self) -> None:
        """Stops the engine thread off the loop; anything in flight ends with "abort"."""
        await asyncio.get_running_loop().run_in_executor(None, self._engine.stop)

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(output: RequestOutput) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, output)
            if output.finished and self.on_closed is not None:
                loop.call_soon_threadsafe(self.on_closed, request)

        adapter = request.lora
        if adapter is not None and self._engine.executor.loras.ref(adapter.name) != adapter:
            # Unloaded (or reloaded) while the request waited in admission.
            raise NotFound(
                f"The model `{adapter.name}` does not exist: the LoRA adapter was unloaded.",
                param="model",
                code="model_not_found",
            )
        self.submitted[request.request_id] = request
        request.admitted_time = time.monotonic()
        finished = False
        try:
            self._engine.submit(request, sink)
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            self.submitted.pop(request.request_id, None)
            if not finished:
                self._engine.abort(request.request_id)

    def abort_all(self, cause: str = "shutdown") -> None:
        for request_id in list(self.submitted):
            self._engine.abort(request_id, cause)
