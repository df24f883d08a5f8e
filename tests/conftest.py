from __future__ import annotations

import os

import pytest
import torch

# Without a GPU, our Triton kernels run through Triton's interpreter. It must be chosen
# before anything imports triton (triton.language's own helpers are jitted at import).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from headroom.config import ModelConfig
from headroom.models.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def default_model() -> LoadedModel:
    """The default SmolLM2-135M in float32 on CPU, loaded once for the whole run."""
    return load_model(ModelConfig(), torch.device("cpu"), torch.float32)
