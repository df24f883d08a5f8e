"""The length probe as served: one decoder layer's residual stream at a
sequence's last token, projected on a fixed PCA basis, with its lengths and loop
signals (probe_rows.feature_matrix), scored by two LightGBM models: the probability that
it runs to its max_tokens and its log remaining output tokens.

Trained by `headroom predictor train --probe-rows ROWS.npz --layer L` from the rows
`predictor calibrate --probe-layers` records; the default model's probe ships in
prediction/data/probe and is used only for a model of the same shape.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import lightgbm as lgb
import numpy as np
import torch

from headroom.contracts.request import Request
from headroom.prediction.probe_rows import (
    PCA_DIMS,
    POINTS,
    feature_matrix,
    features,
    fit,
    loop_signals,
)

log = logging.getLogger("headroom.admission")

DEFAULT_PATH = Path(__file__).parent / "data" / "probe"
_FILES = {"cap": "cap.txt", "remaining": "remaining.txt"}


@dataclass
class ProbeModel:
    layer: int
    mean: np.ndarray  # (hidden,) float32
    basis: np.ndarray  # (PCA_DIMS, hidden) float32
    cap: lgb.Booster
    remaining: lgb.Booster
    meta: dict

    @classmethod
    def train(cls, data: dict, layer: int, seed: int = 0) -> ProbeModel:
        """data: calibration rows (ProbeRecorder.save), which name the served model's
        shape; a probe is only ever loaded for a model of that shape."""
        hidden, layers, vocab = (int(v) for v in data["model_shape"])
        model = {"hidden_size": hidden, "num_layers": layers, "vocab_size": vocab}
        layer_index = list(data["layers"]).index(layer)
        (mean, basis), cap, remaining = fit(data, np.arange(len(data["ids"])), layer_index, seed)
        meta = {
            "layer": layer,
            "pca_dims": PCA_DIMS,
            "points": list(POINTS),
            "rows": len(data["ids"]),
            "requests": len(np.unique(data["ids"])),
            "model": model,
        }
        return cls(layer, mean.astype(np.float32), basis.astype(np.float32), cap, remaining, meta)

    def save(self, path: str | Path) -> None:
        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        np.savez_compressed(path / "pca.npz", mean=self.mean, basis=self.basis)
        self.cap.save_model(str(path / _FILES["cap"]))
        self.remaining.save_model(str(path / _FILES["remaining"]))
        (path / "meta.json").write_text(json.dumps(self.meta, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    @classmethod
    def load(cls, path: str | Path) -> ProbeModel:
        path = Path(path)
        meta = json.loads((path / "meta.json").read_text(encoding="utf-8"))
        with np.load(path / "pca.npz") as pca:
            mean, basis = pca["mean"], pca["basis"]
        return cls(
            int(meta["layer"]),
            mean,
            basis,
            lgb.Booster(model_file=str(path / _FILES["cap"])),
            lgb.Booster(model_file=str(path / _FILES["remaining"])),
            meta,
        )

    @property
    def last_point(self) -> int:
        return max(self.meta.get("points", POINTS))

    def fits(self, hidden_size: int, num_layers: int, vocab_size: int) -> str | None:
        """Why this probe cannot serve a model of this shape (None: it can)."""
        want = {"hidden_size": hidden_size, "num_layers": num_layers, "vocab_size": vocab_size}
        trained = {k: self.meta.get("model", {}).get(k) for k in want}
        return None if trained == want else f"trained for a model with {trained}, this one has {want}"

    def predict_rows(self, data: dict) -> tuple[np.ndarray, np.ndarray]:
        """(p_cap, expected remaining tokens) for calibration rows that hold this probe's layer."""
        x = features(data, np.arange(len(data["ids"])), list(data["layers"]).index(self.layer), (self.mean, self.basis))
        return self._estimate(x, data["max_tokens"] - data["point"])

    def _estimate(self, x: np.ndarray, left: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A sequence either runs to its cap (`left` tokens to go, with the classifier's
        probability) or stops at an EOS somewhere before (the regressor's estimate): the
        remaining tokens are the expectation of the two. The cap case matters most where
        the estimate decides (victims, order): a likely runaway keeps a large remainder.
        One thread: LightGBM's default OpenMP pool costs milliseconds per small call."""
        p_cap = self.cap.predict(x, num_threads=1)
        stops_after = np.minimum(np.expm1(self.remaining.predict(x, num_threads=1)).clip(min=0.0), left)
        return p_cap, p_cap * left + (1 - p_cap) * stops_after

    def predict(self, requests: list[Request], states: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
        """(remaining output tokens, probability of running to max_tokens) per request;
        states: (len(requests), hidden), the probe layer's rows for them."""
        x = feature_matrix(
            [r.num_prompt_tokens for r in requests],
            [r.max_tokens for r in requests],
            [r.num_output_tokens for r in requests],
            [r.sampling.temperature for r in requests],
            np.array([loop_signals(r.output_token_ids) for r in requests], dtype=np.float32),
            states.float().cpu().numpy(),
            (self.mean, self.basis),
        )
        p_cap, remaining = self._estimate(x, np.array([r.max_tokens - r.num_output_tokens for r in requests]))
        return remaining, p_cap


def load_probe(path: str | Path | None, hidden_size: int, num_layers: int, vocab_size: int) -> ProbeModel | None:
    """The probe at path, or the packaged default when path is None, if it was trained for
    a model of this shape. A default that does not fit is skipped (serving must start);
    an explicit path that cannot be loaded or does not fit is an error."""
    where = DEFAULT_PATH if path is None else Path(path)
    if path is None and not (where / "meta.json").exists():
        log.warning("length probe: none packaged at %s; estimates stay at admission's", where)
        return None
    probe = ProbeModel.load(where)
    why = probe.fits(hidden_size, num_layers, vocab_size)
    if why is not None:
        if path is not None:
            raise ValueError(f"length probe {where}: {why}")
        log.info("length probe: the packaged one does not fit this model (%s); off", why)
        return None
    log.info("length probe: %s (layer %d, %d training rows)", where, probe.layer, probe.meta.get("rows", 0))
    return probe
