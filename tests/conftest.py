from __future__ import annotations

import os
import threading
import time

import pytest
import torch

# Without a GPU, our Triton kernels run through Triton's interpreter. It must be chosen
# before anything imports triton (triton.language's own helpers are jitted at import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from headroom.config import ModelConfig
from headroom.models.loader import LoadedModel, load_model


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
