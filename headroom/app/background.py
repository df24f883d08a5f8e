"""The real app on 127.0.0.1 (an ephemeral port) in a background thread with its own
uvloop event loop: for embedding a server in another program, and for the tests and
benchmarks that drive it with synchronous clients."""

from __future__ import annotations

import asyncio
import threading

import uvloop
from aiohttp import web

from headroom.app.server import create_app, drain, make_runner
from headroom.config import Config
from headroom.runtime.engine import Engine

# How long stop() waits for handlers after aborting their sequences: a handler still
# open then (one waiting in admission, say) is cancelled.
SHUTDOWN_TIMEOUT_S = 5.0


class BackgroundServer:
    def __init__(self, config: Config, engine: Engine):
        self.engine = engine
        self.app = create_app(config, engine)
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="headroom-server", daemon=True)
        self.runner: web.AppRunner | None = None
        self.port = 0

    def start(self) -> BackgroundServer:
        self.thread.start()
        self.call(self._start())
        return self

    async def _start(self) -> None:
        self.runner = make_runner(self.app, shutdown_timeout_s=SHUTDOWN_TIMEOUT_S)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", 0).start()
        self.port = self.runner.addresses[0][1]

    def call(self, coro, timeout: float = 60):
        """Run a coroutine on the server's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def stop(self) -> None:
        """Abort every live stream, shut the app down, and stop the engine even where the
        shutdown itself fails or times out: a server that is stopped leaves nothing
        running (a leaked engine would go on decoding whatever it held)."""
        assert self.runner is not None
        try:
            self.call(drain(self.app, 0.0), timeout=SHUTDOWN_TIMEOUT_S)
            self.call(self.runner.cleanup(), timeout=4 * SHUTDOWN_TIMEOUT_S)
        finally:
            if self.engine.running:
                self.engine.stop()
            self.loop.call_soon_threadsafe(self.loop.stop)
            self.thread.join(10)
            if not self.thread.is_alive():
                self.loop.close()
