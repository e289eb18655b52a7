"""specjax: speculative decoding of language models as one compiled JAX loop."""

from specjax import models, sharding, speculate
from specjax.api import GenerateResult, generate
from specjax.models import Model, load
from specjax.speculate import DraftModel, Medusa, NGram, Sampling, SelfDraft, SpecMetrics, TokenTree

__version__ = "0.1.0"

__all__ = [
    "DraftModel",
    "GenerateResult",
    "Medusa",
    "Model",
    "NGram",
    "Sampling",
    "SelfDraft",
    "SpecMetrics",
    "TokenTree",
    "generate",
    "load",
    "models",
    "sharding",
    "speculate",
]
