from __future__ import annotations

import functools
import gc
import os
import threading
import time

import pytest
import torch
from aiohttp import web_app

# Without a GPU, our Triton kernels run through Triton's interpreter. It must be chosen
# before anything imports triton (triton.language's own helpers are jitted at import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from headroom.config import ModelConfig
from headroom.models.loader import LoadedModel, load_model
from headroom.runtime import threads
from headroom.runtime.engine import Engine

# Engines built in this process never try another thread count: a trial step's float sums
# (attention splits its keys by the thread count) may round apart from the reference run's,
# and tests compare tokens exactly. tests/runtime/test_threads.py brings trials back where it
# tests them; servers started as processes run as a user's do.
threads.START_TRIAL_S = threads.FIRST_TRIAL_S = float("inf")
threads.SLOW = float("inf")  # nor a trial its watch starts: no step is that slow


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """The default SmolLM2-135M in float32 on CPU, loaded once for the whole run."""
    return load_model(ModelConfig(), torch.device("cpu"), torch.float32)


# Threads that a test may not leave behind: an engine stepping, a server's event loop, a
# client stream of the test helpers. A leaked engine goes on decoding whatever it held and
# taxes (or, through anything process-wide, corrupts) the tests after it, so the leak is
# failed where it starts.
LEAK_PREFIXES = ("headroom-engine", "headroom-server", "headroom-test-stream")
LEAK_GRACE_S = 10.0  # a stream thread may still be reading its last bytes


def _watched_threads() -> set[threading.Thread]:
    return {t for t in threading.enumerate() if t.name.startswith(LEAK_PREFIXES)}


@pytest.fixture(autouse=True)
def no_leaked_threads():
    before = _watched_threads()
    yield
    deadline = time.monotonic() + LEAK_GRACE_S
    for thread in _watched_threads() - before:
        thread.join(max(0.0, deadline - time.monotonic()))
    leaked = sorted(t.name for t in _watched_threads() - before)
    assert not leaked, f"the test left running: {', '.join(leaked)}"


# An engine a test is done with must be freed before the next test: each holds its KV
# pool, committed at start, and a run builds hundreds. Two things keep one alive past its
# test: aiohttp's module-wide cache of middleware chains, which holds every Application
# it has served (and through it the engine), and reference cycles (the server, client and
# metrics refer to each other), which wait for the collector's rare full pass. A full
# pass costs ~0.3 s with the model loaded, so it runs after the tests that built an
# engine, not after every test.
_built = 0


def _counted(init):
    @functools.wraps(init)
    def counted_init(self, *args, **kwargs):
        global _built
        init(self, *args, **kwargs)
        _built += 1

    return counted_init


Engine.__init__ = _counted(Engine.__init__)


@pytest.fixture(autouse=True)
def engines_freed():
    before = _built
    yield
    if _built != before:
        web_app._cached_build_middleware.cache_clear()
        gc.collect()
