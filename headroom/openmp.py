"""Keep OpenMP to the engine's thread.

libgomp gives each thread that starts a parallel region its own team of workers. Once a
thread other than the engine's has one (torch's CPU ops, LightGBM loading a model), every
region the engine starts afterwards is slower: on a 2-core EPYC the engine's 32-sequence
decode fell from 384-409 to 292-316 tok/s after a single LightGBM model load or torch sum
on the main thread. A team started on a thread that then exits goes with it (391 tok/s
after the same load run that way), so start-up work that may run OpenMP is run so.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


def in_passing_thread(fn: Callable[..., T], *args, **kwargs) -> T:
    """fn(*args, **kwargs) on a new thread that ends when fn returns (or raises, which is
    raised here), so any OpenMP workers it started end with it."""
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="headroom-passing") as pool:
        return pool.submit(fn, *args, **kwargs).result()
