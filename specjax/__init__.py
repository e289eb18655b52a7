"""specjax: speculative decoding of language models as one compiled JAX loop."""

from specjax import models, sharding, speculate
from specjax.api import GenerateResult, generate
from specjax.models import Model, load
from specjax.speculate import DraftModel, NGram, Sampling, SelfDraft, SpecMetrics

__version__ = "0.1.0"

__all__ = [
    "DraftModel",
    "GenerateResult",
    "Model",
    "NGram",
    "Sampling",
    "SelfDraft",
    "SpecMetrics",
    "generate",
    "load",
    "models",
    "sharding",
    "speculate",
]
