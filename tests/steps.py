"""A hook into a real engine's steps from the outside: a fault, a pause or a watch."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from headroom.contracts.schedule import SchedulerOutput
from headroom.runtime.core import EngineCore


@contextlib.contextmanager
def before_each_step(engine: EngineCore, hook: Callable[[SchedulerOutput], None]) -> Iterator[None]:
    """Calls hook(scheduler_output) on the engine thread just before each forward pass.

    What it raises is what the model would raise: the step fails as a device fault does."""
    runner = engine.runner
    execute = runner.execute

    def hooked(out: SchedulerOutput, *args, **kwargs):
        hook(out)
        return execute(out, *args, **kwargs)

    runner.execute = hooked
    try:
        yield
    finally:
        del runner.execute  # the class's method again
