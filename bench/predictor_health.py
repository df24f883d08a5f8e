"""The admission predictor's health figures as the server computes them
(headroom/observability/predictor_health.py), on the calibration labels' held-out rows:
the reference its floors in deploy/prometheus/rules.yml are set from. Also the spread
of each figure over bootstrap windows of those rows, which is how far one window moves
by chance without any drift.

    python bench/predictor_health.py [--data FILE.jsonl] [--predictor DIR] [--resamples 1000]
"""

from __future__ import annotations

import argparse

import numpy as np

from headroom.observability.finished import FinishedRequest
from headroom.observability.predictor_health import Figures, Outcome
from headroom.prediction.features import RequestFeatures
from headroom.prediction.predictor import load_predictor
from headroom.prediction.train import load_records

FIGURES = ("kendall_tau", "mae_tokens", "admission_cap_auc", "cap_rate")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="data/calibration/smollm2-135m-labels.jsonl")
    p.add_argument("--predictor", default=None, help="model directory (default: the packaged one)")
    p.add_argument("--resamples", type=int, default=1000)
    ns = p.parse_args()

    test = [r for r in load_records(ns.data) if r.get("split") == "test"]
    predictor = load_predictor(ns.predictor)
    outcomes = []
    for r in test:
        prediction = predictor.predict(RequestFeatures.from_record(r))
        done = FinishedRequest(
            request_id=r["id"],
            endpoint="/v1/completions",
            model="",
            http_status=200,
            tenant=None,
            tier=None,
            size_class="none",
            ran=True,
            output_tokens=r["output_tokens"],
            max_tokens=r["max_tokens"],
            finish_reason=r["finish_reason"],
            predicted_output_tokens=prediction.p50,
        )
        outcomes.append(Outcome.of(done))
    held_out = Figures.of(outcomes, min_requests=2)
    rng = np.random.default_rng(0)
    windows = [
        Figures.of([outcomes[i] for i in rng.integers(0, len(outcomes), len(outcomes))], 2) for _ in range(ns.resamples)
    ]
    n = len(outcomes)
    print(f"{n} held-out rows; bootstrap windows of {n}, {ns.resamples} resamples")
    print(f"{'figure':<20}{'held out':>10}{'p5':>10}{'p95':>10}")
    for name in FIGURES:
        values = [getattr(w, name) for w in windows if getattr(w, name) is not None]
        p5, p95 = np.percentile(values, [5, 95])
        print(f"{name:<20}{getattr(held_out, name):>10.3f}{p5:>10.3f}{p95:>10.3f}")


if __name__ == "__main__":
    main()
