"""Output-length prediction at admission time: a median and a 90th percentile of the
tokens a request will generate, and the probability that it runs to max_tokens.

Three LightGBM boosters share one feature vector: quantile regressions (alpha 0.5 and
0.9) on log1p(output_tokens) and a classifier for finish_reason == "length". The served
model often loops until the cap, so "runs to the cap" is a point mass at max_tokens that
the classifier models better than the quantile regressions do; the combination below
uses it for the quantiles too.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import lightgbm as lgb
import numpy as np

from headroom.prediction.features import FEATURE_VERSION, NUM_FEATURES, RequestFeatures, featurize

log = logging.getLogger(__name__)

DEFAULT_PREDICTOR_DIR = Path(__file__).parent / "data" / "predictor"
_MODEL_FILES = {"p50": "p50.txt", "p90": "p90.txt", "cap": "cap.txt"}
_ORDER = ("p50", "p90", "cap")


@dataclass(frozen=True)
class Prediction:
    p50: float  # output tokens
    p90: float  # output tokens
    p_cap: float  # probability of finishing with "length"


def combine(q50: float, q90: float, p_cap: float, max_tokens: int) -> Prediction:
    """Raw booster outputs (log1p tokens, log1p tokens, probability) -> Prediction.

    Output never exceeds max_tokens, so its q-quantile is max_tokens exactly when
    P(run to cap) >= 1 - q; the classifier's estimate of that wins over the regressions'.
    """
    cap = float(max(max_tokens, 1))
    p_cap = min(max(p_cap, 0.0), 1.0)
    p50 = cap if p_cap >= 0.5 else min(max(math.expm1(q50), 1.0), cap)
    p90 = cap if p_cap >= 0.1 else min(max(math.expm1(q90), p50), cap)
    return Prediction(p50, p90, p_cap)


class LengthPredictor:
    def __init__(self, p50: lgb.Booster, p90: lgb.Booster, cap: lgb.Booster, meta: dict) -> None:
        self.boosters = {"p50": p50, "p90": p90, "cap": cap}
        self.meta = meta
        self._single_row = _single_row_boosters(self.boosters)

    @classmethod
    def load(cls, path: str | Path) -> LengthPredictor:
        path = Path(path)
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
        if meta.get("feature_version") != FEATURE_VERSION or meta.get("num_features") != NUM_FEATURES:
            raise ValueError(
                f"{path}: trained on feature version {meta.get('feature_version')} with "
                f"{meta.get('num_features')} features; this build has version {FEATURE_VERSION} "
                f"with {NUM_FEATURES}. Retrain with `headroom predictor train`."
            )
        boosters = {name: lgb.Booster(model_file=str(path / file)) for name, file in _MODEL_FILES.items()}
        return cls(meta=meta, **boosters)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        for name, file in _MODEL_FILES.items():
            self.boosters[name].save_model(str(path / file))
        meta = {**self.meta, "feature_version": FEATURE_VERSION, "num_features": NUM_FEATURES}
        (path / "meta.json").write_text(json.dumps(meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    def predict(self, f: RequestFeatures) -> Prediction:
        return self.predict_row(featurize(f), f.max_tokens)

    def predict_row(self, x: np.ndarray, max_tokens: int) -> Prediction:
        """One featurize() vector -> Prediction."""
        if self._single_row is not None:
            raw = [self._single_row[name](x) for name in _ORDER]
        else:  # one thread: the default OpenMP pool costs milliseconds per single-row call
            raw = [float(self.boosters[name].predict(x[None, :], num_threads=1)[0]) for name in _ORDER]
        return combine(*raw, max_tokens)


def _single_row_boosters(boosters: dict[str, lgb.Booster]) -> dict | None:
    try:
        from headroom.prediction.fastpredict import SingleRowBooster

        return {name: SingleRowBooster(b.model_to_string(), NUM_FEATURES) for name, b in boosters.items()}
    except (ImportError, AttributeError, OSError, ValueError, lgb.basic.LightGBMError) as exc:
        # Correct but ~4x slower per request; see fastpredict.py.
        log.warning("length predictor: LightGBM fast single-row path unavailable (%s); using Booster.predict", exc)
        return None


class FallbackPredictor:
    """No trained model: estimates from max_tokens alone, so admission still works."""

    meta: ClassVar[dict] = {"kind": "fallback"}

    def predict(self, f: RequestFeatures) -> Prediction:
        cap = float(max(f.max_tokens, 1))
        return Prediction(p50=min(cap, 256.0), p90=cap, p_cap=0.5)


def load_predictor(path: str | Path | None = None) -> LengthPredictor | FallbackPredictor:
    """The predictor at path, or the packaged default when path is None.

    A missing or stale default falls back (serving must start); an explicit path that
    cannot be loaded is an error.
    """
    if path is not None:
        predictor = LengthPredictor.load(path)
        log.info("length predictor: %s (%s)", path, _describe(predictor))
        return predictor
    if not (DEFAULT_PREDICTOR_DIR / "meta.json").exists():
        log.warning("length predictor: no trained model at %s; using the max_tokens fallback", DEFAULT_PREDICTOR_DIR)
        return FallbackPredictor()
    try:
        predictor = LengthPredictor.load(DEFAULT_PREDICTOR_DIR)
    except (ValueError, OSError, lgb.basic.LightGBMError) as exc:
        log.warning("length predictor: cannot load the default model (%s); using the max_tokens fallback", exc)
        return FallbackPredictor()
    log.info("length predictor: packaged default %s (%s)", DEFAULT_PREDICTOR_DIR, _describe(predictor))
    return predictor


def _describe(predictor: LengthPredictor) -> str:
    tau = predictor.meta.get("metrics", {}).get("model", {}).get("kendall_tau")
    n = predictor.meta.get("n_train")
    return f"trained on {n} rows" + (f", held-out tau {tau:.3f}" if isinstance(tau, float) else "")
