"""specjax: speculative decoding of language models as one compiled JAX loop."""

from specjax import models, sharding, speculate
from specjax._version import __version__
from specjax.ablation import ablate, load_ablation, save_ablation
from specjax.api import GenerateResult, generate, load
from specjax.costs import measure_step_costs
from specjax.export import export_arguments, export_generate
from specjax.memory import MemoryEstimate, estimate_memory
from specjax.models import Model, load_head
from specjax.programs import ProgramCacheInfo, clear_compiled_programs, program_cache_info, set_program_cache
from specjax.serve.engine import Engine
from specjax.serve.engine_config import EngineConfig, Request
from specjax.serve.stream import StreamDelta, stream
from specjax.speculate import (
    MTP,
    DFlash,
    DraftModel,
    Dynamic,
    Eagle,
    Eagle3,
    ForcedAcceptance,
    GoodputSchedule,
    GrammarDraft,
    HeuristicSchedule,
    Hybrid,
    Medusa,
    MLPSpeculator,
    NGram,
    Sampling,
    SelfDraft,
    SpecMetrics,
    TokenTree,
    WithNGram,
)
from specjax.speculate.logprobs import Logprobs
from specjax.speculate.proposers import Capabilities, Proposal, Proposer, ProposerSpec
from specjax.text import TextDeltas, chat_prompt_ids


def __getattr__(name: str):
    # specjax.train (optax, orbax) and specjax.plots (matplotlib) load on first use: generation
    # alone needs neither.
    if name in ("train", "plots"):
        import importlib

        return importlib.import_module(f"specjax.{name}")
    raise AttributeError(f"module 'specjax' has no attribute {name!r}")


__all__ = [
    "__version__",
    "stream",
    "StreamDelta",
    "Capabilities",
    "DraftModel",
    "Dynamic",
    "Engine",
    "EngineConfig",
    "ForcedAcceptance",
    "GoodputSchedule",
    "HeuristicSchedule",
    "Eagle",
    "Eagle3",
    "Hybrid",
    "DFlash",
    "MTP",
    "WithNGram",
    "GenerateResult",
    "Logprobs",
    "MemoryEstimate",
    "Medusa",
    "MLPSpeculator",
    "Model",
    "GrammarDraft",
    "NGram",
    "Proposal",
    "Proposer",
    "ProposerSpec",
    "Request",
    "Sampling",
    "SelfDraft",
    "SpecMetrics",
    "TextDeltas",
    "TokenTree",
    "ProgramCacheInfo",
    "ablate",
    "chat_prompt_ids",
    "clear_compiled_programs",
    "estimate_memory",
    "export_arguments",
    "export_generate",
    "generate",
    "load",
    "load_ablation",
    "load_head",
    "measure_step_costs",
    "models",
    "program_cache_info",
    "save_ablation",
    "set_program_cache",
    "sharding",
    "speculate",
    "plots",
    "train",
]
