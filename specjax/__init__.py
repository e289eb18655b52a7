"""specjax: speculative decoding of language models as one compiled JAX loop."""

from specjax import models, sharding, speculate
from specjax.api import GenerateResult, generate
from specjax.models import Model, load
from specjax.speculate import DraftModel, Eagle, Medusa, NGram, Sampling, SelfDraft, SpecMetrics, TokenTree

__version__ = "0.1.0"


def __getattr__(name: str):
    # specjax.train (optax, orbax) loads on first use: generation alone does not need it.
    if name == "train":
        import importlib

        return importlib.import_module("specjax.train")
    raise AttributeError(f"module 'specjax' has no attribute {name!r}")


__all__ = [
    "DraftModel",
    "Eagle",
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
    "train",
]
