"""Training and evaluation of the length predictor on calibration records (the JSONL
`headroom predictor calibrate` writes: prompt or messages, max_tokens, temperature,
prompt_tokens, output_tokens, finish_reason, and optionally split)."""

from __future__ import annotations

import json
import zlib
from collections import Counter
from pathlib import Path

import lightgbm as lgb
import numpy as np
from scipy import stats

from headroom.prediction.classes import ClassThresholds, classify
from headroom.prediction.features import FEATURE_VERSION, RequestFeatures, featurize
from headroom.prediction.predictor import FallbackPredictor, LengthPredictor

_PARAMS = {
    "num_leaves": 15,
    "min_data_in_leaf": 20,
    "learning_rate": 0.05,
    "feature_fraction": 0.5,
    "bagging_fraction": 0.8,
    "bagging_freq": 1,
    "lambda_l2": 1.0,
    "max_bin": 63,
    "num_threads": 1,  # the box is shared with serving; 2k rows train in seconds anyway
    "deterministic": True,
    "force_row_wise": True,
    "verbose": -1,
}
_OBJECTIVES = {
    "p50": {"objective": "quantile", "alpha": 0.5, "metric": "quantile"},
    "p90": {"objective": "quantile", "alpha": 0.9, "metric": "quantile"},
    "cap": {"objective": "binary", "metric": "binary_logloss"},
}
MAX_ROUNDS = 400
DEFAULT_THRESHOLDS = ClassThresholds()
EARLY_STOPPING_ROUNDS = 40
CV_FOLDS = 4
HOLDOUT_FRACTION = 0.2


