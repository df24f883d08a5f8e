"""A bounded log of finished requests (features, prediction, actual tokens), so the
predictor can be retrained on this deployment's real traffic. Holds prompt text, so it
is written only when the operator names a path."""

from __future__ import annotations

import json
import os
from dataclasses import asdict

from headroom.contracts.request import Request
from headroom.prediction.features import RequestFeatures
from headroom.prediction.predictor import Prediction


class RecordLog:
    def __init__(self, path: str, max_lines: int):
        self.path = path
        self.max_lines = max_lines
        self.lines = 0
        if os.path.exists(path):
            with open(path, "rb") as f:
                self.lines = sum(1 for _ in f)

    def append(
        self,
        features: RequestFeatures,
        prediction: Prediction | None,
        request: Request,
        output_tokens: int,
        finish_reason: str,
    ) -> None:
        if self.lines >= self.max_lines:
            os.replace(self.path, self.path + ".1")  # keep one previous file, drop older
            self.lines = 0
        record = {
            "id": request.request_id,
            # the shape `headroom predictor train` reads: one user message of the joined turns
            "prompt": features.text,
            "prompt_tokens": features.prompt_tokens,
            "max_tokens": features.max_tokens,
            "temperature": features.temperature,
            "tenant": features.tenant,
            "output_tokens": output_tokens,
            "finish_reason": finish_reason,
            "predicted": asdict(prediction) if prediction is not None else None,
            "size_class": request.admitted_class or request.size_class,
        }
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.lines += 1


def label(request: Request) -> tuple[int, str] | None:
    """(output tokens, finish reason) that a finished request teaches the predictors, or None
    where its natural end is unknown. One that stopped on its own is what it was. One the
    server's loop detector capped or stopped counts as a run to its requested max_tokens:
    loops rarely end on their own (bench/RESULTS.md, loop detection), and leaving them out
    would hide most runaways from the data once the detector acts. Any other cap (an
    operator's, a policy's), a wall-clock budget, an abort or the request's own
    repetition_detection leave its natural end unknown."""
    reason = request.status.finish_reason
    if reason == "stop":
        return request.num_output_tokens, "stop"
    if request.loop_detected_at is not None and (
        reason == "repetition" or (reason == "length" and request.max_tokens_cap is not None)
    ):
        return request.sampling.max_tokens, "length"
    if reason == "length" and request.max_tokens_cap is None and request.stop_reason != "wall_clock_budget":
        return request.num_output_tokens, "length"
    return None
