"""The length probe in the engine: when the probe runs, what it reads, what it
changes (a planted loop is flagged and moved to the long lane), and that a failing probe
costs no tokens. The probe is a real ProbeModel (PCA + LightGBM) trained here on rows
where running to the cap is written in the loop signal, so the expectations are exact."""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch

from headroom.config import AdminConfig, CacheConfig, Config, SchedulerConfig, SpeculativeConfig
from headroom.contracts.request import SamplingParams
from headroom.prediction.probe_model import DEFAULT_PATH, ProbeModel, load_probe
from headroom.prediction.probe_rows import POINTS
from headroom.runtime.engine import Engine

LAYER = 18


def loop_rows(n: int, hidden: int, seed: int = 0) -> dict:
    """Calibration rows in which a sequence runs to its cap exactly when its output loops
    (the share of repeated 4-grams, loop_signals' first value, is high from 16 tokens on)."""
    rng = np.random.default_rng(seed)
    ids = np.repeat(np.arange(n), len(POINTS))
    point = np.tile(np.array(POINTS), n)
    capped = np.repeat(rng.random(n) < 0.5, len(POINTS))
    share = np.where(capped, rng.uniform(0.6, 1.0, len(ids)), rng.uniform(0.0, 0.2, len(ids)))
    share[point == 0] = 0.0  # nothing generated yet
    signals = np.column_stack([share, rng.uniform(0.2, 1.0, len(ids)), rng.uniform(0, 0.3, len(ids))])
    # One constant state: the served model's real states then say nothing to the trees
    # (a feature constant in training is never split on), so only the loop decides.
    return {
        "layers": np.array([LAYER]),
        "model_shape": np.array([hidden, 30, 49152]),
        "ids": ids.astype(str),
        "point": point,
        "states": np.ones((len(ids), 1, hidden), dtype=np.float16),
        "signals": signals.astype(np.float32),
        "prompt_tokens": np.full(len(ids), 40),
        "max_tokens": np.full(len(ids), 600),
        "temperature": np.zeros(len(ids), dtype=np.float32),
        "output_tokens": np.where(capped, 600, point + rng.integers(1, 100, len(ids))),
        "capped": capped,
    }


@pytest.fixture(scope="module")
def probe(default_model):
    return ProbeModel.train(loop_rows(300, default_model.args.hidden_size), LAYER)


@pytest.fixture
def engine(default_model):
    # The loop detector would cap the planted loop long before the probe's cap matters:
    # here the probe alone is under test. One token a step, so each estimate falls on its
    # multiple of `every` exactly (with guesses, on the first step past it:
    # tests/admin/test_policies.py runs the probe under the default n-gram speculation).
    return Engine(
        Config(
            cache=CacheConfig(num_blocks=128, block_size=16),
            scheduler=SchedulerConfig(max_num_seqs=4),
            admin=AdminConfig(loop_policy="off"),
            speculative=SpeculativeConfig(method="off"),
        ),
        loaded=default_model,
    )


def test_a_planted_loop_is_flagged_at_its_first_estimate_and_moved_to_the_long_lane(engine, probe, caplog):
    engine.use_probe(probe, every=16, runaway_threshold=0.8, long_min_output=512)
    ids = engine.tokenizer.encode("Once upon a time")
    the = engine.tokenizer.encode(" the")[-1]
    caplog.set_level(logging.INFO, logger="headroom.probe")
    # Neither ignores EOS (that would make running to the cap certain, no guess needed).
    looping, normal = engine.generate(
        [ids, ids],
        [
            SamplingParams(max_tokens=600, temperature=0.0, logit_bias=((the, 100.0),)),
            SamplingParams(max_tokens=40, temperature=0.0),
        ],
    )
    assert looping.output_token_ids == [the] * 600
    # After prefill nothing has been generated, so nothing loops yet; at 16 tokens it does.
    assert looping.estimate.runaway_flagged_at == 16
    assert looping.size_class == "long"
    assert normal.estimate.runaway_flagged_at is None and normal.size_class is None
    assert normal.estimate.runaway_probability < 0.2
    # Estimates at 0, 16, ..., 128 (the last point the probe was trained at) for the loop,
    # and at every 16th token the other reached; from 128 on the loop's estimate counts down.
    points = range(0, normal.num_output_tokens, 16)
    assert engine.refiner.estimates == 9 + len(points)
    assert looping.estimate.at_tokens == 128 and normal.estimate.at_tokens == points[-1]
    assert engine.counters().probe_decisions == {"long_lane": 1}
    flagged = [r.getMessage() for r in caplog.records if r.name == "headroom.probe"]
    assert len(flagged) == 1
    assert flagged[0].startswith(f"{looping.request_id} predicted to run to its 600-token cap (p=")
    assert flagged[0].endswith(") at 16 tokens; moved to the long lane")


