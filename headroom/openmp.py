"""Keep OpenMP to the engine's thread.

libgomp gives each thread that starts a parallel region its own team of workers. Once a
thread other than the engine's has one (torch's CPU ops, LightGBM loading a model), every
region the engine starts afterwards is slower: on a 2-core EPYC the engine's 32-sequence
decode fell from 384-409 to 292-316 tok/s after a single LightGBM model load or torch sum
on the main thread. A team started on a thread that then exits goes with it (391 tok/s
after the same load run that way), so start-up work that may run OpenMP is run so.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def in_passing_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) on a new thread that ends when fn returns (or raises, which is
    raised here), so any OpenMP workers it started end with it."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            result.append(fn(*args, **kwargs))
        except BaseException as exc:  # noqa: BLE001 - re-raised on the caller's thread
            error.append(exc)

    thread = threading.Thread(target=run, name="headroom-passing")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]
