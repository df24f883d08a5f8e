from __future__ import annotations

import json
import os
import random
import re
import subprocess
import sys
import zlib
from dataclasses import astuple

import numpy as np
import pytest

from headroom.app.cli import main
from headroom.config import ConfigError
from headroom.prediction import features as features_module
from headroom.prediction import predictor as predictor_module
from headroom.prediction.classes import ClassThresholds, SizeClass, classify
from headroom.prediction.features import FEATURE_NAMES, HASH_BUCKETS, RequestFeatures, featurize
from headroom.prediction.predictor import (
    FallbackPredictor,
    LengthPredictor,
    Prediction,
    combine,
    load_predictor,
)
from headroom.prediction.train import evaluate, train

_FILLER = [
    "the",
    "cat",
    "garden",
    "river",
    "market",
    "engine",
    "letter",
    "music",
    "window",
    "paper",
    "cloud",
    "forest",
    "city",
    "table",
    "story",
    "coffee",
    "winter",
    "school",
    "bridge",
    "planet",
]
# hint phrase -> median output tokens before the max_tokens cap
_HINTS = {"": 90, "Answer briefly.": 12, "Write a detailed essay about it.": 2000}


def synthetic_records(n: int, seed: int = 0) -> list[dict]:
    """Output length set by a hint phrase and capped by max_tokens, with log-normal noise;
    prompt length is noise. Split 80/20 by the split field."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        hint = rng.choice(list(_HINTS))
        body = " ".join(rng.choice(_FILLER) for _ in range(rng.randint(3, 60)))
        prompt = f"{body}. {hint}" if hint else body
        max_tokens = rng.choice([128, 256, 512])
        wanted = max(1, int(_HINTS[hint] * rng.lognormvariate(0, 0.35)))
        out = min(wanted, max_tokens)
        rows.append(
            {
                "id": f"syn{i}",
                "split": "test" if i % 5 == 0 else "train",
                "prompt": prompt,
                "temperature": rng.choice([0.0, 0.7, 1.0]),
                "max_tokens": max_tokens,
                "prompt_tokens": 30 + len(prompt) // 4,
                "output_tokens": out,
                "finish_reason": "length" if out == max_tokens else "stop",
            }
        )
    return rows


@pytest.fixture(scope="module")
def records() -> list[dict]:
    return synthetic_records(700)


@pytest.fixture(scope="module")
def trained(records, tmp_path_factory) -> tuple[dict, object]:
    out = tmp_path_factory.mktemp("predictor")
    metrics = train(records, out, seed=0)
    return metrics, out


def _feature(vec: np.ndarray, name: str) -> float:
    return float(vec[FEATURE_NAMES.index(name)])


def _features(text: str, max_tokens: int = 512, tenant: str = "") -> RequestFeatures:
    return RequestFeatures.from_messages(
        [{"role": "user", "content": text}], prompt_tokens=40, max_tokens=max_tokens, temperature=0.0, tenant=tenant
    )


# -- features -------------------------------------------------------------------------


def test_from_record_counts_turns_and_system_text():
    row = {
        "messages": [
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
            {"role": "user", "content": "list 3 cats"},
        ],
        "max_tokens": 64,
        "temperature": 0.7,
        "prompt_tokens": 55,
        "tenant": "acme",
    }
    f = RequestFeatures.from_record(row)
    assert (f.turns, f.system_chars, f.prompt_chars) == (2, 9, 9 + 2 + 5 + 11)
    assert (f.text, f.prompt_tokens, f.max_tokens, f.tenant) == ("hi\nlist 3 cats", 55, 64, "acme")
    assert RequestFeatures.from_record({"prompt": "x", "max_tokens": 8}, prompt_tokens=7).prompt_tokens == 7


def test_featurize_is_deterministic_and_uses_crc32_buckets():
    f = _features("Hello world, hello again", tenant="acme")
    a, b = featurize(f), featurize(f)
    assert a.dtype == np.float32 and a.shape == (len(FEATURE_NAMES),)
    assert np.array_equal(a, b)
    hashed = a[len(FEATURE_NAMES) - HASH_BUCKETS :]
    assert hashed[zlib.crc32(b"hello") % HASH_BUCKETS] >= 2  # "hello" twice (lowercased)
    assert hashed.sum() == 4 + 3  # 4 unigrams + 3 bigrams
    assert _feature(a, "tenant_bucket") == zlib.crc32(b"acme") % 1024


@pytest.mark.parametrize("text", ["Hello, world! it's 3.5 x_y (a-b) [c]\n\td\u00e9j\u00e0", "tl;dr: 42 \u4f60\u597d"])
def test_fast_word_split_matches_the_regex(text):
    low = text.lower()
    assert features_module._words(low) == re.findall(r"\w+", low)
    assert features_module._words(low.encode("ascii", "ignore").decode()) == re.findall(
        r"\w+", low.encode("ascii", "ignore").decode()
    )


def test_featurize_is_stable_across_processes():
    text = "Explain in 3 paragraphs how python regex works, step by step?"
    code = (
        "import json; from headroom.prediction.features import RequestFeatures, featurize;"
        f"f = RequestFeatures.from_messages([{{'role': 'user', 'content': {text!r}}}], 40, 512, 0.0, 't1');"
        "print(json.dumps(featurize(f).tolist()))"
    )
    runs = [
        subprocess.run(
            [sys.executable, "-c", code],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    ]
    here = featurize(_features(text, tenant="t1")).tolist()
    assert json.loads(runs[0]) == json.loads(runs[1]) == here


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("Write it in 500 words", {"hint_number": 500, "hint_unit": 1}),
        ("a 300-word summary", {"hint_number": 300, "hint_unit": 1, "brief": 1}),
        ("Answer in three short paragraphs.", {"hint_number": 3, "hint_unit": 3}),
        ("give me 5 bullet points", {"hint_number": 5, "hint_unit": 5, "list_n": 5}),
        ("Explain in 2 sentences", {"hint_number": 2, "hint_unit": 2}),
        ("describe it in a sentence", {"hint_number": 1, "hint_unit": 2}),
        ("List 10 movies", {"list_n": 10}),
        ("top 20 cities", {"list_n": 20}),
        ("give me 7 blog post ideas", {"list_n": 7}),
        ("Be concise", {"brief": 1}),
        ("tl;dr of this text", {"brief": 2}),
        ("explain step by step", {"detailed": 2}),
        ("Write a comprehensive essay", {"detailed": 2}),
        ("Is the sky green? Answer yes or no.", {"yes_no": 1, "question_marks": 1}),
        ("true or false: cats bark", {"yes_no": 1}),
        ("write a python function with a regex", {"code_words": 3}),
        ("fix this:\n```\nx = 1\n```", {"code_fence": 1, "newlines": 3}),
    ],
)
def test_hint_features_fire(text, expected):
    vec = featurize(_features(text))
    for name, value in expected.items():
        assert _feature(vec, name) == value, name


@pytest.mark.parametrize("text", ["hello there", "The river flows to the sea.", "one two three"])
def test_hint_features_stay_quiet_without_hints(text):
    vec = featurize(_features(text))
    for name in ("hint_number", "list_n", "brief", "detailed", "yes_no", "code_words", "code_fence"):
        assert _feature(vec, name) == 0, name


def test_length_hint_scales_with_max_tokens():
    vec = featurize(_features("in 100 words", max_tokens=128))
    assert _feature(vec, "hint_tokens_over_max") == pytest.approx(140 / 128)


# -- classes --------------------------------------------------------------------------


def test_classify_boundaries():
    t = ClassThresholds()
    assert classify(511, 255, t) is SizeClass.SHORT
    assert classify(512, 255, t) is SizeClass.MEDIUM  # prompt at the short limit
    assert classify(511, 256, t) is SizeClass.MEDIUM  # output at the short limit
    assert classify(1535, 511, t) is SizeClass.MEDIUM
    assert classify(1536, 10, t) is SizeClass.LONG
    assert classify(10, 512, t) is SizeClass.LONG
    assert classify(10, 511.9, t) is SizeClass.MEDIUM
    assert SizeClass.SHORT.value == "short" and SizeClass("long") is SizeClass.LONG
    small = ClassThresholds(short_max_prompt=4, short_max_output=4, long_min_prompt=8, long_min_output=8)
    assert [classify(3, 3, small), classify(4, 3, small), classify(3, 8, small)] == [
        SizeClass.SHORT,
        SizeClass.MEDIUM,
        SizeClass.LONG,
    ]


def test_thresholds_reject_overlapping_limits():
    with pytest.raises(ConfigError):
        ClassThresholds(short_max_output=600, long_min_output=512)
    with pytest.raises(ConfigError):
        ClassThresholds(short_max_prompt=0)


# -- training and prediction ----------------------------------------------------------


def test_training_ranks_well_and_beats_baselines(trained):
    metrics, _ = trained
    model = metrics["model"]
    assert metrics["holdout"] == "split field" and metrics["n"] == 140
    assert model["kendall_tau"] >= 0.6
    assert model["kendall_tau"] > metrics["baseline_max_tokens"]["kendall_tau"] + 0.2
    assert model["kendall_tau"] > metrics["baseline_prompt_tokens"]["kendall_tau"] + 0.2
    assert model["cap_auc"] >= 0.9
    assert model["class_accuracy"] >= 0.8


def test_training_without_split_holds_out_a_seeded_fifth(tmp_path):
    rows = [{k: v for k, v in r.items() if k != "split"} for r in synthetic_records(300, seed=3)]
    a = train(rows, tmp_path / "a", seed=5)
    b = train(rows, tmp_path / "b", seed=5)
    assert a["holdout"].startswith("seeded") and 30 <= a["n"] <= 90
    assert a == b


def test_save_load_roundtrip_predicts_identically(trained, records, tmp_path):
    _, path = trained
    first = LengthPredictor.load(path)
    first.save(tmp_path)
    second = LengthPredictor.load(tmp_path)
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta["feature_version"] == 1 and "kendall_tau" in meta["metrics"]["model"]
    for r in records[:50]:
        f = RequestFeatures.from_record(r)
        assert first.predict(f) == second.predict(f)


def test_fast_single_row_path_matches_booster_predict(trained, records):
    predictor = LengthPredictor.load(trained[1])
    assert predictor._single_row is not None
    x = np.stack([featurize(RequestFeatures.from_record(r)) for r in records[:40]])
    for name, booster in predictor.boosters.items():
        expected = booster.predict(x, num_threads=1)
        got = [predictor._single_row[name](row) for row in x]
        np.testing.assert_allclose(got, expected, rtol=1e-12)
    with pytest.raises(ValueError):
        predictor._single_row["p50"](x[0].astype(np.float64))


def test_predictions_are_clamped_to_max_tokens(trained):
    predictor = LengthPredictor.load(trained[1])
    for max_tokens in (1, 2, 7, 128, 512, 4096):
        for text in ("hi", "Write a detailed essay about it.", "Answer briefly. " * 30):
            p = predictor.predict(_features(text, max_tokens=max_tokens))
            assert 1 <= p.p50 <= p.p90 <= max_tokens
            assert 0 <= p.p_cap <= 1


def test_cap_probability_drives_the_quantiles(trained):
    predictor = LengthPredictor.load(trained[1])
    essay = predictor.predict(_features("river market. Write a detailed essay about it.", max_tokens=128))
    brief = predictor.predict(_features("river market. Answer briefly.", max_tokens=512))
    assert essay.p_cap > 0.5 and essay.p50 == essay.p90 == 128
    assert brief.p_cap < 0.1 and brief.p50 < 40


def test_fallback_predictor_and_loading(trained, tmp_path, monkeypatch):
    fallback = FallbackPredictor()
    assert fallback.predict(_features("x", max_tokens=512)) == Prediction(256.0, 512.0, 0.5)
    assert fallback.predict(_features("x", max_tokens=100)) == Prediction(100.0, 100.0, 0.5)
    assert evaluate(fallback, synthetic_records(20))["n"] == 20

    monkeypatch.setattr(predictor_module, "DEFAULT_PREDICTOR_DIR", tmp_path / "absent")
    assert isinstance(load_predictor(None), FallbackPredictor)
    assert isinstance(load_predictor(trained[1]), LengthPredictor)
    with pytest.raises(FileNotFoundError):
        load_predictor(tmp_path / "absent")


def test_stale_feature_version_is_refused(trained, tmp_path, monkeypatch):
    LengthPredictor.load(trained[1]).save(tmp_path)
    meta = json.loads((tmp_path / "meta.json").read_text())
    (tmp_path / "meta.json").write_text(json.dumps({**meta, "feature_version": 0}))
    with pytest.raises(ValueError, match="feature version"):
        LengthPredictor.load(tmp_path)
    monkeypatch.setattr(predictor_module, "DEFAULT_PREDICTOR_DIR", tmp_path)
    assert isinstance(load_predictor(None), FallbackPredictor)


def test_predict_scores_every_request_on_the_single_row_path(trained, records):
    """What keeps admission's predict cheap: no Booster.predict per request (its Python
    overhead is most of the cost), and the same answer as Booster.predict. The timings
    themselves live in bench/admission_cost.py."""
    predictor = LengthPredictor.load(trained[1])
    features = [RequestFeatures.from_record(r) for r in records[:200]]
    x = np.stack([featurize(f) for f in features])
    raw = {name: booster.predict(x, num_threads=1) for name, booster in predictor.boosters.items()}
    calls = []
    for name, booster in predictor.boosters.items():
        booster.predict = lambda *args, name=name, slow=booster.predict, **kwargs: (
            calls.append(name),
            slow(*args, **kwargs),
        )[1]
    got = [predictor.predict(f) for f in features]
    assert calls == []
    for i, (f, prediction) in enumerate(zip(features, got, strict=True)):
        expected = combine(raw["p50"][i], raw["p90"][i], raw["cap"][i], f.max_tokens)
        assert astuple(prediction) == pytest.approx(astuple(expected), rel=1e-12)


def test_cross_validation_refits_per_fold_and_beats_max_tokens_alone(records, tmp_path, capsys):
    from headroom.prediction.train import cross_validate

    folds = cross_validate(records, k=4)
    assert [m["n"] for m in folds] and sum(m["n"] for m in folds) == len(records)
    for m in folds:  # the hint phrase decides the length: the model must find it in every fold
        assert m["model"]["kendall_tau"] > m["baseline_max_tokens"]["kendall_tau"] + 0.1
    path = tmp_path / "records.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records[:40]))
    assert main(["predictor", "eval", "--data", str(path), "--cv", "4"]) == 2
    assert capsys.readouterr().err.strip() == "headroom: need at least 66 records for 4-fold CV, got 40"