def test_the_probe_reads_the_steps_own_forward_pass(engine, probe):
    """No second forward: as many passes with the probe as without, the same tokens, and
    the rows it scores are the probe layer's output in that pass, at the sampling rows."""
    model = engine.loaded.model
    ids = engine.tokenizer.encode("The capital of France is")
    sampling = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    passes = []
    layer_out = []
    counter = model.register_forward_hook(lambda *_: passes.append(1))
    grab = model.layers[LAYER].register_forward_hook(lambda _m, _i, out: layer_out.append(out.detach().clone()))
    try:
        plain = engine.generate([ids], sampling)[0].output_token_ids
        without = len(passes)
        passes.clear()
        layer_out.clear()
        scored = []
        predict = probe.predict

        def spy(requests, states):
            scored.append(states.clone())
            return predict(requests, states)

        probe.predict = spy
        refiner = engine.use_probe(probe, every=16, runaway_threshold=0.8, long_min_output=512)
        kept = []  # the steps that kept hidden rows: only those with an estimate due
        engine.watch_hidden(
            frozenset({probe.layer}),
            lambda requests, hidden: (kept.append(len(requests)), refiner.observe(requests, hidden)),
            refiner.due,
            refiner,
        )
        probed = engine.generate([ids], sampling)[0].output_token_ids
    finally:
        counter.remove()
        grab.remove()
        del probe.predict
    assert len(passes) == without and probed == plain
    # Estimates after prefill (the prompt's last row) and after 16 tokens (a decode step).
    assert len(scored) == 2 and kept == [1, 1]
    torch.testing.assert_close(scored[0], layer_out[0][-1:], rtol=0, atol=0)
    torch.testing.assert_close(scored[1], layer_out[16], rtol=0, atol=0)


def test_ignore_eos_makes_the_estimate_exact(engine, probe):
    engine.use_probe(probe, every=16, runaway_threshold=0.8, long_min_output=512)
    ids = engine.tokenizer.encode("Once upon a time")
    certain, stoppable = engine.generate(
        [ids, ids],
        [
            SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
            SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, stop_token_ids=(7,)),
        ],
    )
    assert (
        certain.estimate.runaway_probability,
        certain.estimate.remaining_tokens,
        certain.estimate.runaway_flagged_at,
    ) == (1.0, 4, 0)
    assert certain.size_class is None  # 20 tokens are not long work
    assert stoppable.estimate.runaway_probability < 0.2 and stoppable.estimate.runaway_flagged_at is None


def test_a_failing_probe_costs_no_tokens(engine, probe, caplog):
    class Broken:
        layer, last_point = LAYER, 128

        def predict(self, requests, states):
            raise RuntimeError("probe broke")

    engine.use_probe(Broken(), every=4, runaway_threshold=0.8, long_min_output=512)
    ids = engine.tokenizer.encode("Hello")
    request = engine.generate([ids], SamplingParams(max_tokens=9, temperature=0.0, ignore_eos=True))[0]
    assert request.num_output_tokens == 9 and request.estimate.runaway_probability is None
    assert sum("length probe failed" in r.getMessage() for r in caplog.records) == 3  # at 0, 4, 8
    assert engine.block_manager.num_used_blocks == 0


def test_the_packaged_probe_fits_the_default_model_only(default_model):
    args = default_model.args
    probe = load_probe(None, args.hidden_size, args.num_layers, args.vocab_size)
    assert probe is not None and probe.layer == LAYER
    assert load_probe(None, 2048, args.num_layers, args.vocab_size) is None
    with pytest.raises(ValueError, match="trained for a model with"):
        load_probe(DEFAULT_PATH, 2048, args.num_layers, args.vocab_size)
