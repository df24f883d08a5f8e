"""The length probe's rows: features of a running sequence, recorded during
calibration, and how well they predict its remaining length.

At fixed points (after prefill, then after 16, 32, 64 and 128 generated tokens) a
running sequence offers: the served model's residual stream after a chosen layer at its
last token (computed anyway; `Llama.hidden_layers` keeps it), how many tokens it has
generated against its max_tokens, and cheap signals of looping in the ids it generated.
`headroom predictor calibrate --probe-layers ...` records them (ProbeRecorder);
`headroom predictor eval --probe-rows FILE` scores them with grouped 4-fold CV (evaluate).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import torch

from headroom.contracts.request import Request

POINTS = (0, 16, 32, 64, 128)  # generated tokens at which a sequence is described
WINDOW = 32  # tokens of the recent output the loop signals look at
PCA_DIMS = 64  # by measurement: 8 and 32 dims scored lower at 4 of 5 points (bench/RESULTS.md)
PARAMS = {
    "learning_rate": 0.05,
    "num_leaves": 15,
    "min_data_in_leaf": 10,
    "bagging_fraction": 0.8,
    "bagging_freq": 1,
    "feature_fraction": 0.8,
    "verbose": -1,
    "num_threads": 1,
}
ROUNDS = 200


def loop_signals(ids: list[int]) -> list[float]:
    """[share of the last WINDOW tokens that end a 4-gram already seen in the output,
    distinct tokens in that window / its length, the most repeated 4-gram's count / the
    number of 4-grams]: all 0 with fewer than 4 tokens."""
    grams = [tuple(ids[i : i + 4]) for i in range(len(ids) - 3)]
    if not grams:
        return [0.0, 0.0, 0.0]
    seen: set[tuple[int, ...]] = set()
    repeated = []
    for g in grams:
        repeated.append(g in seen)
        seen.add(g)
    recent = repeated[-WINDOW:]
    window = ids[-WINDOW:]
    return [sum(recent) / len(recent), len(set(window)) / len(window), Counter(grams).most_common(1)[0][1] / len(grams)]


@dataclass
class ProbeRecorder:
    """Collects, per request, its probe rows and loop signals at each point it reaches."""

    layers: tuple[int, ...]
    model_shape: tuple[int, int, int] = (0, 0, 0)  # the served model's hidden size, layers, vocabulary
    _seen: dict[str, dict[int, tuple[list[np.ndarray], list[float]]]] = field(default_factory=dict)
    rows: list[dict] = field(default_factory=list)

    def observe(self, requests: list[Request], hidden: dict) -> None:
        """Engine.hidden_hook: each request has generated num_output_tokens so far."""
        rows = [r for r, request in enumerate(requests) if request.num_output_tokens in POINTS]
        if not rows:
            return
        # One copy per layer for the rows at a point, not one per row and layer.
        index = torch.tensor(rows)
        layers = [hidden[layer][index].float().cpu().numpy().astype(np.float16) for layer in self.layers]
        for i, r in enumerate(rows):
            request = requests[r]
            point = request.num_output_tokens
            states = [by_layer[i] for by_layer in layers]
            self._seen.setdefault(request.request_id, {})[point] = (states, loop_signals(request.output_token_ids))

    def finish(self, row: dict, request: Request, finish_reason: str | None) -> None:
        for point, (states, signals) in sorted(self._seen.pop(request.request_id, {}).items()):
            if point >= request.num_output_tokens:
                continue  # nothing remains to predict
            self.rows.append(
                {
                    "id": row["id"],
                    "point": point,
                    "states": states,
                    "signals": signals,
                    "prompt_tokens": request.num_prompt_tokens,
                    "max_tokens": request.sampling.max_tokens,
                    "temperature": request.sampling.temperature,
                    "output_tokens": request.num_output_tokens,
                    "capped": finish_reason == "length",
                }
            )

    def save(self, path: str) -> None:
        rows = self.rows
        np.savez_compressed(
            path,
            layers=np.array(self.layers),
            model_shape=np.array(self.model_shape),
            ids=np.array([r["id"] for r in rows]),
            point=np.array([r["point"] for r in rows]),
            states=np.stack([np.stack(r["states"]) for r in rows]) if rows else np.zeros((0, len(self.layers), 0)),
            signals=np.array([r["signals"] for r in rows], dtype=np.float32).reshape(len(rows), 3),
            prompt_tokens=np.array([r["prompt_tokens"] for r in rows]),
            max_tokens=np.array([r["max_tokens"] for r in rows]),
            temperature=np.array([r["temperature"] for r in rows], dtype=np.float32),
            output_tokens=np.array([r["output_tokens"] for r in rows]),
            capped=np.array([r["capped"] for r in rows]),
        )


def _fit_pca(x: np.ndarray, dims: int) -> tuple[np.ndarray, np.ndarray]:
    mean = x.mean(0)
    _, _, vt = np.linalg.svd(x - mean, full_matrices=False)
    return mean, vt[:dims]


def feature_matrix(
    prompt_tokens,
    max_tokens,
    point,
    temperature,
    signals=None,
    states=None,
    pca: tuple[np.ndarray, np.ndarray] | None = None,
) -> np.ndarray:
    """One row per (sequence, point): lengths and temperature, then (with a probe layer)
    the loop signals and the hidden state projected on the PCA basis. Calibration and
    serving both build their rows here, so the two cannot drift apart."""
    max_tokens, point = np.asarray(max_tokens, dtype=np.float64), np.asarray(point, dtype=np.float64)
    base = np.column_stack(
        [
            np.log1p(np.asarray(prompt_tokens, dtype=np.float64)),
            np.log1p(max_tokens),
            point,
            np.log1p(max_tokens - point),
            np.asarray(temperature, dtype=np.float64),
        ]
    )
    if states is None:
        return base
    mean, basis = pca
    return np.column_stack([base, signals, (np.asarray(states, dtype=np.float32) - mean) @ basis.T])


def features(data: dict, rows: np.ndarray, layer_index: int | None, pca: tuple[np.ndarray, np.ndarray] | None):
    states = None if layer_index is None else data["states"][rows, layer_index]
    return feature_matrix(
        data["prompt_tokens"][rows],
        data["max_tokens"][rows],
        data["point"][rows],
        data["temperature"][rows],
        data["signals"][rows],
        states,
        pca,
    )


def fit(data: dict, rows: np.ndarray, layer_index: int | None, seed: int = 0):
    """(PCA mean and basis or None, run-to-cap classifier, log-remaining regressor) on rows."""
    import lightgbm as lgb

    pca = None
    if layer_index is not None:
        pca = _fit_pca(data["states"][rows, layer_index].astype(np.float32), PCA_DIMS)
    x = features(data, rows, layer_index, pca)
    remaining = (data["output_tokens"][rows] - data["point"][rows]).astype(np.float64)
    params = {**PARAMS, "seed": seed}
    classifier = lgb.train({**params, "objective": "binary"}, lgb.Dataset(x, data["capped"][rows].astype(int)), ROUNDS)
    regressor = lgb.train({**params, "objective": "regression"}, lgb.Dataset(x, np.log1p(remaining)), ROUNDS)
    return pca, classifier, regressor


@dataclass
class PointScore:
    point: int
    rows: int
    cap_rate: float
    auc: float
    tau: float


def evaluate(data: dict, layer: int | None, folds: int = 4, seed: int = 0) -> list[PointScore]:
    """Grouped k-fold CV (a request's rows stay in one fold): one LightGBM classifier of
    run-to-cap and one regressor of log remaining tokens over all points, scored per point.
    layer None: prompt and length features only, no hidden state."""
    layer_index = None if layer is None else list(data["layers"]).index(layer)
    ids = data["ids"]
    unique = np.unique(ids)
    fold_of = dict(zip(unique, np.random.default_rng(seed).permutation(len(unique)) % folds, strict=True))
    fold = np.array([fold_of[i] for i in ids])
    p_cap = np.zeros(len(ids))
    p_rem = np.zeros(len(ids))
    for k in range(folds):
        train, test = np.where(fold != k)[0], np.where(fold == k)[0]
        pca, classifier, regressor = fit(data, train, layer_index, seed)
        x_test = features(data, test, layer_index, pca)
        p_cap[test] = classifier.predict(x_test)
        p_rem[test] = regressor.predict(x_test)
    return score(data, p_cap, p_rem)


def score(data: dict, p_cap: np.ndarray, p_remaining: np.ndarray) -> list[PointScore]:
    """Run-to-cap AUC and Kendall tau of the remaining tokens, per point, of predictions
    for data's rows (any monotone transform of the remaining tokens scores alike)."""
    from scipy.stats import kendalltau, mannwhitneyu

    remaining = (data["output_tokens"] - data["point"]).astype(np.float64)
    capped = data["capped"].astype(int)
    scores = []
    for point in POINTS:
        at = data["point"] == point
        if at.sum() < 10:
            continue
        pos, neg = p_cap[at & (capped == 1)], p_cap[at & (capped == 0)]
        auc = mannwhitneyu(pos, neg).statistic / (len(pos) * len(neg)) if len(pos) and len(neg) else float("nan")
        scores.append(
            PointScore(
                point,
                int(at.sum()),
                float(capped[at].mean()),
                float(auc),
                float(kendalltau(p_remaining[at], remaining[at]).statistic),
            )
        )
    return scores


def format_scores(title: str, scores: list[PointScore]) -> str:
    lines = [title, f"{'generated':>10} {'rows':>6} {'cap rate':>9} {'cap AUC':>8} {'tau remaining':>14}"]
    for s in scores:
        label = "prefill" if s.point == 0 else str(s.point)
        lines.append(f"{label:>10} {s.rows:>6} {s.cap_rate:>9.3f} {s.auc:>8.3f} {s.tau:>14.3f}")
    return "\n".join(lines)
