"""What the length predictor costs per request at admission: p50/p99 of featurize alone,
of the three boosters alone, and of featurize + predict together (the admission path),
one request at a time over the calibration test rows. Target: p99 under 0.5 ms.

    python bench/admission_cost.py [--data FILE.jsonl] [--predictor DIR] [--repeat 5]
"""

from __future__ import annotations

import argparse
import platform
import time

import numpy as np

from headroom.prediction.features import RequestFeatures, featurize
from headroom.prediction.predictor import LengthPredictor, load_predictor
from headroom.prediction.train import load_records

TARGET_P99_MS = 0.5


def percentiles(label: str, seconds: list[float]) -> str:
    p50, p99 = np.percentile(seconds, [50, 99]) * 1e3
    return f"{label:<28}{p50:>10.3f}{p99:>10.3f}{max(seconds) * 1e3:>10.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", default="data/calibration/smollm2-135m-labels.jsonl")
    p.add_argument("--predictor", default=None, help="model directory (default: the packaged one)")
    p.add_argument("--repeat", type=int, default=5, help="passes over the rows")
    ns = p.parse_args()

    records = load_records(ns.data)
    test = [r for r in records if r.get("split") == "test"] or records
    features = [RequestFeatures.from_record(r) for r in test]
    predictor = load_predictor(ns.predictor)
    for f in features[:50]:  # warm the word-hash cache and the boosters
        predictor.predict(f)

    feat_s, boost_s, total_s = [], [], []
    for _ in range(ns.repeat):
        for f in features:
            t0 = time.perf_counter()
            x = featurize(f)
            t1 = time.perf_counter()
            if isinstance(predictor, LengthPredictor):
                predictor.predict_row(x, f.max_tokens)
            t2 = time.perf_counter()
            predictor.predict(f)
            t3 = time.perf_counter()
            feat_s.append(t1 - t0)
            boost_s.append(t2 - t1)
            total_s.append(t3 - t2)

    chars = np.array([len(f.text) for f in features])
    print(
        f"{platform.processor() or platform.machine()}, {type(predictor).__name__}, "
        f"{len(features)} rows x {ns.repeat}, prompt chars median {np.median(chars):.0f} max {chars.max()}"
    )
    print(f"{'ms per request':<28}{'p50':>10}{'p99':>10}{'max':>10}")
    print(percentiles("featurize", feat_s))
    print(percentiles("boosters (3)", boost_s))
    print(percentiles("featurize + predict", total_s))
    p99 = float(np.percentile(total_s, 99)) * 1e3
    print(f"p99 {p99:.3f} ms: {'within' if p99 < TARGET_P99_MS else 'OVER'} the {TARGET_P99_MS} ms target")


if __name__ == "__main__":
    main()
