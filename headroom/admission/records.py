"""A bounded log of finished requests (features, prediction, actual tokens), so the
predictor can be retrained on this deployment's real traffic. Holds prompt text, so it
is written only when the operator names a path."""

from __future__ import annotations

import json
import os
from dataclasses import asdict

from headroom.admission.features import RequestFeatures
from headroom.admission.predictor import Prediction
from headroom.runtime.request import Request


class RecordLog:
    def __init__(self, path: str, max_lines: int):
        self.path = path
        self.max_lines = max_lines
        self.lines = 0
        if os.path.exists(path):
            with open(path, "rb") as f:
                self.lines = sum(1 for _ in f)

    def append(self, features: RequestFeatures, prediction: Prediction | None, request: Request,
               finish_reason: str) -> None:
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
            "output_tokens": request.num_output_tokens,
            "finish_reason": finish_reason,
            "predicted": asdict(prediction) if prediction is not None else None,
            "size_class": request.admitted_class or request.size_class,
        }
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
        self.lines += 1
