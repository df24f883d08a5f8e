"""The length probe's features: loop signals, the model's probe rows, what calibration
records, and the grouped CV that scores them."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from headroom.app.cli import main
from headroom.config import CacheConfig, Config, SchedulerConfig, SpeculativeConfig
from headroom.contracts.request import SamplingParams
from headroom.prediction.probe_rows import POINTS, ProbeRecorder, evaluate, loop_signals
from headroom.runtime.engine import Engine


def test_loop_signals_of_a_loop_and_of_fresh_text():
    assert loop_signals([5, 6, 7]) == [0.0, 0.0, 0.0]
    fresh = list(range(40))
    assert loop_signals(fresh) == [0.0, 1.0, 1 / 37]
    loop = [1, 2, 3, 4] * 10  # 37 4-grams, 4 distinct: the first 4 are new, 33 repeat
    share, distinct, top = loop_signals(loop)
    assert share == 1.0  # every 4-gram of the last 32 was seen before
    assert distinct == 4 / 32
    assert top == 10 / 37  # (1, 2, 3, 4) occurs 10 times


@pytest.fixture(scope="module")
def engine(default_model):
    return Engine(
        # One token a step: rows are recorded at exact token counts (as calibration runs).
        Config(
            cache=CacheConfig(num_blocks=64, block_size=16),
            scheduler=SchedulerConfig(max_num_seqs=4),
            speculative=SpeculativeConfig(method="off"),
        ),
        loaded=default_model,
    )


class RecordingSampler:
    """Stands in for one engine's sampler: keeps the logits of each step it samples, so
    no other engine's steps are seen."""

    def __init__(self, sampler):
        self.sampler = sampler
        self.logits: list[torch.Tensor] = []

    def __call__(self, logits, requests, drafts=None):
        self.logits.append(logits.clone())
        return self.sampler(logits, requests, drafts)

    def __getattr__(self, name):
        return getattr(self.sampler, name)


def test_probe_of_the_last_layer_gives_the_steps_logits(engine):
    model = engine.loaded.model
    last = model.args.num_layers - 1
    seen = []
    engine.watch_hidden(frozenset({3, last}), lambda requests, hidden: seen.append((len(requests), hidden)))
    sampler = engine.sampler
    engine.sampler = recording = RecordingSampler(sampler)
    try:
        ids = engine.tokenizer.encode("The capital of France is")
        engine.generate([ids, ids[:3]], SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))
    finally:
        engine.sampler = sampler
        engine.watch_hidden(frozenset(), None)
    # One prefill step and two decode steps, each sampling both sequences.
    assert [rows for rows, _ in seen] == [2, 2, 2] and len(recording.logits) == 3
    for (rows, hidden), logits in zip(seen, recording.logits, strict=True):
        assert set(hidden) == {3, last}
        assert hidden[3].shape == hidden[last].shape == (rows, model.args.hidden_size)
        with torch.inference_mode():
            again = model.compute_logits(model.norm(hidden[last]))
        torch.testing.assert_close(again, logits, rtol=0, atol=0)


def test_recorder_keeps_each_point_a_sequence_reached_with_what_remained(engine):
    recorder = ProbeRecorder(layers=(5, 20))
    engine.watch_hidden(frozenset(recorder.layers), recorder.observe)
    try:
        ids = engine.tokenizer.encode("Once upon a time")
        requests = engine.generate(
            [ids, ids],
            [
                SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True),
                SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
            ],
        )
    finally:
        engine.watch_hidden(frozenset(), None)
    for i, request in enumerate(requests):
        recorder.finish({"id": f"r{i}"}, request, "length")
    rows = [(r["id"], r["point"], r["output_tokens"], r["max_tokens"], r["capped"]) for r in recorder.rows]
    # r1 stops at 16 tokens: nothing remains at point 16, so only its prefill row is kept.
    assert rows == [
        ("r0", 0, 40, 40, True),
        ("r0", 16, 40, 40, True),
        ("r0", 32, 40, 40, True),
        ("r1", 0, 16, 16, True),
    ]
    assert all(len(r["states"]) == 2 and r["states"][0].shape == (576,) for r in recorder.rows)
    # Both sequences share a prompt: their prefill states agree.
    np.testing.assert_allclose(
        recorder.rows[0]["states"][1].astype(np.float32), recorder.rows[3]["states"][1].astype(np.float32), atol=2e-2
    )


