"""The event loop's side of the engine: submits requests and streams their outputs.

Outputs cross from the engine thread with loop.call_soon_threadsafe, which never
blocks either side. Every stream ends in one `finally:` that aborts the sequence if it
did not finish, so a cancelled handler (client gone) frees its KV blocks at the next
engine step.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable

from headroom.contracts.request import Request
from headroom.runtime.engine import Engine
from headroom.runtime.outputs import RequestOutput


class AsyncEngine:
    def __init__(self, engine: Engine, max_submitted: int):
        self.engine = engine
        self.max_submitted = max_submitted
        self.submitted: dict[str, Request] = {}
        # Called on the loop once the engine is done with a request, also one whose client
        # left first (the engine finishes it a step later): where its cost is final.
        self.on_closed: Callable[[Request], None] | None = None

    @property
    def is_full(self) -> bool:
        return len(self.submitted) >= self.max_submitted

    def is_submitted(self, request_id: str) -> bool:
        return request_id in self.submitted

    async def generate(self, request: Request) -> AsyncIterator[RequestOutput]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[RequestOutput] = asyncio.Queue()

        def sink(output: RequestOutput) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, output)
            if output.finished and self.on_closed is not None:
                loop.call_soon_threadsafe(self.on_closed, request)

        self.submitted[request.request_id] = request
        request.admitted_time = time.monotonic()
        finished = False
        try:
            self.engine.submit(request, sink)
            while not finished:
                output = await queue.get()
                finished = output.finished
                yield output
        finally:
            self.submitted.pop(request.request_id, None)
            if not finished:
                self.engine.abort(request.request_id)

    def abort_all(self, cause: str = "shutdown") -> None:
        for request_id in list(self.submitted):
            self.engine.abort(request_id, cause)
