"""One LightGBM model scored one row at a time through the C API's FastConfig path.

Booster.predict spends ~30 us per call in Python (parameter strings, input checks, a
predictor object per call) to score a few hundred small trees that take ~2 us; the
admission path scores three models per request, so it calls the C API directly:
LGBM_BoosterPredictForMatSingleRowFast with a config prepared once at load.
"""

from __future__ import annotations

import ctypes
import threading

import numpy as np
from lightgbm.basic import _LIB, LightGBMError

_PREDICT_NORMAL = 0  # C_API_PREDICT_NORMAL: with the objective's transform (sigmoid for binary)
_DTYPE_FLOAT32 = 0  # C_API_DTYPE_FLOAT32

_LIB.LGBM_GetLastError.restype = ctypes.c_char_p


def _check(rc: int) -> None:
    if rc != 0:
        raise LightGBMError(_LIB.LGBM_GetLastError().decode("utf-8", "replace"))


class SingleRowBooster:
    def __init__(self, model: str, num_features: int) -> None:
        self.num_features = num_features
        self._booster = ctypes.c_void_p()
        self._fast = ctypes.c_void_p()
        iterations = ctypes.c_int()
        _check(
            _LIB.LGBM_BoosterLoadModelFromString(
                ctypes.c_char_p(model.encode("utf-8")), ctypes.byref(iterations), ctypes.byref(self._booster)
            )
        )
        n = ctypes.c_int()
        _check(_LIB.LGBM_BoosterGetNumFeature(self._booster, ctypes.byref(n)))
        if n.value != num_features:
            raise ValueError(f"model has {n.value} features, expected {num_features}")
        _check(
            _LIB.LGBM_BoosterPredictForMatSingleRowFastInit(
                self._booster,
                ctypes.c_int(_PREDICT_NORMAL),
                ctypes.c_int(0),
                ctypes.c_int(-1),
                ctypes.c_int(_DTYPE_FLOAT32),
                ctypes.c_int32(num_features),
                ctypes.c_char_p(b"num_threads=1"),
                ctypes.byref(self._fast),
            )
        )
        self._out = np.zeros(1, dtype=np.float64)
        self._out_ptr = self._out.ctypes.data_as(ctypes.POINTER(ctypes.c_double))
        self._out_len = ctypes.c_int64()
        # The FastConfig and the output buffer are per instance; admission may run on more
        # than one thread.
        self._lock = threading.Lock()

    def __call__(self, row: np.ndarray) -> float:
        if row.dtype != np.float32 or row.shape != (self.num_features,) or not row.flags.c_contiguous:
            raise ValueError(f"expected a contiguous float32 row of {self.num_features} features")
        with self._lock:
            _check(
                _LIB.LGBM_BoosterPredictForMatSingleRowFast(
                    self._fast, row.ctypes.data_as(ctypes.c_void_p), ctypes.byref(self._out_len), self._out_ptr
                )
            )
            return float(self._out[0])

    def __del__(self) -> None:
        if getattr(self, "_fast", None):
            _LIB.LGBM_FastConfigFree(self._fast)
        if getattr(self, "_booster", None):
            _LIB.LGBM_BoosterFree(self._booster)
