"""Start-up work that may run OpenMP (LightGBM loading its models) runs on a thread that
ends, never on the event loop's: a team of OpenMP workers left on a second thread cost
the engine a quarter of its 32-sequence throughput (headroom/openmp.py)."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from headroom.app import admission_gate, server
from headroom.config import Config
from headroom.openmp import in_passing_thread
from headroom.prediction import probe_model


def test_in_passing_thread_returns_raises_and_leaves_no_thread():
    seen: list[threading.Thread] = []

    def work(a, b=0):
        seen.append(threading.current_thread())
        return a + b

    assert in_passing_thread(work, 2, b=3) == 5
    assert seen[0] is not threading.current_thread() and not seen[0].is_alive()
    with pytest.raises(ValueError, match="bad"):
        in_passing_thread(lambda: (_ for _ in ()).throw(ValueError("bad")))


def recorder(threads: list[threading.Thread], value=None):
    def load(*args, **kwargs):
        threads.append(threading.current_thread())
        return value

    return load


def test_the_admission_predictor_is_loaded_off_the_callers_thread(monkeypatch):
    threads: list[threading.Thread] = []
    monkeypatch.setattr(admission_gate, "load_predictor", recorder(threads, "predictor"))
    gate = admission_gate.AdmissionGate(Config(), 72)
    assert gate.predictor == "predictor"
    assert len(threads) == 1 and threads[0] is not threading.current_thread() and not threads[0].is_alive()


def test_the_probe_is_loaded_off_the_callers_thread(monkeypatch):
    threads: list[threading.Thread] = []
    monkeypatch.setattr(probe_model, "load_probe", recorder(threads))
    engine = SimpleNamespace(
        loaded=SimpleNamespace(args=SimpleNamespace(hidden_size=576, num_layers=30, vocab_size=49152))
    )
    server._use_probe(Config(), engine)  # the probe is None: nothing is installed
    assert len(threads) == 1 and threads[0] is not threading.current_thread() and not threads[0].is_alive()
