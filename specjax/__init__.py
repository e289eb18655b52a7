"""specjax: speculative decoding of language models as one compiled JAX loop."""

from specjax import models, sharding, speculate
from specjax.ablation import ablate, load_ablation, save_ablation
from specjax.api import GenerateResult, generate
from specjax.memory import MemoryEstimate, estimate_memory
from specjax.models import Model, load
from specjax.speculate import (
    DFlash,
    DraftModel,
    Dynamic,
    Eagle,
    Eagle3,
    ForcedAcceptance,
    GoodputSchedule,
    HeuristicSchedule,
    Medusa,
    NGram,
    Sampling,
    SelfDraft,
    SpecMetrics,
    TokenTree,
)

__version__ = "0.1.0"


def __getattr__(name: str):
    # specjax.train (optax, orbax) and specjax.plots (matplotlib) load on first use: generation
    # alone needs neither.
    if name in ("train", "plots"):
        import importlib

        return importlib.import_module(f"specjax.{name}")
    raise AttributeError(f"module 'specjax' has no attribute {name!r}")


__all__ = [
    "DraftModel",
    "Dynamic",
    "ForcedAcceptance",
    "GoodputSchedule",
    "HeuristicSchedule",
    "Eagle",
    "Eagle3",
    "DFlash",
    "GenerateResult",
    "MemoryEstimate",
    "Medusa",
    "Model",
    "NGram",
    "Sampling",
    "SelfDraft",
    "SpecMetrics",
    "TokenTree",
    "ablate",
    "estimate_memory",
    "generate",
    "load",
    "load_ablation",
    "models",
    "save_ablation",
    "sharding",
    "speculate",
    "plots",
    "train",
]