def load_records(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [r for r in rows if "output_tokens" in r and "prompt_tokens" in r]


def split_records(records: list[dict], seed: int = 0) -> tuple[list[dict], list[dict], str]:
    """(train, test, how): the records' own split when they carry one with test rows,
    else a seeded holdout of whole prompts."""
    test = [r for r in records if r.get("split") == "test"]
    if test:
        return [r for r in records if r.get("split") == "train"], test, "split field"
    held = _held_out(records, HOLDOUT_FRACTION, seed)
    return (
        [r for r, h in zip(records, held) if not h],
        [r for r, h in zip(records, held) if h],
        f"seeded {HOLDOUT_FRACTION:.0%} holdout",
    )


def _held_out(records: list[dict], fraction: float, seed: int) -> np.ndarray:
    return _draws(records, seed) < fraction


def _folds(records: list[dict], k: int, seed: int) -> np.ndarray:
    return np.minimum((_draws(records, seed) * k).astype(int), k - 1)


def _draws(records: list[dict], seed: int) -> np.ndarray:
    # Per prompt, so one prompt sampled at two temperatures never sits on both sides.
    return np.array([zlib.crc32(f"{seed}:{_text_key(r)}".encode()) / 2**32 for r in records])


def _text_key(r: dict) -> str:
    return json.dumps(r["messages"]) if "messages" in r else r["prompt"]


def _matrix(records: list[dict]) -> np.ndarray:
    return np.stack([featurize(RequestFeatures.from_record(r)) for r in records])


def _targets(records: list[dict]) -> dict[str, np.ndarray]:
    log_len = np.log1p(np.array([r["output_tokens"] for r in records], dtype=np.float64))
    capped = np.array([r["finish_reason"] == "length" for r in records], dtype=np.float64)
    return {"p50": log_len, "p90": log_len, "cap": capped}


def _fit(name: str, x: np.ndarray, y: np.ndarray, fold: np.ndarray, seed: int) -> tuple[lgb.Booster, int]:
    """Pick the round count by early stopping on the cross-validated loss, then refit on
    all rows. One small validation slice picks it too noisily at this data size: a
    classifier stopped after a few rounds predicts the base rate for every request."""
    params = {**_PARAMS, **_OBJECTIVES[name], "seed": seed}
    folds = [(np.flatnonzero(fold != k), np.flatnonzero(fold == k)) for k in range(CV_FOLDS)]
    history = lgb.cv(
        params,
        lgb.Dataset(x, y),
        MAX_ROUNDS,
        folds=folds,
        callbacks=[lgb.early_stopping(EARLY_STOPPING_ROUNDS, verbose=False)],
    )
    rounds = max(len(next(iter(history.values()))), 10)
    return lgb.train(params, lgb.Dataset(x, y), rounds), rounds


def train(
    records: list[dict], out_dir: str | Path, seed: int = 0, thresholds: ClassThresholds = DEFAULT_THRESHOLDS
) -> dict:
    """Fit on the train rows, save to out_dir, and return held-out metrics."""
    train_rows, test_rows, how = split_records(records, seed)
    if len(train_rows) < 50:
        raise ValueError(f"need at least 50 training records, got {len(train_rows)}")
    fold = _folds(train_rows, CV_FOLDS, seed + 1)
    x = _matrix(train_rows)
    targets = _targets(train_rows)
    boosters, rounds = {}, {}
    for name in ("p50", "p90", "cap"):
        boosters[name], rounds[name] = _fit(name, x, targets[name], fold, seed)
    meta = {
        "n_train": len(train_rows),
        "n_test": len(test_rows),
        "holdout": how,
        "seed": seed,
        "rounds": rounds,
        "params": _PARAMS,
        "feature_version": FEATURE_VERSION,
    }
    predictor = LengthPredictor(meta=meta, **boosters)
    metrics = evaluate(predictor, test_rows, thresholds)
    metrics["holdout"] = how
    predictor.meta["metrics"] = metrics
    predictor.save(out_dir)
    return metrics


def cross_validate(
    records: list[dict], k: int = CV_FOLDS, seed: int = 0, thresholds: ClassThresholds = DEFAULT_THRESHOLDS
) -> list[dict]:
    """k-fold CV over all records (a prompt's rows stay in one fold): each fold's metrics
    from a predictor fitted, as train() fits, on the other folds."""
    if len(records) < 50 * k // (k - 1):
        raise ValueError(f"need at least {50 * k // (k - 1)} records for {k}-fold CV, got {len(records)}")
    outer = _folds(records, k, seed)
    results = []
    for fold in range(k):
        fit_rows = [r for r, f in zip(records, outer) if f != fold]
        held = [r for r, f in zip(records, outer) if f == fold]
        inner = _folds(fit_rows, CV_FOLDS, seed + 1)
        x, targets = _matrix(fit_rows), _targets(fit_rows)
        boosters = {name: _fit(name, x, targets[name], inner, seed)[0] for name in ("p50", "p90", "cap")}
        results.append(evaluate(LengthPredictor(meta={}, **boosters), held, thresholds))
    return results


def format_cv(results: list[dict]) -> str:
    rows = [
        ("Kendall tau, predicted p50", lambda m: m["model"]["kendall_tau"]),
        ("Kendall tau, max_tokens alone", lambda m: m["baseline_max_tokens"]["kendall_tau"]),
        ("run-to-cap AUC", lambda m: m["model"]["cap_auc"]),
        ("class accuracy (p50)", lambda m: m["model"]["class_accuracy"]),
    ]
    lines = [
        f"{len(results)}-fold CV by prompt ({sum(m['n'] for m in results)} records)",
        f"{'':<32}" + "".join(f"{'fold ' + str(i):>9}" for i in range(len(results))) + f"{'mean':>9}",
    ]
    for label, get in rows:
        values = [get(m) for m in results]
        lines.append(f"{label:<32}" + "".join(f"{v:>9.3f}" for v in values) + f"{np.mean(values):>9.3f}")
    return "\n".join(lines)


def evaluate(
    predictor: LengthPredictor | FallbackPredictor,
    records: list[dict],
    thresholds: ClassThresholds = DEFAULT_THRESHOLDS,
) -> dict:
    if not records:
        return {}
    preds = [predictor.predict(RequestFeatures.from_record(r)) for r in records]
    actual = np.array([r["output_tokens"] for r in records], dtype=np.float64)
    prompt = np.array([r["prompt_tokens"] for r in records], dtype=np.float64)
    max_tokens = np.array([r["max_tokens"] for r in records], dtype=np.float64)
    capped = np.array([r["finish_reason"] == "length" for r in records])
    p50 = np.array([p.p50 for p in preds])
    p90 = np.array([p.p90 for p in preds])
    p_cap = np.array([p.p_cap for p in preds])
    true_class = [classify(int(t), a, thresholds) for t, a in zip(prompt, actual)]

    def class_accuracy(predicted_output: np.ndarray) -> float:
        guess = [classify(int(t), p, thresholds) for t, p in zip(prompt, predicted_output)]
        return float(np.mean([a == b for a, b in zip(true_class, guess)]))

    return {
        "n": len(records),
        "model": {
            **_rank(p50, actual),
            "mae_log": float(np.mean(np.abs(np.log1p(p50) - np.log1p(actual)))),
            "class_accuracy": class_accuracy(p50),
            "class_accuracy_p90": class_accuracy(p90),
            "cap_auc": _auc(p_cap, capped),
            "cap_accuracy": float(np.mean((p_cap >= 0.5) == capped)),
            "p50_coverage": float(np.mean(actual <= p50)),
            "p90_coverage": float(np.mean(actual <= p90)),
        },
        "baseline_max_tokens": {**_rank(max_tokens, actual), "class_accuracy": class_accuracy(max_tokens)},
        "baseline_prompt_tokens": _rank(prompt, actual),
        "data": {
            "cap_rate": float(capped.mean()) if len(capped) else float("nan"),
            "classes": dict(Counter(c.value for c in true_class)),
            "mean_output_tokens": float(actual.mean()) if len(actual) else float("nan"),
        },
    }


def _rank(score: np.ndarray, actual: np.ndarray) -> dict:
    if len(actual) < 2 or np.ptp(score) == 0 or np.ptp(actual) == 0:
        return {"kendall_tau": float("nan"), "spearman": float("nan")}
    return {
        "kendall_tau": float(stats.kendalltau(score, actual).statistic),
        "spearman": float(stats.spearmanr(score, actual).statistic),
    }


def _auc(score: np.ndarray, label: np.ndarray) -> float:
    n_pos, n_neg = int(label.sum()), int((~label).sum())
    if not n_pos or not n_neg:
        return float("nan")
    ranks = stats.rankdata(score)
    return float((ranks[label].sum() - n_pos * (n_pos + 1) / 2) / (n_pos * n_neg))


def format_metrics(metrics: dict) -> str:
    if "model" not in metrics:
        return "no held-out records to evaluate on"
    m, data = metrics["model"], metrics["data"]
    classes = ", ".join(f"{k} {v}" for k, v in sorted(data["classes"].items()))
    lines = [
        f"held-out rows: {metrics['n']}" + (f" ({metrics['holdout']})" if "holdout" in metrics else ""),
        (
            f"  run to cap {data['cap_rate']:.1%}, mean output {data['mean_output_tokens']:.0f} tokens; "
            f"true classes: {classes}"
        ),
        "",
        f"{'ranking vs actual output_tokens':<34}{'kendall tau':>12}{'spearman':>10}",
    ]
    for label, key in (
        ("predictor p50", "model"),
        ("baseline: max_tokens", "baseline_max_tokens"),
        ("baseline: prompt_tokens", "baseline_prompt_tokens"),
    ):
        lines.append(f"{label:<34}{metrics[key]['kendall_tau']:>12.3f}{metrics[key]['spearman']:>10.3f}")
    lines += [
        "",
        f"{'MAE of log1p(tokens), p50':<34}{m['mae_log']:>12.3f}",
        f"{'size-class accuracy (p50)':<34}{m['class_accuracy']:>12.3f}",
        f"{'size-class accuracy (p90)':<34}{m['class_accuracy_p90']:>12.3f}",
        f"{'  baseline: output = max_tokens':<34}{metrics['baseline_max_tokens']['class_accuracy']:>12.3f}",
        f"{'p_cap AUC':<34}{m['cap_auc']:>12.3f}",
        f"{'p_cap accuracy (at 0.5)':<34}{m['cap_accuracy']:>12.3f}",
        f"{'p50 coverage (actual <= p50)':<34}{m['p50_coverage']:>12.3f}",
        f"{'p90 coverage (actual <= p90)':<34}{m['p90_coverage']:>12.3f}",
    ]
    return "\n".join(lines)
