from __future__ import annotations

import pytest
import torch

from headroom.config import ModelConfig
from headroom.models.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """The default SmolLM2-135M in float32 on CPU, loaded once for the whole run."""
    return load_model(ModelConfig(), torch.device("cpu"), torch.float32)
