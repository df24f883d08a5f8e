"""Optional GPU packages in tests."""

from __future__ import annotations

import importlib
import os

import pytest

# `make test-gpu` installs the GPU extra and sets this: there a missing or unusable GPU
# package fails its tests instead of skipping them (a GPU run that skips proves nothing).
REQUIRE_GPU_EXTRA = os.environ.get("HEADROOM_REQUIRE_GPU_EXTRA") == "1"


def gpu_package(name: str):
    """Import an optional GPU package: skip without it, unless the run requires it."""
    if REQUIRE_GPU_EXTRA:
        return importlib.import_module(name)
    return pytest.importorskip(name)


def gpu_backend_unusable(exc: Exception) -> None:
    """A GPU backend that imports but cannot run here: skip, unless the run requires it."""
    if REQUIRE_GPU_EXTRA:
        raise exc
    pytest.skip(f"unusable here: {exc}")