def synthetic(n: int, seed: int = 0) -> dict:
    """Rows whose run-to-cap is written in one direction of the hidden state, not in the
    lengths: the hidden-state model must find it, the length-only one cannot."""
    rng = np.random.default_rng(seed)
    ids = np.repeat(np.arange(n), len(POINTS))
    point = np.tile(np.array(POINTS), n)
    capped = rng.random(n) < 0.5
    states = rng.normal(size=(len(ids), 1, 64)).astype(np.float16)
    states[:, 0, 0] += np.where(np.repeat(capped, len(POINTS)), 3.0, -3.0).astype(np.float16)
    output = np.where(np.repeat(capped, len(POINTS)), 512, point + rng.integers(1, 300, size=len(ids)))
    return {
        "layers": np.array([7]),
        "ids": ids.astype(str),
        "point": point,
        "states": states,
        "signals": np.zeros((len(ids), 3), dtype=np.float32),
        "prompt_tokens": np.full(len(ids), 50),
        "max_tokens": np.full(len(ids), 512),
        "temperature": np.full(len(ids), 0.7, dtype=np.float32),
        "output_tokens": output,
        "capped": np.repeat(capped, len(POINTS)),
    }


def test_grouped_cv_finds_a_signal_in_the_hidden_state_and_not_in_the_lengths():
    data = synthetic(240)
    with_state = {s.point: s for s in evaluate(data, 7)}
    lengths_only = {s.point: s for s in evaluate(data, None)}
    assert sorted(with_state) == list(POINTS)
    for point in POINTS:
        assert with_state[point].rows == 240
        assert with_state[point].auc > 0.95
        assert lengths_only[point].auc < 0.75  # only `point` varies, and it says nothing of the cap


def test_eval_needs_data_or_probe_rows(capsys):
    assert main(["predictor", "eval"]) == 2
    assert capsys.readouterr().err.strip() == "headroom: predictor eval needs --data or --probe-rows"


def test_train_then_score_a_probe_on_held_out_rows(tmp_path, capsys):
    def save(data: dict, name: str) -> str:
        path = tmp_path / name
        np.savez_compressed(path, **data, model_shape=np.array([64, 30, 1000]))
        return str(path)

    train_rows, held_out = save(synthetic(240, seed=0), "train.npz"), save(synthetic(80, seed=1), "test.npz")
    assert (
        main(["predictor", "train", "--probe-rows", train_rows, "--layer", "7", "--out", str(tmp_path / "probe")]) == 0
    )
    assert "saved to" in capsys.readouterr().err
    meta = json.loads((tmp_path / "probe" / "meta.json").read_text())
    assert (meta["layer"], meta["rows"], meta["requests"]) == (7, 240 * len(POINTS), 240)
    assert meta["model"] == {"hidden_size": 64, "num_layers": 30, "vocab_size": 1000}
    assert main(["predictor", "eval", "--probe-rows", held_out, "--probe", str(tmp_path / "probe")]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"the probe in {tmp_path / 'probe'} (layer 7) on every row of {held_out}"
    rows = [line.split() for line in lines[2:]]
    assert [r[0] for r in rows] == ["prefill", "16", "32", "64", "128"]
    assert all(int(r[1]) == 80 and float(r[3]) > 0.95 for r in rows)  # the signal is in the state
    # --inflight, the old name of --probe-rows, still works the same
    assert main(["predictor", "eval", "--inflight", held_out, "--probe", str(tmp_path / "probe")]) == 0
    assert capsys.readouterr().out.splitlines() == lines


def test_train_refuses_a_layer_it_was_not_given(tmp_path, capsys):
    path = tmp_path / "rows.npz"
    np.savez_compressed(path, **synthetic(20), model_shape=np.array([64, 30, 1000]))
    assert main(["predictor", "train", "--probe-rows", str(path), "--layer", "3", "--out", str(tmp_path / "p")]) == 2
    assert capsys.readouterr().err.strip() == f"headroom: {path} has layers [7], not 3"
